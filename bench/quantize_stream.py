"""Streaming quantisation of a real-shape checkpoint (random bf16 weights in transformers' own
class, offline/real_shape_configs.py): wall time and peak memory of `pagedweight quantize`'s
default path, loss scales skipped (a phase of its own). `--layers N` builds the first N decoder
layers where the device minutes cannot pay for the whole depth, which is then extrapolated
(fixed part + layers x per layer). Baseline: the whole-model quantiser's fp32 copy of every
parameter (params x 4 bytes, reported). Checkpoint, work directory and artifact of the full
depth do not fit a 64 GB disk together, hence `--checkpoint`, `--work-dir` and `--build-only`
(bench/__main__.py stages quantize-full-depth with them).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.bench_meta import arg_parser, log, write_result
from pagedweight.common.paths import BUNDLED_MODEL
from pagedweight.format.model_config import ModelConfig
from pagedweight.offline.calib_text import bundled_calib_files
from pagedweight.offline.calibrate import CalibConfig
from pagedweight.offline.quantize import QuantizeConfig, quantize_model
from pagedweight.offline.real_shape_configs import REAL_SHAPE_CONFIGS

MODEL_TYPES = {"Qwen2MoeForCausalLM": "qwen2_moe", "MixtralForCausalLM": "mixtral"}


def build_checkpoint(name: str, layers: int | None, out: Path, device: torch.device) -> dict:
    """Random bf16 weights in transformers' class, saved as a checkpoint directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(REAL_SHAPE_CONFIGS[name])
    if layers is not None:
        raw["num_hidden_layers"] = layers
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(MODEL_TYPES[raw["architectures"][0]], **raw))
    finally:
        torch.set_default_dtype(previous)
    model.to(torch.bfloat16).save_pretrained(out)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(BUNDLED_MODEL / file, out / file)
    return raw


def checkpoint(args, ckpt: Path, device: torch.device) -> tuple[dict, float | None]:
    """(config.json of the checkpoint in ckpt, seconds its build took): built unless there."""
    record = ckpt.parent / f"{ckpt.name}.build.json"  # the build's time, for a later run
    if (ckpt / "config.json").is_file():
        log(f"using the checkpoint in {ckpt}")
        return json.loads((ckpt / "config.json").read_text()), \
            json.loads(record.read_text())["build_seconds"] if record.is_file() else None
    started = time.perf_counter()
    raw = build_checkpoint(args.model, args.layers, ckpt, device)
    build_s = time.perf_counter() - started
    record.write_text(json.dumps({"build_seconds": build_s}))
    log(f"built {args.model} with {raw['num_hidden_layers']} layers in {build_s:.1f} s")
    return raw, build_s


def checkpoint_params(ckpt: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            total += sum(torch.Size(f.get_slice(key).get_shape()).numel() for key in f.keys())
    return total


def main(argv=None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--model", default="Qwen1.5-MoE-A2.7B", choices=list(REAL_SHAPE_CONFIGS))
    parser.add_argument("--layers", type=int, default=None, help="decoder layers to build (default: all)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--calib-tokens", type=int, default=4096, help="tokens per bundled calibration file")
    parser.add_argument("--work", default=None, help="where checkpoint and artifact go (default: a temp dir)")
    parser.add_argument("--checkpoint", default=None, help="the checkpoint directory (default: WORK/ckpt); "
                        "built unless it holds a config.json already")
    parser.add_argument("--build-only", action="store_true", help="build the checkpoint and stop")
    parser.add_argument("--work-dir", default=None, help="the quantiser's work directory (default: beside the "
                        "artifact)")
    parser.add_argument("--name", default="quantize_stream", help="bench/results/NAME_<gpu>.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    root = Path(args.work or tempfile.mkdtemp(prefix="quantize-stream-"))
    root.mkdir(parents=True, exist_ok=True)
    ckpt, paged = Path(args.checkpoint) if args.checkpoint else root / "ckpt", root / "paged"
    raw, build_s = checkpoint(args, ckpt, device)
    if args.build_only:
        if args.work is None and not any(root.iterdir()):
            root.rmdir()  # the checkpoint went elsewhere (--checkpoint): nothing to keep here
        return 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    qconfig = replace(QuantizeConfig(), device=str(device), scale_tokens=0, calib_text_name="bundled:v1",
                      calib=CalibConfig(max_tokens_per_file=args.calib_tokens))
    started = time.perf_counter()
    quantize_model(ckpt, paged, bundled_calib_files(), qconfig, log=log, work_dir=args.work_dir, progress=sys.stderr)
    quantize_s = time.perf_counter() - started
    quantizer = json.loads((paged / "paged_model.json").read_text())["quantizer"]
    seconds = quantizer["streaming"]["seconds"]
    layers = ModelConfig.from_dict(raw, source=args.model).num_layers
    full_layers = REAL_SHAPE_CONFIGS[args.model]["num_hidden_layers"]
    per_layer = (seconds["forward"] + seconds["quantize"] + seconds["backward"]) / layers
    fixed = quantize_s - per_layer * layers
    params = checkpoint_params(ckpt)
    result = {
        "model": args.model, "layers_built": layers, "layers_full": full_layers, "reduced_depth": layers != full_layers,
        "device": str(device), "calibration": {"files": len(bundled_calib_files()), "tokens_per_file": args.calib_tokens,
                                               "seq_len": qconfig.calib.seq_len},
        "build_seconds": build_s, "quantize_seconds": quantize_s, "phase_seconds": seconds,
        "per_layer_seconds": per_layer, "fixed_seconds": fixed,
        "full_depth_seconds_extrapolated": fixed + per_layer * full_layers,
        "peak_device_bytes": quantizer["peak_device_bytes"], "peak_host_bytes": quantizer["peak_host_bytes"],
        "peak_host_anonymous_bytes": quantizer.get("peak_host_anonymous_bytes"),
        "peak_device_gib": (quantizer["peak_device_bytes"] or 0) / 2**30,
        "compute_dtype": quantizer["streaming"]["compute_dtype"], "checkpoint_params": params,
        "baseline_whole_model_fp32_bytes_computed": params * 4,
        "targets": {"full_depth_seconds": 600, "peak_device_gib": 16},
        "artifact_bytes": sum(p.stat().st_size for p in paged.iterdir())}
    log(f"wrote {write_result(args.name, result)}")
    if args.work is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
