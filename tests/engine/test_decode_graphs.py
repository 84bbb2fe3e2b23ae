"""Steps through static buffers and padded buckets of token rows (engine/decode_graphs.py).

On the CPU the plumbing runs without capture (`capture=False`): padding rows, the pinned
mirror, the block-table buffer at the model's full context width, prefill chunks and mixed
prefill + decode steps as token rows, and the fallbacks are checked against single-stream
generation. On CUDA (`make test-gpu`) the same with real graphs: greedy outputs equal
generate, steps replay (prefills too) and compute the eager step, and a changed experts
signature recaptures."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedweight.common.errors import UserError
from pagedweight.engine.decode_graphs import DecodeGraphs, StepChunk, buckets_up_to, pick_bucket, token_buckets
from pagedweight.engine.decode_graphs import LOGITS_ROW, REAL_ROW, TABLE_COLUMN
from pagedweight.engine.engine import Engine, EngineConfig
from pagedweight.engine.generate import generate
from pagedweight.engine.graph_warmup import warm_decode_buckets
from pagedweight.engine.sampler import SamplingParams
from pagedweight.engine.scheduler import SchedulerConfig
from pagedweight.memory.kv_cache import KVCacheConfig
from pagedweight.model import load_model
from pagedweight.weights.routing_feed import RoutingFeed
from tests.conftest import BUNDLED_MODEL
from tests.engine.replay_check import compare_replays_with_eager

PROMPT_LENS = (3, 17, 33, 5, 40, 1, 29)
MAX_TOKENS = (10, 5, 12, 9, 8, 11, 7)


def test_buckets():
    assert buckets_up_to(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert buckets_up_to(20) == (1, 2, 4, 8, 16, 20)
    assert [pick_bucket(n, (1, 2, 4, 8)) for n in (1, 3, 8, 9)] == [1, 4, 8, None]
    assert token_buckets(64, 512) == (96, 128, 192, 256, 384, 512)
    assert token_buckets(5, 48) == (8, 16, 24, 32, 48) and token_buckets(5, 40) == (8, 16, 24, 32, 40)
    assert token_buckets(64, 64) == () and token_buckets(64, None) == ()


BUDGET = 48  # the tests' step token budget


def _engine(model, device, capture, max_seqs=5, num_blocks=1024, token_rows=True, **kw):
    """capture=False: the CPU's plumbing without capture, graphs taking up to BUDGET token
    rows (prefill chunks) unless token_rows is False; None: the engine's own graphs."""
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=BUDGET),
                          kv=KVCacheConfig(block_size=4), attention_impl="inplace", num_kv_blocks=num_blocks, **kw)
    engine = Engine(model, config=config)
    if capture is not None:
        engine.runner.graphs = DecodeGraphs(model, engine.kv, max_seqs, capture=capture,
                                            max_tokens=BUDGET if token_rows else None)
    return engine


def _grouped_model():
    model = load_model(BUNDLED_MODEL, dtype=torch.float32)
    for block in model.moe_blocks:  # the grouped experts (CUDA's default) are what graphs need
        block.experts.grouped = True
    return model



def _routing_window(model, engine, seed=0):
    """The routing feed's window after the standard load (a fresh feed on the model)."""
    c = model.config
    feed = RoutingFeed(c.num_layers, c.num_experts)
    feed.install(model)
    try:
        _run(model, engine, seed)
        return feed.snapshot()
    finally:
        for block in model.moe_blocks:
            block.observer = None


def test_padding_rows_are_not_counted_in_the_routing_statistics():
    """A step padded to its bucket computes copies of row 0; the planner's routing feed must
    count the step's own rows only, exactly as an eager engine counts the same load."""
    model = _grouped_model()
    eager = _routing_window(model, _engine(model, "cpu", capture=None))
    padded_engine = _engine(model, "cpu", capture=False)
    padded = _routing_window(model, padded_engine)
    graphs = padded_engine.runner.graphs
    assert graphs.num_captures > 0 and graphs.padding_rows > 0 and graphs.prefill_steps > 0
    assert padded_engine.runner.num_eager_steps == 0  # every step went through the padded buffers
    assert (padded.num_tokens == eager.num_tokens).all()
    assert (padded.num_tokens == sum(PROMPT_LENS) + sum(MAX_TOKENS) - len(PROMPT_LENS)).all()
    assert (padded.counts == eager.counts).all()
    assert abs(padded.mass - eager.mass).max() < 1e-4

