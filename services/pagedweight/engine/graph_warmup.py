"""Every decode bucket met once before serving.

The first decode step at a batch bucket does work that no later step at that bucket does:
the Triton attention kernel compiles a specialisation per split count, and its split count
follows the batch (`paged_decode.num_splits`: 1 at 48-64 sequences on an H200, 2 at 32, 3
at 16, ...), then the bucket's graph is captured. Met inside serving, that is a step of
0.3-0.5 s on the H200 (docs/elasticity.md 2g), paid by whichever load first reaches the
bucket. `warm_decode_buckets` meets every bucket at start-up instead: per bucket, that many
one-token requests for one token, i.e. one step of exactly that many rows with one new
token each (a step the decode graphs serve), so each bucket's specialisation is compiled
and its graph captured at the current bits. One KV block per request, given back at once.
Token buckets (steps of more rows than sequences: prefill chunks) are met the same way by
one request whose prompt has exactly that many tokens (one prefill step of that many
rows), where the free KV blocks hold it now; a bucket they do not hold is captured when
a load first reaches it.
"""

from __future__ import annotations

from pagedweight.engine.sampler import SamplingParams
from pagedweight.memory.kv_cache import blocks_for


def warm_decode_buckets(engine, token_id: int = 1) -> list[int]:
    """Run one decode step at every batch bucket of the engine's decode graphs (none when
    every step is eager), then one prefill step at every token bucket the free KV blocks
    hold; returns the buckets met. The engine must have no requests."""
    graphs = engine.runner.graphs
    if graphs is None:
        return []
    if engine.has_work:
        raise RuntimeError("warm_decode_buckets: the engine has requests in flight")
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for bucket in graphs.buckets:
        request_ids = [f"warm-{bucket}-{i}" for i in range(bucket)]
        for rid in request_ids:
            engine.add_request(rid, [token_id], params)
        while engine.has_work:
            engine.step()
    met = list(graphs.buckets)
    for bucket in graphs.token_buckets if engine.runner.graph_prefill else ():
        if blocks_for(bucket, engine.kv.block_size) > engine.kv.num_free_blocks:
            continue
        engine.add_request(f"warm-{bucket}", [token_id] * bucket, params)
        while engine.has_work:
            engine.step()
        met.append(bucket)
    return met
