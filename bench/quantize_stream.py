"""Streaming quantisation of a real-shape checkpoint: wall time and peak memory (issue 14.3).

1. build: transformers' own class (`Qwen2MoeForCausalLM` for Qwen1.5-MoE-A2.7B) at the
   published shape (bench/real_shape_configs.py), randomly initialised on the device in
   bf16, written with `save_pretrained` (per-expert or fused tensors, as transformers
   writes them) with the bundled tokenizer; `--layers N` keeps only the first N decoder
   layers when the device minutes cannot pay for the whole depth (the JSON says so);
2. quantise it with `pagedweight quantize`'s default path (quantize.quantize_model, one
   layer at a time, bundled calibration text) into a temporary directory, the planner's
   loss scales skipped (`scale_tokens=0`: that phase is measured on its own by
   bench/quantize_scales_stream.py, docs/quantize.md); the device allocator's peak and the process's peak RSS are read
   after the build's memory is released and the peak counters reset;
3. per-layer times (forward + k-means, backward) from the artifact's record, and the
   full-depth time extrapolated from them: fixed part + num_hidden_layers x per layer.
The baseline it is held against: the whole-model quantiser would first allocate every
parameter in fp32 on one device (params x 4 bytes, computed from the config, reported).

    PYTHONPATH=.:services:kernels python3 -m bench.quantize_stream --device cuda --layers 4
    .venv/bin/python -m bench.quantize_stream --model tiny-qwen-moe --device cpu   # checks the script
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.bench_meta import write_result
from bench.real_shape_configs import REAL_SHAPE_CONFIGS
from pagedweight.common.paths import BUNDLED_MODEL
from pagedweight.format.model_config import ModelConfig
from pagedweight.offline.calib_text import bundled_calib_files
from pagedweight.offline.calibrate import CalibConfig
from pagedweight.offline.quantize import QuantizeConfig, quantize_model

MODEL_TYPES = {"Qwen2MoeForCausalLM": "qwen2_moe", "MixtralForCausalLM": "mixtral"}
SMALL = {  # the same class at a size the CPU runs in seconds: checks the script, not a result
    "tiny-qwen-moe": {**REAL_SHAPE_CONFIGS["Qwen1.5-MoE-A2.7B"], "vocab_size": 32000, "hidden_size": 64,
                      "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
                      "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                      "shared_expert_intermediate_size": 64, "eos_token_id": 2},
}


def build_checkpoint(name: str, layers: int | None, out: Path, device: torch.device) -> dict:
    """Random bf16 weights in transformers' class, saved as a checkpoint directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(SMALL.get(name) or REAL_SHAPE_CONFIGS[name])
    if layers is not None:
        raw["num_hidden_layers"] = layers
    hf_config = AutoConfig.for_model(MODEL_TYPES[raw["architectures"][0]], **raw)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_config)
    finally:
        torch.set_default_dtype(previous)
    model.to(torch.bfloat16).save_pretrained(out)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(BUNDLED_MODEL / file, out / file)
    del model
    return raw


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="Qwen1.5-MoE-A2.7B", choices=[*REAL_SHAPE_CONFIGS, *SMALL])
    parser.add_argument("--layers", type=int, default=None, help="decoder layers to build (default: all)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--calib-tokens", type=int, default=4096, help="tokens per bundled calibration file")
    parser.add_argument("--work", default=None, help="where checkpoint and artifact go (default: a temp dir)")
    parser.add_argument("--name", default="quantize_stream", help="bench/results/NAME.json")
    parser.add_argument("--copy-to", default=None, help="also write the JSON here (the GPU run's $OUT)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    root = Path(args.work or tempfile.mkdtemp(prefix="quantize-stream-"))
    root.mkdir(parents=True, exist_ok=True)
    ckpt, paged = root / "ckpt", root / "paged"

    started = time.perf_counter()
    raw = build_checkpoint(args.model, args.layers, ckpt, device)
    build_s = time.perf_counter() - started
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    config = ModelConfig.from_dict(raw, source=args.model)
    print(f"built {args.model} with {config.num_layers} layers in {build_s:.1f} s", file=sys.stderr, flush=True)

    qconfig = replace(QuantizeConfig(), device=str(device), scale_tokens=0, calib_text_name="bundled:v1",
                      calib=CalibConfig(max_tokens_per_file=args.calib_tokens))
    started = time.perf_counter()
    quantize_model(ckpt, paged, bundled_calib_files(), qconfig,
                   log=lambda msg: print(msg, file=sys.stderr, flush=True), progress=sys.stderr)
    quantize_s = time.perf_counter() - started
    quantizer = json.loads((paged / "paged_model.json").read_text())["quantizer"]
    stream = quantizer["streaming"]
    seconds = stream["seconds"]
    L = config.num_layers
    full_layers = (SMALL.get(args.model) or REAL_SHAPE_CONFIGS[args.model])["num_hidden_layers"]
    per_layer = (seconds["forward"] + seconds["quantize"] + seconds["backward"]) / L
    fixed = quantize_s - per_layer * L
    params = sum(t.numel() for t in _checkpoint_numels(ckpt))
    result = {
        "model": args.model, "layers_built": L, "layers_full": full_layers,
        "reduced_depth": L != full_layers, "device": str(device),
        "calibration": {"files": len(bundled_calib_files()), "tokens_per_file": args.calib_tokens,
                        "seq_len": qconfig.calib.seq_len, "gradients": qconfig.calib.gradients},
        "build_seconds": build_s, "quantize_seconds": quantize_s,
        "phase_seconds": seconds, "per_layer_seconds": per_layer, "fixed_seconds": fixed,
        "full_depth_seconds_extrapolated": fixed + per_layer * full_layers,
        "peak_device_bytes": quantizer["peak_device_bytes"], "peak_host_bytes": quantizer["peak_host_bytes"],
        "peak_device_gib": (quantizer["peak_device_bytes"] or 0) / 2**30,
        "compute_dtype": stream["compute_dtype"],
        "checkpoint_params": params,
        "baseline_whole_model_fp32_bytes_computed": params * 4,
        "targets": {"full_depth_seconds": 600, "peak_device_gib": 16},
        "artifact_bytes": sum(p.stat().st_size for p in paged.iterdir()),
    }
    path = write_result(args.name, result)
    if args.copy_to:
        shutil.copyfile(path, Path(args.copy_to) / path.name)
    print(json.dumps(result, indent=1))
    if args.work is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def _checkpoint_numels(ckpt: Path):
    from safetensors import safe_open

    for file in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                yield torch.empty(f.get_slice(key).get_shape(), device="meta")


if __name__ == "__main__":
    sys.exit(main())
