"""`pagedweight quantize`: checkpoint directory -> paged model directory, one decoder layer
at a time.

The model is never built whole: one layer is read from the safetensors files onto the
device in the compute dtype (the checkpoint's on an accelerator), every calibration batch
passes through it, and it is dropped; hidden states between layers live on the host, in
the work directory (work_dir.py), which also makes the run resumable. Phases:
1. embed, then forward layer by layer (stream_passes.py): each layer's expert input
   statistics and routing (calibrate.RecordingExperts), its smoothed Hessian diagonals,
   its experts quantised with them as k-means weights (layer_quantize.py, apl_quantizer.py)
   and its per-chunk sensitivities for the residual heads;
2. with gradients (the default), the loss, then backward layer by layer from the last,
   recomputing each layer's forward: the output Fisher G per expert row and the
   Gauss-Newton column errors from the planes phase 1 wrote;
3. the tables (quantize_tables.py): sensitivity S_i(b), S_gn_i(b), residual heads; the
   directory is saved (paged_model.py); no bf16 copy of the routed experts unless
   `keep_bf16` (the source checkpoint has them: model/source_experts.py);
4. the planner's loss scales: one KL measurement per (layer, module) group on the
   calibration files (artifact_scales.py), so `plan`, `eval` and the runtime rank in loss
   units by default. It streams too (stream_scales.py): the written artifact's layers one
   at a time in fp32, every group's trial carried forward together, resumable.
Shared experts and every non-expert weight are copied in bf16, unquantised. Peak device
and host memory are logged and recorded under the artifact's "quantizer" section. The
result equals the whole-model quantiser's (tests/offline/quantize_reference.py) when both compute in
fp32: the same batches meet the same operations, only one layer at a time.
"""

from __future__ import annotations

import resource
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, TextIO

import torch

from pagedweight.format.apl_format import BIT_WIDTHS, MODULES
from pagedweight.format.paged_meta import read_meta, write_meta
from pagedweight.format.paged_model import all_block_ids, save_paged_model
from pagedweight.frontend.tokenizer import Tokenizer
from pagedweight.offline.apl_quantizer import QuantizerConfig
from pagedweight.offline.artifact_scales import record_planner_scales, scale_windows
from pagedweight.offline.calibrate import CalibConfig, CalibrationStats, read_chunks
from pagedweight.offline.checkpoint_layers import CheckpointLayers
from pagedweight.offline.host_memory import AnonymousPeak
from pagedweight.offline.paged_layers import PagedLayers
from pagedweight.offline.layer_quantize import DEFAULT_TILE_ELEMENTS, LayerResult, quantize_layer  # noqa: F401 - re-exported
from pagedweight.offline.progress import ProgressBar
from pagedweight.offline.quantize_tables import artifact_meta, fit_heads
from pagedweight.offline.residual_heads import ResidualConfig, heads_tensors
from pagedweight.offline.sensitivity import sensitivity_table
from pagedweight.offline.stream_passes import (
    StreamRun, backward_step, embed_step, forward_step, loss_step, stored_planes,
)
from pagedweight.offline.stream_scales import ScaleRun, forget_other_windows, group_kls, scale_steps
from pagedweight.common.file_digest import file_sha256
from pagedweight.offline.work_dir import WorkDir


@dataclass(frozen=True)
class QuantizeConfig:
    calib: CalibConfig = field(default_factory=CalibConfig)
    quantizer: QuantizerConfig = field(default_factory=QuantizerConfig)
    residual: ResidualConfig = field(default_factory=ResidualConfig)
    device: str = "cpu"  # where the layers, calibration and k-means run (cuda works too)
    keep_bf16: bool = False  # also store the original experts in bf16 (the source has them)
    scale_tokens: int = 256  # calibration tokens per file for the planner's loss scales (0: skip)
    calib_text_name: str = "user"  # what the calibration text was ("bundled:v1": the package's own)
    # compute dtype of the layers: "auto" is the checkpoint's on an accelerator, fp32 on
    # the CPU (checkpoint_layers.py); "float32", "bfloat16", "float16" force one
    dtype: str = "auto"
    tile_elements: int = DEFAULT_TILE_ELEMENTS  # weights per k-means tile (bounds device memory)


def run_fingerprint(model_dir: Path, calib_files: list[Path], config: QuantizeConfig, dtype: torch.dtype) -> dict:
    """What a resumed run must share with the run that wrote the work directory."""
    settings = asdict(config)
    # only the final assembly reads these; the loss-scale steps check their own windows
    # (stream_scales.forget_other_windows), so `--scale-tokens 0` can finish a run
    for name in ("keep_bf16", "scale_tokens", "calib_text_name"):
        settings.pop(name)
    return {
        "model": str(model_dir.resolve()),
        "model_files": {p.name: {"bytes": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns}
                        for p in sorted(model_dir.iterdir()) if p.suffix in (".safetensors", ".json")},
        "calib_files": [{"path": str(Path(f).resolve()), "sha256": file_sha256(Path(f))} for f in calib_files],
        "settings": settings,
        "compute_dtype": str(dtype).removeprefix("torch."),
    }


