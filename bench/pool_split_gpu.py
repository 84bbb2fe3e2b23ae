"""Reserved device memory against the budget while the weights/KV split moves.

One worker's memory on synthetic APL experts (default: 4 MoE layers of Qwen1.5-MoE-A2.7B
size, 60 experts, hidden 2048, intermediate 1408): a pool of `--budget` bytes, one arena,
every block loaded at 8 bits. Then `--cycles` times: the load rises (the KV cache takes
blocks; when the arena is full the weight pager lowers bits to free them) and falls (KV
blocks freed, the bytes offered back, bits raised by copies on the side stream). Every
step runs the MoE layers through the page table (the torch reference path). After every
step boundary it records the allocator's reserved bytes and the device's used bytes.

Baseline in the same run: the same sequence of plane and KV-block allocations made as
separate tensors from PyTorch's caching allocator (no arena), whose reserved memory is
what the budget would have to cover without one arena.

    python bench/pool_split_gpu.py                      # on the GPU machine
    python bench/pool_split_gpu.py --device cpu --layers 1 --experts 8 --hidden 256 --intermediate 128 --budget 64MiB --no-write
"""

from __future__ import annotations

import argparse
import json
import time

import torch


from bench.bench_meta import write_result
from pagedweight.memory.arena import Arena
from pagedweight.memory.pool import KV_USED, WORKSPACE, MemoryPool, parse_memory_budget, device_memory_bytes
from pagedweight.weights.arena_experts import ArenaExperts
from pagedweight.planner.in_process_planner import InProcessPlanner, page_table_registration
from pagedweight.weights.page_mover import PageMover
from pagedweight.weights.page_table import PageTable
from pagedweight.weights.synthetic import random_blocks
from pagedweight.weights.weight_pager import WeightPager

MiB = 1 << 20


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=60)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--tokens", type=int, default=4, help="tokens per emulated step")
    p.add_argument("--budget", default="2GiB", help="bytes (2GiB) or a fraction of the device (0.1)")
    p.add_argument("--kv-block-bytes", type=int, default=2 * MiB)
    p.add_argument("--page-bytes", type=int, default=64 * 1024)
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--kv-blocks-per-step", type=int, default=32)
    p.add_argument("--no-write", action="store_true")
    return p.parse_args()


class Recorder:
    def __init__(self, device):
        self.device, self.samples = device, []
        self.cuda = device.type == "cuda"
        self.base_used = self._device_used()

    def _device_used(self) -> int:
        if not self.cuda:
            return 0
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def sample(self, phase, pool, pager):
        if self.cuda:
            torch.cuda.synchronize(self.device)
        s = pool.snapshot()
        self.samples.append({
            "phase": phase,
            "reserved": torch.cuda.memory_reserved(self.device) if self.cuda else None,
            "device_used_over_start": self._device_used() - self.base_used if self.cuda else None,
            "pool_reserved": s.reserved_bytes, "expert": s.expert_bytes, "kv": s.kv_used_bytes,
            "transit": s.transit_bytes, "mean_bits": pager.stats().mean_committed_bits,
        })


def emulate_step(experts, args, device, gen):
    """One decode-like step through every layer's experts operator (reads the arena)."""
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    for op in experts:
        ids = torch.stack([torch.randperm(args.experts, generator=gen)[: args.top_k] for _ in range(args.tokens)]).to(device)
        weights = torch.full((args.tokens, args.top_k), 1.0 / args.top_k, device=device, dtype=x.dtype)
        x = op(x, ids, weights)


def measure_workspace(table, experts, args, device, gen) -> int:
    """Peak temporary bytes of one step (dequantised weights, activations), to reserve."""
    if device.type != "cuda":
        return 1 * MiB  # CPU: nominal (no allocator to measure)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    emulate_step(experts, args, device, gen)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def run_cycles(args, device, pool, arena, pager, experts, rec, gen):
    boundary_ms = []

    def step(phase):
        emulate_step(experts, args, device, gen)
        t0 = time.perf_counter()
        pager.step_boundary()
        boundary_ms.append((time.perf_counter() - t0) * 1e3)
        rec.sample(phase, pool, pager)

    for cycle in range(args.cycles):
        kv, floor_steps = [], 0
        while floor_steps < 3:  # rising load: take KV blocks until bits are at their floor
            for _ in range(args.kv_blocks_per_step):
                if not arena.can_allocate(KV_USED, args.kv_block_bytes):
                    promised = pager.request_bytes(args.kv_blocks_per_step * args.kv_block_bytes)
                    floor_steps += promised == 0
                    break
                kv.append(arena.allocate(KV_USED, args.kv_block_bytes))
                arena.view(kv[-1], torch.uint8, (args.kv_block_bytes,)).fill_(cycle + 1)  # KV writes
            step(f"rise{cycle}")
        for x in kv:  # falling load
            arena.free(x)
        for _ in range(1000):
            pager.offer_bytes(pool.free_bytes)
            step(f"fall{cycle}")
            if not pager.busy() and pager.stats().mean_committed_bits == 8:
                break
    return boundary_ms


