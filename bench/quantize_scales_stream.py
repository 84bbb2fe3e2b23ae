"""The loss-scale phase of `quantize`, whole model against streamed: peak memory and time.

1. build a random-weight Qwen1.5-MoE-shaped checkpoint (transformers' Qwen2MoeForCausalLM,
   bf16, `--layers`, `--hidden` ...) and quantise it once with `scale_tokens=0` and few
   k-means iterations (the planes' quality does not matter here, their bytes do);
2. measure the planner's group KLs on that artifact twice, each in a fresh subprocess so
   each has its own peak: `whole` (artifact_scales' path: build_paged_lm, the whole model
   in fp32 on --device, measure_group_kls) and `streamed` (stream_scales.py: one layer at a
   time through a work directory, what `quantize` now runs);
3. report each one's peak memory (CUDA allocator on a GPU; on the CPU, where the device
   is the host, the peak RSS above the process's RSS before the phase), its wall time, and
   the largest relative difference between the two runs' KLs (they must agree).

    .venv/bin/python -m bench.quantize_scales_stream --device cpu
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.bench_meta import RESULTS_DIR, write_result

ROOT = Path(__file__).resolve().parent.parent


def rss_bytes() -> int:
    """The process's current resident set (/proc/self/statm's second field, in pages)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


