"""Proto messages <-> the engine's types, and nothing else.

The one place that knows both vocabularies: a `SamplingParams` message becomes the
engine's `SamplingParams` (refusing what this engine cannot do, rather than ignoring
it), and the engine's stats become a `WorkerStats` message.
"""

from __future__ import annotations

from pagedweight.common.errors import UserError
from pagedweight.engine.sampler import SamplingParams
from pagedweight.format.apl_format import BIT_WIDTHS
from pagedweight.rpc import worker_pb2


def sampling_params(msg: worker_pb2.SamplingParams) -> SamplingParams:
    """Raises UserError (-> INVALID_ARGUMENT) for values the engine refuses or lacks."""
    if msg.min_p != 0.0:
        raise UserError("this worker does not support min_p yet")
    return SamplingParams(
        max_tokens=msg.max_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        ignore_eos=msg.ignore_eos,
        stop_token_ids=tuple(msg.stop_token_ids),
        min_tokens=msg.min_tokens,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
    )


def memory_split(pool: dict | None, kv_reclaimable_bytes: int) -> worker_pb2.MemorySplit:
    """From the pool snapshot (MemoryPool.snapshot().to_dict())."""
    if pool is None:
        return worker_pb2.MemorySplit()
    return worker_pb2.MemorySplit(
        budget_bytes=pool["budget_bytes"],
        expert_bytes_by_bits={int(b): n for b, n in pool["expert_bytes_by_bits"].items()},
        dense_weight_bytes=pool["other_weight_bytes"],
        workspace_bytes=pool["workspace_bytes"],
        kv_used_bytes=pool["kv_used_bytes"],
        kv_free_bytes=pool["kv_free_bytes"],
        in_transit_bytes=pool["transit_bytes"],
        free_bytes=pool["budget_bytes"] - pool["reserved_bytes"],
        kv_reclaimable_bytes=kv_reclaimable_bytes,
    )


def bits_stats(mean_bits: float, blocks_by_bits: dict[int, int], num_page_moves: int,
               num_service: int, num_local: int) -> worker_pb2.BitsStats:
    return worker_pb2.BitsStats(
        mean_expert_bits=mean_bits,
        blocks_by_bits={b: n for b, n in blocks_by_bits.items() if b in BIT_WIDTHS},
        num_page_moves=num_page_moves,
        num_plans_service=num_service,
        num_plans_local=num_local,
    )


def load_stats(stats, kv_capacity_blocks: int, num_prompt_tokens: int) -> worker_pb2.LoadStats:
    """stats: engine.EngineStats."""
    return worker_pb2.LoadStats(
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        kv_cache_usage_perc=kv_cache_usage(stats),
        kv_block_size=stats.kv_block_size,
        kv_num_blocks=stats.kv_num_blocks,
        kv_num_used_blocks=stats.kv_num_used_blocks,
        kv_capacity_blocks=kv_capacity_blocks,
        num_preemptions=stats.num_preemptions,
        num_prompt_tokens=num_prompt_tokens,
        num_generation_tokens=stats.num_output_tokens,
    )


def kv_cache_usage(stats) -> float:
    """vllm:kv_cache_usage_perc: used over allocated-now KV blocks (docs: capacity moves in
    pagedweight:kv_capacity_blocks). An engine without requests reads 0 whatever blocks it
    still holds: none of them holds a request's tokens, and a router must not see it full."""
    if not (stats.num_running or stats.num_waiting) or not stats.kv_num_blocks:
        return 0.0
    return min(1.0, stats.kv_num_used_blocks / stats.kv_num_blocks)
