"""The model side of one engine step: input preparation, the forward, sampling.

`ModelRunner.run(scheduled)` flattens the scheduled sequences' new tokens into one varlen
batch, builds the step's attention context over the paged KV cache, runs the model and
samples one token for each sequence whose last known token was computed. It changes no
sequence state: the engine loop applies the results (engine.py). On CUDA, steps replay a
captured graph of the forward per padded bucket of token rows (decode_graphs.py) unless
the engine runs with `enforce_eager`: decode steps, and with `graph_prefill` steps with
prefill chunks too (every new token a row); steps a graph cannot serve run eagerly.
"""

from __future__ import annotations

import torch

from pagedweight.engine.decode_graphs import DecodeGraphs, StepChunk
from pagedweight.engine.sampler import apply_penalties, sample
from pagedweight.engine.scheduler import ScheduledSeq
from pagedweight.engine.sequence import Sequence
from pagedweight.engine.step_phases import StepPhases
from pagedweight.memory.kv_cache import PagedKVCache
from pagedweight.model.paged_attention import SeqSlice, build_step_with
from pagedweight.model.transformer import MoECausalLM


class ModelRunner:
    def __init__(self, model: MoECausalLM, kv: PagedKVCache, attention_impl: str, eos_ids: set[int],
                 graphs: DecodeGraphs | None = None, phases: StepPhases | None = None,
                 graph_prefill: bool = True):
        self.model, self.kv = model, kv
        self.attention_impl = attention_impl
        self.eos_ids = eos_ids
        self.graphs = graphs  # None: every step eager
        # steps with a prefill chunk (or a sequence that does not sample) replay graphs too;
        # False: only pure decode steps do, the others run eagerly
        self.graph_prefill = graph_prefill
        self.phases = phases if phases is not None else StepPhases()
        self.num_graph_steps = self.num_eager_steps = 0
        # per sampling sequence of the last step: (logprob, top ids, top logprobs), or None
        # where the sequence asked for none
        self.step_logprobs: list | None = None

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq]) -> list[int]:
        """One forward over the step; a sampled token per sequence with `samples` set."""
        seqs = [s.seq for s in scheduled if s.samples]
        self.step_logprobs = None
        replayed = self._replay(scheduled)
        if replayed is None:
            input_ids, step, logits_indices = self.prepare(scheduled)
            self.phases.mark("prepare")
            logits = self.model.forward_paged(input_ids, step, logits_indices)
            self.phases.mark("launch")
            self.num_eager_steps += 1
            return self.sample(seqs, logits)
        self.num_graph_steps += 1
        logits, tokens = replayed
        self.phases.mark("launch")
        if all(s.params.greedy and len(s.output_ids) >= s.params.min_tokens and s.params.logprobs is None
               and not s.params.processes_logits for s in seqs):
            out = tokens.tolist()  # the graph's own argmax: nothing more to launch
            self.phases.mark("wait")
            return out
        return self.sample(seqs, logits)

    def _replay(self, scheduled: list[ScheduledSeq]):
        """(logits, greedy tokens) of the sampling sequences from a graph, or None: no graph
        fits, or (without graph_prefill) not a pure decode step."""
        if self.graphs is None:
            return None
        decode = all(s.num_new_tokens == 1 and s.samples for s in scheduled)
        if not (decode or self.graph_prefill):
            return None
        chunks = [StepChunk(_tokens_at(s.seq, s.seq.num_computed_tokens, s.num_new_tokens), s.seq.block_ids,
                            s.seq.num_computed_tokens + s.num_new_tokens, s.samples) for s in scheduled]
        self.phases.mark("prepare")
        return self.graphs.run(chunks, self.phases)

    def prepare(self, scheduled: list[ScheduledSeq]):
        input_ids, slices, logits_indices = [], [], []
        for s in scheduled:
            start = s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            input_ids.extend(s.seq.token_ids[start:end])
            slices.append(SeqSlice(s.seq.block_ids, end, s.num_new_tokens))
            if s.samples:
                logits_indices.append(len(input_ids) - 1)
        # input ids and logits rows cross with the step's index tensors, in one copy
        step, (ids, rows) = build_step_with(self.kv, slices, self.attention_impl, extra=(input_ids, logits_indices))
        return ids, step, rows

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """Greedy rows in one argmax; others one by one with their own parameters."""
        self.step_logprobs = None
        wants = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
        raw = logits[wants].float().log_softmax(dim=-1) if wants else None  # before any processing
        for i, seq in enumerate(seqs):
            if seq.params.processes_logits:
                logits[i:i + 1] = apply_penalties(logits[i:i + 1].clone(), seq.params, seq.prompt_ids,
                                                  seq.output_ids)
            if len(seq.output_ids) < seq.params.min_tokens:
                # Too early to finish: the tokens that would finish it cannot be sampled.
                eos = set() if seq.params.ignore_eos else self.eos_ids
                banned = list(eos | set(seq.params.stop_token_ids))
                banned = [t for t in banned if t < logits.shape[-1]]
                if banned:
                    logits[i, banned] = float("-inf")
        tokens = logits.argmax(dim=-1)
        for i, seq in enumerate(seqs):
            if not seq.params.greedy:
                tokens[i] = sample(logits[i : i + 1], seq.params, seq.generator)[0]
        self.phases.mark("launch")
        out = tokens.tolist()  # the step's one synchronisation
        self.phases.mark("wait")
        if wants:
            self.step_logprobs = self._logprobs(seqs, wants, raw, out)
        return out

    @staticmethod
    def _logprobs(seqs: list[Sequence], wants: list[int], raw: torch.Tensor, tokens: list[int]) -> list:
        top = max(seqs[i].params.logprobs for i in wants)
        chosen = raw[torch.arange(len(wants)), torch.tensor([tokens[i] for i in wants])].tolist()
        top_lps, top_ids = (raw.topk(top, dim=-1) if top else (raw[:, :0], raw[:, :0].long()))
        top_lps, top_ids = top_lps.tolist(), top_ids.tolist()
        out: list = [None] * len(seqs)
        for row, i in enumerate(wants):
            k = seqs[i].params.logprobs
            out[i] = (chosen[row], top_ids[row][:k], top_lps[row][:k])
        return out


def _tokens_at(seq: Sequence, i: int, count: int) -> list[int]:
    """seq.token_ids[i:i + count] without building the whole list."""
    n = len(seq.prompt_ids)
    if i + count <= n:
        return seq.prompt_ids[i:i + count]
    if i >= n:
        return seq.output_ids[i - n:i - n + count]
    return seq.prompt_ids[i:] + seq.output_ids[:i + count - n]
