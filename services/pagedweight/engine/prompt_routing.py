"""Each request's prompt routing, recorded as the engine prefills it; the mix in flight.

The planner's third signal (planner/prompt_context.py) is the prompt residual: the
artifact's ridge heads map a prompt's routing histogram (per layer, the fraction of its
tokens' top-k selections each expert got) to a per-block correction of S. Online, the
prompts are prefilled in chunks, several per step, beside decodes, in one varlen batch;
`PromptRoutingRecorder` is a MoE routing observer that attributes each step's rows to
the prompts they belong to and adds their selections to that request's own [L, E]
counts (`Sequence.prompt_counts`).

Cost: a step without prompt tokens (a pure decode step, most steps) does nothing but one
`None` test per MoE layer. A step with prompt tokens builds a row -> prompt map once (one
small host-to-device copy), adds the selections per layer with one `index_add_` on the
device, and copies the step's [L, prompts, E] counts to the host once after the forward
(the step's sampled tokens are copied anyway). Prompt tokens recomputed after a
preemption are not counted twice (`Sequence.num_prompt_tokens_routed`); output tokens
recomputed with them are not prompt tokens and are not counted.

`mix()` is what a plan request carries (messages.PromptMix): the requests in flight with
recorded prompt tokens, each weighted by the tokens it still has to run (prompt rest plus
max_tokens left); finished or aborted requests are dropped. It runs once per plan request,
over the requests in flight, never per step or per block.
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np
import torch

from pagedweight.engine.scheduler import ScheduledSeq
from pagedweight.engine.sequence import Sequence
from pagedweight.planner.messages import PromptMix


class PromptRoutingRecorder:
    def __init__(self, num_layers: int, num_experts: int, device: torch.device | str = "cpu"):
        self.num_layers, self.num_experts = num_layers, num_experts
        self.device = torch.device(device)
        self._in_flight: dict[int, Sequence] = {}  # seq_id -> a request with recorded prompt tokens
        self._step: list[tuple[Sequence, int]] = []  # this step's prompts: (sequence, prompt end routed)
        self._rows: torch.Tensor | None = None  # [T] (then [T*k]) row -> slot*E on the device (None: no prompt rows)
        self._num_rows = 0  # T, the step's rows
        self._ones: torch.Tensor | None = None  # [T*k] ones, made at the step's first layer
        self._counts: torch.Tensor | None = None  # [L, (slots + 1) * E], the last slot takes other rows
        self._next: dict[int, Callable] = {}  # the observers this one was chained in front of

    def install(self, model) -> None:
        """Observe every MoE block, after whatever observer is there (the routing feed)."""
        for block in model.moe_blocks:
            if block.observer is not None:
                self._next[block.layer_idx] = block.observer
            block.observer = self

    def set_row_weights(self, weights: torch.Tensor | None) -> None:
        """Passed on to the observers behind this one (the routing feed). A padded step has no
        prompt rows here: prefill steps run eagerly while this recorder is installed."""
        for following in {id(o): o for o in self._next.values()}.values():
            if hasattr(following, "set_row_weights"):
                following.set_row_weights(weights)

    # ---- one engine step ------------------------------------------------------------------
    def begin_step(self, scheduled: list[ScheduledSeq]) -> None:
        """Map this step's rows (the scheduled sequences' new tokens, in batch order) to the
        prompts they prefill."""
        self._step, spans, offset = [], [], 0
        for s in scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            lo = max(start, seq.num_prompt_tokens_routed)
            hi = min(start + s.num_new_tokens, len(seq.prompt_ids))
            if hi > lo:
                spans.append((offset + lo - start, offset + hi - start))
                self._step.append((seq, hi))
            offset += s.num_new_tokens
        if not self._step:
            self._rows = None
            return
        slots = len(self._step)
        slot_of_row = np.full(offset, slots, dtype=np.int64)  # rows of no prompt: the spare slot
        for slot, (a, b) in enumerate(spans):
            slot_of_row[a:b] = slot
        self._rows = torch.from_numpy(slot_of_row * self.num_experts).to(self.device)
        self._num_rows, self._ones = offset, None
        self._counts = torch.zeros(self.num_layers, (slots + 1) * self.num_experts, device=self.device)

    def __call__(self, layer: int, x, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        following = self._next.get(layer)
        if following is not None:
            following(layer, x, topk_ids, topk_weights)
        if self._rows is None:
            return
        if topk_ids.shape[0] != self._num_rows:
            raise RuntimeError(f"prompt routing: {topk_ids.shape[0]} routed rows, the step has {self._num_rows}")
        if self._ones is None:  # once per step: each row's slot k times, and the increments
            self._rows = self._rows.repeat_interleave(topk_ids.shape[1])
            self._ones = torch.ones(self._rows.shape[0], device=self.device)
        self._counts[layer].index_add_(0, self._rows + topk_ids.reshape(-1), self._ones)

    def end_step(self) -> None:
        """Add the step's counts to each prompt's own (after the forward)."""
        if self._rows is None:
            return
        counts = self._counts.cpu().double().numpy().reshape(self.num_layers, -1, self.num_experts)
        for slot, (seq, end) in enumerate(self._step):
            if seq.prompt_counts is None:
                seq.prompt_counts = np.zeros((self.num_layers, self.num_experts))
            seq.prompt_counts += counts[:, slot]
            seq.num_prompt_tokens_routed = end
            self._in_flight[seq.seq_id] = seq
        self._rows = self._counts = self._ones = None
        self._step = []
        self._drop_finished()

    # ---- the mix a plan request carries ---------------------------------------------------
    def mix(self, residual_of: Callable[[np.ndarray], np.ndarray] | None = None) -> PromptMix | None:
        """The prompts in flight, weighted by their remaining tokens (None: none in flight).
        `residual_of`: routing [L, E] -> [N] predicted residual (the artifact's heads)."""
        self._drop_finished()
        return prompt_mix(self._in_flight.values(), residual_of)

    def _drop_finished(self) -> None:
        for seq_id in [i for i, seq in self._in_flight.items() if seq.is_finished]:
            del self._in_flight[seq_id]


def remaining_tokens(seq: Sequence) -> int:
    """Tokens the request still runs through the model: the prompt's rest and max_tokens left."""
    return max(seq.max_total_tokens - seq.num_computed_tokens, 0)


def prompt_mix(seqs: Iterable[Sequence], residual_of=None) -> PromptMix | None:
    """The weighted mean of the prompts' per-layer routing fractions; see PromptMix."""
    live = [(seq.prompt_counts, remaining_tokens(seq)) for seq in seqs
            if seq.prompt_counts is not None and not seq.is_finished]
    live = [(counts, weight) for counts, weight in live if weight > 0]
    if not live:
        return None
    counts = np.stack([c for c, _ in live])  # [S, L, E]
    weights = np.array([w for _, w in live], dtype=np.float64)
    fractions = counts / np.maximum(counts.sum(-1, keepdims=True), 1.0)
    routing = np.tensordot(weights, fractions, axes=1) / weights.sum()
    residual = residual_of(routing) if residual_of is not None else None
    return PromptMix(routing, residual, len(live), int(weights.sum()))
