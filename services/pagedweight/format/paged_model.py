"""The paged model directory: what `pagedweight quantize` writes and the worker loads.

Layout (docs/paged_model.md):
    paged_model.json          metadata: format version, architecture, block list with
                              shapes and bytes per bit-width (LUTs included), calibration
                              summary, routing statistics, sensitivity tables, residual
                              heads' description, size and sha256 of every file below
    config.json, tokenizer.json, tokenizer_config.json   copied from the source checkpoint
    dense.safetensors         every non-routed-expert parameter (our parameter names), bf16;
                              shared experts stay here, unquantised
    experts_apl.safetensors   per layer l and module m (gate_up | down), all experts stacked:
                                layers.{l}.{m}.planes    uint8 [E, 8, rows, cols/8]
                                layers.{l}.{m}.lut{b}    fp16  [E, rows, 8 | 17], b = 3, 4 (the stored LUTs)
                              expert e's slice is exactly one APL block (apl_format.py)
    experts_bf16.safetensors  only with `quantize --keep-bf16`: the original routed experts,
                              layers.{l}.{m} bf16 [E, rows, cols] (the "no bits given"
                              reference); by default the reference is read from the source
                              checkpoint (`source.path`, model/source_experts.py), so the
                              artifact holds no second copy of the experts (format version 2)
    residual_heads.safetensors  prompt-residual ridge heads (residual_heads.py)
    hessians.safetensors      the calibration's smoothed input-Hessian diagonals h,
                              layers.{l}.{m} fp32 [E, cols] (S_i(b) = h . err_i(b)), and
                              the output Fisher diagonals G, layers.{l}.{m}.grad_sq [E, rows]

Loading checks the format name and version, the metadata against its own model_config
(paged_model_checks.py), every file's size (truncation) and sha256 (corruption) -- every
file it reads must be listed, under a name that stays inside the directory -- and every
tensor's shape, dtype and finiteness against the block list, with no tensor left over;
any failure is one `CheckpointError` line.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from pagedweight.common.errors import CheckpointError
from pagedweight.common.file_digest import file_sha256
from pagedweight.common.json_files import read_json_object
from pagedweight.common.safe_paths import model_file
from pagedweight.format.model_config import ModelConfig
from pagedweight.format.apl_format import BIT_WIDTHS, LUT_WIDTHS, MODULES, APLBlock, BlockId, block_bytes, lut_entries, lut_width
from pagedweight.format.paged_meta import (  # noqa: F401 - re-exported
    APL_FILE, APL_FORMAT_VERSION, BF16_FILE, COPIED_FILES, DENSE_FILE, FORMAT_NAME, FORMAT_VERSION,
    HEADS_FILE, HESSIAN_FILE, KNOWN_FILES, META_FILE, is_paged_model_dir, read_meta, write_meta,
)
from pagedweight.format.paged_model_checks import check_block_list, check_files_section
from pagedweight.format.safetensors_writer import SafetensorsWriter


def block_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(rows, cols) of an expert block: gate_up [2I, H], down [H, I]."""
    H, I = config.hidden_size, config.expert_intermediate_size
    return (2 * I, H) if module == "gate_up" else (H, I)


def all_block_ids(config: ModelConfig) -> list[BlockId]:
    """Every routed-expert block, in (layer, expert, module) order."""
    return [BlockId(l, e, m) for l in range(config.num_layers)
            for e in range(config.num_experts) for m in MODULES]


@dataclass
class LayerPlanes:
    """All experts of one (layer, module): the APL tensors as stored."""

    planes: torch.Tensor  # uint8 [E, 8, rows, cols/8]
    luts: dict[int, torch.Tensor]  # stored LUT width (3, 4) -> fp16 [E, rows, lut_entries(width)]

    def lut(self, bits: int) -> torch.Tensor:
        """The stored LUTs [E, rows, lut_entries(bits)] blocks at `bits` read."""
        return self.luts[lut_width(bits)]

    def block(self, expert: int) -> APLBlock:
        _, _, rows, packed = self.planes.shape
        return APLBlock(rows, packed * 8, self.planes[expert], {b: l[expert] for b, l in self.luts.items()})


