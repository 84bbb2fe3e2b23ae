"""The routing feed: live routing reaches the planner's moving average before each plan."""

import numpy as np
import pytest
import torch

from conftest import build
from pagedweight.planner.policies import PlanContext
from pagedweight.planner.prompt_context import RoutingRecorder
from pagedweight.planner.routing_stats import RoutingStats
from pagedweight.model.loader import load_model
from pagedweight.weights.arena_experts import install_arena_experts
from pagedweight.weights.greedy_planner import GreedyPlanner
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
    feed = RoutingFeed(RoutingStats(cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok), PlanContext())
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

    reference = RoutingStats(cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok)
    for layer in range(cfg.num_layers):
        reference.observe_counts(layer, recorder.counts[layer], recorder.mass[layer], int(recorder.num_tokens[layer]))
    feed.refresh()
    np.testing.assert_allclose(feed.context.relative_mass, reference.relative_mass(), rtol=1e-5)
    assert feed.counts.sum() == 0 and feed.num_tokens.sum() == 0  # the window starts again


def test_pager_refreshes_the_routing_before_every_plan(model, bundled_model_dir):
    paged = load_model(bundled_model_dir, dtype=torch.float32)
    blocks = blocks_from_model(model)
    probe = build(blocks, 64 << 20)
    pool, arena, table, mover = build(blocks, probe[0].reserved_bytes)
    probe[3].close()
    install_arena_experts(paged, table)
    cfg = model.config
    context = PlanContext()
    feed = RoutingFeed(RoutingStats(cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok), context)
    feed.install(paged)
    pager = WeightPager(mover, GreedyPlanner(table.charged_bytes_table()), before_plan=feed.refresh)
    paged(torch.tensor([[5, 6, 7, 8]]))
    assert context.relative_mass is None
    pager.request_bytes(1 << 16)
    assert feed.num_refreshes == 1 and context.relative_mass.shape == (cfg.num_layers, cfg.num_experts)
    assert (context.relative_mass != 1).any()  # 4 tokens do not route uniformly
    pager.step_boundary()
    pager.offer_bytes(1 << 16)
    assert feed.num_refreshes == 2
    mover.close()
