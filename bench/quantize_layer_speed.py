"""Per-layer cost of the streaming quantiser's steps: forward, quantise, backward.

A checkpoint of a few decoder layers (random bf16 weights in transformers' class, as
bench/quantize_stream.py builds them) and random calibration tokens (the costs depend on
the shapes, not the values); then the streaming steps of offline/stream_passes.py, one by
one, each timed with the device synchronised: embed, forward l (its `forward` and
`quantize` parts as StreamRun.seconds splits them), loss, backward l. The JSON is
rewritten after every step, so a run cut off by a time limit still leaves its figures.

    python3 -m bench.quantize_layer_speed --model Qwen1.5-MoE-A2.7B --layers 2 --tokens 65536 --device cuda
    python3 -m bench.quantize_layer_speed --model qwen-scaled --layers 2 --tokens 4096 --device cpu

`qwen-scaled` (bench/quantize_stream.SMALL) keeps Qwen1.5-MoE-A2.7B's 60 experts and top-4
routing at hidden 256: the loops over experts and batches are the real ones, the products
small, so the CPU shows the per-expert and per-batch structure.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.bench_meta import write_result
from bench.quantize_stream import SMALL, build_checkpoint
from bench.real_shape_configs import REAL_SHAPE_CONFIGS
from pagedweight.offline.calibrate import CalibConfig
from pagedweight.offline.checkpoint_layers import CheckpointLayers
from pagedweight.offline.quantize import QuantizeConfig
from pagedweight.offline.stream_passes import StreamRun, backward_step, embed_step, forward_step, loss_step
from pagedweight.offline.work_dir import WorkDir

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(run: StreamRun, fn, *args) -> dict:
    """One step, synchronised: its wall seconds (work-dir writes included) and the split
    StreamRun.seconds recorded for it."""
    before = dict(run.seconds)
    synchronize(run.device)
    started = time.perf_counter()
    fn(run, *args)
    synchronize(run.device)
    out = {"wall": time.perf_counter() - started}
    out.update({k: run.seconds[k] - before[k] for k in run.seconds if run.seconds[k] != before[k]})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="Qwen1.5-MoE-A2.7B", choices=[*REAL_SHAPE_CONFIGS, *SMALL])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--run-layers", type=int, default=None,
                        help="run only the first N layers of the checkpoint (the loss on their output)")
    parser.add_argument("--tokens", type=int, default=65536, help="calibration tokens (chunks of 256)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--checkpoint", default=None, help="built here unless it holds a config.json")
    parser.add_argument("--work-dir", default=None, help="the streaming work directory (default: a temp dir)")
    parser.add_argument("--label", default="", help="recorded as is (e.g. before / after)")
    parser.add_argument("--name", default="quantize_layer_speed")
    parser.add_argument("--copy-to", default=None, help="also write the JSON here (the GPU run's $OUT)")
    parser.add_argument("--profile", action="store_true", help="torch.profiler table of the last layer's steps")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    root = Path(tempfile.mkdtemp(prefix="quantize-layer-speed-"))
    ckpt = Path(args.checkpoint) if args.checkpoint else root / "ckpt"
    build_s = None
    if not (ckpt / "config.json").is_file():
        started = time.perf_counter()
        build_checkpoint(args.model, args.layers, ckpt, device if device.type == "cuda" else torch.device("cpu"))
        build_s = time.perf_counter() - started
        print(f"built {args.model} ({args.layers} layers) in {build_s:.1f} s", file=sys.stderr, flush=True)
    layers = CheckpointLayers(ckpt, str(device))
    if args.run_layers is not None:  # a shallower model on the same checkpoint: the steps read num_layers
        layers.config = dataclasses.replace(layers.config, num_layers=min(args.run_layers, layers.config.num_layers))
    L = layers.config.num_layers
    seq = 256
    num_chunks = args.tokens // seq
    gen = torch.Generator().manual_seed(0)
    chunks = torch.randint(0, layers.config.vocab_size, (num_chunks, seq), generator=gen)
    config = dataclasses.replace(QuantizeConfig(), device=str(device), scale_tokens=0,
                                 calib=CalibConfig(seq_len=seq, max_tokens_per_file=args.tokens))
    work_path = Path(args.work_dir) if args.work_dir else root / "work"
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    result = {"model": args.model, "label": args.label, "layers": L, "tokens": num_chunks * seq,
              "batch_tokens": config.calib.batch_size * seq, "device": str(device),
              "compute_dtype": str(layers.dtype), "build_seconds": build_s, "steps": {},
              "env": {k: v for k, v in os.environ.items() if k.startswith("PAGEDWEIGHT_")}}

    def record(name, value):
        result["steps"][name] = value
        if device.type == "cuda":
            result["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
        path = write_result(args.name, result)
        if args.copy_to:
            shutil.copyfile(path, Path(args.copy_to) / path.name)
        print(f"{name}: " + ", ".join(f"{k} {v:.2f} s" for k, v in value.items()), file=sys.stderr, flush=True)

    steps = [("embed", embed_step, ())] + [(f"forward{l}", forward_step, (l,)) for l in range(L)]
    steps += [("loss", loss_step, ())] + [(f"backward{l}", backward_step, (l,)) for l in reversed(range(L))]
    try:
        with WorkDir(work_path, {"bench": args.name}, restart=True) as work:
            run = StreamRun(layers, work, config, chunks, ["random"] * num_chunks, config.tile_elements)
            for name, fn, fargs in steps:
                last = fargs == (L - 1,)
                if args.profile and last:
                    from torch.profiler import ProfilerActivity, profile
                    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
                    with profile(activities=activities) as prof:
                        value = timed_step(run, fn, *fargs)
                    averages = prof.key_averages()
                    tables = [averages.table(sort_by="self_cpu_time_total", row_limit=40)]
                    if device.type == "cuda":
                        tables.append(averages.table(sort_by="self_device_time_total", row_limit=40))
                    (results_dir(args) / f"{args.name}.{name}.profile.txt").write_text("\n\n".join(tables))
                    value["profiled"] = 1.0
                else:
                    value = timed_step(run, fn, *fargs)
                record(name, value)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def results_dir(args) -> Path:
    """Where the profile tables go: beside the JSON copy (the GPU run's $OUT) or bench/results."""
    return Path(args.copy_to) if args.copy_to else Path(__file__).resolve().parent / "results"


if __name__ == "__main__":
    sys.exit(main())