def _run(model, engine, seed):
    gen = torch.Generator().manual_seed(seed)
    for i, n in enumerate(PROMPT_LENS):
        prompt = torch.randint(1, model.config.vocab_size, (n,), generator=gen).tolist()
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=MAX_TOKENS[i], ignore_eos=True))
    out = engine.run_to_completion()
    assert len(out) == len(PROMPT_LENS) and engine.kv.manager.num_used_blocks == 0
    return out


def _check_against_generate(model, engine, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    expected = [generate(model, p, sp).token_ids for p, sp in zip(prompts, params)]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    out = engine.run_to_completion()
    assert [out[str(i)] for i in range(len(prompts))] == expected
    assert engine.kv.manager.num_used_blocks == 0


@pytest.mark.parametrize("num_blocks", [1024, 20])  # 20: preemption and chunked prefill
def test_static_buffer_decode_equals_generate_on_cpu(num_blocks):
    """Decode steps only through the buffers (token rows off): prefills run eagerly."""
    model = _grouped_model()
    engine = _engine(model, "cpu", capture=False, num_blocks=num_blocks, token_rows=False, graph_prefill=False)
    _check_against_generate(model, engine)
    runner = engine.runner
    assert runner.num_graph_steps > 0 and runner.num_eager_steps > 0  # decodes and prefills
    assert runner.graphs.prefill_steps == 0


def _record_steps(runner) -> list[tuple[int, int, bool]]:
    """(sequences, token rows, every sequence samples) of each step the graphs served; each
    step's logits must be rows of the graphs' one shared buffer (no logits kept per graph)."""
    replay, steps = runner._replay, []
    shared = runner.graphs.logits_out

    def recording(scheduled):
        replayed = replay(scheduled)
        if replayed is not None:
            logits = replayed[0]
            assert logits.data_ptr() == shared.data_ptr() and logits.shape[0] <= shared.shape[0]
            steps.append((len(scheduled), sum(s.num_new_tokens for s in scheduled), all(s.samples for s in scheduled)))
        return replayed

    runner._replay = recording
    return steps


@pytest.mark.parametrize("num_blocks", [1024, 20])  # 20: preemption and chunked prefill
def test_prefill_and_mixed_steps_as_token_rows_equal_generate_on_cpu(num_blocks):
    """Every step (prefill chunks, decodes, both in one step, chunks that do not sample)
    through the static buffers as token rows: greedy outputs equal generate, and no step
    ran eagerly (each has at most BUDGET rows)."""
    model = _grouped_model()
    engine = _engine(model, "cpu", capture=False, num_blocks=num_blocks)
    steps = _record_steps(engine.runner)
    _check_against_generate(model, engine)
    runner = engine.runner
    assert runner.num_eager_steps == 0 and runner.num_graph_steps == len(steps)
    assert runner.graphs.prefill_steps > 0
    assert any(rows > seqs > 1 for seqs, rows, _ in steps)  # a prefill chunk beside other sequences
    assert any(not samples for _, _, samples in steps)  # a chunk of a prompt that continues next step
    assert any(pick_bucket(rows, runner.graphs.row_buckets) > rows for _, rows, _ in steps)  # padded rows
    if num_blocks == 20:
        assert engine.scheduler.num_preemptions > 0


def test_token_row_prefill_in_bf16_is_as_close_to_fp32_as_the_eager_prefill():
    """In bf16 the token-row prefill (the decode kernel's attention, one row per token) and
    the eager varlen prefill (SDPA over a gathered copy) round differently, so they differ
    by about 1% at the last token's logits (0.5-2.4% here and at the Qwen shape on the
    H200). That is rounding, not a different function: against the fp32 model on the same
    prompt the token rows are as close as the eager step (measured: 0.5-3.0% vs 0.5-6.8%)."""
    import copy

    model = load_model(BUNDLED_MODEL, dtype=torch.bfloat16)
    reference = copy.deepcopy(model).float()
    for block in model.moe_blocks:
        block.experts.grouped = True
    engine = _engine(model, "cpu", capture=False)
    runner = engine.runner
    replay, errors = runner._replay, []

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    def replay_and_compare(scheduled):
        replayed = replay(scheduled)
        if replayed is not None and scheduled[0].num_new_tokens > 1:
            rows_logits = replayed[0].float().clone()
            ids, step, rows = runner.prepare(scheduled)  # the eager step, after the replay
            eager = model.forward_paged(ids, step, rows).float()
            with torch.inference_mode():
                exact = reference(torch.tensor([scheduled[0].seq.prompt_ids]))[0, -1:].float()
            errors.append((rel(eager, exact), rel(rows_logits, exact)))
        return replayed

    runner._replay = replay_and_compare
    gen = torch.Generator().manual_seed(5)
    for i, n in enumerate((8, 16, 24, 32, 40, 48)):
        engine.add_request(str(i), torch.randint(1, model.config.vocab_size, (n,), generator=gen).tolist(),
                           SamplingParams(max_tokens=1, ignore_eos=True))
        engine.run_to_completion()
    assert len(errors) == 6 and runner.num_eager_steps == 0
    eager_err = sum(e for e, _ in errors) / len(errors)
    rows_err = sum(r for _, r in errors) / len(errors)
    assert rows_err <= 1.25 * eager_err + 1e-3 and max(r for _, r in errors) < 0.05, errors


def test_graph_prefill_off_keeps_prefill_steps_eager_and_prompt_routing_does_not():
    """A prompt routing recorder kept prefill steps eager before its graph recording
    (tests/engine/test_prompt_routing.py checks its counts through the graphs)."""
    model = _grouped_model()
    engine = _engine(model, "cpu", capture=False, graph_prefill=False)
    assert engine.runner.graph_prefill is False
    _check_against_generate(model, engine)
    assert engine.runner.graphs.prefill_steps == 0 and engine.runner.num_eager_steps > 0
    from pagedweight.engine.prompt_routing import PromptRoutingRecorder

    config = EngineConfig(kv=KVCacheConfig(block_size=4), attention_impl="inplace")
    recorder = PromptRoutingRecorder(model.config.num_layers, model.config.num_experts)
    assert Engine(model, config, prompt_routing=recorder).runner.graph_prefill is True
    assert recorder.max_slots == config.scheduler.max_num_seqs  # its static counts, for replays
    assert Engine(model, config).runner.graph_prefill is True


def test_upload_writes_each_chunk_as_token_rows():
    """A mixed step's host rows: a 3-token chunk that does not sample, a decode, a 2-token
    chunk that samples; padding repeats row 0; the logits rows are the samplers' last rows."""
    model = _grouped_model()
    engine = _engine(model, "cpu", capture=False)
    graphs, kv = engine.runner.graphs, engine.kv
    bs = kv.block_size
    chunks = [StepChunk([11, 12, 13], [7, 3], 6, samples=False),  # positions 3, 4, 5
              StepChunk([21], [5, 9, 2], 9),  # position 8
              StepChunk([31, 32], [4], 2)]  # positions 0, 1
    bucket = pick_bucket(6, graphs.row_buckets)
    assert bucket == 8 and graphs.logits_rows(bucket) == 5
    width = graphs.table_width(chunks)
    assert width == graphs.table_widths[0] == 16  # 3 blocks at most
    assert graphs._upload(chunks, bucket, width) == 2
    host = graphs.rows(bucket, width, host=True)
    assert host.shape == (bucket, TABLE_COLUMN + width)
    assert host[:6, 0].tolist() == [11, 12, 13, 21, 31, 32]
    assert host[:6, 1].tolist() == [3, 4, 5, 8, 0, 1]
    assert host[:6, 3].tolist() == [4, 5, 6, 9, 1, 2]
    slots = kv.token_offsets([7, 3], 3, 6) + kv.token_offsets([5, 9, 2], 8, 9) + kv.token_offsets([4], 0, 2)
    assert host[:6, 2].tolist() == slots == [7 * bs + 3, 3 * bs, 3 * bs + 1, 2 * bs, 4 * bs, 4 * bs + 1]
    table = host[:, TABLE_COLUMN:]
    assert all(table[r, :2].tolist() == [7, 3] for r in range(3)) and (table[:3, 2:] == -1).all()
    assert table[3, :3].tolist() == [5, 9, 2] and table[4, :1].tolist() == [4] and (table[4:6, 1:] == -1).all()
    # padding repeats row 0 (inputs, slot, table) but is marked as no row of the step
    assert (host[6:8, :4] == host[0, :4]).all() and (host[6:8, TABLE_COLUMN:] == host[0, TABLE_COLUMN:]).all()
    assert host[:8, REAL_ROW].tolist() == [1] * 6 + [0] * 2 and graphs.padding_rows == 2
    assert host[:5, LOGITS_ROW].tolist() == [3, 5, 3, 3, 3]  # the decode's row, the last chunk's last row
    assert torch.equal(graphs.rows(bucket, width), torch.from_numpy(host))


def test_warm_decode_buckets_meets_every_bucket_once_and_leaves_nothing_behind():
    """One decode step of exactly each bucket's rows, one prefill step of each token
    bucket's, then no request, no KV block in use; greedy outputs afterwards still equal
    generate."""
    model = _grouped_model()
    engine = _engine(model, "cpu", capture=False)
    graphs = engine.runner.graphs
    assert graphs.buckets == (1, 2, 4, 5) and graphs.token_buckets == (8, 16, 24, 32, 48)
    assert warm_decode_buckets(engine) == [1, 2, 4, 5, 8, 16, 24, 32, 48] == list(graphs.row_buckets)
    assert graphs.steps_per_bucket == dict.fromkeys(graphs.row_buckets, 1)
    assert not engine.has_work and not engine.seqs and engine.kv.manager.num_used_blocks == 0
    _check_against_generate(model, engine)
    engine.add_request("busy", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="in flight"):
        warm_decode_buckets(engine)


def test_warm_decode_buckets_skips_token_buckets_the_free_blocks_do_not_hold():
    model = _grouped_model()
    engine = _engine(model, "cpu", capture=False, num_blocks=10)  # 40 tokens of KV
    assert warm_decode_buckets(engine) == [1, 2, 4, 5, 8, 16, 24, 32]
    assert not engine.has_work and engine.kv.manager.num_used_blocks == 0


def test_an_uncapturable_experts_operator_keeps_steps_eager():
    model = load_model(BUNDLED_MODEL, dtype=torch.float32)
    engine = _engine(model, "cpu", capture=False)
    for block in model.moe_blocks:
        block.experts.grouped = True
    model.moe_blocks[1].experts.grouped = False  # the per-expert loop reads counts on the host
    _check_against_generate(model, engine, seed=1)
    assert engine.runner.num_graph_steps == 0


def test_engine_builds_no_graphs_on_cpu_or_when_eager():
    model = load_model(BUNDLED_MODEL, dtype=torch.float32)
    assert _engine(model, "cpu", capture=None).runner.graphs is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_replays_compute_the_eager_step():
    """bf16 (where the grouped experts run): every replayed step's logits against the same
    step run eagerly right after it (it rewrites the same KV values, up to rounding), rows
    padded or not, prefill chunks and mixed steps as token rows too."""
    model = load_model(BUNDLED_MODEL, dtype=torch.bfloat16, device="cuda")
    engine = _engine(model, "cuda", capture=None)
    runner = engine.runner
    assert runner.graphs is not None
    checked = compare_replays_with_eager(runner, model)
    gen = torch.Generator().manual_seed(3)
    for i, n in enumerate(PROMPT_LENS):
        prompt = torch.randint(1, model.config.vocab_size, (n,), generator=gen).tolist()
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=MAX_TOKENS[i], ignore_eos=True))
    engine.run_to_completion()
    buckets = runner.graphs.row_buckets
    assert runner.graphs.token_buckets and runner.num_eager_steps == 0  # every step replayed
    assert checked and max(n for n, _, _, _ in checked) == 5
    assert any(rows > n > 1 for n, rows, _, _ in checked)  # a prefill chunk beside other sequences
    assert any(pick_bucket(rows, buckets) > rows for _, rows, _, _ in checked)  # padded rows too
    # decode steps: the same kernels as the eager step; steps with prefill rows: the decode
    # kernel's attention and the fused RoPE against SDPA and torch's RoPE, which round
    # differently in bf16 (1.7-2.4% at the Qwen shape, argmax equal; the CPU test above
    # holds both equally close to fp32). This test's first form held them to 1e-2 and
    # failed on the H200 (2026-12-01; the log was cut before its report).
    assert all(rel < (1e-2 if rows == n else 4e-2) and same >= 0.99 for n, rows, rel, same in checked), checked
    g = runner.graphs
    assert g.num_replays == len(checked) and g.num_captures >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_warmed_per_bucket_serve_a_load_without_capture():
    """Graphs captured by the warm-up (one-token sequences) serve a later load of longer
    contexts: no capture during the load, and every replayed step's logits equal the same
    step run eagerly (as test_cuda_graph_replays_compute_the_eager_step holds lazily captured
    graphs). bf16 greedy tokens are not compared with generate: its eager kernels round
    differently, and greedy sequences part at near ties (this test's first form did so on
    the H200 at the fourth token)."""
    model = load_model(BUNDLED_MODEL, dtype=torch.bfloat16, device="cuda")
    engine = _engine(model, "cuda", capture=None)
    runner, graphs = engine.runner, engine.runner.graphs
    warm_decode_buckets(engine)
    assert set(graphs.graphs) == {(b, graphs.table_widths[0]) for b in graphs.row_buckets}
    assert graphs.num_captures == len(graphs.row_buckets)
    replay, checked = runner._replay, []

    def replay_and_compare(scheduled):
        replayed = replay(scheduled)
        if replayed is not None:
            logits = replayed[0].clone()
            ids, step, rows = runner.prepare(scheduled)
            eager = model.forward_paged(ids, step, rows).float()
            rel = ((logits.float() - eager).norm() / eager.norm()).item()
            same = (logits.float().argmax(-1) == eager.argmax(-1)).float().mean().item()
            context = max(x.seq.num_computed_tokens + x.num_new_tokens for x in scheduled)
            checked.append((len(scheduled), context, rel, same))
        return replayed

    runner._replay = replay_and_compare
    _run(model, engine, seed=1)
    assert checked and max(ctx for _, ctx, _, _ in checked) > 2 * engine.kv.block_size  # several blocks read
    assert all(rel < 1e-2 and same >= 0.99 for _, _, rel, same in checked), checked
    assert graphs.num_captures == len(graphs.row_buckets) and graphs.num_replays > len(graphs.row_buckets)
    assert runner.num_eager_steps == 0 and graphs.prefill_steps > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_engine_equals_generate_and_falls_back_in_fp32():
    """fp32 dense experts take the per-expert loop on CUDA (no grouped product): steps stay
    eager and greedy outputs equal generate; enforce_eager builds no graphs at all."""
    model = load_model(BUNDLED_MODEL, dtype=torch.float32, device="cuda")
    assert _engine(model, "cuda", capture=None, enforce_eager=True).runner.graphs is None
    engine = _engine(model, "cuda", capture=None)
    _check_against_generate(model, engine, seed=2)
    assert engine.runner.num_graph_steps == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_recaptures_when_the_signature_changes():
    model = load_model(BUNDLED_MODEL, dtype=torch.bfloat16, device="cuda")
    engine = _engine(model, "cuda", capture=None)
    _run(model, engine, seed=4)
    before = engine.runner.graphs.num_captures
    assert before >= 1
    feed_calls = []
    model.moe_blocks[0].observer = lambda layer, x, ids, w: feed_calls.append(layer)  # a new observer
    try:
        _run(model, engine, seed=5)
    finally:
        model.moe_blocks[0].observer = None
    assert engine.runner.graphs.num_captures > before and feed_calls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kept", [1, 2])