@dataclass
class PagedModel:
    """A loaded paged model. Tensors live on the CPU (the pinned-RAM copy of every plane)."""

    path: Path | None
    config: ModelConfig
    meta: dict  # the parsed paged_model.json
    dense_state: dict[str, torch.Tensor]  # parameter name -> bf16 tensor
    apl: dict[tuple[int, str], LayerPlanes]  # (layer, module) -> planes and LUTs
    bf16_experts: dict[tuple[int, str], torch.Tensor] | None  # (layer, module) -> [E, rows, cols]
    residual_heads: dict[str, torch.Tensor] = field(default_factory=dict)  # see residual_heads.py
    # (layer, module) -> h [E, cols]; (layer, module + ".grad_sq") -> G [E, rows] when recorded
    hessians: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)

    @property
    def block_ids(self) -> list[BlockId]:
        return all_block_ids(self.config)

    def block(self, block_id: BlockId) -> APLBlock:
        return self.apl[(block_id.layer, block_id.module)].block(block_id.expert)

    def block_bytes(self, block_id: BlockId, bits: int) -> int:
        rows, cols = block_shape(self.config, block_id.module)
        return block_bytes(rows, cols, bits)

    @property
    def sensitivity(self) -> dict[BlockId, dict[int, float]]:
        """# block_id -> bits -> S_i(b) (Hessian-weighted squared error, sensitivity.py)."""
        return {BlockId.parse(k): {int(b): s for b, s in row.items()}
                for k, row in self.meta["sensitivity"].items()}

    @property
    def sensitivity_gn(self) -> dict[BlockId, dict[int, float]] | None:
        """# block_id -> bits -> S_gn_i(b) = sum G[r] h[c] (w - Q_b)^2, an estimate of the
        loss increase (calibrate.py); None for artifacts calibrated without gradients."""
        table = self.meta.get("sensitivity_gn")
        if table is None:
            return None
        return {BlockId.parse(k): {int(b): s for b, s in row.items()} for k, row in table.items()}

    @property
    def routing(self) -> dict:
        """Routing statistics of the calibration run (calibrate.routing_summary)."""
        return self.meta["routing"]


# ---------------------------------------------------------------- saving

def block_table(config: ModelConfig) -> list[dict]:
    rows_of = {m: block_shape(config, m) for m in MODULES}
    return [{
        "key": b.key(), "layer": b.layer, "expert": b.expert, "module": b.module,
        "rows": rows_of[b.module][0], "cols": rows_of[b.module][1],
        "bytes": {str(bits): block_bytes(*rows_of[b.module], bits) for bits in BIT_WIDTHS},
        "bf16_bytes": rows_of[b.module][0] * rows_of[b.module][1] * 2,
    } for b in all_block_ids(config)]


