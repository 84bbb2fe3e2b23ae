"""RoPE parameters of the single-RoPE families (Mixtral, Qwen1.5-MoE, Qwen3-MoE, OLMoE).

As transformers 5.24 reads them (`PreTrainedConfig.convert_rope_params_to_dict` and
`modeling_rope_utils`): a legacy top-level `rope_scaling` takes precedence over
`rope_parameters`; `rope_theta` falls back to the top-level key, then the family's default;
"llama3" and "yarn" take `original_max_position_embeddings` from the top level, else from
the parameters, else `max_position_embeddings`.

Implemented types, each a fixed set of inverse frequencies (model/rope.py computes them):
"default", "linear" (frequencies / factor), "llama3" (band-wise interpolation) and "yarn"
(ramped interpolation plus a cos/sin scale, `attention_factor`). Refused, naming the type:
"dynamic" and "longrope", whose frequencies follow the running sequence length (keys already
cached keep the frequencies they were rotated with, so their result depends on how a
sequence was batched and chunked), and any other type. A parameter a type does not read is
refused too, as is `partial_rotary_factor` (transformers either ignores it or fails on it
in these families).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedweight.common.errors import CheckpointError, UnsupportedModelError

# rope_type -> the parameters it reads (besides rope_type / rope_theta)
_PARAMETERS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate"),
}
ROPE_TYPES = tuple(_PARAMETERS)


@dataclass(frozen=True, order=True)
class RopeScaling:
    """How the inverse frequencies of the default RoPE are rescaled (hashable: it keys the
    model's shared cos/sin tables)."""

    rope_type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    # llama3: wavelengths beyond original / low_freq_factor are divided by factor, below
    # original / high_freq_factor kept, in between interpolated
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    # yarn: the ramp between interpolated and extrapolated dimensions, and the scale of cos/sin
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


def parse_rope(f, default_theta: float) -> tuple[float, RopeScaling]:
    """(rope_theta, scaling) of a single-RoPE config (f: model_config._Fields)."""
    raw, source = f.raw, f.source
    legacy = raw.get("rope_scaling")
    params = legacy or raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"{source}: rope_parameters must be an object")
    name = "rope_scaling" if legacy else "rope_parameters"
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _PARAMETERS:
        why = (" (its frequencies follow the running sequence length)" if rope_type in ("dynamic", "longrope")
               else "")
        raise UnsupportedModelError(f"{source}: {name} rope_type {repr(rope_type)[:40]} is not supported{why}; "
                                    f"PagedWeight runs {', '.join(ROPE_TYPES)}")
    known = {"rope_type", "type", "rope_theta", *_PARAMETERS[rope_type]}
    unknown = sorted(set(params) - known)
    if unknown:
        raise UnsupportedModelError(f"{source}: {name} field {unknown[0]!r} is not supported with rope_type "
                                    f"{rope_type!r}")
    fields = type(f)(params, f"{source} {name}")
    if "rope_theta" in params:
        theta = fields.float("rope_theta", 0.0, 1e12)
    else:
        theta = f.float("rope_theta", 0.0, 1e12, default=default_theta)
    if rope_type == "default":
        return theta, RopeScaling()
    factor = fields.float("factor", 0.0, 1e6, default=None)
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor=_required(factor, "factor", fields))
    max_positions = f.int("max_position_embeddings", 1, 1 << 24, default=4096)
    original = f.int("original_max_position_embeddings", 1, 1 << 24, default=None) or \
        fields.int("original_max_position_embeddings", 1, 1 << 24, default=max_positions)
    if rope_type == "llama3":
        low = fields.float("low_freq_factor", 0.0, 1e6)
        high = fields.float("high_freq_factor", 0.0, 1e6)
        if low == high:
            raise CheckpointError(f"{fields.source}: low_freq_factor and high_freq_factor must differ")
        return theta, RopeScaling("llama3", factor=_required(factor, "factor", fields), low_freq_factor=low,
                                  high_freq_factor=high, original_max_position_embeddings=original)
    return theta, _yarn(fields, factor, original, max_positions)


def _yarn(fields, factor: float | None, original: int, max_positions: int) -> RopeScaling:
    """transformers' `_compute_yarn_parameters`, up to the frequencies themselves."""
    if factor is None:  # the ratio of the context lengths (DeepSeek-V3's convention)
        factor = max_positions / original
    attention_factor = fields.float("attention_factor", 0.0, 1e6, default=None)
    if attention_factor is None:
        mscale = fields.float("mscale", -1e6, 1e6, default=None)
        mscale_all_dim = fields.float("mscale_all_dim", -1e6, 1e6, default=None)
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    # `or`: transformers reads a null or zero beta as its default
    beta_fast = fields.float("beta_fast", 0.0, 1e6, default=None) or 32.0
    beta_slow = fields.float("beta_slow", 0.0, 1e6, default=None) or 1.0
    truncate = fields.bool("truncate", True)
    return RopeScaling("yarn", factor=factor, original_max_position_embeddings=original, beta_fast=beta_fast,
                       beta_slow=beta_slow, truncate=truncate, attention_factor=float(attention_factor))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _required(value, key: str, fields):
    if value is None:
        raise CheckpointError(f"{fields.source}: missing key {key!r}")
    return value