class PeakRss:
    """The largest current RSS seen while running, sampled every 2 ms on a thread (the
    high-water mark ru_maxrss would include the imports' and tokenizer's peaks)."""

    def __enter__(self):
        self.peak, self._stop = rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def build(args, root: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench.real_shape_configs import REAL_SHAPE_CONFIGS
    from pagedweight.common.paths import BUNDLED_MODEL
    from pagedweight.offline.apl_quantizer import QuantizerConfig
    from pagedweight.offline.calib_text import bundled_calib_files
    from pagedweight.offline.calibrate import CalibConfig
    from pagedweight.offline.quantize import QuantizeConfig, quantize_model

    raw = {**REAL_SHAPE_CONFIGS["Qwen1.5-MoE-A2.7B"], "vocab_size": 32000, "hidden_size": args.hidden,
           "num_hidden_layers": args.layers, "num_attention_heads": 4, "num_key_value_heads": 4,
           "num_experts": args.experts, "num_experts_per_tok": 4, "moe_intermediate_size": args.hidden,
           "shared_expert_intermediate_size": args.hidden, "eos_token_id": 2}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2_moe", **raw))
    ckpt = root / "ckpt"
    model.to(torch.bfloat16).save_pretrained(ckpt)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (ckpt / file).write_bytes((BUNDLED_MODEL / file).read_bytes())
    del model
    config = replace(QuantizeConfig(), scale_tokens=0, calib_text_name="bundled:v1",
                     calib=CalibConfig(seq_len=128, max_tokens_per_file=256, batch_size=8),
                     quantizer=QuantizerConfig(seed_iters=1, split_iters=1))
    return quantize_model(ckpt, root / "paged", bundled_calib_files(), config, progress=sys.stderr)


def phase(which: str, paged: Path, device: str, tokens: int, work: Path) -> dict:
    """One measurement in this process: KLs, seconds, peak memory of the phase."""
    from pagedweight.offline.artifact_scales import scale_windows
    from pagedweight.offline.calib_text import bundled_calib_files

    windows = scale_windows(paged, bundled_calib_files(), tokens)
    dev = torch.device(device)
    before = rss_bytes()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    started = time.perf_counter()
    with PeakRss() as rss:
        kls = measure(which, paged, dev, windows, work)
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else rss.peak - before
    return {"kls": kls, "seconds": seconds, "peak_bytes": peak, "rss_before_bytes": before,
            "peak_rss_bytes": rss.peak}


def measure(which: str, paged: Path, dev: torch.device, windows: list, work: Path) -> dict:
    from pagedweight.format.paged_model import load_paged_model
    from pagedweight.model.dequantized_experts import build_paged_lm, set_model_bits
    from pagedweight.offline.group_scales import measure_group_kls
    from pagedweight.offline.paged_layers import PagedLayers
    from pagedweight.offline.stream_scales import ScaleRun, group_kls, scale_steps
    from pagedweight.offline.work_dir import WorkDir
    from pagedweight.planner.artifact import load_planner_inputs

    if which == "whole":
        table = load_planner_inputs(paged, with_heads=False, sensitivity="sensitivity").table
        model = build_paged_lm(load_paged_model(paged, with_bf16=False), dtype=torch.float32, device=dev)
        kls, _ = measure_group_kls(model, table, windows, lambda bits: set_model_bits(
            model, {b: int(v) for b, v in zip(table.block_ids, bits)}))
    else:
        with WorkDir(work, {"bench": "quantize_scales_stream"}, restart=True) as w:
            run = ScaleRun(PagedLayers(paged, dev), w, windows)
            for _, _, step, step_args in scale_steps(run.layers):
                step(run, *step_args)
            kls, _ = group_kls(run)
    return kls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256, help="hidden size = expert intermediate size")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--scale-tokens", type=int, default=128, help="tokens per calibration file")
    parser.add_argument("--phase", choices=["whole", "streamed"], help=argparse.SUPPRESS)  # the subprocesses
    parser.add_argument("--paged", help=argparse.SUPPRESS)
    parser.add_argument("--name", default="quantize_scales_stream")
    args = parser.parse_args(argv)
    if args.phase:
        print(json.dumps(phase(args.phase, Path(args.paged), args.device, args.scale_tokens,
                               Path(args.paged).parent / "work")))
        return 0
    with tempfile.TemporaryDirectory(prefix="scales-stream-") as tmp:
        paged = build(args, Path(tmp))
        runs = {}
        for which in ("whole", "streamed"):
            print(f"measuring the loss scales: {which}", file=sys.stderr, flush=True)
            out = subprocess.run([sys.executable, "-m", "bench.quantize_scales_stream", "--phase", which,
                                  "--paged", str(paged), "--device", args.device,
                                  "--scale-tokens", str(args.scale_tokens)],
                                 cwd=ROOT, capture_output=True, text=True, check=True)
            runs[which] = json.loads(out.stdout.strip().splitlines()[-1])
        meta = json.loads((paged / "paged_model.json").read_text())
        files = {name: record["bytes"] for name, record in meta["files"].items()}
    whole, streamed = runs["whole"], runs["streamed"]
    rel = max(abs(streamed["kls"][k] - v) / max(abs(v), 1e-30) for k, v in whole["kls"].items())
    mib = lambda b: round(b / 2**20, 1)  # noqa: E731
    result = {
        "device": args.device, "peak_measure": "CUDA allocator" if args.device.startswith("cuda")
        else "peak RSS (sampled every 2 ms) above the RSS before the phase",
        "model": {"shape": "Qwen1.5-MoE-A2.7B family, random weights, bf16", "layers": args.layers,
                  "hidden": args.hidden, "experts": args.experts, "expert_intermediate": args.hidden,
                  "vocab": 32000},
        "artifact_file_bytes": files, "groups": len(whole["kls"]), "scale_tokens_per_file": args.scale_tokens,
        "whole": {k: v for k, v in whole.items() if k != "kls"},
        "streamed": {k: v for k, v in streamed.items() if k != "kls"},
        "peak_mib": {"whole": mib(whole["peak_bytes"]), "streamed": mib(streamed["peak_bytes"])},
        "kl_max_relative_difference": rel,
        "kls_whole": whole["kls"], "kls_streamed": streamed["kls"],
    }
    path = write_result(args.name, result)
    plot(result, RESULTS_DIR / f"{args.name}.png")
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("kls_")}, indent=1))
    print(f"wrote {path}", file=sys.stderr)
    return 0


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (mem, sec) = plt.subplots(1, 2, figsize=(8, 3.2))
    names = ["whole model", "streamed"]
    mem.bar(names, [result["peak_mib"]["whole"], result["peak_mib"]["streamed"]], color=["#999", "#3a7"])
    mem.set_ylabel("peak MiB of the phase (RSS above its start on the CPU)" if result["device"] == "cpu"
                   else "peak MiB (CUDA allocator)", fontsize=7)
    sec.bar(names, [result["whole"]["seconds"], result["streamed"]["seconds"]], color=["#999", "#3a7"])
    sec.set_ylabel("seconds")
    m = result["model"]
    fig.suptitle(f"loss-scale phase, {m['layers']} layers x {m['experts']} experts, H={m['hidden']}, "
                 f"{result['device']}; KLs agree to {result['kl_max_relative_difference']:.1e}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
