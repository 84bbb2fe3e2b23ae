"""One MoE layer through the fused APL kernel at real model sizes (MODELS, synthetic APL weights)
per token count and bit configuration, against bf16 on the same experts in the same run (the
torch._grouped_mm and the engine's bf16 GEMV), and the HBM floor: the bytes the fused kernel must
read over the copy bandwidth measured in the same run. docs/kernel.md says how it is timed;
bench/tables.py renders its tables. Several copies of the layer and a fresh routing per
call keep the weights out of L2, as a model running its layers in turn does.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from bench.bench_meta import arg_parser, write_result
from pagedweight_kernels import decode_ops
from pagedweight_kernels.apl_moe import APLLayer, ResidentBlock, apl_moe
from pagedweight_kernels.synthetic import nested_luts
from pagedweight.format.apl_format import lut_width
from pagedweight_kernels.plan import plan_launch

MODELS = {  # experts, top_k, hidden, intermediate
    "qwen1.5-moe-a2.7b": (60, 4, 2048, 1408),
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "gemma-4-26b-a4b": (128, 8, 2816, 704),
}
TOKENS = (1, 4, 16, 64, 256)
BIT_CONFIGS = ("3", "4", "5", "6", "7", "8", "mixed")  # every width the mixed layer's byte-weighted time needs
MIXED_CHOICES = (3, 4, 4, 5, 6, 8)  # the mixed assignment draws each block's bits from these
COPIES, REPS, TRIALS, REPLAYS = 3, 6, 5, 8


class SyntheticLayer:
    """All 8 planes and every LUT of every block of one layer, on the GPU, plus bf16 weights."""

    def __init__(self, E, H, I, seed, device):
        gen = torch.Generator(device=device).manual_seed(seed)
        self.gu_planes = torch.randint(0, 256, (E, 8, 2 * I, H // 8), dtype=torch.uint8, device=device, generator=gen)
        self.dn_planes = torch.randint(0, 256, (E, 8, H, I // 8), dtype=torch.uint8, device=device, generator=gen)
        self.gu_luts = [nested_luts(self._lut8(2 * I, H, gen, device)) for _ in range(E)]
        self.dn_luts = [nested_luts(self._lut8(H, I, gen, device)) for _ in range(E)]
        self.gate_up = (torch.randn(E, 2 * I, H, device=device, generator=gen) * H ** -0.5).bfloat16()
        self.down = (torch.randn(E, H, I, device=device, generator=gen) * I ** -0.5).bfloat16()

    @staticmethod
    def _lut8(rows, cols, gen, device):
        return torch.randn(rows, 256, device=device, generator=gen).sort(dim=1).values * cols ** -0.5

    def apl(self, bits: dict[tuple[int, str], int]) -> APLLayer:
        E = self.gu_planes.shape[0]

        def block(planes, luts, b):
            return ResidentBlock(b, [planes[p] for p in range(b)], luts[lut_width(b)])

        return APLLayer([block(self.gu_planes[e], self.gu_luts[e], bits[(e, "gate_up")]) for e in range(E)],
                        [block(self.dn_planes[e], self.dn_luts[e], bits[(e, "down")]) for e in range(E)])


def bit_assignment(config: str, E: int, seed: int) -> dict[tuple[int, str], int]:
    if config != "mixed":
        return {(e, m): int(config) for e in range(E) for m in ("gate_up", "down")}
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(MIXED_CHOICES), (E, 2), generator=gen)
    return {(e, m): MIXED_CHOICES[picks[e, i]] for e in range(E) for i, m in enumerate(("gate_up", "down"))}


def routings(T, E, k, count, device, seed):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        probs = torch.softmax(torch.randn(T, E, generator=gen), dim=-1)
        w, ids = probs.topk(k, dim=-1)
        out.append((ids.to(device), (w / w.sum(-1, keepdim=True)).bfloat16().to(device)))
    return out


def bf16_grouped(x, ids, w, layer: SyntheticLayer):
    T, k = ids.shape
    E = layer.gate_up.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat)
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    tokens = order // k
    gate, up = torch._grouped_mm(x[tokens], layer.gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, layer.down.transpose(1, 2), offs=offs)
    out = torch.zeros_like(x)
    return out.index_add_(0, tokens, y * w.reshape(-1)[order, None])


def time_calls(calls) -> float:
    """Microseconds per call: a CUDA graph of all calls, replayed; median over trials."""
    for c in calls:  # warm-up: compiles kernels, fills caches of the allocator
        c()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    trials = []
    for _ in range(TRIALS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            graph.replay()
        end.record()
        end.synchronize()
        trials.append(start.elapsed_time(end) * 1000 / (REPLAYS * len(calls)))
    del graph
    return statistics.median(trials)


def copy_bandwidth(device) -> dict:
    """The HBM ceiling, bytes read + written per second, three ways (the card idles at low
    clocks, so after warm-up copies): a memcpy in a CUDA graph, eager memcpys timed with
    events, and an elementwise kernel (SM loads and stores, as our kernels move data)."""
    n = 2 << 30
    a, b = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    a.random_(0, 255)
    fa, fb = a.view(torch.float32), b.view(torch.float32)
    for _ in range(20):
        b.copy_(a)
    graph_us = min(time_calls([lambda: b.copy_(a)]) for _ in range(2))
    kernel_us = min(time_calls([lambda: torch.neg(fa, out=fb)]) for _ in range(2))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    end.synchronize()
    eager_us = start.elapsed_time(end) * 100
    del a, b, fa, fb
    return {name: 2 * n / (us * 1e-6) for name, us in
            (("graph_memcpy", graph_us), ("eager_memcpy", eager_us), ("elementwise_kernel", kernel_us))}


def add_byte_weighted(row, mixed_layers, active, pairs, io_bytes) -> None:
    """The mixed layer against the time its bytes predict (target: within 1.2x): each width's
    share of the mixed layer's bytes read at that width's own uniform-layer rate (us per byte,
    measured in this run), summed. Written only when every width the mix holds was timed."""
    if not mixed_layers or "bits_mixed" not in row:
        return
    shares: dict[int, float] = {}
    for c, i in pairs:
        for bits, nbytes in mixed_layers[c].nbytes_by_width(active[i]).items():
            shares[bits] = shares.get(bits, 0.0) + nbytes / len(pairs)
    if not all(f"bits_{b}" in row for b in shares):
        return
    # (activations and outputs, io_bytes, are < 0.1% of the weight bytes at these shapes: left out)
    predicted = sum(nbytes * row[f"bits_{b}"]["fused_us"] / (row[f"bits_{b}"]["bytes"] - io_bytes)
                    for b, nbytes in shares.items())
    cell = row["bits_mixed"]
    cell["byte_weighted_us"] = predicted
    cell["over_byte_weighted"] = cell["fused_us"] / predicted
    print(f"{row['model']:18s} T={row['tokens']:3d} mixed {cell['fused_us']:.1f} us, byte-weighted {predicted:.1f} us: "
          f"{cell['over_byte_weighted']:.2f}x", flush=True)


def bench_model(name, device, bw, bit_configs) -> list[dict]:
    """Every token count and bit configuration of one model's layer, with its bf16 baselines."""
    E, k, H, I = MODELS[name]
    layers = [SyntheticLayer(E, H, I, seed, device) for seed in range(COPIES)]
    configs = {c: [layer.apl(bit_assignment(c, E, 17)) for layer in layers] for c in bit_configs}
    rows = []
    for T in TOKENS:
        route = routings(T, E, k, REPS, device, seed=T)
        x = [torch.randn(T, H, device=device).bfloat16() for _ in range(REPS)]
        pairs = [(i % COPIES, i) for i in range(REPS)]
        active = [ids.unique().tolist() for ids, _ in route]
        io_bytes = 2 * T * H * 2
        row = {"model": name, "tokens": T, "experts_per_call": statistics.mean(len(a) for a in active)}
        row["bf16_bytes"] = statistics.mean(len(a) * 3 * H * I * 2 for a in active) + io_bytes
        row["bf16_floor_us"] = row["bf16_bytes"] / bw * 1e6
        try:
            row["bf16_grouped_us"] = time_calls([lambda c=c, i=i: bf16_grouped(x[i], *route[i], layers[c])
                                                 for c, i in pairs])
        except (RuntimeError, AttributeError) as err:  # no _grouped_mm on this build / GPU
            row["bf16_grouped_us"] = None
            row["bf16_grouped_error"] = str(err).splitlines()[0][:200]
        if decode_ops.gemv_supported(T, k, E, torch.bfloat16):  # the engine's own bf16 path at these tokens
            row["bf16_gemv_us"] = time_calls([lambda c=c, i=i: decode_ops.experts_gemv(
                x[i], *route[i], layers[c].gate_up, layers[c].down) for c, i in pairs])
        for config in bit_configs:
            apl = configs[config]
            plan = plan_launch(T, k, E, H, I, apl[0].max_bits)
            nbytes = statistics.mean(apl[c].nbytes_active(active[i]) for c, i in pairs) + io_bytes
            fused = time_calls([lambda c=c, i=i: apl_moe(x[i], *route[i], apl[c]) for c, i in pairs])
            cell = {"regime": plan.gate_up.regime, "bytes": nbytes, "floor_us": nbytes / bw * 1e6,
                    "fused_us": fused}
            cell["fused_over_floor"] = fused / cell["floor_us"]
            for base in ("bf16_grouped_us", "bf16_gemv_us"):
                if row.get(base):
                    cell[f"speedup_vs_{base[:-3]}"] = row[base] / fused
            row[f"bits_{config}"] = cell
            print(f"{name:18s} T={T:3d} bits={config:5s} {plan.gate_up.regime:7s} fused {fused:8.1f} us "
                  f"({cell['fused_over_floor']:.2f}x floor), "
                  f"bf16 grouped {row.get('bf16_grouped_us') or float('nan'):8.1f}, "
                  f"gemv {row.get('bf16_gemv_us') or float('nan'):8.1f}", flush=True)
        add_byte_weighted(row, configs.get("mixed"), active, pairs, io_bytes)
        rows.append(row)
    del layers, configs
    torch.cuda.empty_cache()
    return rows


def main():
    parser = arg_parser(__doc__)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--bits", nargs="*", default=list(BIT_CONFIGS), choices=BIT_CONFIGS, help="bit configs to time")
    parser.add_argument("--name", default="apl_moe_kernel", help="result file name (bench/results/NAME_<gpu>.json)")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    ceilings = copy_bandwidth(device)
    bw = max(ceilings.values())  # the floor uses the best copy rate measured
    print("copy bandwidth (read + write): " + ", ".join(f"{k} {v / 1e12:.2f} TB/s" for k, v in ceilings.items()),
          flush=True)
    results = [row for name in args.models for row in bench_model(name, device, bw, args.bits)]
    print("wrote", write_result(args.name, {
        "copy_bandwidth_bytes_per_s": bw, "copy_bandwidths": ceilings, "copies": COPIES, "calls_per_graph": REPS,
        "trials": TRIALS, "replays": REPLAYS, "has_grouped_mm": hasattr(torch, "_grouped_mm"), "tokens": list(TOKENS),
        "results": results}))


if __name__ == "__main__":
    main()