def peak_memory(device: torch.device, anonymous: AnonymousPeak | None = None) -> dict:
    """Peak bytes so far: the device allocator's (CUDA), this process's resident set (which
    counts the checkpoint's memory-mapped pages too) and, sampled after every step, its
    anonymous memory alone (host_memory.py; None where the OS does not report it)."""
    host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    dev = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    if anonymous is not None:
        anonymous.sample()
    return {"peak_device_bytes": dev, "peak_host_bytes": host,
            "peak_host_anonymous_bytes": anonymous.peak if anonymous is not None else None}


def quantize_model(model_dir: str | Path, out_dir: str | Path, calib_files: list[Path],
                   config: QuantizeConfig = QuantizeConfig(),
                   log: Callable[[str], None] = lambda msg: None,
                   work_dir: str | Path | None = None, restart: bool = False,
                   progress: TextIO | None = None) -> Path:
    """Quantise into `out_dir`. With `work_dir`, a run interrupted earlier resumes from it
    (and it is removed once the artifact is written); without, a temporary one is used.
    `progress`: a stream for the progress bar (the CLI passes stderr)."""
    started = time.perf_counter()
    model_dir = Path(model_dir)
    layers = CheckpointLayers(model_dir, config.device, config.dtype)
    if layers.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(layers.device)
    chunks, domains = read_chunks(Tokenizer(model_dir), calib_files, config.calib)
    fingerprint = run_fingerprint(model_dir, calib_files, config, layers.dtype)
    temporary = work_dir is None
    work_path = Path(tempfile.mkdtemp(prefix="pagedweight-quantize-")) if temporary else Path(work_dir)
    try:
        with WorkDir(work_path, fingerprint, restart) as work:
            if work.resumed_steps:
                log(f"resuming from {work.path}: {work.resumed_steps} steps already done")
            log(f"calibrating and quantising {layers.config.num_layers} layers one at a time in "
                f"{str(layers.dtype).removeprefix('torch.')} on {layers.device}, "
                f"{len(chunks)} calibration chunks of {config.calib.seq_len} tokens")
            run = StreamRun(layers, work, config, torch.tensor(chunks), domains, config.tile_elements)
            steps = stream_steps(run)
            L = layers.config.num_layers
            scale_count = L + 2 if config.scale_tokens > 0 else 0  # scale_steps' length
            bar = ProgressBar(len(steps) + scale_count, L * layers.config.num_experts * len(MODULES), progress)
            anonymous = AnonymousPeak()
            run_steps(run, steps, bar, anonymous)
            stream_peak = peak_memory(layers.device, anonymous)
            out = write_artifact(run, out_dir, model_dir, calib_files, started, stream_peak)
            scale_seconds = None
            if config.scale_tokens > 0:
                log(f"measuring the planner's loss scales ({2 * L} groups), one layer at a time")
                scales_started = time.perf_counter()
                measure_scales(out, work, calib_files, config, bar, anonymous)
                scale_seconds = time.perf_counter() - scales_started
                log(f"loss scales in {scale_seconds:.1f} s")
    except BaseException:
        if temporary:
            shutil.rmtree(work_path, ignore_errors=True)
        raise
    work.remove()  # the artifact is whole: nothing left to resume
    peak = record_peaks(out, layers.device, scale_seconds, anonymous)
    gib = lambda b: f"{b / 2**30:.2f} GiB" if b is not None else "n/a"  # noqa: E731
    # (no path: the CLI writes into a temporary sibling of --out and renames it when complete)
    log(f"artifact complete in {time.perf_counter() - started:.1f} s; peak device memory "
        f"{gib(peak['peak_device_bytes'])}, peak host memory {gib(peak['peak_host_anonymous_bytes'])} "
        f"anonymous ({gib(peak['peak_host_bytes'])} resident, mapped checkpoint pages included)")
    return out


def stream_steps(run: StreamRun) -> list[tuple]:
    """(step name, progress label, function, args, blocks quantised) of phases 1-2, in order."""
    L, E = run.layers.config.num_layers, run.layers.config.num_experts
    gradients = run.config.calib.gradients
    steps = [("embed", "embedding", embed_step, (), 0)]
    steps += [(f"forward{l}", f"forward layer {l + 1}/{L}", forward_step, (l,), E * len(MODULES)) for l in range(L)]
    if gradients:
        steps += [("loss", "loss", loss_step, (), 0)]
        steps += [(f"backward{l}", f"backward layer {l + 1}/{L}", backward_step, (l,), 0)
                  for l in reversed(range(L))]
    return steps


