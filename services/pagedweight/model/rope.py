"""RoPE inverse frequencies, default and rescaled (format/rope_config.py parses the types).

Each type follows transformers 5.24's `modeling_rope_utils` operation for operation, in
fp32 on the CPU, so the frequencies (and the logits) match it bit for bit, not merely
to within rounding.
"""

from __future__ import annotations

import math

import torch

from pagedweight.format.rope_config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, pairs: int, scaling: RopeScaling) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2], cos/sin scale). `pairs` below head_dim // 2 (Gemma-4's
    proportional RoPE) leaves the remaining frequencies 0: those dimensions pass through."""
    exponent = torch.arange(0, 2 * pairs, 2, dtype=torch.int64, device="cpu").float() / head_dim
    if scaling.rope_type == "yarn":
        return _yarn(head_dim, theta, scaling), scaling.attention_factor
    inv_freq = 1.0 / (theta**exponent)
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    return torch.cat([inv_freq, torch.zeros(head_dim // 2 - pairs, device="cpu")]), 1.0


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Long wavelengths divided by factor, short ones kept, the band between interpolated."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(dim: int, base: float, s: RopeScaling) -> torch.Tensor:
    """Interpolated (/ factor) frequencies for the dimensions that rotate less than beta_slow
    times over the original context, extrapolated (kept) ones above beta_fast, a linear ramp
    between."""
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
