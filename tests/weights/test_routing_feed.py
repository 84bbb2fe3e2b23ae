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
