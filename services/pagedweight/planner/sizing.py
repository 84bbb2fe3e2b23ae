"""How much memory a model needs, and what a memory budget buys: the sizing report.

`pagedweight info` prints it before anything is started, and the worker logs the same
report at start-up (one function, `sizing_report`, for both). From config.json and tensor
headers only (no weights):

- parameters, dense vs routed-expert, and their bytes: dense at the serving dtype, experts
  at every width 3..8 bits through the APL format's own `block_bytes` (LUTs included);
- KV bytes per token at the serving dtype;
- for a budget B: what is left once the dense weights and the step workspace are charged,
  KV tokens at each uniform width (expert blocks and KV blocks charged in whole arena pages,
  as the worker's arena charges them), the widest uniform width that holds N requests of C
  tokens, and the plan the planner's `pagedweight` policy makes for the bytes N x C leaves.

The planner's choice uses the artifact's sensitivity and calibration routing for a paged
model; a plain checkpoint has neither yet, so it gets the size prior S_i(b) = bytes_i(8) *
4^-b (the error of a uniform b-bit grid), which spreads bits evenly by size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedweight.common.errors import CheckpointError, UserError
from pagedweight.format.checkpoint_headers import checkpoint_headers, is_routed_expert, read_headers
from pagedweight.format.paged_meta import DENSE_FILE, is_paged_model_dir, read_meta

from pagedweight.format.blocks import BIT_WIDTHS, MODULES, BlockId, block_bytes, lut_bytes
from pagedweight.format.model_config import ModelConfig
from pagedweight.planner.config import PlannerConfig
from pagedweight.planner.policies import PlanContext, make_policy
from pagedweight.planner.tables import BlockTable

PLANNER_POLICY = "pagedweight"


@dataclass(frozen=True)
class ModelSizes:
    """What the report is computed from (no weights)."""

    source: str  # "paged model" | "checkpoint"
    config: ModelConfig
    num_dense_params: int  # everything but routed experts (embeddings, attention, norms, routers, shared experts)
    num_expert_params: int  # routed experts
    dtype: str  # the serving dtype of dense weights, activations and KV ("bfloat16", ...)
    dtype_bytes: int
    workspace_bytes: int  # activations of the largest step (runtime.workspace_bytes)
    page_bytes: int  # the arena's page: expert planes, LUTs and KV blocks are charged in whole pages
    kv_block_size: int  # tokens per KV block
    sensitivity: np.ndarray | None = None  # float64 [N, 6] in block_ids() order; None: size prior
    calib_mass: np.ndarray | None = None  # float64 [L, E]
    calib_share: np.ndarray | None = None  # float64 [L, E]
    dense_bytes: int | None = None  # measured by the caller (the worker); default params x dtype

    def block_ids(self) -> list[BlockId]:
        c = self.config
        return [BlockId(l, e, m) for l in range(c.num_layers) for e in range(c.num_experts) for m in MODULES]

    def block_shapes(self) -> dict[str, tuple[int, int]]:
        h, i = self.config.hidden_size, self.config.expert_intermediate_size
        return {"gate_up": (2 * i, h), "down": (h, i)}  # module -> (rows, cols)


def model_sizes(model_dir: str | Path, dtype: str, dtype_bytes: int, workspace_bytes: int, page_bytes: int,
                kv_block_size: int, dense_bytes: int | None = None) -> ModelSizes:
    """ModelSizes of a checkpoint or paged model directory, from config.json and tensor headers."""
    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointError(f"{path}: model directory does not exist")
    config = ModelConfig.from_dir(path)
    h, i = config.hidden_size, config.expert_intermediate_size
    num_expert_params = config.num_layers * config.num_experts * 3 * h * i
    if is_paged_model_dir(path):
        num_dense_params = sum(t.numel for t in read_headers(path / DENSE_FILE))
        return sizes_from_meta(config, read_meta(path), path / "paged_model.json", num_dense_params, dtype,
                               dtype_bytes, workspace_bytes, page_bytes, kv_block_size, dense_bytes)
    tensors = checkpoint_headers(path)
    num_dense_params = sum(t.numel for t in tensors if not is_routed_expert(t.name))
    in_headers = sum(t.numel for t in tensors if is_routed_expert(t.name))
    if in_headers != num_expert_params:
        raise CheckpointError(f"{path}: routed-expert tensors hold {in_headers} parameters, config.json "
                              f"says {num_expert_params}")
    return ModelSizes("checkpoint", config, num_dense_params, num_expert_params, dtype, dtype_bytes,
                      workspace_bytes, page_bytes, kv_block_size, dense_bytes=dense_bytes)


def sizes_from_meta(config: ModelConfig, meta: dict, where: Path, num_dense_params: int, dtype: str,
                    dtype_bytes: int, workspace_bytes: int, page_bytes: int, kv_block_size: int,
                    dense_bytes: int | None = None) -> ModelSizes:
    """ModelSizes of a paged model from its metadata (paged_model.json, read or in memory):
    the artifact's sensitivity and calibration routing feed the planner's choice."""
    from pagedweight.planner.artifact import table_from_meta

    h, i = config.hidden_size, config.expert_intermediate_size
    num_expert_params = config.num_layers * config.num_experts * 3 * h * i
    if meta.get("sensitivity") is None:  # an in-memory synthetic model without a sensitivity table: the size prior
        return ModelSizes("paged model", config, num_dense_params, num_expert_params, dtype, dtype_bytes,
                          workspace_bytes, page_bytes, kv_block_size, dense_bytes=dense_bytes)
    table = table_from_meta(meta, where)
    row = {b: n for n, b in enumerate(table.block_ids)}
    order = [BlockId(l, e, m) for l in range(config.num_layers) for e in range(config.num_experts) for m in MODULES]
    if set(row) != set(order):
        raise CheckpointError(f"{where}: the block list does not match config.json's layers and experts")
    return ModelSizes("paged model", config, num_dense_params, num_expert_params, dtype, dtype_bytes,
                      workspace_bytes, page_bytes, kv_block_size, table.sensitivity[[row[b] for b in order]], table.calib_mass, table.calib_share, dense_bytes)


def sizing_report(sizes: ModelSizes, budget: int | None = None, context: int | None = None,
                  concurrency: int | None = None) -> dict:
    """The report as plain JSON-able data; `format_sizing` renders it as text."""
    c = sizes.config
    num_experts = c.num_layers * c.num_experts
    shapes = sizes.block_shapes()
    expert_bytes = {b: num_experts * sum(block_bytes(r, k, b) for r, k in shapes.values()) for b in BIT_WIDTHS}
    kv_heads, head_dim = c.kv_slot  # as the paged KV cache sizes a layer's slot
    kv_per_token = 2 * c.num_layers * kv_heads * head_dim * sizes.dtype_bytes
    dense_bytes = sizes.dense_bytes if sizes.dense_bytes is not None else sizes.num_dense_params * sizes.dtype_bytes
    report = {
        "source": sizes.source,
        "architecture": c.architecture,
        "num_layers": c.num_layers, "num_experts": c.num_experts, "top_k": c.num_experts_per_tok,
        "hidden_size": c.hidden_size, "expert_intermediate_size": c.expert_intermediate_size,
        "shared_expert_intermediate_size": c.shared_expert_intermediate_size,
        "num_params": sizes.num_dense_params + sizes.num_expert_params,
        "num_dense_params": sizes.num_dense_params, "num_expert_params": sizes.num_expert_params,
        "num_expert_blocks": num_experts * len(MODULES),
        "dtype": sizes.dtype,
        "dense_bytes": dense_bytes,
        "expert_bf16_bytes": 2 * sizes.num_expert_params,
        "expert_bytes": {str(b): n for b, n in expert_bytes.items()},  # bits -> bytes (planes + LUTs)
        "kv_bytes_per_token": kv_per_token,
    }
    if context is not None and context > c.max_position_embeddings:
        raise UserError(f"--context {context} is beyond the model's context of {c.max_position_embeddings} tokens")
    if budget is not None:
        report["budget"] = _budget_report(sizes, budget, dense_bytes, kv_per_token, context, concurrency)
    return report


def _budget_report(sizes: ModelSizes, budget: int, dense_bytes: int, kv_per_token: int,
                   context: int | None, concurrency: int | None) -> dict:
    page = sizes.page_bytes
    charged = _charged_nbytes(sizes)  # [N, 6] arena bytes per block and width
    kv_block = _pages(kv_per_token * sizes.kv_block_size, page)  # arena bytes of one KV block
    left = (budget - dense_bytes - sizes.workspace_bytes) // page * page  # the arena: experts and KV, whole pages
    out = {"memory_budget": budget, "workspace_bytes": sizes.workspace_bytes, "page_bytes": page,
           "kv_block_size": sizes.kv_block_size, "weights_and_kv_bytes": max(left, 0), "uniform": {}}
    for i, b in enumerate(BIT_WIDTHS):
        experts = int(charged[:, i].sum())
        num_kv_blocks = max(left - experts, 0) // kv_block if left >= experts else 0
        out["uniform"][str(b)] = {"expert_bytes": experts, "fits": left >= experts,
                                  "kv_tokens": num_kv_blocks * sizes.kv_block_size}
    if context is None or concurrency is None:
        return out
    kv_blocks_needed = concurrency * -(-context // sizes.kv_block_size)
    kv_bytes = kv_blocks_needed * kv_block
    serving = [b for b in BIT_WIDTHS if out["uniform"][str(b)]["fits"]
               and out["uniform"][str(b)]["kv_tokens"] >= kv_blocks_needed * sizes.kv_block_size]
    # the most requests of this context the arena holds: every expert at 3 bits, the rest KV
    blocks_per_request = -(-context // sizes.kv_block_size)
    max_concurrency = out["uniform"][str(BIT_WIDTHS[0])]["kv_tokens"] // sizes.kv_block_size // blocks_per_request
    out["requests"] = {"context": context, "concurrency": concurrency, "kv_bytes": kv_bytes,
                       "max_concurrency": int(max_concurrency), "fits": concurrency <= max_concurrency,
                       "widest_uniform_bits": max(serving) if serving else None,
                       "planner": _planner_choice(sizes, charged, left - kv_bytes)}
    return out


def fitting_uniform_bits(expert_bytes: dict[int, int], fixed_bytes: int, kv_bytes: int, budget: int) -> int | None:
    """The widest uniform width whose experts, beside the fixed bytes (dense weights, workspace)
    and the trace's KV demand, fit the budget: the static baseline a fair comparison with the
    elastic policy runs at that budget. None when not even every expert at 3 bits fits.

    expert_bytes: bits -> bytes of every expert block at that width (planes and LUTs).
    """
    if any(b not in expert_bytes for b in BIT_WIDTHS):
        raise ValueError(f"expert_bytes must give every width in {BIT_WIDTHS}")
    room = budget - fixed_bytes - kv_bytes
    return max((b for b in BIT_WIDTHS if expert_bytes[b] <= room), default=None)


def _planner_choice(sizes: ModelSizes, charged: np.ndarray, weight_budget: int) -> dict:
    """What the `pagedweight` policy plans for the bytes the requests' KV leaves."""
    floor_bytes = int(charged[:, 0].sum())
    if weight_budget < floor_bytes:
        return {"policy": PLANNER_POLICY, "fits": False, "weight_budget": weight_budget,
                "shortfall_bytes": floor_bytes - max(weight_budget, 0)}
    c = sizes.config
    sensitivity = sizes.sensitivity
    if sensitivity is None:  # a plain checkpoint: the size prior (module docstring)
        sensitivity = charged[:, -1:].astype(np.float64) * np.power(4.0, -np.array(BIT_WIDTHS, dtype=np.float64))
    table = BlockTable(sizes.block_ids(), charged, sensitivity, c.num_layers, c.num_experts,
                       sizes.calib_mass, sizes.calib_share)
    plan = make_policy(PLANNER_POLICY, table, PlannerConfig()).plan(weight_budget, PlanContext())
    weights = np.array([r * k for r, k in (sizes.block_shapes()[b.module] for b in table.block_ids)], dtype=np.float64)
    histogram = {str(b): int((plan.bits == b).sum()) for b in BIT_WIDTHS}
    return {"policy": PLANNER_POLICY, "fits": True, "weight_budget": weight_budget,
            "sensitivity": "artifact" if sizes.sensitivity is not None else "size prior",
            "expert_bytes": table.bytes_of(plan.bits),
            "mean_bits": float((plan.bits * weights).sum() / weights.sum()),
            "bits_histogram": histogram}  # bits -> blocks


