"""Building blocks of the decoder: RMSNorm, rotary embedding, attention, dense MLP.

Shape legend: B = batch, T = new tokens, S = tokens in the cache, H = hidden size,
N = query heads, G = key/value heads, D = head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedweight.format.model_config import ModelConfig
from pagedweight.format.rope_config import RopeScaling
from pagedweight.model.contiguous_kv import ContiguousKVCache
from pagedweight.model.rope import inverse_frequencies
from pagedweight_kernels import decode_ops
from pagedweight_kernels.moe_reference import gated


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a learned scale (Gemma-4's value and router norms), in fp32. On CUDA
    one kernel (decode_ops.rms_norm) where the composed form launches five, every layer of
    a Gemma-4 step runs two; the tests hold the two forms equal."""
    if _fused_norm(x):
        return decode_ops.rms_norm(x, None, eps)
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _fused_norm(x: torch.Tensor) -> bool:
    """Whether decode_ops.rms_norm takes x: on CUDA with cupy, rows it holds in registers."""
    return x.is_cuda and x.shape[-1] <= decode_ops.MAX_NORM_HIDDEN and decode_ops.available()


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, scale_in_fp32: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.scale_in_fp32 = scale_in_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32; Llama-style references cast back before the scale, Gemma-4's
        # after it: in bf16 the two round differently, so each family follows its reference.
        # On CUDA one kernel (decode_ops.rms_norm) where this chain launches 3-7: a Gemma-4
        # layer has seven of these norms plus q and k norms.
        if _fused_norm(x) and self.weight.dtype == x.dtype:
            return decode_ops.rms_norm(x, self.weight, self.eps, self.scale_in_fp32)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.scale_in_fp32:
            return (x32 * self.weight.float()).to(x.dtype)
        return self.weight * x32.to(x.dtype)


def norm_for(config: ModelConfig, size: int) -> RMSNorm:
    """The family's RMSNorm over `size` features."""
    return RMSNorm(size, config.rms_norm_eps, scale_in_fp32=config.is_gemma4)


class RotaryEmbedding:
    """RoPE with the rotate-half layout used by Llama-family checkpoints; `scaling` rescales
    its frequencies (linear, llama3, yarn: model/rope.py) and, for yarn, cos and sin.

    With `rope_pairs` below head_dim // 2 it is Gemma-4's "proportional" (partial) RoPE: the
    first rope_pairs frequencies as the full RoPE would have them (exponents over the whole
    head_dim), the rest 0, so those dimensions pass through unrotated.

    Not a module: its fp32 frequencies must survive `model.to(bfloat16)` and meta-device
    construction, so they are kept on the CPU and copied to the device on first use.
    """

    def __init__(self, head_dim: int, theta: float, rope_pairs: int | None = None,
                 scaling: RopeScaling = RopeScaling()):
        pairs = head_dim // 2 if rope_pairs is None else rope_pairs
        self.inv_freq, self.scale = inverse_frequencies(head_dim, theta, pairs, scaling)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [B, T] -> cos, sin [B, 1, T, D]."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[..., None] * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        if self.scale != 1.0:  # yarn's attention factor, applied to cos/sin in fp32 as transformers does
            return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with rotate-half's sign folded in: cat(-sin[:D/2], sin[D/2:])."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rotary_signed(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`apply_rotary` as x * cos + roll(x, D/2) * signed_sin(sin): roll(x, D/2) is
    cat(x2, x1), so the product is rotate-half's cat(-x2, x1) * sin. Three kernels where
    apply_rotary launches five (a decode graph replays two per layer)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


class _SignedSinOfStep:
    """signed_sin of the step's sin, made by the first layer and reused by the others: the
    layers of one forward get the very same sin tensor (rope_tables), a new step a new one."""

    def __init__(self):
        self._cached: tuple[torch.Tensor, torch.Tensor] | None = None  # (sin, signed_sin(sin))

    def __call__(self, sin: torch.Tensor) -> torch.Tensor:
        # One attribute read and one write, so two models stepping in two threads can never
        # pair one's sin with the other's signed sin (two attributes could be read torn).
        cached = self._cached
        if cached is None or cached[0] is not sin:
            cached = (sin, signed_sin(sin))
            self._cached = cached
        return cached[1]


_signed_sin_of_step = _SignedSinOfStep()


