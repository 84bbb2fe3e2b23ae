"""The planner's loss scales measured one decoder layer at a time (quantize's last phase).

group_scales.measure_group_kls runs the whole dequantised model once at 8 bits (the
reference) and once per (layer, module) group with that group at 3 bits. A trial for
group (l, m) equals the reference up to layer l, so instead of 2L + 1 whole forwards the
streamed phase carries every trial's hidden states forward together, layer by layer:

    scalex             calibration windows -> embeddings (the reference stream)      -> sx0
    scale l            layer l at 8 bits runs the reference and every trial started
                       before l; with module m at 3 bits it runs the reference's input,
                       starting trial (l, m)                                         -> sx{l+1}
    scalekl            final norm + LM head: each trial's summed KL from the reference
                       per window                                                    -> scalekl

The same windows meet the same operations as in the whole model (one window per forward,
fp32, the artifact's weights), so the KLs are the same numbers; one layer (PagedLayers)
and one window of one stream are on the device at a time. The hidden states of the
1 + 2l streams stay in the work directory, which makes the phase resumable like the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedweight.common.errors import UserError
from pagedweight.format.apl_format import MODULES
from pagedweight.model.transformer import soft_cap
from pagedweight.offline.paged_layers import DTYPE, PagedLayers
from pagedweight.offline.work_dir import WorkDir
from pagedweight.planner.loss_scale import group_key

REFERENCE = "ref"
GROUP_MODULES = sorted(MODULES)  # the order measure_group_kls visits a layer's groups in


@dataclass
class ScaleRun:
    layers: PagedLayers
    work: WorkDir
    windows: list[list[int]]

    @property
    def groups(self) -> list[str]:
        return [group_key(l, m) for l in range(self.layers.config.num_layers) for m in GROUP_MODULES]

    def load_streams(self, name: str, streams: list[str]) -> dict[str, list[torch.Tensor]]:
        """stream -> one hidden state [1, T_w, H] per window, checked (the directory is input)."""
        stored, hidden = self.work.load(name), self.layers.config.hidden_size
        out = {}
        for s in streams:
            out[s] = []
            for w, window in enumerate(self.windows):
                x = stored.get(f"{s}.{w}")
                if x is None or tuple(x.shape) != (1, len(window), hidden) or x.dtype != DTYPE:
                    raise UserError(f"{self.work.path}: {name} lacks stream {s} window {w} "
                                    f"[1, {len(window)}, {hidden}] float32; pass --restart")
                out[s].append(x)
        return out


def streams_before(layer: int) -> list[str]:
    """The reference and every trial started in layers 0..layer-1."""
    return [REFERENCE] + [group_key(l, m) for l in range(layer) for m in GROUP_MODULES]


def flat(streams: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {f"{s}.{w}": x for s, xs in streams.items() for w, x in enumerate(xs)}


@torch.inference_mode()
def scale_embed_step(run: ScaleRun) -> None:
    ref = [run.layers.embed(torch.tensor([w])) for w in run.windows]
    run.work.commit("scalex", {"sx0": flat({REFERENCE: ref}), "scalewin": {"lengths": window_lengths(run)}})


def window_lengths(run: ScaleRun) -> torch.Tensor:
    return torch.tensor([len(w) for w in run.windows], dtype=torch.int64)


def forget_other_windows(run: ScaleRun) -> None:
    """The windows are the first `scale tokens` of each calibration file, so their lengths
    say which windows a resumed phase measured: another `--scale-tokens` (not part of the
    run's fingerprint, so a run can be finished with `--scale-tokens 0`) redoes the phase
    instead of mixing two runs' streams, and keeps the calibration steps."""
    if not run.work.done("scalex"):
        return
    stored = run.work.load("scalewin").get("lengths")
    if stored is None or not torch.equal(stored, window_lengths(run)):
        L = run.layers.config.num_layers
        run.work.forget([name for name, *_ in scale_steps(run.layers)],
                        ["scalewin", "scalekl", *(f"sx{l}" for l in range(L + 1))])


@torch.inference_mode()
def scale_layer_step(run: ScaleRun, layer: int) -> None:
    streams = run.load_streams(f"sx{layer}", streams_before(layer))
    module = run.layers.decoder_layer(layer)
    experts, dev = module.moe.experts, run.layers.device
    ropes = [run.layers.rope(len(w)) for w in run.windows]

    def through(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [module(x.to(dev), rope, 0, None).cpu() for x, rope in zip(xs, ropes)]

    out = {s: through(xs) for s, xs in streams.items()}  # everything at 8 bits
    for m in GROUP_MODULES:
        group = {b: 3 for b in experts.get_bits() if b.module == m}
        experts.set_bits(group)
        out[group_key(layer, m)] = through(streams[REFERENCE])
        experts.set_bits({b: 8 for b in group})
    del module, experts
    run.work.commit(f"scale{layer}", {f"sx{layer + 1}": flat(out)})
    run.work.discard(f"sx{layer}")


@torch.inference_mode()
def scale_kl_step(run: ScaleRun) -> None:
    """Per group and window: KL(p_8bit || p_trial) summed over the window's tokens."""
    L = run.layers.config.num_layers
    streams = run.load_streams(f"sx{L}", streams_before(L))
    norm, head = run.layers.head()
    dev, cap = run.layers.device, run.layers.config.final_logit_softcapping
    logprobs = lambda x: F.log_softmax(soft_cap(F.linear(norm(x.to(dev)), head), cap).float(), dim=-1)  # noqa: E731
    kl = torch.zeros(len(run.groups), len(run.windows), dtype=torch.float64)
    for w in range(len(run.windows)):
        ref = logprobs(streams[REFERENCE][w])
        for g, key in enumerate(run.groups):
            kl[g, w] = float(F.kl_div(logprobs(streams[key][w]), ref, log_target=True, reduction="sum"))
        del ref
    run.work.commit("scalekl", {"scalekl": {"kl": kl}})
    run.work.discard(f"sx{L}")


def group_kls(run: ScaleRun) -> tuple[dict[str, float], int]:
    """measure_group_kls's result: per group the mean KL per token, summed window by window
    in the reference's order; and the number of tokens."""
    kl = run.work.load("scalekl").get("kl")
    if kl is None or tuple(kl.shape) != (len(run.groups), len(run.windows)) or kl.dtype != torch.float64:
        raise UserError(f"{run.work.path}: scalekl is not the KL table of this run; pass --restart")
    num_tokens = sum(len(w) for w in run.windows)
    return {key: sum(float(v) for v in kl[g]) / num_tokens for g, key in enumerate(run.groups)}, num_tokens


def scale_steps(layers: PagedLayers) -> list[tuple[str, str, object, tuple]]:
    """(step name, progress label, function, args) of the phase, in order."""
    L = layers.config.num_layers
    return [("scalex", "loss scales: embedding", scale_embed_step, ())] + \
        [(f"scale{l}", f"loss scales layer {l + 1}/{L}", scale_layer_step, (l,)) for l in range(L)] + \
        [("scalekl", "loss scales: KL", scale_kl_step, ())]
