"""Calibration: expert input statistics and routing statistics from calibration text.

Each calibration file is tokenised and cut into chunks of `seq_len` tokens (at most
`max_tokens_per_file` per file). The chunks run through the dense model with every MoE
layer's experts operator wrapped by a `RecordingExperts`, which computes the experts as
`DenseExperts` does and, per chunk and per expert, accumulates over the tokens routed
to that expert:
- sum of x^2 per input column of `gate_up` (x is the MoE block's input),
- sum of a^2 per input column of `down` (a = act(gate) * up of that expert),
- the token count and the routing mass (sum of the token's routing weight);
- with `full_hessians` (the quantiser's error feedback), also the full sums of x x^T and
  a a^T over all chunks (not per chunk), one [C, C] per expert and module.
With `gradients=True` the chunks also run backward (loss: summed next-token NLL;
gradients for activations only, no weight gradients) and each expert accumulates the
squared loss gradient per output row of `gate_up` (its pre-activations) and of `down`
(its routing-weighted output): the diagonal Fisher of the block's outputs, G. With it,
sensitivity.py's Gauss-Newton table S_gn(b) = sum G[r] h[c] (w - Q_b(w))^2 estimates the
loss increase itself, which the input-only S cannot compare across layers.

Per-chunk sums are kept because prompt-residual heads (residual_heads.py) learn from
each chunk's own statistics; the global statistics are their sums. `block_hessians`
turns sums into the diagonal input Hessian h = mean squared input per column, smoothed
towards the layer's average for experts that calibration rarely routes to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pagedweight.common.errors import UserError
from pagedweight_kernels.moe_reference import expert_bounds, gated, group_tokens_by_expert


@dataclass(frozen=True)
class CalibConfig:
    seq_len: int = 256  # tokens per calibration chunk (one forward window)
    max_tokens_per_file: int = 16384  # calibration tokens taken from each file
    batch_size: int = 8  # chunks per forward pass
    # Smoothing: h = (sum_sq + prior_tokens * h_prior) / (count + prior_tokens), so an
    # expert with few routed tokens leans on the layer's average input statistics.
    prior_tokens: float = 16.0
    min_tokens: int = 64  # experts with fewer routed tokens are reported as under-covered
    gradients: bool = True  # also record squared output gradients (one backward per batch)

    def __post_init__(self):
        if self.seq_len < 2 or self.max_tokens_per_file < self.seq_len or self.batch_size < 1:
            raise UserError(f"calibration needs seq_len >= 2, max_tokens_per_file >= seq_len, "
                            f"batch_size >= 1; got {self}")


@dataclass
class CalibrationStats:
    """Raw per-chunk sums. Shapes: N chunks, L layers, E experts, H hidden, I intermediate."""

    chunk_domains: list[str]  # [N] name of the file each chunk came from
    sum_sq_gate_up: torch.Tensor  # [N, L, E, H] float32
    sum_sq_down: torch.Tensor  # [N, L, E, I] float32
    token_counts: torch.Tensor  # [N, L, E] routed tokens
    routing_mass: torch.Tensor  # [N, L, E] sum of routing weights
    num_tokens_per_chunk: int
    files: list[str] = field(default_factory=list)
    grad_sq_gate_up: torch.Tensor | None = None  # [L, E, 2I] sum of squared output gradients
    grad_sq_down: torch.Tensor | None = None  # [L, E, H]
    gram_gate_up: torch.Tensor | None = None  # [L, E, H, H] sum of x x^T (full_hessians)
    gram_down: torch.Tensor | None = None  # [L, E, I, I] sum of a a^T

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_domains)

    @property
    def num_tokens(self) -> int:
        return self.num_chunks * self.num_tokens_per_chunk


class RecordingExperts(nn.Module):
    """Computes dense experts like `DenseExperts` and records their input statistics.

    Before each forward the calibrator sets `chunk_of_token` ([T] chunk index of every
    flattened token); statistics go to that chunk's row of the accumulators. Left None,
    no input statistics are recorded (the streaming quantiser's backward pass recomputes
    a layer's forward only for its output gradients).

    The T*k (token, slot) assignments are sorted by expert once; each expert's products
    run on its slice of the sorted rows, and everything elementwise or accumulated (the
    activation, the statistics, the output Fisher's hooks, the combine) runs once over
    all experts' rows. The per-expert loop used to make ~26 launches per expert (a gather,
    four index_adds, conversions, two hooks...), most of a calibration batch's time on a
    GPU; it now makes the two products and the two Hessian updates. The sums per
    (chunk, expert) add the same rows in the same order as before, so on the CPU the
    products and the diagonal statistics are the same bits; the full Hessians are updated
    by addmm_ and the output Fisher by one index_add_, which round differently.
    """

    def __init__(self, dense, layer: int, stats: CalibrationStats):
        super().__init__()
        self.dense, self.layer, self.stats = dense, layer, stats
        self.chunk_of_token: torch.Tensor | None = None

    def forward(self, x, topk_ids, topk_weights):
        k, E = topk_ids.shape[1], self.dense.num_experts
        order, counts = group_tokens_by_expert(topk_ids, E)
        expert_of = topk_ids.reshape(-1)[order]  # [A] expert of every sorted assignment
        token_of = order // k
        w = topk_weights.reshape(-1)[order]
        xs = x[token_of]  # [A, H], sorted by expert
        sizes = counts.tolist()  # rows of each expert in the sorted assignments (one host read)
        bounds = expert_bounds(sizes)
        if not bounds:
            return torch.zeros_like(x)
        # split, not slices: a slice's backward writes a zero tensor of all rows per expert
        pre = torch.cat([F.linear(part, self.dense.gate_up[e]) for e, part in enumerate(xs.split(sizes)) if len(part)])
        gate, up = pre.chunk(2, dim=-1)
        act = gated(gate, up, self.dense.activation)
        if self.chunk_of_token is not None:  # None: a backward-only pass (quantize.py)
            self._record(expert_of, token_of, xs.detach(), act.detach(), w.detach(), bounds)
        y = torch.cat([F.linear(part, self.dense.down[e]) for e, part in enumerate(act.split(sizes)) if len(part)])
        y = y * w[:, None]
        if y.requires_grad and self.stats.grad_sq_gate_up is not None:
            pre.register_hook(self._grad_recorder(self.stats.grad_sq_gate_up, expert_of))
            y.register_hook(self._grad_recorder(self.stats.grad_sq_down, expert_of))
        return torch.zeros_like(x).index_add_(0, token_of, y.to(x.dtype))

    def _grad_recorder(self, target: torch.Tensor, expert_of: torch.Tensor):
        def record(grad: torch.Tensor) -> None:
            target[self.layer].index_add_(0, expert_of, grad.detach().float().square())
        return record

    def _record(self, expert_of, token_of, xs, act, w, bounds):
        s, L = self.stats, self.layer
        num_layers, E = s.token_counts.shape[1], s.token_counts.shape[2]
        # each accumulator [N, layers, E, ...] as rows (chunk, layer, expert): one index_add_ each
        cell = (self.chunk_of_token[token_of] * num_layers + L) * E + expert_of
        s.sum_sq_gate_up.view(-1, s.sum_sq_gate_up.shape[-1]).index_add_(0, cell, xs.float().square())
        s.sum_sq_down.view(-1, s.sum_sq_down.shape[-1]).index_add_(0, cell, act.float().square())
        s.token_counts.view(-1).index_add_(0, cell, torch.ones_like(w, dtype=torch.float32))
        s.routing_mass.view(-1).index_add_(0, cell, w.float())
        if s.gram_gate_up is not None:
            xf, af = xs.float(), act.float()
            for e, a, b in bounds:
                s.gram_gate_up[L, e].addmm_(xf[a:b].T, xf[a:b])
                s.gram_down[L, e].addmm_(af[a:b].T, af[a:b])


def read_chunks(tokenizer, files: list[Path], config: CalibConfig) -> tuple[list[list[int]], list[str]]:
    """Token chunks of seq_len from each file (at most max_tokens_per_file), and their domains."""
    chunks, domains = [], []
    for path in files:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"{path}: calibration file does not exist")
        try:
            ids = tokenizer.encode(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as err:
            raise UserError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
        ids = ids[: config.max_tokens_per_file]
        num = len(ids) // config.seq_len
        if num == 0:
            raise UserError(f"{path}: fewer than {config.seq_len} tokens, too short to calibrate on")
        domain = path.name.split(".")[0]
        for i in range(num):
            chunks.append(ids[i * config.seq_len:(i + 1) * config.seq_len])
            domains.append(domain)
    return chunks, domains


def calibrate(model, chunks: list[list[int]], domains: list[str], config: CalibConfig,
              files: list[str] | None = None, full_hessians: bool = False) -> CalibrationStats:
    """Run the chunks through `model` (dense experts) and collect per-chunk expert statistics
    (with `full_hessians`, also every expert's full input Hessian sums)."""
    cfg = model.config
    N, L, E = len(chunks), cfg.num_layers, cfg.num_experts
    dev = model.device  # accumulate where the model runs; moved to the CPU at the end
    stats = CalibrationStats(
        chunk_domains=list(domains),
        sum_sq_gate_up=torch.zeros(N, L, E, cfg.hidden_size, device=dev),
        sum_sq_down=torch.zeros(N, L, E, cfg.expert_intermediate_size, device=dev),
        token_counts=torch.zeros(N, L, E, device=dev), routing_mass=torch.zeros(N, L, E, device=dev),
        num_tokens_per_chunk=config.seq_len, files=[str(f) for f in files or []],
    )
    if config.gradients:
        stats.grad_sq_gate_up = torch.zeros(L, E, 2 * cfg.expert_intermediate_size, device=dev)
        stats.grad_sq_down = torch.zeros(L, E, cfg.hidden_size, device=dev)
    if full_hessians:
        H, I = cfg.hidden_size, cfg.expert_intermediate_size
        stats.gram_gate_up = torch.zeros(L, E, H, H, device=dev)
        stats.gram_down = torch.zeros(L, E, I, I, device=dev)
    recorders = []
    originals = [block.experts for block in model.moe_blocks]
    for layer, block in enumerate(model.moe_blocks):
        block.experts = RecordingExperts(block.experts, layer, stats)
        recorders.append(block.experts)
    try:
        for start in range(0, N, config.batch_size):
            batch = torch.tensor(chunks[start:start + config.batch_size], device=model.device)
            chunk_of_token = torch.arange(start, start + batch.shape[0], device=model.device)
            chunk_of_token = chunk_of_token.repeat_interleave(batch.shape[1])
            for recorder in recorders:
                recorder.chunk_of_token = chunk_of_token
            _run_batch(model, batch, config.gradients)
    finally:
        for block, dense in zip(model.moe_blocks, originals):
            block.experts = dense
    for name in ("sum_sq_gate_up", "sum_sq_down", "token_counts", "routing_mass",
                 "grad_sq_gate_up", "grad_sq_down", "gram_gate_up", "gram_down"):
        if getattr(stats, name) is not None:
            setattr(stats, name, getattr(stats, name).cpu())
    return stats


def _run_batch(model, batch: torch.Tensor, gradients: bool) -> None:
    """Forward (and with gradients, backward of the summed NLL to the activations only)."""
    if not gradients:
        with torch.inference_mode():
            model(batch)
        return
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    hook = model.embed_tokens.register_forward_hook(lambda m, args, out: out.requires_grad_(True))
    try:
        with torch.enable_grad():
            logits = model(batch)
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum")
            loss.backward()
    finally:
        hook.remove()
        for p in frozen:
            p.requires_grad_(True)


def output_fisher(stats: CalibrationStats, config: CalibConfig) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Smoothed mean squared output gradient per row: gate_up [L, E, 2I], down [L, E, H]."""
    if stats.grad_sq_gate_up is None:
        return None
    counts = stats.token_counts.sum(0)
    g_gate_up = smoothed_hessians(stats.grad_sq_gate_up, counts, config.prior_tokens, False)
    g_down = smoothed_hessians(stats.grad_sq_down, counts, config.prior_tokens, True)
    return g_gate_up, g_down


def smoothed_hessians(sum_sq: torch.Tensor, counts: torch.Tensor, prior_tokens: float,
                      per_column_prior: bool) -> torch.Tensor:
    """Mean squared input per column, smoothed: sum_sq [..., L, E, C], counts [..., L, E].

    The prior is the layer's mean over all routed tokens, per column for `gate_up`
    (every expert of a layer reads the same hidden space) and a single scalar for
    `down` (intermediate columns of different experts are unrelated).
    """
    layer_sum = sum_sq.sum(dim=-2, keepdim=True)  # [..., L, 1, C]
    layer_count = counts.sum(dim=-1, keepdim=True)[..., None].clamp_min(1)  # [..., L, 1, 1]
    prior = layer_sum / layer_count
    if not per_column_prior:
        prior = prior.mean(dim=-1, keepdim=True)
    return (sum_sq + prior_tokens * prior) / (counts[..., None] + prior_tokens)


def block_hessians(stats: CalibrationStats, config: CalibConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Global smoothed diagonal Hessians: gate_up [L, E, H], down [L, E, I]."""
    counts = stats.token_counts.sum(0)
    h_gate_up = smoothed_hessians(stats.sum_sq_gate_up.sum(0), counts, config.prior_tokens, True)
    h_down = smoothed_hessians(stats.sum_sq_down.sum(0), counts, config.prior_tokens, False)
    return h_gate_up, h_down


def routing_summary(stats: CalibrationStats, config: CalibConfig) -> dict:
    """JSON-ready routing statistics and coverage of the calibration run (per layer, per expert)."""
    counts, mass = stats.token_counts.sum(0), stats.routing_mass.sum(0)
    domains = sorted(set(stats.chunk_domains))
    per_domain = {}
    for d in domains:
        rows = torch.tensor([c == d for c in stats.chunk_domains])
        per_domain[d] = {
            "num_tokens": int(rows.sum()) * stats.num_tokens_per_chunk,
            "token_counts": stats.token_counts[rows].sum(0).tolist(),
            "routing_mass": stats.routing_mass[rows].sum(0).tolist(),
        }
    under = [f"L{l}.E{e}" for l, e in (counts < config.min_tokens).nonzero().tolist()]
    return {
        "num_tokens": stats.num_tokens,
        "num_chunks": stats.num_chunks,
        "seq_len": stats.num_tokens_per_chunk,
        "token_counts": counts.tolist(),  # [L][E] routed tokens
        "routing_mass": mass.tolist(),  # [L][E] sum of routing weights
        "routing_fraction": (mass / mass.sum(-1, keepdim=True).clamp_min(1e-30)).tolist(),
        "per_domain": per_domain,
        "coverage": {
            "min_tokens": config.min_tokens,
            "prior_tokens": config.prior_tokens,
            "under_covered_experts": under,  # fewer than min_tokens routed: smoothed towards the layer
            "min_expert_tokens": int(counts.min()),
        },
    }
