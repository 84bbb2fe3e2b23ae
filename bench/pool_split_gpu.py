"""Reserved device memory against the budget while the weights/KV split moves (docs/memory_pool.md).

Synthetic APL experts (SHAPE: 4 MoE layers of Qwen1.5-MoE-A2.7B size) in one arena of a
`--budget` pool; `--cycles` times the KV cache rises (the pager lowers bits to free blocks) and
falls (bits raised again), a step through the page table between boundaries. The result keeps
the maxima of the allocator's reserved bytes, the device's used bytes and the pool's split.
Baseline in the same run: the same allocations as separate tensors of PyTorch's caching
allocator, whose reserved memory is what the budget would have to cover without one arena.
"""

from __future__ import annotations

import json
import time

import torch

from bench.bench_meta import arg_parser, write_result
from pagedweight.memory.arena import Arena
from pagedweight.memory.pool import KV_USED, WORKSPACE, MemoryPool, device_memory_bytes, parse_memory_budget
from pagedweight.planner.in_process_planner import InProcessPlanner, page_table_registration
from pagedweight.weights.arena_experts import ArenaExperts
from pagedweight.weights.page_mover import PageMover
from pagedweight.weights.page_table import PageTable
from pagedweight.weights.synthetic import random_blocks
from pagedweight.weights.weight_pager import WeightPager

MiB = 1 << 20
LAYERS, EXPERTS, HIDDEN, INTERMEDIATE = SHAPE = 4, 60, 2048, 1408
TOP_K, TOKENS = 4, 4  # routed experts per token, tokens per emulated step
KV_BLOCK_BYTES, PAGE_BYTES, KV_BLOCKS_PER_STEP = 2 * MiB, 64 * 1024, 32


def parse_args():
    p = arg_parser(__doc__)
    p.add_argument("--budget", default="2GiB", help="bytes (2GiB) or a fraction of the device (0.1)")
    p.add_argument("--cycles", type=int, default=3)
    return p.parse_args()


class Peaks:
    """The largest value of each quantity seen after a step boundary."""

    def __init__(self, device):
        self.device, self.peaks, self.num_steps = device, {}, -1
        self.base_used = self._device_used()

    def _device_used(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def sample(self, pool, pager) -> None:
        torch.cuda.synchronize(self.device)
        s = pool.snapshot()
        now = {"max_pool_reserved_bytes": s.reserved_bytes, "max_kv_bytes": s.kv_used_bytes,
               "mean_bits_min": -pager.stats().mean_committed_bits,  # a maximum of the negated minimum
               "max_allocator_reserved_bytes": torch.cuda.memory_reserved(self.device),
               "max_device_used_over_start_bytes": self._device_used() - self.base_used}
        self.peaks = {k: max(v, self.peaks.get(k, v)) for k, v in now.items()}
        self.num_steps += 1


def emulate_step(experts, device, gen):
    """One decode-like step through every layer's experts operator (reads the arena)."""
    x = torch.randn(TOKENS, HIDDEN, device=device, dtype=torch.bfloat16)
    for op in experts:
        ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(TOKENS)])
        x = op(x, ids.to(device), torch.full((TOKENS, TOP_K), 1.0 / TOP_K, device=device, dtype=torch.bfloat16))


def measure_workspace(blocks, device, gen) -> int:
    """Peak temporary bytes of one step (dequantised weights, activations), to reserve: measured
    on a throw-away arena holding the blocks at 8 bits."""
    probe = PageTable(blocks, Arena(MemoryPool(1 << 50), sum(b.nbytes(8) for b in blocks.values()) * 2,
                                    PAGE_BYTES, device))
    mover = PageMover(probe)
    mover.load_all()
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    emulate_step([ArenaExperts(probe, layer, EXPERTS) for layer in range(LAYERS)], device, gen)
    torch.cuda.synchronize(device)
    workspace = torch.cuda.max_memory_allocated(device) - before
    mover.close()
    del probe, mover
    torch.cuda.empty_cache()
    return workspace


def run_cycles(args, device, pool, arena, pager, experts, peaks: Peaks, gen) -> list[float]:
    """The rises and falls of the KV cache; returns each step boundary's ms."""
    boundary_ms = []

    def step():
        emulate_step(experts, device, gen)
        t0 = time.perf_counter()
        pager.step_boundary()
        boundary_ms.append((time.perf_counter() - t0) * 1e3)
        peaks.sample(pool, pager)

    for cycle in range(args.cycles):
        kv, floor_steps = [], 0
        while floor_steps < 3:  # rising load: take KV blocks until bits are at their floor
            for _ in range(KV_BLOCKS_PER_STEP):
                if not arena.can_allocate(KV_USED, KV_BLOCK_BYTES):
                    floor_steps += pager.request_bytes(KV_BLOCKS_PER_STEP * KV_BLOCK_BYTES) == 0
                    break
                kv.append(arena.allocate(KV_USED, KV_BLOCK_BYTES))
                arena.view(kv[-1], torch.uint8, (KV_BLOCK_BYTES,)).fill_(cycle + 1)  # KV writes
            step()
        for x in kv:  # falling load
            arena.free(x)
        for _ in range(1000):
            pager.offer_bytes(pool.free_bytes)
            step()
            if not pager.busy() and pager.stats().mean_committed_bits == 8:
                break
    return boundary_ms


