"""The continuous-batching engine: token ids in, one token id per sequence per step out.

`step()` = schedule (scheduler.py) -> run (model_runner.py: one varlen forward over the
paged KV cache, prefill chunks and decodes together, and sampling) -> update (append the
sampled tokens, finish sequences at EOS, a stop token id or max_tokens) -> step boundary
(the weight pager commits page moves, the broker rebalances bytes between KV and weights).
Greedy outputs equal single-stream `generate` token for token, preempted or not.

Tokens in, tokens out: the engine never sees text. Detokenisation and stop strings live in
pagedweight.frontend (the gateway and the CLI use it and abort a request whose stop string
matched); params carrying stop strings are refused here rather than silently ignored. EOS
ids are the model's (config.json) plus any the caller passes (e.g. the tokenizer's).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field


from pagedweight.common.errors import ContextLengthError, UserError
from pagedweight.engine.generate import check_context
from pagedweight.engine.decode_graphs import DecodeGraphs
from pagedweight.engine.memory_broker import BrokerConfig, MemoryBroker
from pagedweight.engine.model_runner import ModelRunner
from pagedweight.engine.sampler import SamplingParams, make_generator
from pagedweight.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from pagedweight.engine.sequence import FinishReason, Sequence
from pagedweight.engine.step_phases import StepPhases
from pagedweight.memory.kv_cache import KVCacheConfig, PagedKVCache, blocks_for
from pagedweight.model.transformer import MoECausalLM

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv: KVCacheConfig = field(default_factory=KVCacheConfig)
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    attention_impl: str = "auto"  # "reference", "batched", "inplace" or "auto" (inplace on CUDA)
    num_kv_blocks: int = 1024  # fixed KV size when there is no memory arena
    # True: no CUDA graphs (every step eager; vLLM's name). Graphs need the inplace path.
    enforce_eager: bool = False
    # Decode graphs kept per padded batch size, one per weight-precision signature (1: only
    # the current one; more: bits lowered and raised back replay a kept graph, no capture).
    graphs_per_bucket: int = 1
    # Steps with prefill chunks replay graphs too, every new token a row (decode_graphs.py):
    # an eager prefill of a short prompt at real sizes is bound by launching its kernels
    # from the host (941 kernels, 30 ms of host for 6 ms of device work). Buckets
    # of token rows above max_num_seqs go up to graph_max_tokens (at most the step's token
    # budget); longer steps run eagerly. With a prompt routing recorder (the planner's
    # prompt residuals) steps with prompt rows replay graphs that record them
    # (engine/prompt_routing.py). False: only pure decode steps replay, the others run eagerly.
    graph_prefill: bool = True
    graph_max_tokens: int = 512
    # CUDA: each layer's shared expert (Qwen-MoE) on a side stream, concurrent with the
    # router and the routed experts (SparseMoeBlock._forward_parts_overlapped).
    overlap_shared_experts: bool = True

    def __post_init__(self):
        if self.num_kv_blocks < 1:
            raise UserError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.graphs_per_bucket < 1:
            raise UserError(f"graphs_per_bucket must be >= 1, got {self.graphs_per_bucket}")
        if self.graph_max_tokens < 1:
            raise UserError(f"graph_max_tokens must be >= 1, got {self.graph_max_tokens}")


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]  # 0 or 1 token
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    stop_reason: int | None = None  # the EOS / stop token id that finished it (not in output)
    queue_time_s: float | None = None  # on a request's first output: arrival to first scheduled
    # per token of new_token_ids, with SamplingParams.logprobs: (logprob, top ids, top logprobs)
    logprobs: list[tuple[float, list[int], list[float]]] | None = None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_finished: int
    num_preemptions: int
    num_steps: int
    num_output_tokens: int
    kv_block_size: int
    kv_num_blocks: int  # blocks that exist (reserved from the pool)
    kv_num_used_blocks: int  # blocks holding tokens
    kv_used_bytes: int
    kv_reserved_bytes: int
    memory_requests: int  # accepted asks to the pager for bytes
    memory_offers: int  # accepted offers of bytes back to the weights
    memory_short_steps: int  # steps in which some sequence waited for KV bytes
    pool: dict | None = None  # the pool's snapshot (bytes by kind, peak)
    pager: dict | None = None  # the pager's stats (bits histogram, page moves, plans)


class Engine:
    def __init__(
        self,
        model: MoECausalLM,
        config: EngineConfig | None = None,
        arena=None,  # memory Arena: KV blocks are allocated from it (None: fixed num_kv_blocks)
        pager=None,  # the weight pager / memory controller (None: weights never move)
        max_kv_blocks: int | None = None,  # with an arena: the most KV blocks it could ever give
        eos_token_ids=(),  # EOS ids beyond the model config's (e.g. the tokenizer's)
        prompt_routing=None,  # PromptRoutingRecorder: each prompt's routing for the planner (None: off)
    ):
        if not isinstance(config, (EngineConfig, type(None))):
            raise TypeError("Engine(model, config, ...): config must be an EngineConfig; the engine takes "
                            "token ids, not a tokenizer")
        self.model = model
        self.config = config or EngineConfig()
        if model.device.type == "cuda":
            # fewer launches per layer; values unchanged up to the split product's rounding
            model.fuse_projections(overlap_shared_experts=self.config.overlap_shared_experts)
        self.arena, self.pager = arena, pager
        self.pool = arena.pool if arena is not None else None
        self.kv = PagedKVCache(
            model.config, self.config.kv, model.dtype, model.device, self.config.num_kv_blocks, arena
        )
        self.broker = MemoryBroker(self.kv, self.config.broker, pager)
        self.max_kv_blocks = self.config.num_kv_blocks if arena is None else max_kv_blocks
        self.scheduler = Scheduler(self.config.scheduler, self.kv, self.broker)
        self.seqs: dict[str, Sequence] = {}  # request_id -> live sequence
        self.eos_ids = set(model.config.eos_token_ids) | {int(t) for t in eos_token_ids}
        graphs = None
        graph_prefill = self.config.graph_prefill
        if prompt_routing is not None:  # a static counts buffer: graph replays can record prompts
            prompt_routing.reserve_slots(self.config.scheduler.max_num_seqs)
        if (self.kv.device.type == "cuda" and not self.config.enforce_eager
                and self.config.attention_impl in ("auto", "inplace")):
            graphs = DecodeGraphs(model, self.kv, self.config.scheduler.max_num_seqs,
                                  graphs_per_bucket=self.config.graphs_per_bucket,
                                  max_tokens=self.graph_tokens() if graph_prefill else None)
        self.phases = StepPhases()  # host seconds per phase of a step (benchmarks read it)
        self.runner = ModelRunner(model, self.kv, self.config.attention_impl, self.eos_ids, graphs, self.phases,
                                  graph_prefill=graph_prefill)
        self.prompt_routing = prompt_routing
        self._seq_ids = itertools.count()
        self.num_steps = self.num_finished = self.num_output_tokens = 0
        # moving average of the seconds between consecutive steps that sampled tokens (0: none
        # yet): the inter-token latency a decoding request sees, sent with plan requests
        self.inter_token_s = 0.0
        self._sampled_at: float | None = None  # when the previous step sampled (None: idle since)

    def graph_tokens(self) -> int:
        """The most token rows a step's graph takes (prefill chunks included)."""
        return min(self.config.graph_max_tokens, self.config.scheduler.max_num_batched_tokens)

    # ---- requests -------------------------------------------------------------------
    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise a UserError for a request that can never run (changes nothing)."""
        if not prompt_ids:
            raise ContextLengthError("the prompt is empty: give at least one token")
        vocab = self.model.config.vocab_size
        if not all(0 <= t < vocab for t in prompt_ids):
            raise UserError(f"prompt token ids must be in [0, {vocab})")
        if params.stop:
            raise UserError(
                "the engine takes token ids only: stop strings are matched by the front end "
                "(pagedweight.frontend.RequestDetokenizer); pass stop_token_ids here"
            )
        check_context(self.model, len(prompt_ids), params.max_tokens)
        self._check_fits(len(prompt_ids) + params.max_tokens)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.seqs:
            raise UserError(f"request id {request_id!r} is already in use")
        self.check_request(prompt_ids, params)
        seq = Sequence(next(self._seq_ids), request_id, list(prompt_ids), params)
        seq.generator = make_generator(params, self.model.device)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def _check_fits(self, num_tokens: int) -> None:
        """A request that could never fit the KV cache is refused now, not dropped later."""
        if self.max_kv_blocks is None:
            return
        limit = self.max_kv_blocks * self.kv.block_size
        if blocks_for(num_tokens, self.kv.block_size) > self.max_kv_blocks:
            raise ContextLengthError(
                f"prompt plus max_tokens needs {num_tokens} tokens of KV; the cache holds {limit}"
            )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; None when it is unknown or already done."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, FinishReason.ABORT)
        self.num_finished += 1
        return RequestOutput(request_id, [], True, FinishReason.ABORT.value)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ---- one step -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        phases = self.phases
        phases.start()
        plan = self.scheduler.schedule()
        phases.mark("schedule")
        outputs = [self._ignored(seq) for seq in plan.ignored]
        if plan.scheduled:
            if self.prompt_routing is not None:
                self.prompt_routing.begin_step(plan.scheduled)
            token_ids = self.runner.run(plan.scheduled)
            if self.prompt_routing is not None:
                self.prompt_routing.end_step()
            outputs += self._update(plan.scheduled, token_ids)
            phases.mark("update")
        self._observe_latency(any(s.samples for s in plan.scheduled))
        self.broker.step_boundary(len(self.scheduler.waiting), self.scheduler.blocks_needed_next_step(),
                                  self.scheduler.blocks_projected())
        phases.mark("boundary")
        phases.end_step()
        self.num_steps += 1
        return outputs

    def _observe_latency(self, sampled: bool) -> None:
        if not sampled:
            self._sampled_at = None  # an idle gap is no inter-token time
            return
        now = time.perf_counter()
        if self._sampled_at is not None:
            gap = now - self._sampled_at
            self.inter_token_s = gap if not self.inter_token_s else 0.8 * self.inter_token_s + 0.2 * gap
        self._sampled_at = now

    def _update(self, scheduled: list[ScheduledSeq], token_ids: list[int]) -> list[RequestOutput]:
        samplers = [s.seq for s in scheduled if s.samples]  # before `samples` changes below
        window = self.model.config.kv_window
        for s in scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            if window is not None:  # the next query (at num_computed_tokens) sees W keys back
                self.kv.release_before(s.seq, s.seq.num_computed_tokens - window + 1)
        outputs = [self._append(seq, token) for seq, token in zip(samplers, token_ids)]
        step_logprobs = self.runner.step_logprobs
        if step_logprobs is not None:
            for out, entry in zip(outputs, step_logprobs):
                if entry is not None and out.new_token_ids:
                    out.logprobs = [entry]
        for seq, out in zip(samplers, outputs):
            if not seq.queue_time_reported:
                seq.queue_time_reported = True
                out.queue_time_s = seq.first_scheduled_time - seq.arrival_time
        return outputs

    def _append(self, seq: Sequence, token: int) -> RequestOutput:
        params = seq.params
        if (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return self._finish(seq, FinishReason.STOP, [], stop_reason=token)
        seq.output_ids.append(token)
        self.num_output_tokens += 1
        if len(seq.output_ids) >= params.max_tokens:
            return self._finish(seq, FinishReason.LENGTH, [token])
        return RequestOutput(seq.request_id, [token])

    def _finish(
        self, seq: Sequence, reason: FinishReason, new_ids: list[int], stop_reason: int | None = None
    ) -> RequestOutput:
        self.scheduler.finish(seq, reason)
        del self.seqs[seq.request_id]
        self.num_finished += 1
        return RequestOutput(seq.request_id, new_ids, True, reason.value, stop_reason)

    def _ignored(self, seq: Sequence) -> RequestOutput:
        """A request the scheduler finished unrun (its KV can never be had)."""
        log.warning("request %s finished unrun: its %d tokens of KV cannot be had even with every "
                    "expert at its lowest bits", seq.request_id, seq.max_total_tokens)
        del self.seqs[seq.request_id]
        self.num_finished += 1
        return RequestOutput(seq.request_id, [], True, FinishReason.LENGTH.value)

    # ---- conveniences ---------------------------------------------------------------
    def run_to_completion(self) -> dict[str, list[int]]:
        """Step until no work is left; request_id -> output token ids."""
        outputs: dict[str, list[int]] = {}
        while self.has_work:
            for out in self.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_finished=self.num_finished,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            num_output_tokens=self.num_output_tokens,
            kv_block_size=self.kv.block_size,
            kv_num_blocks=self.kv.num_blocks,
            kv_num_used_blocks=self.kv.manager.num_used_blocks,
            kv_used_bytes=self.kv.used_bytes,
            kv_reserved_bytes=self.kv.reserved_bytes,
            memory_requests=self.broker.num_requests,
            memory_offers=self.broker.num_offers,
            memory_short_steps=self.broker.num_short_steps,
            pool=self.pool.snapshot().to_dict() if self.pool is not None else None,
            pager=self.pager.stats().to_dict() if self.pager is not None else None,
        )
