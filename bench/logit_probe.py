"""The served logit error of the real-shape run's pressure section (docs/elasticity.md): how far
the logits of the model as it is served at a step lie from bf16's.

A probe is a few fixed random sequences run teacher-forced (every position in one forward pass,
as `parity` runs them): once through the bf16 model for the reference, then through the
runtime's model between engine steps. There its MoE blocks call the experts operator the
engine's steps call (ArenaExperts), which reads the bits the page table has committed at that
step: the plan in force. Attention and the other weights are the same bf16 tensors in both, so
what differs is the experts' width. Errors are `logit_error`'s (offline/real_shape_models.py).

The probes run in a replay of the measured load after it (the same requests, the same
prompts), never inside it: subtracting a probe's time from the load's would not give the load
unprobed, since the page mover's copies go on during a probe and the pager reads the engine's
inter-token latency, so the pager would move differently in the load whose throughput is
reported. The replay follows the measured load's course as far as the pager's moves do not
depend on time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedweight.cli.load_bench import LoadSpec, drive_load
from pagedweight.offline.real_shape_models import logit_error

# 4 x 64 positions: at Qwen1.5-MoE's vocabulary (151,936) 78 MB of bf16 reference logits
PROBE_SEQS, PROBE_LEN, PROBE_SEED = 4, 64, 11


def teacher_forced(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V] of ids [B, T] in one forward pass, with the routing observers (the
    feed the planner reads, the prompt recorder) detached meanwhile: a probe is not traffic."""
    blocks = model.moe_blocks
    observers = [block.observer for block in blocks]
    for block in blocks:
        block.observer = None
    try:
        with torch.inference_mode():
            return model(ids)
    finally:
        for block, observer in zip(blocks, observers):
            block.observer = observer


@dataclass
class LogitProbe:
    ids: torch.Tensor  # [sequences, positions] on the model's device
    ref: torch.Tensor  # the reference model's logits of ids [sequences, positions, V], its dtype

    @classmethod
    def of(cls, model, num_seqs: int = PROBE_SEQS, seq_len: int = PROBE_LEN, seed: int = PROBE_SEED):
        """The probe with `model` (the bf16 one) as its reference."""
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, model.config.vocab_size, (num_seqs, seq_len), generator=gen).to(model.device)
        return cls(ids, teacher_forced(model, ids))

    def measure(self, model) -> dict:
        """`model`'s logits of the probe against the reference (logit_error)."""
        return logit_error(teacher_forced(model, self.ids), self.ref)


def replay_with_probes(engine, spec: LoadSpec, probe: LogitProbe, bits_now, every: int) -> dict:
    """`spec` driven on `engine`, the probe run before its first step and after every
    `every` steps, and after a step that leaves the mean bits (`bits_now()`) below every
    probe's so far, once `every // 4` steps have passed since the last: the lowest bits the
    pager holds for a while are probed, not each step of the way down. A probe after step
    s measures the weights step s + 1 is served with."""
    samples, state = [], {"step": 0, "probed_min": math.inf, "bits_min": math.inf}

    def sample(bits: float) -> None:
        error = {k: round(v, 5) for k, v in probe.measure(engine.model).items()}
        samples.append({"step": state["step"], "bits_mean": round(bits, 4), **error})
        state["probed_min"] = min(state["probed_min"], bits)

    def after_step():
        state["step"] += 1
        bits = bits_now()
        state["bits_min"] = min(state["bits_min"], bits)
        since = state["step"] - samples[-1]["step"]
        if since >= every or (bits < state["probed_min"] and since >= max(1, every // 4)):
            sample(bits)

    sample(bits_now())
    drive_load(engine, spec, after_step)
    return summary(probe, samples, state["step"], state["bits_min"])


def summary(probe: LogitProbe, samples: list[dict], num_steps: int, bits_min: float) -> dict:
    """Over the probes: the mean of their mean relative errors, the worst position's error and
    the mean top-1 agreement; the probe at the lowest bits; the replay's lowest mean bits
    (whether the probes met it)."""
    lowest = min(samples, key=lambda s: s["bits_mean"])
    return {"probe": {"sequences": probe.ids.shape[0], "positions": probe.ids.shape[1]},
            "replay": {"steps": num_steps, "bits_mean_min": round(bits_min, 4)},
            "relative_error_mean": round(sum(s["relative_error_mean"] for s in samples) / len(samples), 5),
            "relative_error_worst": max(s["relative_error_max"] for s in samples),
            "argmax_agree": round(sum(s["argmax_agree"] for s in samples) / len(samples), 4),
            "at_lowest_bits": lowest, "steps": samples}
