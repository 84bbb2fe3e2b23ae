"""Routing statistics gathered on the device equal the planner's per-step updates."""

from __future__ import annotations

import numpy as np
import torch

from services.planner.routing_stats import RoutingStats
from services.worker.model import load_model
from services.worker.routing_collector import RoutingCollector
from tests.conftest import BUNDLED_MODEL


@torch.inference_mode()
def test_collector_matches_direct_observation():
    model = load_model(BUNDLED_MODEL, dtype=torch.float32)
    c = model.config
    ids = torch.randint(1, c.vocab_size, (1, 37), generator=torch.Generator().manual_seed(0))
    direct = RoutingStats(c.num_layers, c.num_experts, c.num_experts_per_tok)
    for block in model.moe_blocks:
        block.observer = lambda layer, x, topk_ids, w: direct.observe(layer, topk_ids, w)
    model(ids)
    collected = RoutingStats(c.num_layers, c.num_experts, c.num_experts_per_tok)
    collector = RoutingCollector(model, collected)
    model(ids)
    collector.flush()
    assert np.allclose(collected.mass, direct.mass, atol=1e-9)
    assert np.allclose(collected.share, direct.share, atol=1e-9)
    assert not np.allclose(collected.mass, 1.0 / c.num_experts)  # the traffic moved it
    assert float(collector.num_tokens.sum()) == 0  # flushed