def caching_allocator_baseline(args, device, table) -> dict | None:
    """The same kind of split moves with one tensor per plane/LUT/KV block, no arena."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    start = torch.cuda.memory_reserved(device)
    planes = {bid: [torch.empty(table.plane_bytes(bid), dtype=torch.uint8, device=device) for _ in range(8)]
              + [torch.empty(table.lut_bytes(bid, 8), dtype=torch.uint8, device=device)] for bid in table.entries}
    budget_like = sum(t.numel() for ts in planes.values() for t in ts)
    peak, bits = 0, {bid: 8 for bid in table.entries}
    order = sorted(table.entries)
    for cycle in range(args.cycles):
        kv = []
        for b in (7, 6, 5, 4, 3):  # rising load: drop one plane everywhere, fill with KV
            freed = 0
            for bid in order:
                planes[bid].pop(bits[bid] - 1)  # plane
                planes[bid][-1] = torch.empty(table.lut_bytes(bid, b), dtype=torch.uint8, device=device)
                freed += table.plane_bytes(bid) + table.lut_bytes(bid, b + 1) - table.lut_bytes(bid, b)
                bits[bid] = b
            kv += [torch.empty(args.kv_block_bytes, dtype=torch.uint8, device=device)
                   for _ in range(freed // args.kv_block_bytes)]
            peak = max(peak, torch.cuda.memory_reserved(device))
        kv.clear()
        for b in (4, 5, 6, 7, 8):  # falling load
            for bid in order:
                planes[bid].insert(bits[bid], torch.empty(table.plane_bytes(bid), dtype=torch.uint8, device=device))
                planes[bid][-1] = torch.empty(table.lut_bytes(bid, b), dtype=torch.uint8, device=device)
                bits[bid] = b
            peak = max(peak, torch.cuda.memory_reserved(device))
    result = {"bytes_at_8_bits": budget_like, "reserved_at_start": start,
              "peak_reserved": peak, "peak_reserved_over_8_bit_bytes": peak - start - budget_like}
    del planes
    torch.cuda.empty_cache()
    return result


def main():
    args = parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    budget = parse_memory_budget(args.budget, device_memory_bytes(device))
    blocks = random_blocks(args.layers, args.experts, args.hidden, args.intermediate, seed=0)
    pool = MemoryPool(budget)

    # Workspace: measured on a throw-away arena holding the blocks at 8 bits.
    probe_pool = MemoryPool(1 << 50)
    probe = PageTable(blocks, Arena(probe_pool, sum(b.nbytes(8) for b in blocks.values()) * 2, args.page_bytes, device))
    probe_mover = PageMover(probe)
    probe_mover.load_all()
    workspace = measure_workspace(probe, [ArenaExperts(probe, l, args.experts) for l in range(args.layers)], args, device, gen)
    probe_mover.close()
    del probe, probe_mover
    if device.type == "cuda":
        torch.cuda.empty_cache()
    rec = Recorder(device)  # device memory counted from here

    pool.allocate(WORKSPACE, workspace)
    arena = Arena.from_pool(pool, args.page_bytes, device)
    table = PageTable(blocks, arena)
    mover = PageMover(table)
    mover.load_all()
    pager = WeightPager(mover, size_only_planner(table), kv_block_bytes=args.kv_block_bytes)
    experts = [ArenaExperts(table, layer, args.experts) for layer in range(args.layers)]
    rec.sample("loaded", pool, pager)
    t0 = time.perf_counter()
    boundary_ms = run_cycles(args, device, pool, arena, pager, experts, rec, gen)
    elapsed = time.perf_counter() - t0
    stats = pager.stats()
    mover.close()

    reserved = [s["reserved"] for s in rec.samples if s["reserved"] is not None]
    used = [s["device_used_over_start"] for s in rec.samples if s["device_used_over_start"] is not None]
    result = {
        "config": {k: v for k, v in vars(args).items() if k != "no_write"},
        "budget_bytes": budget, "workspace_bytes": workspace, "arena_bytes": arena.num_pages * arena.page_bytes,
        "expert_bytes_at_8_bits": sum(table.charged_bytes(bid, 8) for bid in table.entries),
        "num_steps": len(rec.samples) - 1, "seconds": round(elapsed, 2),
        "max_allocator_reserved_bytes": max(reserved) if reserved else None,
        "max_reserved_over_budget_bytes": (max(reserved) - budget) if reserved else None,
        "max_device_used_over_start_bytes": max(used) if used else None,
        "max_pool_reserved_bytes": max(s["pool_reserved"] for s in rec.samples),
        "mean_bits_min": min(s["mean_bits"] for s in rec.samples),
        "mean_bits_end": rec.samples[-1]["mean_bits"],
        "max_kv_bytes": max(s["kv"] for s in rec.samples),
        "step_boundary_ms_mean": round(sum(boundary_ms) / len(boundary_ms), 3),
        "step_boundary_ms_max": round(max(boundary_ms), 3),
        "pager": stats.to_dict(),
        "baseline_caching_allocator": caching_allocator_baseline(args, device, table),
        "samples": rec.samples,
    }
    summary = {k: v for k, v in result.items() if k not in ("samples", "pager", "config")}
    print(json.dumps(summary, indent=1))
    if not args.no_write:
        print(write_result("pool_split_gpu" if device.type == "cuda" else "pool_split_cpu", result))


def size_only_planner(table: PageTable) -> InProcessPlanner:
    """The serving planner over a synthetic table: no artifact, so S_i(b) ~ size * 4^-b."""
    planner = InProcessPlanner("pagedweight")
    planner.register(page_table_registration(table.charged_bytes_table()))
    return planner


if __name__ == "__main__":
    main()
