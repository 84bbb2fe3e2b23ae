"""Streaming quantisation of a real-shape checkpoint: wall time and peak memory.

1. build: transformers' own class (`Qwen2MoeForCausalLM` for Qwen1.5-MoE-A2.7B) at the
   published shape (pagedweight/offline/real_shape_configs.py), randomly initialised on the device in
   bf16, written with `save_pretrained` (per-expert or fused tensors, as transformers
   writes them) with the bundled tokenizer; `--layers N` keeps only the first N decoder
   layers when the device minutes cannot pay for the whole depth (the JSON says so);
2. quantise it with `pagedweight quantize`'s default path (quantize.quantize_model, one
   layer at a time, bundled calibration text) into a temporary directory, the planner's
   loss scales skipped (`scale_tokens=0`: a phase of its own, docs/quantize.md); the device allocator's peak and the process's peak RSS are read
   after the build's memory is released and the peak counters reset;
3. per-layer times (forward + k-means, backward) from the artifact's record, and the
   full-depth time extrapolated from them: fixed part + num_hidden_layers x per layer.
Full depth does not fit a 64 GB disk as checkpoint + work directory + artifact (Qwen:
28.6 + ~24 + ~23 GB): `--checkpoint` puts the checkpoint elsewhere (e.g. /dev/shm, where it
stays for a later run; `--build-only` just builds it, so the quantisation's process and its
peak RSS start clean), `--work-dir` the quantiser's work directory. While quantising, a
thread samples the process's memory (/proc/self/status: anonymous, file-backed and shared
resident pages; the checkpoint is read through mmap, whose pages count in the RSS but are
the file's, not the process's) and the device allocator every 2 s, appending to
NAME.samples.jsonl beside the JSON (the --copy-to folder), so a run cut off by a time
limit still shows how far it got and how memory grew.
The baseline it is held against: the whole-model quantiser would first allocate every
parameter in fp32 on one device (params x 4 bytes, computed from the config, reported).

    PYTHONPATH=.:services:kernels python3 -m bench.quantize_stream --device cuda --layers 4
    ... --checkpoint /dev/shm/qwen --build-only; ... --checkpoint /dev/shm/qwen --work-dir /dev/shm/w
    .venv/bin/python -m bench.quantize_stream --model tiny-qwen-moe --device cpu   # checks the script
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.bench_meta import log, write_result
from pagedweight.offline.real_shape_configs import REAL_SHAPE_CONFIGS
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
    # Qwen1.5-MoE-A2.7B's routing (60 experts, top-4) at hidden 256: its loops over experts
    # and batches are the real ones, its products small
    "qwen-scaled": {**REAL_SHAPE_CONFIGS["Qwen1.5-MoE-A2.7B"], "vocab_size": 32000, "hidden_size": 256,
                    "num_attention_heads": 4, "num_key_value_heads": 4, "moe_intermediate_size": 192,
                    "shared_expert_intermediate_size": 768, "eos_token_id": 2},
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


class MemorySampler(threading.Thread):
    """Every `period` s: this process's resident pages by kind and the device allocator,
    appended to `path` (JSON lines) and kept for the peaks."""

    FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")

    def __init__(self, path: Path | None, device: torch.device, period: float = 2.0):
        super().__init__(daemon=True)
        self.path, self.device, self.period = path, device, period
        self.samples: list[dict] = []
        self.stop = threading.Event()
        self.started = time.perf_counter()

    def sample(self) -> dict:
        status = {}
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in self.FIELDS:
                status[key] = int(value.split()[0]) * 1024  # kB
        record = {"t": round(time.perf_counter() - self.started, 1), **status}
        if self.device.type == "cuda":
            record["device_allocated"] = torch.cuda.memory_allocated(self.device)
        self.samples.append(record)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        return record

    def run(self) -> None:
        while not self.stop.wait(self.period):
            self.sample()

    def peaks(self) -> dict:
        return {f"peak_{k}_bytes_sampled": max((s.get(k, 0) for s in self.samples), default=None)
                for k in self.FIELDS}


def disk_free(*paths: Path) -> dict:
    return {str(p): shutil.disk_usage(p).free for p in paths if p.exists()}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="Qwen1.5-MoE-A2.7B", choices=[*REAL_SHAPE_CONFIGS, *SMALL])
    parser.add_argument("--layers", type=int, default=None, help="decoder layers to build (default: all)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--calib-tokens", type=int, default=4096, help="tokens per bundled calibration file")
    parser.add_argument("--work", default=None, help="where checkpoint and artifact go (default: a temp dir)")
    parser.add_argument("--checkpoint", default=None, help="the checkpoint directory (default: WORK/ckpt); "
                        "built unless it holds a config.json already")
    parser.add_argument("--build-only", action="store_true", help="build the checkpoint and stop")
    parser.add_argument("--work-dir", default=None,
                        help="the quantiser's work directory (default: beside the artifact)")
    parser.add_argument("--name", default="quantize_stream", help="bench/results/NAME.json")
    parser.add_argument("--copy-to", default=None, help="also write the JSON here (the GPU run's $OUT)")
    return parser.parse_args(argv)


def checkpoint(model: str, layers: int | None, ckpt: Path, device: torch.device) -> tuple[dict, float | None]:
    """(config.json of the checkpoint in ckpt, seconds its build took): built unless there."""
    build_record = ckpt.parent / f"{ckpt.name}.build.json"  # the build's time, for a later run
    if (ckpt / "config.json").is_file():
        build_s = json.loads(build_record.read_text())["build_seconds"] if build_record.is_file() else None
        log(f"using the checkpoint in {ckpt}")
        return json.loads((ckpt / "config.json").read_text()), build_s
    started = time.perf_counter()
    raw = build_checkpoint(model, layers, ckpt, device)
    build_s = time.perf_counter() - started
    build_record.write_text(json.dumps({"build_seconds": build_s}))
    gc.collect()
    log(f"built {model} with {raw['num_hidden_layers']} layers in {build_s:.1f} s")
    return raw, build_s


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    root = Path(args.work or tempfile.mkdtemp(prefix="quantize-stream-"))
    root.mkdir(parents=True, exist_ok=True)
    ckpt, paged = Path(args.checkpoint) if args.checkpoint else root / "ckpt", root / "paged"
    raw, build_s = checkpoint(args.model, args.layers, ckpt, device)
    if args.build_only:
        if args.work is None and not any(root.iterdir()):
            root.rmdir()  # the checkpoint went elsewhere (--checkpoint): nothing to keep here
        return 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    config = ModelConfig.from_dict(raw, source=args.model)
    free_before = disk_free(root, ckpt, Path("/dev/shm"))

    qconfig = replace(QuantizeConfig(), device=str(device), scale_tokens=0, calib_text_name="bundled:v1",
                      calib=CalibConfig(max_tokens_per_file=args.calib_tokens))
    samples = Path(args.copy_to) / f"{args.name}.samples.jsonl" if args.copy_to else None
    sampler = MemorySampler(samples, device)
    sampler.start()
    started = time.perf_counter()
    quantize_model(ckpt, paged, bundled_calib_files(), qconfig,
                   log=log,
                   work_dir=args.work_dir, progress=sys.stderr)
    quantize_s = time.perf_counter() - started
    sampler.stop.set()
    sampler.sample()
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
        "checkpoint_dir": str(ckpt), "work_dir": args.work_dir or "beside the artifact",
        "artifact_dir": str(paged), "disk_free_bytes_before": free_before,
        "host_memory_sampled": {**sampler.peaks(), "samples": len(sampler.samples),
                                "period_s": sampler.period},
        "phase_seconds": seconds, "per_layer_seconds": per_layer, "fixed_seconds": fixed,
        "full_depth_seconds_extrapolated": fixed + per_layer * full_layers,
        "peak_device_bytes": quantizer["peak_device_bytes"], "peak_host_bytes": quantizer["peak_host_bytes"],
        "peak_host_anonymous_bytes": quantizer.get("peak_host_anonymous_bytes"),
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
