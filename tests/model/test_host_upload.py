"""A step's index tensors cross to the device in one copy, and building a step on CUDA
never waits for the GPU (torch's sync debug mode turns any host synchronisation into an
error)."""

from __future__ import annotations

import pytest
import torch

from pagedweight.format.model_config import ModelConfig
from pagedweight.memory.kv_cache import KVCacheConfig, PagedKVCache
from pagedweight.model.host_upload import upload_int64
from pagedweight.model.paged_attention import SeqSlice, build_step, build_step_with
from tests.conftest import BUNDLED_MODEL

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_upload_keeps_values_shapes_and_order(device):
    gen = torch.Generator().manual_seed(3)
    parts = [torch.randint(-9, 10**12, (3, 5), generator=gen), [7, 1, 2], [],
             torch.randint(0, 9, (2, 1, 4), generator=gen)]
    out = upload_int64(parts, torch.device(device))
    assert len(out) == len(parts)
    for got, want in zip(out, parts):
        want = want if isinstance(want, torch.Tensor) else torch.tensor(want, dtype=torch.int64)
        assert got.device.type == device and got.dtype == torch.int64
        assert got.shape == want.shape and torch.equal(got.cpu(), want)


@pytest.mark.parametrize("impl", ["reference", "batched", "inplace"])
def test_extra_lists_ride_along_and_the_step_is_unchanged(impl):
    config = ModelConfig.from_dir(BUNDLED_MODEL)
    kv = PagedKVCache(config, KVCacheConfig(block_size=4), torch.float32, "cpu", num_blocks=16)
    seqs = [SeqSlice([5, 2, 9], 11, 3), SeqSlice([7], 1, 1)]
    step, (ids, rows) = build_step_with(kv, seqs, impl, extra=([4, 8, 15, 16], [2, 3]))
    plain = build_step(kv, seqs, impl)
    assert ids.tolist() == [4, 8, 15, 16] and rows.tolist() == [2, 3]
    for name in ("positions", "new_offsets", "context_offsets", "block_table", "query_index",
                 "output_index", "mask"):
        a, b = getattr(step, name), getattr(plain, name)
        assert (a is None and b is None) or torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("impl", ["reference", "batched", "inplace"])
def test_building_a_step_on_cuda_does_not_synchronise(impl):
    config = ModelConfig.from_dir(BUNDLED_MODEL)
    kv = PagedKVCache(config, KVCacheConfig(block_size=4), torch.float32, "cuda", num_blocks=16)
    seqs = [SeqSlice([5, 2, 9], 11, 3), SeqSlice([7], 1, 1)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step, (ids, rows) = build_step_with(kv, seqs, impl, extra=([4, 8, 15, 16], [2, 3]))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert ids.tolist() == [4, 8, 15, 16] and step.positions.tolist() == [8, 9, 10, 0]
