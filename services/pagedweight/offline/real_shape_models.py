"""Real-shape models without a checkpoint: transformers' own class at a published shape,
randomly initialised, and ours assembled over the same tensors; the benchmarks (bench/real_shape.py,
bench/budget_sweep.py) and the parity tests build on these.

The routed experts get a fast nested-uniform quantisation (`nested_uniform_planes`: per-row
min-max 8-bit codes, b-bit LUTs at the b-bit bucket centres; no calibration, so the format and
byte counts are real but quality is not measured) into an in-memory `PagedModel`.
`transformers` is imported only when a model is built (it is a test/bench dependency).

A model whose bf16 weights do not fit the device (Mixtral-8x7B's 93 GB on an 80 GB card) is
never built whole: `paged_by_layer` draws one layer's tensors at a time on the device,
quantises its experts, keeps its dense weights on the host and frees it. For that to give
the model `build_hf_model(..., seed=)` builds whole, every tensor is drawn from a generator
seeded by its own name (`fill_seeded_`), not from one stream in construction order: same
seed and device -> the same tensors, whichever way they are built.
"""

from __future__ import annotations

import time
import zlib

import torch

from pagedweight.format.apl_format import BIT_WIDTHS, LUT_WIDTHS, lut_entries, pack_planes
from pagedweight.format.model_config import ModelConfig
from pagedweight.format.paged_model import LayerPlanes, PagedModel, block_table
from pagedweight.model.loader import checkpoint_key
from pagedweight.offline.host_memory import anonymous_bytes
from pagedweight.model.transformer import MoECausalLM
from pagedweight.offline.real_shape_configs import REAL_SHAPE_CONFIGS
from pagedweight.weights.synthetic import nested_uniform_rows

GiB = 1 << 30

# transformers config kwargs of the real models (public config.json values); "tiny-*"
# keep the architecture at a size the CPU runs in seconds, to check the script.
CONFIGS = {
    "qwen1.5-moe-a2.7b": dict(
        model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], vocab_size=151936,
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=16, num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, norm_topk_prob=False, max_position_embeddings=8192,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "mixtral-8x7b": dict(
        model_type="mixtral", architectures=["MixtralForCausalLM"], vocab_size=32000,
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # Qwen1.5-MoE's ratio at a CPU's size: a down plane holds 2.75 KV tiles (fp32), as the
    # real one does in bf16 (the profile's scaled-down shape; 16 experts of 352, top-4)
    "qwen-scaled": dict(
        model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], vocab_size=4096,
        hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
        num_key_value_heads=1, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=352,
        shared_expert_intermediate_size=1408, norm_topk_prob=False, max_position_embeddings=8192,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    # Qwen1.5-MoE's width and experts, 1 layer, small vocab: its planes and KV tiles on a CPU
    "qwen-width": dict(
        model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], vocab_size=2048,
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=1, num_attention_heads=16,
        num_key_value_heads=16, num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, norm_topk_prob=False, max_position_embeddings=8192,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "tiny-qwen-moe": dict(
        model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], vocab_size=512,
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96,
        shared_expert_intermediate_size=128, norm_topk_prob=False, max_position_embeddings=8192,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
}
# More families, at the shapes tests/offline/test_real_shape_configs.py checks against the published
# parameter counts, and tiny versions to check the script on the CPU.
CONFIGS.update({
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", **REAL_SHAPE_CONFIGS["Qwen3-30B-A3B"]),
    "olmoe-1b-7b": dict(model_type="olmoe", **REAL_SHAPE_CONFIGS["OLMoE-1B-7B"]),
    "tiny-qwen3-moe": dict(model_type="qwen3_moe", **{**REAL_SHAPE_CONFIGS["Qwen3-30B-A3B"], **dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96, intermediate_size=128,
        eos_token_id=2)}),
    "tiny-olmoe": dict(model_type="olmoe", **{**REAL_SHAPE_CONFIGS["OLMoE-1B-7B"], **dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        num_experts=16, num_experts_per_tok=4, intermediate_size=96, eos_token_id=2)}),
    "tiny-mixtral": {**CONFIGS["mixtral-8x7b"], **dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4)},
    "gemma-4-26b-a4b": dict(REAL_SHAPE_CONFIGS["Gemma-4-26B-A4B"]),
    # sliding and full layers of different shapes (k=v on the full ones), as in the real one
    "tiny-gemma4": {**REAL_SHAPE_CONFIGS["Gemma-4-26B-A4B"], **dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, num_global_key_value_heads=1, global_head_dim=64, num_experts=16, top_k_experts=4,
        moe_intermediate_size=96, intermediate_size=128, sliding_window=16,
        layer_types=["sliding_attention"] * 5 + ["full_attention"], eos_token_id=2)},
})