def run_steps(run, steps: list[tuple], bar: ProgressBar, anonymous: AnonymousPeak | None = None) -> None:
    """Every step not yet done, in order, advancing the progress bar (and sampling the host's
    anonymous memory after each, where it is highest: before the step's temporaries go)."""
    for name, label, step, args, blocks in steps:
        if run.work.done(name):
            bar.skip(blocks)
            continue
        step(run, *args)
        if anonymous is not None:
            anonymous.sample()
        bar.advance(label, blocks)


def measure_scales(out: Path, work: WorkDir, calib_files: list[Path], config: QuantizeConfig,
                   bar: ProgressBar, anonymous: AnonymousPeak | None = None) -> None:
    """Phase 4, streamed (stream_scales.py), recorded in the artifact."""
    run = ScaleRun(PagedLayers(out, config.device), work, scale_windows(out, calib_files, config.scale_tokens))
    forget_other_windows(run)
    run_steps(run, [(*step, 0) for step in scale_steps(run.layers)], bar, anonymous)
    kls, num_tokens = group_kls(run)
    record_planner_scales(out, calib_files, config.scale_tokens, kls, num_tokens)


def write_artifact(run: StreamRun, out_dir, model_dir: Path, calib_files, started: float, peak: dict) -> Path:
    """Gather every layer's tables from the work directory and save the paged model; the
    planes and LUTs go to the artifact one layer at a time (host memory: one layer's)."""
    cfg, config, work = run.layers.config, run.config, run.work
    L, gradients = cfg.num_layers, config.calib.gradients
    col_errors, col_errors_gn = {}, {}
    h = {m: [] for m in MODULES}
    g = {m: [] for m in MODULES}
    chunk_s, counts, mass = [], [], []
    for l in range(L):
        stored = work.load(f"layer{l}")
        gn = work.load(f"gn{l}") if gradients else None
        for m in MODULES:
            col_errors[(l, m)] = {b: stored[f"err{b}.{m}"] for b in BIT_WIDTHS}
            col_errors_gn[(l, m)] = {b: gn[f"errgn{b}.{m}"] for b in BIT_WIDTHS} if gn else None
            h[m].append(stored[f"h.{m}"])
            if gn:
                g[m].append(gn[f"g.{m}"])
        chunk_s.append(stored["chunk_s"])
        counts.append(stored["token_counts"])
        mass.append(stored["routing_mass"])
    h = {m: torch.stack(v) for m, v in h.items()}  # module -> [L, E, C]
    N = run.chunks.shape[0]
    token_counts = torch.stack(counts, 1)  # [N, L, E]
    stats = CalibrationStats(run.domains, torch.empty(0), torch.empty(0), token_counts, torch.stack(mass, 1),
                             run.chunks.shape[1], files=[str(f) for f in calib_files])
    sens = sensitivity_table(h, col_errors, L)
    heads, heads_report = fit_heads(torch.stack(chunk_s, 1).reshape(N, -1, len(BIT_WIDTHS)), sens,
                                    all_block_ids(cfg), token_counts, run.domains, config)
    elapsed = time.perf_counter() - started
    quantizer = {
        "calibration_seconds": run.seconds["forward"] + run.seconds["loss"] + run.seconds["backward"],
        "quantization_seconds": run.seconds["quantize"],
        "streaming": {"compute_dtype": str(run.layers.dtype).removeprefix("torch."),
                      "checkpoint_dtype": str(run.layers.checkpoint_dtype).removeprefix("torch."),
                      "steps_resumed": work.resumed_steps, "seconds": dict(run.seconds),
                      "seconds_total": elapsed, "tile_elements": run.tile_elements, **peak},
    }
    meta = artifact_meta(stats, calib_files, config, h, col_errors, col_errors_gn, L, gradients,
                         heads_report, quantizer)
    dense = run.layers.dense_state()
    bf16 = {(l, m): w for l in range(L) for m, w in run.layers.expert_weights(l).items()} \
        if config.keep_bf16 else None
    hessians = {(l, m): h[m][l] for l in range(L) for m in MODULES}
    if gradients:
        hessians.update({(l, f"{m}.grad_sq"): g[m][l] for l in range(L) for m in MODULES})
    apl = (((l, m), planes) for l in range(L) for m, planes in stored_planes(run, l).items())
    return save_paged_model(out_dir, model_dir, cfg, dense, apl, bf16, meta, heads_tensors(heads), hessians)


def record_peaks(out: Path, device: torch.device, scale_seconds: float | None,
                 anonymous: AnonymousPeak | None = None) -> dict:
    """The whole run's peaks (loss scales included) into paged_model.json's quantizer section."""
    peak = peak_memory(device, anonymous)
    meta = read_meta(out)
    meta["quantizer"]["streaming"]["seconds"]["loss_scales"] = scale_seconds
    meta["quantizer"]["peak_device_bytes"] = peak["peak_device_bytes"]
    meta["quantizer"]["peak_host_bytes"] = peak["peak_host_bytes"]
    meta["quantizer"]["peak_host_anonymous_bytes"] = peak["peak_host_anonymous_bytes"]
    write_meta(out, meta)
    return peak