def caching_allocator_baseline(args, device, table) -> dict:
    """The same kind of split moves with one tensor per plane/LUT/KV block, no arena."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    start = torch.cuda.memory_reserved(device)

    def tensor(nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    planes = {bid: [tensor(table.plane_bytes(bid)) for _ in range(8)] + [tensor(table.lut_bytes(bid, 8))]
              for bid in table.entries}
    budget_like = sum(t.numel() for ts in planes.values() for t in ts)
    peak, bits, order = 0, {bid: 8 for bid in table.entries}, sorted(table.entries)
    for _ in range(args.cycles):
        kv = []
        for b in (7, 6, 5, 4, 3):  # rising load: drop one plane everywhere, fill with KV
            freed = 0
            for bid in order:
                planes[bid].pop(bits[bid] - 1)  # plane
                planes[bid][-1] = tensor(table.lut_bytes(bid, b))
                freed += table.plane_bytes(bid) + table.lut_bytes(bid, b + 1) - table.lut_bytes(bid, b)
                bits[bid] = b
            kv += [tensor(KV_BLOCK_BYTES) for _ in range(freed // KV_BLOCK_BYTES)]
            peak = max(peak, torch.cuda.memory_reserved(device))
        kv.clear()
        for b in (4, 5, 6, 7, 8):  # falling load
            for bid in order:
                planes[bid].insert(bits[bid], tensor(table.plane_bytes(bid)))
                planes[bid][-1] = tensor(table.lut_bytes(bid, b))
                bits[bid] = b
            peak = max(peak, torch.cuda.memory_reserved(device))
    del planes
    torch.cuda.empty_cache()
    return {"bytes_at_8_bits": budget_like, "reserved_at_start": start, "peak_reserved": peak,
            "peak_reserved_over_8_bit_bytes": peak - start - budget_like}


def main():
    args = parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    budget = parse_memory_budget(args.budget, device_memory_bytes(device))
    blocks = random_blocks(*SHAPE, seed=0)
    workspace = measure_workspace(blocks, device, gen)
    peaks = Peaks(device)  # device memory counted from here
    pool = MemoryPool(budget)
    pool.allocate(WORKSPACE, workspace)
    arena = Arena.from_pool(pool, PAGE_BYTES, device)
    table = PageTable(blocks, arena)
    mover = PageMover(table)
    mover.load_all()
    planner = InProcessPlanner("pagedweight")  # no artifact: S_i(b) ~ size * 4^-b
    planner.register(page_table_registration(table.charged_bytes_table()))
    pager = WeightPager(mover, planner, kv_block_bytes=KV_BLOCK_BYTES)
    experts = [ArenaExperts(table, layer, EXPERTS) for layer in range(LAYERS)]
    peaks.sample(pool, pager)
    t0 = time.perf_counter()
    boundary_ms = run_cycles(args, device, pool, arena, pager, experts, peaks, gen)
    elapsed = time.perf_counter() - t0
    stats = pager.stats()
    mover.close()
    p = peaks.peaks
    result = {
        "config": {**vars(args), **dict(zip(("layers", "experts", "hidden", "intermediate"), SHAPE)), "top_k": TOP_K,
                   "tokens": TOKENS, "kv_block_bytes": KV_BLOCK_BYTES, "page_bytes": PAGE_BYTES,
                   "kv_blocks_per_step": KV_BLOCKS_PER_STEP},
        "budget_bytes": budget, "workspace_bytes": workspace, "arena_bytes": arena.num_pages * arena.page_bytes,
        "expert_bytes_at_8_bits": sum(table.charged_bytes(bid, 8) for bid in table.entries),
        "num_steps": peaks.num_steps, "seconds": round(elapsed, 2), **{k: v for k, v in p.items() if k.startswith("max")},
        "max_reserved_over_budget_bytes": p["max_allocator_reserved_bytes"] - budget,
        "mean_bits_min": -p["mean_bits_min"], "mean_bits_end": stats.mean_committed_bits,
        "step_boundary_ms_mean": round(sum(boundary_ms) / len(boundary_ms), 3),
        "step_boundary_ms_max": round(max(boundary_ms), 3), "pager": stats.to_dict(),
        "baseline_caching_allocator": caching_allocator_baseline(args, device, table)}
    print(json.dumps({k: v for k, v in result.items() if k not in ("pager", "config")}, indent=1))
    print(write_result("pool_split_gpu", result))


if __name__ == "__main__":
    main()