def hf_config_of(name: str, overrides: dict | None = None):
    """(transformers config, its dict as our ModelConfig reads it) of a CONFIGS entry."""
    from transformers import AutoConfig

    kwargs = {**CONFIGS[name], **(overrides or {})}
    model_type = kwargs.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **kwargs)
    raw = hf_config.to_dict()
    raw["architectures"] = kwargs["architectures"]
    return hf_config, raw


def _hf_from_config(hf_config, device: torch.device | str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_config)
    finally:
        torch.set_default_dtype(previous)
    return model


def build_hf_model(name: str, device: torch.device, dtype: torch.dtype, overrides: dict | None = None,
                   seed: int | None = None):
    """transformers' own class, random init, built directly on the device in `dtype`;
    `overrides`: config fields to change (e.g. fewer layers, to fit a disk or a time limit);
    `seed`: every parameter redrawn by `fill_seeded_` (what `paged_by_layer` builds), None:
    transformers' own init."""
    hf_config, raw = hf_config_of(name, overrides)
    # No `.to(dtype)`: the parameters are built in dtype already, and the cast would also
    # round the fp32 RoPE frequencies transformers keeps (from_pretrained(dtype=) leaves
    # them fp32), moving every cos/sin by a few bf16 steps from what transformers computes.
    model = _hf_from_config(hf_config, device, dtype).eval()
    if seed is not None:
        std = getattr(hf_config, "initializer_range", 0.02)
        with torch.no_grad():
            for key, param in model.named_parameters():
                fill_seeded_(param, key, seed, std)
    return model, raw


def fill_seeded_(t: torch.Tensor, key: str, seed: int, std: float = 0.02) -> torch.Tensor:
    """t drawn in place as transformers initialises a tensor of its kind, from a generator on
    t's device seeded by (seed, key): 1-D biases 0, other 1-D tensors (norms, scales) 1,
    matrices normal(0, std) in t's dtype."""
    if t.dim() <= 1:
        return t.fill_(0.0 if key.endswith("bias") else 1.0)
    generator = torch.Generator(device=t.device).manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    return t.normal_(0.0, std, generator=generator)


def paged_by_layer(name: str, device: torch.device, dtype: torch.dtype, seed: int,
                   overrides: dict | None = None, log=print) -> tuple[PagedModel, dict]:
    """The `paged_in_memory` artifact of `build_hf_model(name, ..., seed=seed)` without the
    whole model on the device: transformers' model is built on the meta device for its
    tensor names and shapes only; per layer, its tensors are drawn on `device`, the routed
    experts quantised (`nested_uniform_planes`), the rest moved to the host, and the layer
    freed. -> (artifact, stats: seconds, per-layer seconds, peak device and host bytes)."""
    hf_config, raw = hf_config_of(name, overrides)
    config = ModelConfig.from_dict(raw)
    std = getattr(hf_config, "initializer_range", 0.02)
    hf_meta = _hf_from_config(hf_config, "meta", dtype)
    # every tensor our model reads, by transformers' name (parameters, and persistent buffers
    # such as Gemma-4's layer_scalar, drawn by the same rule as the whole model's init)
    shapes = {k: tuple(v.shape) for k, v in hf_meta.state_dict().items()}
    del hf_meta
    with torch.device("meta"):
        ours = MoECausalLM(config)
    dense_names = [n for n in ours.state_dict() if ".experts." not in n]
    del ours

    def draw(keys) -> dict[str, torch.Tensor]:
        return {k: fill_seeded_(torch.empty(shapes[k], dtype=dtype, device=device), k, seed, std) for k in keys}

    def layer_of(key: str) -> int | None:
        parts = key.split(".")
        return int(parts[parts.index("layers") + 1]) if "layers" in parts else None

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start, host_peak, per_layer = time.perf_counter(), anonymous_bytes() or 0, []
    dense, apl = {}, {}
    top = draw([k for k in shapes if layer_of(k) is None])
    for n in dense_names:
        if not n.startswith("layers."):
            dense[n] = _hf_tensor(top, checkpoint_key(config, n)).to("cpu", torch.bfloat16)
    del top
    L = config.num_layers
    for layer in range(L):
        t0 = time.perf_counter()
        state = draw([k for k in shapes if layer_of(k) == layer])
        gate_up, down = _hf_experts(state, config, layer)
        apl[(layer, "gate_up")] = nested_uniform_planes(gate_up)
        apl[(layer, "down")] = nested_uniform_planes(down)
        prefix = f"layers.{layer}."
        for n in dense_names:
            if n.startswith(prefix):
                dense[n] = _hf_tensor(state, checkpoint_key(config, n)).to("cpu", torch.bfloat16)
        del state, gate_up, down
        per_layer.append(time.perf_counter() - t0)
        host_peak = max(host_peak, anonymous_bytes() or 0)
        done = time.perf_counter() - start
        log(f"quantise by layer: {layer + 1}/{L} layers, {done:.1f} s, about {done / (layer + 1) * L:.0f} s "
            f"for all, host {host_peak / GiB:.1f} GiB")
    stats = {"seconds": round(time.perf_counter() - start, 1),
             "seconds_per_layer": round(sum(per_layer) / max(1, L), 2),
             "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
             "peak_host_anon_bytes": host_peak}
    dense = {n: dense[n] for n in dense_names}  # the model's own order, as paged_in_memory keeps it
    return paged_artifact(config, raw, dense, apl), stats


