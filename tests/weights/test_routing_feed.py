"""The routing feed: live routing reaches the planner as a snapshot with each plan request."""

import numpy as np
import pytest
import torch

from conftest import build
from pagedweight.model.loader import load_model
from pagedweight.offline.prompt_routing import RoutingRecorder
from pagedweight.weights.arena_experts import install_arena_experts
from tests.weights.greedy_planner import GreedyPlanner
from pagedweight.weights.routing_feed import RoutingFeed
from pagedweight.weights.synthetic import blocks_from_model
from pagedweight.weights.weight_pager import WeightPager


@pytest.fixture(scope="module")
def model(bundled_model_dir):
    return load_model(bundled_model_dir, dtype=torch.float32)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def test_feed_counts_equal_the_planner_recorder(model):
    cfg = model.config
    feed = RoutingFeed(cfg.num_layers, cfg.num_experts)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    recorder = RoutingRecorder(model, cfg.num_experts)
    model(ids)
    recorder.detach()
    feed.install(model)
    model(ids)
    for block in model.moe_blocks:
        block.observer = None
    np.testing.assert_allclose(feed.counts.numpy(), recorder.counts)
    np.testing.assert_allclose(feed.mass.numpy(), recorder.mass, rtol=1e-5)
    assert feed.num_tokens.tolist() == recorder.num_tokens.tolist()

    snap = feed.snapshot()
    np.testing.assert_allclose(snap.counts, recorder.counts)
    np.testing.assert_allclose(snap.mass, recorder.mass, rtol=1e-5)
    assert snap.num_tokens.tolist() == recorder.num_tokens.tolist()
    assert feed.counts.sum() == 0 and feed.num_tokens.sum() == 0  # the window starts again
    assert feed.snapshot().is_empty()


def test_pager_sends_the_routing_with_every_plan_request(model, bundled_model_dir):
    paged = load_model(bundled_model_dir, dtype=torch.float32)
    blocks = blocks_from_model(model)
    probe = build(blocks, 64 << 20)
    pool, arena, table, mover = build(blocks, probe[0].reserved_bytes)
    probe[3].close()
    install_arena_experts(paged, table)
    cfg = model.config
    feed = RoutingFeed(cfg.num_layers, cfg.num_experts)
    feed.install(paged)
    planner = GreedyPlanner(table.charged_bytes_table())
    pager = WeightPager(mover, planner, routing=feed.snapshot)
    paged(torch.tensor([[5, 6, 7, 8]]))
    pager.request_bytes(1 << 16)
    first = planner.requests[0].routing
    assert feed.num_snapshots == 1 and first.num_tokens.tolist() == [4] * cfg.num_layers
    assert first.counts.sum() == 4 * cfg.num_experts_per_tok * cfg.num_layers
    pager.step_boundary()
    pager.offer_bytes(1 << 16)
    assert feed.num_snapshots == 2 and planner.requests[1].routing.is_empty()  # no forward since
    mover.close()


def test_row_weights_leave_padding_rows_uncounted():
    """A padded graph step hands the feed 0/1 row weights: weighted rows count as if the
    zero rows were never routed; weights of the wrong length are refused."""
    ids = torch.tensor([[0, 2], [1, 2], [0, 1]])
    gates = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    plain, weighted = RoutingFeed(1, 3), RoutingFeed(1, 3)
    plain(0, None, ids[:2], gates[:2])
    weighted.set_row_weights(torch.tensor([1, 1, 0]))
    weighted(0, None, ids, gates)
    a, b = plain.snapshot(), weighted.snapshot()
    assert np.array_equal(a.counts, b.counts) and np.allclose(a.mass, b.mass)
    assert a.num_tokens.tolist() == b.num_tokens.tolist() == [2]
    weighted.set_row_weights(torch.tensor([1, 0]))
    with pytest.raises(RuntimeError, match="row weights"):
        weighted(0, None, ids, gates)
    weighted.set_row_weights(None)
    weighted(0, None, ids, gates)
    assert weighted.snapshot().num_tokens.tolist() == [3]