def save_paged_model(out_dir: str | Path, source_dir: str | Path, config: ModelConfig,
                     dense_state: dict[str, torch.Tensor],
                     apl: Mapping[tuple[int, str], LayerPlanes] | Iterable[tuple[tuple[int, str], LayerPlanes]],
                     bf16_experts: dict[tuple[int, str], torch.Tensor] | None,
                     extra_meta: dict, residual_heads: dict[str, torch.Tensor] | None = None,
                     hessians: dict[tuple[int, str], torch.Tensor] | None = None) -> Path:
    """Write the directory; `extra_meta` adds calibration, routing, sensitivity, ... sections.
    `apl`: every (layer, module)'s planes, as a dict or as (key, planes) pairs that may be
    produced one at a time (the streaming quantiser reads them layer by layer from its work
    directory): each is written to experts_apl.safetensors as it comes and can be dropped."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # model_file: a symlink out of the source directory is refused, never copied into `out`
    copied = {name: path for name in COPIED_FILES if (path := model_file(source_dir, name)) is not None}
    for name, path in copied.items():
        shutil.copyfile(path, out / name)
    write_apl_file(out / APL_FILE, config, apl.items() if isinstance(apl, Mapping) else apl)
    tensors = {DENSE_FILE: {k: v.to(torch.bfloat16).contiguous() for k, v in dense_state.items()}}
    if bf16_experts is not None:
        tensors[BF16_FILE] = {f"layers.{l}.{m}": t.to(torch.bfloat16).contiguous() for (l, m), t in bf16_experts.items()}
    if residual_heads:
        tensors[HEADS_FILE] = {k: v.contiguous() for k, v in residual_heads.items()}
    if hessians:
        tensors[HESSIAN_FILE] = {f"layers.{l}.{m}": h.float().contiguous() for (l, m), h in hessians.items()}
    for name, named in tensors.items():
        save_file(named, str(out / name))
    raw_config = json.loads((Path(source_dir) / "config.json").read_text())
    meta = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "apl_format_version": APL_FORMAT_VERSION,
        "architecture": config.architecture,
        "model_config": raw_config,
        "source": {"path": str(Path(source_dir).resolve()),
                   "bf16_experts": "stored" if bf16_experts is not None else "source checkpoint"},
        "num_layers": config.num_layers,
        "num_experts": config.num_experts,
        "bit_widths": list(BIT_WIDTHS),
        "blocks": block_table(config),
        **extra_meta,
        "files": {name: _file_record(out / name) for name in [APL_FILE, *tensors, *copied]},
    }
    write_meta(out, meta)
    return out


def write_apl_file(path: Path, config: ModelConfig, apl: Iterable[tuple[tuple[int, str], LayerPlanes]]) -> None:
    """experts_apl.safetensors, one (layer, module) at a time: the layout follows from the
    config, so no more than one layer's planes need be in memory; every one must come."""
    E = config.num_experts
    specs = {}
    for layer in range(config.num_layers):
        for module in MODULES:
            rows, cols = block_shape(config, module)
            specs[f"layers.{layer}.{module}.planes"] = (torch.uint8, (E, 8, rows, cols // 8))
            specs.update({f"layers.{layer}.{module}.lut{b}": (torch.float16, (E, rows, lut_entries(b))) for b in LUT_WIDTHS})
    with SafetensorsWriter(path, specs) as writer:
        for (layer, module), lp in apl:
            writer.write(f"layers.{layer}.{module}.planes", lp.planes)
            for bits, lut in lp.luts.items():
                writer.write(f"layers.{layer}.{module}.lut{bits}", lut.to(torch.float16))


def _file_record(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


# ---------------------------------------------------------------- loading

def load_paged_model(path: str | Path, with_bf16: bool = True, verify: bool = True) -> PagedModel:
    """Load and check a paged model directory (CPU tensors).

    `with_bf16=False` skips the original experts (the serving path never reads them); with
    True they are read from the directory if it stores them, else left None for
    `model.source_experts.attach_source_experts` to read from the source checkpoint;
    `verify=False` skips the sha256 checks (sizes and shapes are always checked).
    """
    path = Path(path)
    meta = read_meta(path)
    config = ModelConfig.from_dict(meta["model_config"], source=str(path / META_FILE))
    check_meta_against_config(path, meta, config, with_bf16)
    for name, record in meta["files"].items():
        check_file(path / name, record, verify)
    # every file read below is listed in meta["files"], so its size (and hash) was just checked
    dense = _check_floats(_load(path / DENSE_FILE), path / DENSE_FILE)
    apl = _parse_apl(path, _load(path / APL_FILE), config)
    stored = BF16_FILE in meta["files"]
    bf16 = _parse_bf16(path, _load(path / BF16_FILE), config) if with_bf16 and stored else None
    heads = _check_floats(_load(path / HEADS_FILE), path / HEADS_FILE) if HEADS_FILE in meta["files"] else {}
    hessians = _parse_hessians(path, _load(path / HESSIAN_FILE), config) if HESSIAN_FILE in meta["files"] else {}
    return PagedModel(path, config, meta, dense, apl, bf16, heads, hessians)


def check_dense_state(paged: PagedModel, expected: dict[str, tuple[int, ...]]) -> None:
    """dense.safetensors holds exactly the parameters `expected` (name -> shape) names:
    a tensor left over means the file belongs to a different model than model_config."""
    file = (paged.path or Path(".")) / DENSE_FILE
    for name in sorted(set(paged.dense_state) - set(expected)):
        raise CheckpointError(f"{file}: tensor {name[:80]!r} is not a parameter of the model "
                              f"model_config describes")
    for name, shape in expected.items():
        tensor = paged.dense_state.get(name)
        if tensor is None or tuple(tensor.shape) != tuple(shape):
            found = "missing" if tensor is None else f"{tuple(tensor.shape)}"
            raise CheckpointError(f"{file}: tensor {name!r} is {found}, expected {tuple(shape)}")


def check_meta_against_config(path: Path, meta: dict, config: ModelConfig, with_bf16: bool) -> None:
    """The metadata describes this model_config's blocks and lists every file to be read."""
    # version 1 always stored the bf16 experts; from version 2 they are optional (the
    # reference is then read from the source checkpoint, model/source_experts.py)
    stores_bf16 = with_bf16 and meta.get("format_version") == 1
    required = (DENSE_FILE, APL_FILE, BF16_FILE) if stores_bf16 else (DENSE_FILE, APL_FILE)
    check_files_section(path, meta["files"], KNOWN_FILES, required)
    check_block_list(meta, config, block_table(config), path / META_FILE)


def check_file(file: Path, record: dict, verify: bool = True) -> None:
    """One file of the directory against its paged_model.json record: present, a plain
    file, its size, and (verify) its sha256; CheckpointError otherwise."""
    if file.is_symlink() or not file.is_file():
        raise CheckpointError(f"{file}: file of the paged model is missing")
    size = file.stat().st_size
    if size != record["bytes"]:
        raise CheckpointError(f"{file}: truncated or altered: {size} bytes, metadata says {record['bytes']}")
    if verify and file_sha256(file) != record["sha256"]:
        raise CheckpointError(f"{file}: corrupt: sha256 does not match the metadata")


def _load(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, RuntimeError) as err:
        raise CheckpointError(f"{file}: unreadable safetensors file ({err})") from None


def _check_floats(named: dict[str, torch.Tensor], file: Path) -> dict[str, torch.Tensor]:
    """Floating point and finite: a NaN weight would make every output NaN."""
    for key, tensor in named.items():
        if not tensor.dtype.is_floating_point:
            raise CheckpointError(f"{file}: tensor {key[:80]!r} is {tensor.dtype}, expected floating point")
        if not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{file}: tensor {key[:80]!r} holds NaN or infinite values")
    return named


def _check_no_extra(named: dict, expected: set[str], file: Path) -> None:
    extra = sorted(set(named) - expected)
    if extra:
        raise CheckpointError(f"{file}: {len(extra)} tensors the model_config does not account for "
                              f"(first: {extra[0][:80]!r})")


def _get(named: dict, key: str, shape: tuple, dtype: torch.dtype, file: Path) -> torch.Tensor:
    tensor = named.get(key)
    if tensor is None:
        raise CheckpointError(f"{file}: tensor {key!r} is missing")
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
        raise CheckpointError(f"{file}: tensor {key!r} is {tensor.dtype} {tuple(tensor.shape)}, "
                              f"expected {dtype} {tuple(shape)}")
    return tensor


def _parse_apl(path: Path, named: dict, config: ModelConfig) -> dict[tuple[int, str], LayerPlanes]:
    file, E = path / APL_FILE, config.num_experts
    apl = {}
    for layer in range(config.num_layers):
        for module in MODULES:
            rows, cols = block_shape(config, module)
            prefix = f"layers.{layer}.{module}"
            planes = _get(named, f"{prefix}.planes", (E, 8, rows, cols // 8), torch.uint8, file)
            luts = {b: _get(named, f"{prefix}.lut{b}", (E, rows, lut_entries(b)), torch.float16, file)
                    for b in LUT_WIDTHS}
            apl[(layer, module)] = LayerPlanes(planes, luts)
    _check_no_extra(named, {f"layers.{l}.{m}.{t}" for l in range(config.num_layers) for m in MODULES
                            for t in ("planes", *(f"lut{b}" for b in LUT_WIDTHS))}, file)
    _check_floats({k: v for k, v in named.items() if ".lut" in k}, file)
    return apl


def _parse_bf16(path: Path, named: dict, config: ModelConfig) -> dict[tuple[int, str], torch.Tensor]:
    file, E = path / BF16_FILE, config.num_experts
    _check_no_extra(named, {f"layers.{l}.{m}" for l in range(config.num_layers) for m in MODULES}, file)
    _check_floats(named, file)
    return {(l, m): _get(named, f"layers.{l}.{m}", (E, *block_shape(config, m)), torch.bfloat16, file)
            for l in range(config.num_layers) for m in MODULES}


def _parse_hessians(path: Path, named: dict, config: ModelConfig) -> dict[tuple[int, str], torch.Tensor]:
    file, E = path / HESSIAN_FILE, config.num_experts
    out = {(l, m): _get(named, f"layers.{l}.{m}", (E, block_shape(config, m)[1]), torch.float32, file)
           for l in range(config.num_layers) for m in MODULES}
    for l in range(config.num_layers):
        for m in MODULES:
            if f"layers.{l}.{m}.grad_sq" in named:
                out[(l, f"{m}.grad_sq")] = _get(named, f"layers.{l}.{m}.grad_sq",
                                                (E, block_shape(config, m)[0]), torch.float32, file)
    _check_no_extra(named, {f"layers.{l}.{m}{s}" for l in range(config.num_layers) for m in MODULES
                            for s in ("", ".grad_sq")}, file)
    _check_floats(named, file)
    if any(bool((t < 0).any()) for t in named.values()):
        raise CheckpointError(f"{file}: Hessian diagonals must be >= 0")
    return out