def test_cuda_graphs_kept_per_signature_replay_without_capture(kept):
    """Signature A, then B, then A again over the same loads: with two graphs kept per
    bucket the return to A replays the graphs captured first (no capture); with one, every
    change captures again. A kept graph gives the tokens it gave when it was captured."""
    model = load_model(BUNDLED_MODEL, dtype=torch.bfloat16, device="cuda")
    engine = _engine(model, "cuda", capture=None, graphs_per_bucket=kept)
    graphs = engine.runner.graphs
    outputs_a = _run(model, engine, seed=4)
    first = graphs.num_captures
    model.moe_blocks[0].observer = lambda layer, x, ids, w: None  # signature B
    try:
        _run(model, engine, seed=4)
    finally:
        model.moe_blocks[0].observer = None
    second = graphs.num_captures
    assert _run(model, engine, seed=4) == outputs_a  # back to A
    assert first >= 1 and second > first
    assert (graphs.num_captures == second) == (kept == 2)
    assert all(len(by_sig) <= kept for by_sig in graphs.graphs.values())


def test_graphs_per_bucket_must_be_positive():
    with pytest.raises(UserError, match="graphs_per_bucket"):
        EngineConfig(graphs_per_bucket=0)


@pytest.mark.parametrize("graph_max_tokens, step_tokens, top", [(512, 2048, 512), (256, 2048, 256), (512, 128, 128)])
def test_graph_max_tokens_caps_the_token_buckets_at_the_step_budget(graph_max_tokens, step_tokens, top):
    """Steps with prefill rows replay graphs up to graph_max_tokens rows, never more than a
    step can hold; above that a step runs eagerly."""
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=step_tokens),
                          graph_max_tokens=graph_max_tokens)
    tokens = Engine.graph_tokens(SimpleNamespace(config=config))
    assert tokens == top
    assert token_buckets(16, tokens)[-1] == top and pick_bucket(top + 1, token_buckets(16, tokens)) is None