def _charged_nbytes(sizes: ModelSizes) -> np.ndarray:
    """int64 [N, 6]: arena bytes of every block at 3..8 bits (planes and LUT, whole pages)."""
    page, per_module = sizes.page_bytes, {}
    for module, (rows, cols) in sizes.block_shapes().items():
        plane = _pages(rows * cols // 8, page)
        per_module[module] = [b * plane + _pages(lut_bytes(rows, b), page) for b in BIT_WIDTHS]
    return np.array([per_module[b.module] for b in sizes.block_ids()], dtype=np.int64).reshape(-1, len(BIT_WIDTHS))


def _pages(num_bytes: int, page: int) -> int:
    return -(-num_bytes // page) * page


# ---- text ----------------------------------------------------------------------------------
def format_sizing(report: dict) -> str:
    r = report
    shared = f", shared expert {r['shared_expert_intermediate_size']}" if r["shared_expert_intermediate_size"] else ""
    lines = [
        f"architecture   {r['architecture']} ({r['source']}): {r['num_layers']} layers, {r['num_experts']} experts "
        f"of {r['expert_intermediate_size']} (top-{r['top_k']}), hidden {r['hidden_size']}{shared}",
        f"parameters     {_count(r['num_params'])}: dense {_count(r['num_dense_params'])}, routed experts "
        f"{_count(r['num_expert_params'])} in {r['num_expert_blocks']} expert blocks",
        f"dense weights  {_size(r['dense_bytes'])} at {r['dtype']}",
        f"experts        {_size(r['expert_bf16_bytes'])} at bf16; at b bits (planes + LUTs): "
        + ", ".join(f"{b}: {_size(n)}" for b, n in r["expert_bytes"].items()),
        f"KV cache       {_size(r['kv_bytes_per_token'])} per token at {r['dtype']}",
    ]
    budget = r.get("budget")
    if budget:
        lines.append(f"budget         {_size(budget['memory_budget'])}: {_size(budget['weights_and_kv_bytes'])} for "
                     f"experts and KV after dense weights and {_size(budget['workspace_bytes'])} workspace")
        for b, u in budget["uniform"].items():
            lines.append(f"  {b} bits       experts {_size(u['expert_bytes'])}, "
                         + (f"KV {u['kv_tokens']} tokens" if u["fits"] else "does not fit"))
        requests = budget.get("requests")
        if requests:
            n, ctx = requests["concurrency"], requests["context"]
            widest = requests["widest_uniform_bits"]
            lines.append(f"{n} x {ctx} tokens  KV {_size(requests['kv_bytes'])}; widest uniform width: "
                         + (f"{widest} bits" if widest else "none (the budget is too small)"))
            if not requests["fits"]:
                lines.append(f"  does not fit: at most {requests['max_concurrency']} requests of {ctx} tokens "
                             f"(every expert at 3 bits, the rest KV)")
            p = requests["planner"]
            if p["fits"]:
                hist = ", ".join(f"{b}: {k}" for b, k in p["bits_histogram"].items() if k)
                lines.append(f"  planner ({p['policy']}, {p['sensitivity']}): mean {p['mean_bits']:.2f} bits, "
                             f"experts {_size(p['expert_bytes'])}; blocks by bits {hist}")
            else:
                lines.append(f"  planner ({p['policy']}): does not fit, {_size(p['shortfall_bytes'])} short "
                             f"with every block at 3 bits")
    return "\n".join(lines)


def _size(num_bytes: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{int(num_bytes)} B"


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)