def _hf_tensor(state: dict, key: str) -> torch.Tensor:
    """A checkpoint key in transformers' in-memory naming (v5 renamed Mixtral's
    `block_sparse_moe` to `mlp`)."""
    for candidate in (key, key.replace(".block_sparse_moe.", ".mlp.")):
        if candidate in state:
            return state[candidate]
    raise KeyError(f"transformers model has no tensor {key!r}")


def _hf_experts(state: dict, config: ModelConfig, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2I, H], down [E, H, I]) of one layer: transformers v5 keeps them fused in
    this layout (gate rows first, as ours); older versions per expert (stacked here)."""
    from pagedweight.model.loader import fused_expert_keys

    E, H, I = config.num_experts, config.hidden_size, config.expert_intermediate_size
    # Gemma-4 keeps its experts in the layer itself (the loader's key), the others under mlp
    # (Mixtral: block_sparse_moe before transformers 5)
    prefixes = {fused_expert_keys(config, layer)["gate_up"][: -len("gate_up_proj")]} | {
        f"model.layers.{layer}.{moe}.experts." for moe in ("mlp", "block_sparse_moe")}
    for prefix in sorted(prefixes):
        gate_up = state.get(prefix + "gate_up_proj")
        if gate_up is not None:
            down = state[prefix + "down_proj"]
            if tuple(gate_up.shape) != (E, 2 * I, H):  # stored input-major: transpose to ours
                gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
            assert tuple(gate_up.shape) == (E, 2 * I, H) and tuple(down.shape) == (E, H, I)
            return gate_up.contiguous(), down.contiguous()
    from pagedweight.model.loader import expert_keys

    keys = [expert_keys(config, layer, e) for e in range(E)]
    gate_up = torch.stack([torch.cat([_hf_tensor(state, k["gate"]), _hf_tensor(state, k["up"])]) for k in keys])
    down = torch.stack([_hf_tensor(state, k["down"]) for k in keys])
    return gate_up, down


def ours_from_hf(hf_model, config: ModelConfig) -> MoECausalLM:
    """Our model over transformers' tensors (assigned, not copied: no second 28 GB)."""
    state = dict(hf_model.state_dict())
    with torch.device("meta"):
        model = MoECausalLM(config)
    ours = {}
    for name, _ in model.named_parameters():
        if name.endswith("experts.gate_up") or name.endswith("experts.down"):
            continue
        ours[name] = _hf_tensor(state, checkpoint_key(config, name))
    for layer in range(config.num_layers):
        ours[f"layers.{layer}.moe.experts.gate_up"], ours[f"layers.{layer}.moe.experts.down"] = \
            _hf_experts(state, config, layer)
    model.load_state_dict(ours, assign=True, strict=True)
    for name, buf in list(model.named_buffers()):  # rotary tables etc. were built on meta
        if buf.is_meta:
            raise RuntimeError(f"buffer {name} left on the meta device")
    return model.eval()


