"""The streaming quantiser's steps: each runs every calibration batch through one piece
of the model held on the device, reading its inputs from and writing its outputs to the
work directory (host files), never the whole model or all activations on the device.

    embed          token ids -> x0
    forward l      x_l -> x_{l+1}; the layer's input statistics (calibrate.RecordingExperts;
                   with error feedback also its experts' full input Hessians, held only
                   for this step, on the device),
                   its smoothed Hessians h, column errors and per-chunk sensitivities ->
                   layer{l}; its experts quantised -> planes{l} (planes and LUTs, kept
                   apart so the artifact's assembly reads the small tables without them)
    loss           x_L -> dx_L, the gradient of the summed next-token NLL
    backward l     recompute layer l's forward from x_l, backward dx_{l+1} -> dx_l with the
                   experts' squared output gradients recorded -> G and the Gauss-Newton
                   column errors from layer l's stored planes -> gn{l}

Every batch holds the same chunks as the whole-model calibration's batches and runs the
same operations, so the statistics equal calibrate.calibrate's (the test compares them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedweight.common.errors import UserError
from pagedweight.format.apl_format import BIT_WIDTHS, LUT_WIDTHS, MODULES
from pagedweight.format.paged_model import LayerPlanes
from pagedweight.model.transformer import soft_cap
from pagedweight.offline.calibrate import CalibrationStats, RecordingExperts, smoothed_hessians
from pagedweight.offline.checkpoint_layers import CheckpointLayers
from pagedweight.offline.error_feedback import smoothed_full_hessians
from pagedweight.offline.layer_quantize import gn_col_errors, quantize_experts
from pagedweight.offline.quantize_tables import layer_chunk_sensitivities
from pagedweight.offline.work_dir import WorkDir

PER_COLUMN_PRIOR = {"gate_up": True, "down": False}  # calibrate.block_hessians' priors


@dataclass
class StreamRun:
    layers: CheckpointLayers
    work: WorkDir
    config: object  # quantize.QuantizeConfig
    chunks: torch.Tensor  # [N, T] token ids
    domains: list[str]
    tile_elements: int
    seconds: dict[str, float] = field(default_factory=lambda: {"forward": 0.0, "quantize": 0.0,
                                                                "loss": 0.0, "backward": 0.0})

    @property
    def device(self) -> torch.device:
        return self.layers.device

    def batches(self):
        """(start, stop) of each calibration batch, as calibrate.calibrate cuts them."""
        n, size = self.chunks.shape[0], self.config.calib.batch_size
        for start in range(0, n, size):
            yield start, min(start + size, n)

    def load_hidden(self, name: str) -> torch.Tensor:
        """Hidden states (or their gradients) [N, T, H] from the work directory, checked."""
        n, t = self.chunks.shape
        x = self.work.load(name).get("x")
        if x is None or tuple(x.shape) != (n, t, self.layers.config.hidden_size) or x.dtype != self.layers.dtype:
            raise UserError(f"{self.work.path}: {name} is not [{n}, {t}, hidden] {self.layers.dtype}; pass --restart")
        return x


def embed_step(run: StreamRun) -> None:
    run.work.commit("embed", {"x0": {"x": run.layers.embed(run.chunks)}})


def forward_step(run: StreamRun, layer: int) -> None:
    started = time.perf_counter()
    c, dev, gradients = run.layers.config, run.device, run.config.calib.gradients
    module = run.layers.decoder_layer(layer)
    dense = module.moe.experts
    N, T = run.chunks.shape
    E = c.num_experts
    stats = CalibrationStats(
        chunk_domains=run.domains,
        sum_sq_gate_up=torch.zeros(N, 1, E, c.hidden_size, device=dev),
        sum_sq_down=torch.zeros(N, 1, E, c.expert_intermediate_size, device=dev),
        token_counts=torch.zeros(N, 1, E, device=dev), routing_mass=torch.zeros(N, 1, E, device=dev),
        num_tokens_per_chunk=T)
    full = run.config.quantizer.needs_full_hessians
    if full:  # error feedback / LUT refit: every expert's full input Hessian sums
        H, I = c.hidden_size, c.expert_intermediate_size
        stats.gram_gate_up = torch.zeros(1, E, H, H, device=dev)
        stats.gram_down = torch.zeros(1, E, I, I, device=dev)
    recorder = RecordingExperts(dense, 0, stats)
    module.moe.experts = recorder
    x = run.load_hidden(f"x{layer}")
    out = torch.empty_like(x)
    for start, stop in run.batches():
        xb = x[start:stop].to(dev)
        recorder.chunk_of_token = torch.arange(start, stop, device=dev).repeat_interleave(T)
        rope = run.layers.rope(stop - start, T)
        # the whole-model calibration runs its forward with gradients on (it backpropagates
        # next); the same mode here keeps the same kernels, hence the same statistics
        with torch.enable_grad() if gradients else torch.inference_mode():
            if gradients:
                xb.requires_grad_(True)
            out[start:stop] = module(xb, rope, 0, None).detach().cpu()
    del xb
    counts = stats.token_counts.cpu()
    sums = {"gate_up": stats.sum_sq_gate_up.cpu(), "down": stats.sum_sq_down.cpu()}
    h = {m: smoothed_hessians(sums[m].sum(0), counts.sum(0), run.config.calib.prior_tokens,
                              PER_COLUMN_PRIOR[m])[0] for m in MODULES}
    # the full Hessians are smoothed where they were summed and stay there for the
    # quantiser (1.5 GB at Qwen's shape): no round trip through the host, and a division,
    # correctly rounded on either, gives the same bits on the device as on the CPU
    grams = {"gate_up": stats.gram_gate_up, "down": stats.gram_down}
    stats.gram_gate_up = stats.gram_down = None
    h_full = {}
    for m in (MODULES if full else ()):
        h_full[m] = smoothed_full_hessians(grams.pop(m)[0], counts.sum(0)[0].to(dev), h[m].to(dev),
                                           run.config.calib.prior_tokens)
    run.seconds["forward"] += time.perf_counter() - started

    started = time.perf_counter()
    tensors = {"token_counts": counts[:, 0], "routing_mass": stats.routing_mass[:, 0].cpu()}
    planes = {}
    col_errors = {}
    for m in MODULES:
        result = quantize_experts(getattr(dense, m).detach(), h[m], run.config.quantizer, str(dev),
                                  run.tile_elements, h_full.pop(m, None))
        col_errors[m] = result.col_errors
        planes[f"planes.{m}"] = result.planes.planes
        tensors[f"h.{m}"] = h[m]
        for b, lut in result.planes.luts.items():
            planes[f"lut{b}.{m}"] = lut
        for b in BIT_WIDTHS:
            tensors[f"err{b}.{m}"] = result.col_errors[b]
    del module, dense, recorder
    tensors["chunk_s"] = layer_chunk_sensitivities(sums, counts, col_errors, run.config.calib)
    run.seconds["quantize"] += time.perf_counter() - started
    run.work.commit(f"forward{layer}", {f"layer{layer}": tensors, f"planes{layer}": planes,
                                        f"x{layer + 1}": {"x": out}})


def stored_planes(run: StreamRun, layer: int) -> dict[str, LayerPlanes]:
    """Module -> the planes and LUTs `forward layer` wrote."""
    stored = run.work.load(f"planes{layer}")
    return {m: LayerPlanes(stored[f"planes.{m}"], {b: stored[f"lut{b}.{m}"] for b in LUT_WIDTHS}) for m in MODULES}


def loss_step(run: StreamRun) -> None:
    """dx_L: gradient of the summed next-token NLL (calibrate._run_batch's loss)."""
    started = time.perf_counter()
    L, dev = run.layers.config.num_layers, run.device
    norm, head = run.layers.head()
    x = run.load_hidden(f"x{L}")
    grad = torch.empty_like(x)
    for start, stop in run.batches():
        xb = x[start:stop].to(dev).requires_grad_(True)
        ids = run.chunks[start:stop].to(dev)
        with torch.enable_grad():
            logits = soft_cap(F.linear(norm(xb), head), run.layers.config.final_logit_softcapping)
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum")
            loss.backward()
        grad[start:stop] = xb.grad.cpu()
        del logits, loss, xb
    run.seconds["loss"] += time.perf_counter() - started
    run.work.commit("loss", {f"dx{L}": {"x": grad}})


def backward_step(run: StreamRun, layer: int) -> None:
    started = time.perf_counter()
    c, dev = run.layers.config, run.device
    E = c.num_experts
    module = run.layers.decoder_layer(layer)
    dense = module.moe.experts
    stats = CalibrationStats(
        chunk_domains=run.domains, sum_sq_gate_up=torch.empty(0), sum_sq_down=torch.empty(0),
        token_counts=torch.empty(0), routing_mass=torch.empty(0), num_tokens_per_chunk=run.chunks.shape[1],
        grad_sq_gate_up=torch.zeros(1, E, 2 * c.expert_intermediate_size, device=dev),
        grad_sq_down=torch.zeros(1, E, c.hidden_size, device=dev))
    module.moe.experts = RecordingExperts(dense, 0, stats)  # chunk_of_token None: gradients only
    x = run.load_hidden(f"x{layer}")
    upstream = run.load_hidden(f"dx{layer + 1}")
    grad = torch.empty_like(x) if layer > 0 else None
    T = run.chunks.shape[1]
    for start, stop in run.batches():
        xb = x[start:stop].to(dev).requires_grad_(True)
        rope = run.layers.rope(stop - start, T)
        with torch.enable_grad():
            module(xb, rope, 0, None).backward(upstream[start:stop].to(dev))
        if grad is not None:
            grad[start:stop] = xb.grad.cpu()
        del xb
    stored = run.work.load(f"layer{layer}")
    counts = stored["token_counts"].sum(0)[None]  # [1, E]
    prior = run.config.calib.prior_tokens
    g = {"gate_up": smoothed_hessians(stats.grad_sq_gate_up.cpu(), counts, prior, False)[0],
         "down": smoothed_hessians(stats.grad_sq_down.cpu(), counts, prior, True)[0]}
    tensors = {}
    planes = stored_planes(run, layer)
    for m in MODULES:
        errors = gn_col_errors(getattr(dense, m).detach(), planes[m], g[m], str(dev), run.tile_elements)
        tensors[f"g.{m}"] = g[m]
        tensors.update({f"errgn{b}.{m}": errors[b] for b in BIT_WIDTHS})
    del module, dense
    run.seconds["backward"] += time.perf_counter() - started
    outputs = {f"gn{layer}": tensors}
    if grad is not None:
        outputs[f"dx{layer}"] = {"x": grad}
    run.work.commit(f"backward{layer}", outputs)
    run.work.discard(f"x{layer + 1}", f"dx{layer + 1}")
