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

CUDA-graph replay (engine/decode_graphs.py): once the engine has reserved its slots
(`reserve_slots(max_num_seqs)`: the counts buffer is static and the spare slot fixed), a
step with prompt rows hands its row -> offset map to the graphs (`graph_rows`), which
upload it with the step's other rows and replay a graph captured with the recording in it
(`set_graph_rows` gives the static column; padding rows add their row weight, 0). Steps
without prompt rows replay graphs captured without it, so decode steps pay nothing.

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
from pagedweight.weights.routing_feed import each_choice


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
        self._first_layer = 0  # the first observed layer: where each forward starts its counts
        # reserve_slots: the most prompts a step holds, the spare slot after them, and the
        # static [L, (max_slots + 1) * E] counts every step (eager or replayed) adds into
        self.max_slots: int | None = None
        self._buffer: torch.Tensor | None = None
        self._offsets: np.ndarray | None = None  # this step's row -> slot * E (None: no prompt rows)
        self._graph_rows: torch.Tensor | None = None  # during a graph's forward: the static offsets column
        self._row_weights: torch.Tensor | None = None  # during a graph's forward: 1 real row, 0 padding
        self._graph_index = self._graph_source = None  # per forward, made at its first layer

    def install(self, model) -> None:
        """Observe every MoE block, after whatever observer is there (the routing feed)."""
        for block in model.moe_blocks:
            if block.observer is not None:
                self._next[block.layer_idx] = block.observer
            block.observer = self
        self._first_layer = min((block.layer_idx for block in model.moe_blocks), default=0)

    def uninstall(self, model) -> None:
        """Put back the observers this one was chained in front of (a benchmark switches the
        recorder on and off on one engine)."""
        for block in model.moe_blocks:
            if block.observer is self:
                block.observer = self._next.get(block.layer_idx)
        self._next = {}

    def reserve_slots(self, max_slots: int) -> None:
        """At most max_slots prompts per step (the engine's max_num_seqs): fixes the spare slot
        and makes the counts buffer static, which graph replays need."""
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        self.max_slots = max_slots
        self._buffer = torch.zeros(self.num_layers, (max_slots + 1) * self.num_experts, device=self.device)

    def set_row_weights(self, weights: torch.Tensor | None) -> None:
        """A graph's padding rows (weight 0) are counted by no one: kept for this recorder's
        graph forward and passed on to the observers behind it (the routing feed)."""
        self._row_weights = weights
        for following in {id(o): o for o in self._next.values()}.values():
            if hasattr(following, "set_row_weights"):
                following.set_row_weights(weights)

    def graph_rows(self) -> np.ndarray | None | bool:
        """For a graph replay of this step: None (no prompt rows: a graph without the
        recording serves it), the rows' offsets into the counts (uploaded with the step), or
        False (prompt rows but no reserved slots: the step must run eagerly)."""
        if self._offsets is None:
            return None
        return self._offsets if self._buffer is not None else False

    def set_graph_rows(self, offsets: torch.Tensor | None) -> None:
        """The static offsets column a graph's forward reads (None after it, or for a graph
        without the recording)."""
        self._graph_rows = offsets
        if offsets is None:  # made inside a capture: held here they would pin pool memory
            self._graph_index = self._graph_source = None

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
        self._rows = self._ones = None
        if not self._step:
            self._offsets = None
            return
        slots = len(self._step)
        spare = slots if self.max_slots is None else self.max_slots
        if slots > spare:
            raise RuntimeError(f"prompt routing: {slots} prompts in one step, slots reserved for {spare}")
        slot_of_row = np.full(offset, spare, dtype=np.int64)  # rows of no prompt: the spare slot
        for slot, (a, b) in enumerate(spans):
            slot_of_row[a:b] = slot
        self._offsets = slot_of_row * self.num_experts
        self._num_rows = offset
        self._counts = self._buffer if self._buffer is not None else \
            torch.zeros(self.num_layers, (slots + 1) * self.num_experts, device=self.device)

    def __call__(self, layer: int, x, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        following = self._next.get(layer)
        if following is not None:
            following(layer, x, topk_ids, topk_weights)
        if self._graph_rows is not None:
            self._record_in_graph(layer, topk_ids)
            return
        if self._offsets is None:
            return
        if topk_ids.shape[0] != self._num_rows:
            raise RuntimeError(f"prompt routing: {topk_ids.shape[0]} routed rows, the step has {self._num_rows}")
        if layer == self._first_layer:  # once per forward: each row's slot k times, the increments
            self._counts.zero_()  # the reserved buffer holds the last step's counts
            self._rows = each_choice(torch.from_numpy(self._offsets).to(self.device), topk_ids.shape[1])
            self._ones = torch.ones(self._rows.shape[0], device=self.device)
        self._counts[layer].index_add_(0, self._rows + topk_ids.reshape(-1), self._ones)

    def _record_in_graph(self, layer: int, topk_ids: torch.Tensor) -> None:
        """The same counts from the graph's static columns: rebuilt at the first layer of
        every forward (the capture's warm-up, the capture, each replay), padding rows adding
        their weight 0."""
        if layer == self._first_layer:
            k = topk_ids.shape[1]
            self._buffer.zero_()
            self._graph_index = each_choice(self._graph_rows, k)
            self._graph_source = each_choice(self._row_weights.to(torch.float32), k)
        self._buffer[layer].index_add_(0, self._graph_index + topk_ids.reshape(-1), self._graph_source)

    def end_step(self) -> None:
        """Add the step's counts to each prompt's own (after the forward)."""
        if self._offsets is None:
            return
        # the step's prompt slots only (the reserved buffer has room for max_slots + the spare)
        counts = self._counts.view(self.num_layers, -1, self.num_experts)[:, :len(self._step)]
        counts = counts.cpu().double().numpy()
        for slot, (seq, end) in enumerate(self._step):
            if seq.prompt_counts is None:
                seq.prompt_counts = np.zeros((self.num_layers, self.num_experts))
            seq.prompt_counts += counts[:, slot]
            seq.num_prompt_tokens_routed = end
            self._in_flight[seq.seq_id] = seq
        self._rows = self._counts = self._ones = self._offsets = None
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