def rope_key(config: ModelConfig, layer: int) -> tuple[int, float, int, RopeScaling]:
    """Which RotaryEmbedding a layer uses: layers with equal keys share cos/sin."""
    a = config.attention(layer)
    return a.head_dim, a.rope_theta, a.rope_pairs, a.rope_scaling


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        shape = config.attention(layer_idx)  # Gemma-4's sliding and full layers differ
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = shape.num_kv_heads
        self.head_dim = shape.head_dim
        self.rope_key = rope_key(config, layer_idx)
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        # Gemma-4's `attention_k_eq_v` full layers: the values are the key projection
        self.v_proj = None if shape.k_eq_v else nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=config.o_proj_bias)
        self._qkv: tuple | None = None  # fuse_qkv: (weight, bias, split sizes), not a parameter
        # decode_ops' RoPE + KV write kernel on in-place decode steps (set by the model's
        # fuse_projections on CUDA; needs fuse_qkv)
        self.fused_kernels = False
        self.qk_norm = config.qk_norm
        self.v_norm = config.v_norm
        self.eps = config.rms_norm_eps
        self.scale = config.attention_scale  # None: SDPA's 1 / sqrt(head_dim)
        self.window = shape.window  # None: full causal attention
        self.clip_qkv = config.clip_qkv
        if config.qk_norm == "head":  # Qwen3-MoE: one norm shared by every head
            self.q_norm = norm_for(config, self.head_dim)
            self.k_norm = norm_for(config, self.head_dim)
        elif config.qk_norm == "full":  # OLMoE: over the whole q (k) projection
            self.q_norm = RMSNorm(self.num_heads * self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim, config.rms_norm_eps)

    def fuse_qkv(self) -> None:
        """Serve q, k and v from one product (a decoded layer launches 2 kernels
        fewer). Their weights (and biases) move into one [q + k + v rows, H] tensor and
        the three projections' parameters become views of it: nothing is stored twice, and
        whatever later writes a projection's parameter in place writes the fused one."""
        if self.v_proj is None or self._qkv is not None:
            return  # Gemma-4's k = v layers keep their two products
        projs = (self.q_proj, self.k_proj, self.v_proj)
        with torch.no_grad():
            weight = torch.cat([p.weight for p in projs])
            bias = torch.cat([p.bias for p in projs]) if self.q_proj.bias is not None else None
        start = 0
        for p in projs:
            rows = p.weight.shape[0]
            p.weight = nn.Parameter(weight[start:start + rows], requires_grad=False)
            if bias is not None:
                p.bias = nn.Parameter(bias[start:start + rows], requires_grad=False)
            start += rows
        self._qkv = (weight, bias, tuple(p.weight.shape[0] for p in projs))

    def _project(self, x: torch.Tensor):
        """x [..., H] -> q [..., N, D], k, v [..., G, D], with the q/k norms applied (before RoPE)."""
        if self._qkv is not None:
            weight, bias, sizes = self._qkv
            q, k, v = F.linear(x, weight, bias).split(sizes, dim=-1)
        else:
            q, k = self.q_proj(x), self.k_proj(x)
            v = k if self.v_proj is None else self.v_proj(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.v_norm:
            v = rms_normalize(v, self.eps)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,  # [B, T, H]
        cos: torch.Tensor,
        sin: torch.Tensor,
        start_pos: int,
        kv_cache: ContiguousKVCache | None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self._project(x))  # [B, heads, T, D]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.append(self.layer_idx, start_pos, k, v)  # [B, G, S, D]
        out = causal_attention(q, k, v, start_pos, self.window, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))

    def forward_paged(self, x: torch.Tensor, cos, sin, step) -> torch.Tensor:
        """Varlen step: x [T, H] holds the new tokens of many sequences.

        `step` is the step's attention context (paged_attention.PagedStep): it was built
        once by the engine and carries the slots and block tables, so this layer calls
        `step.attend` and never imports the KV cache or the engine.
        """
        T = x.shape[0]
        if self._rope_writes(x, step):  # one kernel for the RoPE of q, k and the KV write
            weight, bias, _ = self._qkv
            q = step.rope_write(self.layer_idx, F.linear(x, weight, bias), cos.reshape(T, -1),
                                _signed_sin_of_step(sin).reshape(T, -1), self.num_heads)
            out = step.attend_written(self.layer_idx, q, self.window, self.scale)
            return self.o_proj(out.reshape(T, -1))
        q, k, v = (t[None].transpose(1, 2) for t in self._project(x))  # [1, heads, T, D]
        if x.is_cuda:  # fewer launches; the CPU keeps the reference's arithmetic
            sin_signed = _signed_sin_of_step(sin)
            q, k = apply_rotary_signed(q, cos, sin_signed), apply_rotary_signed(k, cos, sin_signed)
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # [1, heads, T, D] -> [T, heads, D]
        q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))
        out = step.attend(self.layer_idx, q, k, v, self.window, self.scale)  # [T, N, D]
        return self.o_proj(out.reshape(T, -1))

    def _rope_writes(self, x: torch.Tensor, step) -> bool:
        """Whether this step takes the fused RoPE + KV write: q, k, v from one product with
        no norms between it and RoPE, and a step whose cache takes whole token rows."""
        return (self.fused_kernels and self._qkv is not None and x.is_cuda and self.qk_norm == "none"
                and not self.v_norm and self.clip_qkv is None and step.writes_rows_in_place(self.num_kv_heads, self.head_dim, x.dtype))


def causal_attention(q, k, v, start_pos: int, window: int | None = None,
                     scale: float | None = None) -> torch.Tensor:
    """q [B, N, T, D] attends to k, v [B, G, S, D] where query t sits at start_pos + t.
    With a window W, query p sees only keys p - W + 1 .. p. scale: of q.k (None: 1/sqrt(D))."""
    T, S = q.shape[2], k.shape[2]
    if window is not None and start_pos + T > window:  # some query has keys outside its window
        query_pos = torch.arange(start_pos, start_pos + T, device=q.device)[:, None]
        key_pos = torch.arange(S, device=q.device)[None, :]
        mask = (key_pos <= query_pos) & (key_pos > query_pos - window)  # [T, S]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=scale)
    if start_pos == 0 and T == S:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scale)
    if T == 1:  # one new token sees the whole cache
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=scale)
    query_pos = torch.arange(start_pos, start_pos + T, device=q.device)[:, None]
    mask = torch.arange(S, device=q.device)[None, :] <= query_pos  # [T, S]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=scale)


class GatedMLP(nn.Module):
    """Gated dense MLP: Qwen1.5-MoE's always-on shared expert (SiLU), Gemma-4's dense MLP
    beside the experts (GELU-tanh)."""

    def __init__(self, hidden: int, intermediate: int, activation: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated(self.gate_proj(x), self.up_proj(x), self.activation))