def nested_uniform_planes(w: torch.Tensor, group: int | None = None) -> LayerPlanes:
    """w [E, R, C] (one module of every expert of a layer) -> planes and LUTs, CPU.

    Per row: 8-bit codes on 256 equal buckets of min..max (the b-bit code is the top b bits,
    so nesting holds), LUT_3 / LUT_4 = the centres of the buckets (format 2 derives the rest):
    `weights.synthetic.nested_uniform_rows`, stacked. No calibration: for speed and byte
    counts, not quality. Runs on w's device, `group` experts at a time.
    """
    E, R, C = w.shape
    if group is None:  # about 40 bytes of temporaries per weight (fp32 copy, int32 bit planes)
        group = max(1, min(8, (4 * GiB) // (R * C * 40)))
    planes = torch.empty(E, 8, R, C // 8, dtype=torch.uint8)
    luts = {b: torch.empty(E, R, lut_entries(b), dtype=torch.float16) for b in LUT_WIDTHS}
    for first in range(0, E, group):
        codes, tables = nested_uniform_rows(w[first:first + group])
        g = codes.shape[0]
        packed = pack_planes(codes.reshape(g * R, C)).view(8, g, R, C // 8).permute(1, 0, 2, 3)
        planes[first:first + g] = packed.cpu()
        for b in LUT_WIDTHS:
            luts[b][first:first + g] = tables[b].cpu()
    return LayerPlanes(planes, luts)


def paged_in_memory(model: MoECausalLM, config: ModelConfig, raw_config: dict) -> PagedModel:
    """The paged artifact `pagedweight quantize` would write, in memory: non-expert weights
    (bf16, CPU), nested planes and LUTs of every routed expert, the metadata the runtime
    and the planner read (block table; S_i(b) = 8-bit bytes * 4^-b, the rule the planner
    uses without a table; uniform calibration routing)."""
    apl = {}
    for layer, block in enumerate(model.moe_blocks):
        apl[(layer, "gate_up")] = nested_uniform_planes(block.experts.gate_up.detach())
        apl[(layer, "down")] = nested_uniform_planes(block.experts.down.detach())
    dense = {k: v.detach().to("cpu", torch.bfloat16) for k, v in model.state_dict().items()
             if ".experts." not in k}
    return paged_artifact(config, raw_config, dense, apl)


def paged_artifact(config: ModelConfig, raw_config: dict, dense: dict, apl: dict) -> PagedModel:
    """The in-memory PagedModel of dense weights (host bf16) and routed experts' planes."""
    blocks = block_table(config)
    sensitivity = {b["key"]: {str(w): b["bytes"]["8"] * 4.0 ** -w for w in BIT_WIDTHS} for b in blocks}
    L, E, k = config.num_layers, config.num_experts, config.num_experts_per_tok
    tokens = 1 << 16
    routing = {"num_tokens": tokens, "routing_mass": [[tokens / E] * E] * L,
               "token_counts": [[tokens * k / E] * E] * L}
    meta = {"model_config": raw_config, "num_layers": L, "num_experts": E, "blocks": blocks,
            "sensitivity": sensitivity, "routing": routing, "bit_widths": list(BIT_WIDTHS),
            "quantizer": {"name": "nested-uniform (offline/real_shape_models.py), no calibration"}}
    return PagedModel(None, config, meta, dense, apl, None)


PARITY_POSITIONS = 256


def parity(hf_model, ours: MoECausalLM, vocab: int, device: torch.device, positions: int = PARITY_POSITIONS) -> dict:
    """Our logits against transformers' over one random sequence, teacher-forced (every position
    of one forward pass): the largest |logit difference| and the reference's largest |logit|,
    and `logit_error`'s per-position relative error (worst and mean) and top-1 agreement."""
    ids = torch.randint(1, vocab, (1, positions), generator=torch.Generator().manual_seed(7)).to(device)
    with torch.inference_mode():
        ref = hf_model(ids).logits[0].float()
        got = ours(ids)[0].float()
    return {"positions": positions, "max_abs_diff": float((ref - got).abs().max()),
            "ref_abs_max": float(ref.abs().max()), **logit_error(got, ref)}


def logit_error(got: torch.Tensor, ref: torch.Tensor) -> dict:
    """Logits [..., V] against a reference of the same shape: each position's relative error
    ||got - ref|| / ||ref|| (L2 over the vocabulary, in fp32; worst and mean over positions)
    and the share of positions whose top-1 token agrees."""
    got, ref = got.float().reshape(-1, got.shape[-1]), ref.float().reshape(-1, ref.shape[-1])
    relative = (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-12)
    return {"relative_error_max": float(relative.max()), "relative_error_mean": float(relative.mean()),
            "argmax_agree": float((ref.argmax(-1) == got.argmax(-1)).float().mean())}
