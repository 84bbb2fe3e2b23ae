"""Each BrokerConfig knob changes what the broker asks for or gives back, against fakes of the
KV cache, the pool and the pager (the end-to-end loads: test_broker_projected_demand.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedweight.common.errors import UserError
from pagedweight.engine.memory_broker import BrokerConfig, MemoryBroker

BLOCK = 100  # bytes a KV block is charged


class FakeKV:
    def __init__(self, free_blocks=0, used_blocks=0, pool_free=0):
        self.num_free_blocks, self.charged_block_bytes = free_blocks, BLOCK
        self.manager = SimpleNamespace(num_used_blocks=used_blocks)
        self.arena = SimpleNamespace(pool=SimpleNamespace(free_bytes=pool_free))
        self.kept_free = None

    def grow(self, n):
        self.num_free_blocks += n

    def shrink(self, keep_free_blocks):
        self.kept_free = keep_free_blocks


class FakePager:
    def __init__(self):
        self.requested, self.offered = [], []

    def request_bytes(self, n):
        self.requested.append(n)
        return n

    def offer_bytes(self, n):
        self.offered.append(n)
        return n

    def step_boundary(self, sequences_running=False):
        pass

    def busy(self):
        return False

    def wants_boundaries(self, offer_bytes):
        return offer_bytes > 0


def broker(config: BrokerConfig, **kv) -> tuple[MemoryBroker, FakeKV, FakePager]:
    cache, pager = FakeKV(**kv), FakePager()
    return MemoryBroker(cache, config, pager), cache, pager


def test_ask_ahead_blocks_asks_for_blocks_beyond_the_shortage():
    for ahead in (0, 3):
        b, _, pager = broker(BrokerConfig(ask_ahead_blocks=ahead, project_demand=False))
        assert b.ask(2)
        assert pager.requested == [(2 + ahead) * BLOCK]


def calm_boundary(b: MemoryBroker, steps: int) -> None:
    for _ in range(steps):
        b.step_boundary(num_waiting=0, blocks_needed_next=1)


def test_headroom_blocks_stay_free_while_sequences_run():
    for headroom, used, kept in ((4, 5, 1 + 4), (4, 0, 1), (0, 5, 1)):
        b, cache, _ = broker(BrokerConfig(calm_steps=1, headroom_blocks=headroom), used_blocks=used)
        calm_boundary(b, 1)
        assert cache.kept_free == kept


def test_calm_steps_and_calm_seconds_both_hold_back_the_give_back():
    b, cache, _ = broker(BrokerConfig(calm_steps=3))
    calm_boundary(b, 2)
    assert cache.kept_free is None
    calm_boundary(b, 1)
    assert cache.kept_free == 1
    b, cache, _ = broker(BrokerConfig(calm_steps=1, calm_seconds=3600.0))
    calm_boundary(b, 5)
    assert cache.kept_free is None  # calm for steps, not yet for an hour


def test_offer_min_blocks_refuses_crumbs():
    for min_blocks, offered in ((3, []), (2, [2 * BLOCK])):
        b, _, pager = broker(BrokerConfig(calm_steps=1, offer_min_blocks=min_blocks, offer_min_used_fraction=0.0),
                             pool_free=2 * BLOCK)
        calm_boundary(b, 1)
        assert pager.offered == offered
        assert b.num_offers_too_small == (not offered)


def test_offer_min_used_fraction_scales_the_least_offer_with_the_kv_in_use():
    # 8 blocks in use: a quarter is 2 blocks, half is 4; 3 blocks are spare
    for fraction, offered in ((0.25, [3 * BLOCK]), (0.5, [])):
        b, _, pager = broker(BrokerConfig(calm_steps=1, offer_min_used_fraction=fraction),
                             used_blocks=8, pool_free=3 * BLOCK)
        calm_boundary(b, 1)
        assert pager.offered == offered


@pytest.mark.parametrize("bad", [dict(calm_steps=0), dict(headroom_blocks=-1), dict(calm_seconds=-1.0),
                                 dict(offer_min_blocks=-1), dict(ask_ahead_blocks=-1),
                                 dict(offer_min_used_fraction=1.5)])
def test_out_of_range_values_are_refused(bad):
    with pytest.raises(UserError, match=next(iter(bad))):
        BrokerConfig(**bad)
