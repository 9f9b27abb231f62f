"""Opening a source checkpoint: validate everything up front, then read logical weights lazily.

Three source formats, one reader:
- plain (BF16 / FP16 / FP32) tensors;
- FP8-block: `X.weight` (float8_e4m3fn) + `X.weight_scale_inv` (fp32 per 128x128 block), possibly in
  different shards; dequant is `fp8 * scale_inv` per block;
- compressed-tensors pack-quantized INT4 (Kimi K2.x): `X.weight_packed/_scale/_shape`.

Each logical weight `X.weight` is assembled from its physical parts wherever they live (the index says
where). Nothing is read until asked for, and a worker holds at most one tensor at a time.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import torch

from quantkit.arch import Adapter, get_adapter, text_config
from quantkit.checkpoint.safetensors_header import ST_TO_TORCH, HeaderEntry, ShardHeader, read_header
from quantkit.errors import QuantkitError
from quantkit.quant.int4 import dequantize_group, unpack_int4

__all__ = ["INDEX_NAME", "LogicalTensor", "PICKLE_SUFFIXES", "SourceCheckpoint", "TensorFormat", "check_config",
           "link_root", "open_source", "read_config", "read_json"]

# The one format vocabulary: how a logical tensor is stored, and (its most specific one) a whole checkpoint.
# plain: BF16 / FP16 / FP32 values; fp8_block: e4m3 + per-block scale_inv; int4_packed: compressed-tensors.
TensorFormat = Literal["plain", "fp8_block", "int4_packed"]

INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_FP8_DTYPES = {"F8_E4M3"}
_INT4_PARTS = ("weight_packed", "weight_scale", "weight_shape")
_PICKLE_REFUSED = "pickle checkpoints are refused (they are never unpickled); convert them to safetensors first"
_MAX_CONFIG_BYTES = 16 << 20  # a real config.json is a few KB
_MAX_INDEX_BYTES = 256 << 20  # DeepSeek-V3's index is ~10 MB
_MAX_DIM = 1 << 31
# Every config.json field the adapters read as a count or a size; each must be a whole number in range.
_CONFIG_INTS = (
    "num_hidden_layers", "num_nextn_predict_layers", "first_k_dense_replace", "moe_layer_freq", "hidden_size",
    "vocab_size", "n_routed_experts", "moe_intermediate_size", "n_shared_experts", "intermediate_size",
    "num_attention_heads", "head_dim", "num_key_value_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "kv_lora_rank", "q_lora_rank", "index_n_heads", "index_head_dim", "num_experts_per_tok",
)


@dataclass
class LogicalTensor:
    """One logical tensor and the physical tensors it is made of."""

    name: str
    fmt: TensorFormat
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype of the primary physical tensor
    shard: str  # file holding the primary physical tensor
    parts: dict[str, str] = field(default_factory=dict)  # physical name -> file
    nbytes: int = 0  # source bytes of all parts


class SourceCheckpoint:
    """A validated source checkpoint directory. Use `open_source` to build one."""

    def __init__(self, root: Path, config: dict[str, Any], headers: dict[str, ShardHeader]) -> None:
        self.root = root
        self.config = config
        self.headers = headers  # shard file name -> header, in shard order
        self.adapter: Adapter = get_adapter(config)
        self.logical: dict[str, LogicalTensor] = _assemble(headers)
        self.warnings: list[str] = []

    # ---- format facts ---------------------------------------------------------------------------
    @cached_property
    def quantization_config(self) -> dict[str, Any]:
        return self.config.get("quantization_config") or {}

    @cached_property
    def fp8_block_size(self) -> tuple[int, int]:
        block = self.quantization_config.get("weight_block_size") or [128, 128]
        return int(block[0]), int(block[1])

    @cached_property
    def int4_group_size(self) -> int | None:
        """Group size of a compressed-tensors INT4 source (None for other sources)."""
        if self.quantization_config.get("quant_method") != "compressed-tensors":
            return None
        for group in (self.quantization_config.get("config_groups") or {}).values():
            weights = group.get("weights") or {}
            if weights.get("num_bits") == 4 and weights.get("type") == "int":
                return int(weights.get("group_size") or 0) or None
        return None

    @cached_property
    def int4_symmetric(self) -> bool:
        groups = (self.quantization_config.get("config_groups") or {}).values()
        return all((g.get("weights") or {}).get("symmetric", True) for g in groups)

    @cached_property
    def source_format(self) -> TensorFormat:
        """The checkpoint's most specific tensor format (INT4 sources keep BF16 attention, FP8 ones too)."""
        fmts = {t.fmt for t in self.logical.values()}
        return "int4_packed" if "int4_packed" in fmts else "fp8_block" if "fp8_block" in fmts else "plain"

    @cached_property
    def model_dtype(self) -> torch.dtype:
        """The dtype unquantized weights and scales are written in (bf16 unless the config says fp16)."""
        name = str(self.config.get("torch_dtype") or self.config.get("dtype") or "bfloat16")
        return torch.float16 if "16" in name and "b" not in name else torch.bfloat16

    @property
    def shard_files(self) -> list[str]:
        return list(self.headers)

    @property
    def source_bytes(self) -> int:
        return sum(h.file_size for h in self.headers.values())

    # ---- naming -----------------------------------------------------------------------------------
    def logical_names(self) -> list[str]:
        return list(self.logical)

    # ---- reading ----------------------------------------------------------------------------------
    def read(self, name: str, dtype: torch.dtype = torch.float32, check_finite: bool = True) -> torch.Tensor:
        """The logical tensor `name`, dequantized if needed, as `dtype`.

        NaN/Inf raise a QuantkitError naming the file and tensor. Callers that compute group scales
        anyway pass `check_finite=False` and check the (much smaller) scales instead.
        """
        t = self.logical.get(name)
        if t is None:
            raise QuantkitError(f"{self.root}: no tensor named {name}")
        if t.fmt == "fp8_block":
            value = self._dequant_fp8(t)
        elif t.fmt == "int4_packed":
            value = self._dequant_int4(t)
        else:
            value = self.read_physical(name, t.shard)
        if check_finite and value.is_floating_point() and not torch.isfinite(value).all():
            raise QuantkitError(f"{self.root / t.shard}: tensor {name} contains NaN or Inf values")
        return value.to(dtype) if value.is_floating_point() else value

    def read_physical(self, name: str, shard: str) -> torch.Tensor:
        """One stored tensor exactly as on disk, read with a positioned read (no mmap).

        Plain reads keep the page cache out of the process's resident memory, so a worker's RSS is
        what it computes with, not the shards it has touched.
        """
        header = self.headers[shard]
        entry = header.tensors.get(name)
        if entry is None:
            raise QuantkitError(f"{self.root / shard}: has no tensor {name}")
        buffer = torch.empty(entry.nbytes, dtype=torch.uint8)
        try:
            with open(header.path, "rb", buffering=0) as fh:
                fh.seek(8 + header.header_len + entry.start)
                got = fh.readinto(memoryview(buffer.numpy()))
        except OSError as exc:
            raise QuantkitError(f"{self.root / shard}: cannot read tensor {name} ({exc.strerror})") from None
        if got != entry.nbytes:
            raise QuantkitError(f"{self.root / shard}: truncated while reading tensor {name}")
        return buffer.view(ST_TO_TORCH[entry.dtype]).reshape(entry.shape)

    def close(self) -> None:
        """Nothing is held open between reads (no mmap), so there is nothing to release."""

    def fp8_parts(self, t: LogicalTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored float8 weight of an FP8-block tensor and its fp32 block scales, both checked: the scale
        grid must match the weight, and every scale must be positive and finite."""
        scale_name = t.name + "_scale_inv"
        raw = self.read_physical(t.name, t.shard)
        scale = self.read_physical(scale_name, t.parts[scale_name]).to(torch.float32)
        bh, bw = self.fp8_block_size
        rows, cols = raw.shape
        if scale.shape != (-(-rows // bh), -(-cols // bw)):
            raise QuantkitError(
                f"{self.root / t.parts[scale_name]}: tensor {scale_name} has shape {list(scale.shape)}, "
                f"expected {[-(-rows // bh), -(-cols // bw)]} for blocks {bh}x{bw}"
            )
        if not (torch.isfinite(scale).all() and (scale > 0).all()):
            raise QuantkitError(f"{self.root / t.parts[scale_name]}: tensor {scale_name} holds a zero, negative, "
                                "NaN or Inf block scale")
        return raw, scale

    def _dequant_fp8(self, t: LogicalTensor) -> torch.Tensor:
        raw, scale = self.fp8_parts(t)
        bh, bw = self.fp8_block_size
        rows, cols = raw.shape
        weight = fp8_to_float32(raw)
        if rows % bh == 0 and cols % bw == 0:  # broadcast the block scale, no full-size scale matrix
            return weight.view(rows // bh, bh, cols // bw, bw).mul_(scale[:, None, :, None]).view(rows, cols)
        full = scale.repeat_interleave(bh, 0)[:rows].repeat_interleave(bw, 1)[:, :cols]
        return weight.mul_(full)

    def _dequant_int4(self, t: LogicalTensor) -> torch.Tensor:
        module = t.name.rsplit(".", 1)[0]
        packed = self.read_physical(f"{module}.weight_packed", t.parts[f"{module}.weight_packed"])
        scale = self.read_physical(f"{module}.weight_scale", t.parts[f"{module}.weight_scale"])
        group = t.shape[1] // scale.shape[1]
        return dequantize_group(unpack_int4(packed, t.shape), scale, group)


_FP8_TABLE = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).numpy()


def fp8_to_float32(raw: torch.Tensor) -> torch.Tensor:
    """e4m3fn -> fp32 through a 256-entry table: exact, and ~2.5x faster than torch's cast on CPU."""
    return torch.from_numpy(_FP8_TABLE[raw.view(torch.uint8).numpy()])


def open_source(path: str | os.PathLike[str]) -> SourceCheckpoint:
    """Open and fully validate a source directory (config, index, every shard header)."""
    root = Path(path)
    if not root.is_dir():
        raise QuantkitError(f"{root}: not a directory")
    config = read_config(root)
    files = _weight_files(root)
    headers = {f: read_header(root / f) for f in files}
    _check_index(root, files, headers)
    _check_config_size(root / "config.json", config, sum(len(h.tensors) for h in headers.values()))
    source = SourceCheckpoint(root, config, headers)
    _check_formats(source)
    _check_inventory(source)
    return source


def read_config(root: Path) -> dict[str, Any]:
    """ROOT/config.json, size-bounded and checked (`check_config`) before anything uses its values."""
    path = root / "config.json"
    config = read_json(path, _MAX_CONFIG_BYTES)
    check_config(path, config)
    return config


def read_json(path: Path, max_bytes: int = _MAX_INDEX_BYTES) -> dict[str, Any]:
    """A JSON object from `path`, refusing files larger than `max_bytes` before reading them."""
    try:
        if path.stat().st_size > max_bytes:
            raise QuantkitError(f"{path}: {path.stat().st_size} bytes, more than the {max_bytes} such a file can "
                                "plausibly need; refusing to parse it")
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise QuantkitError(f"{path}: missing") from None
    except OSError as exc:
        raise QuantkitError(f"{path}: cannot read ({exc.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise QuantkitError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise QuantkitError(f"{path}: expected a JSON object")
    return value


def link_root(root: Path) -> Path:
    """Where the files of `root` may resolve to through symlinks: `root` itself, or for a Hugging Face
    cache snapshot (`models--org--name/snapshots/<rev>/file -> ../../blobs/<hash>`) the cache repo folder."""
    real = root.resolve()
    if real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
        return real.parent.parent
    return real


def _inside(root: Path, rel: str) -> Path:
    """Resolve `rel` under `root`, refusing absolute paths, `..` and symlinks that lead out of `link_root`."""
    if os.path.isabs(rel) or ".." in Path(rel).parts:
        raise QuantkitError(f"{root / INDEX_NAME}: file {rel!r} points outside the checkpoint directory")
    candidate = (root / rel).resolve()
    if not candidate.is_relative_to(link_root(root)):
        raise QuantkitError(f"{root / rel}: is a symlink to {candidate}, outside the checkpoint directory")
    return candidate


def _weight_files(root: Path) -> list[str]:
    """Shard files in index order (or the directory's safetensors files when there is no index)."""
    pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
    index_path = root / INDEX_NAME
    if index_path.exists():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise QuantkitError(f"{index_path}: no weight_map")
        files: list[str] = []
        for rel in weight_map.values():
            if not isinstance(rel, str):
                raise QuantkitError(f"{index_path}: weight_map values must be file names")
            if rel.endswith(PICKLE_SUFFIXES):
                raise QuantkitError(f"{root / rel}: {_PICKLE_REFUSED}")
            target = _inside(root, rel)
            if not target.is_file():
                raise QuantkitError(f"{index_path}: names file {rel}, which does not exist")
            if rel not in files:
                files.append(rel)
        return files
    files = sorted(p.name for p in root.glob("*.safetensors"))
    for f in files:
        _inside(root, f)
    if not files:
        if pickles:
            raise QuantkitError(f"{root / pickles[0]}: {_PICKLE_REFUSED}")
        raise QuantkitError(f"{root}: no *.safetensors files and no {INDEX_NAME}")
    return files


def _check_index(root: Path, files: list[str], headers: dict[str, ShardHeader]) -> None:
    """The index and the shard headers must describe exactly the same tensors."""
    index_path = root / INDEX_NAME
    seen: dict[str, str] = {}
    for f in files:
        for name in headers[f].tensors:
            if name in seen:
                raise QuantkitError(f"{root / f}: tensor {name} is also stored in {seen[name]}")
            seen[name] = f
    if not index_path.exists():
        return
    weight_map: dict[str, str] = read_json(index_path)["weight_map"]
    for name, rel in weight_map.items():
        if name not in headers[rel].tensors:
            raise QuantkitError(f"{index_path}: names tensor {name} in {rel}, which does not contain it")
    for name, f in seen.items():
        if name not in weight_map:
            raise QuantkitError(f"{root / f}: holds tensor {name}, which the index does not list (stale index?)")


def check_config(path: Path, config: dict[str, Any]) -> None:
    """Counts and sizes in config.json are whole numbers in range and `quantization_config` is well formed,
    checked before any adapter reads them."""
    text = text_config(config)
    qc = config.get("quantization_config")
    if qc is not None and not (isinstance(qc, dict) and isinstance(qc.get("config_groups", {}), dict)
                               and all(isinstance(g, dict) and isinstance(g.get("weights") or {}, dict)
                                       for g in (qc.get("config_groups") or {}).values())):
        raise QuantkitError(f"{path}: quantization_config is malformed (expected an object with config_groups)")
    for group in ((qc or {}).get("config_groups") or {}).values():
        size = (group.get("weights") or {}).get("group_size")
        if size is not None and (type(size) is not int or not 0 < size < _MAX_DIM):
            raise QuantkitError(f"{path}: quantization_config group_size must be a positive integer, got {size!r}")
    for key in _CONFIG_INTS:
        value = text.get(key)
        if value is None:
            continue
        if type(value) is not int or not 0 <= value < _MAX_DIM:
            raise QuantkitError(f"{path}: {key} must be a whole number between 0 and {_MAX_DIM}, got {value!r}")
    layers = text.get("num_hidden_layers")
    if not isinstance(layers, int) or layers < 1:
        raise QuantkitError(f"{path}: num_hidden_layers must be a positive whole number, got {layers!r}")


def _check_config_size(path: Path, config: dict[str, Any], n_tensors: int) -> None:
    """The config may not imply more tensors than the shards hold: `num_hidden_layers: 1e9` fails at once
    instead of building an inventory of billions of entries."""
    text = text_config(config)
    layers = text["num_hidden_layers"]
    implied = 2 * layers + 3 * (text.get("n_routed_experts") or 0)  # two norms per layer, one MoE layer at least
    if implied > n_tensors:
        raise QuantkitError(f"{path}: num_hidden_layers {layers} and n_routed_experts "
                            f"{text.get('n_routed_experts')} imply at least {implied} tensors, but the shards hold "
                            f"{n_tensors}")


def _check_formats(source: SourceCheckpoint) -> None:
    """The tensors must be what `quantization_config` says they are, and quantized parts must fit together."""
    qc = source.quantization_config
    path = source.root / "config.json"
    method = qc.get("quant_method")
    fmts = {t.fmt for t in source.logical.values()}
    if "fp8_block" in fmts and method != "fp8":
        name = next(n for n, t in source.logical.items() if t.fmt == "fp8_block")
        raise QuantkitError(f"{path}: tensor {name} is FP8 but quantization_config.quant_method is {method!r}, "
                            "not 'fp8'")
    if method == "fp8" and "fp8_block" not in fmts:
        raise QuantkitError(f"{path}: quantization_config says fp8, but no tensor is stored as FP8 (F8_E4M3)")
    if "int4_packed" in fmts and method != "compressed-tensors":
        name = next(n for n, t in source.logical.items() if t.fmt == "int4_packed")
        raise QuantkitError(f"{path}: tensor {name} is INT4-packed but quantization_config.quant_method is "
                            f"{method!r}, not 'compressed-tensors'")
    if method == "fp8":
        block = qc.get("weight_block_size") or [128, 128]
        if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and 0 < b < _MAX_DIM
                                                                    for b in block)):
            raise QuantkitError(f"{path}: quantization_config.weight_block_size must be two positive integers, "
                                f"got {block!r}")
    for name, t in source.logical.items():
        if t.fmt == "fp8_block":
            _check_fp8_scale(source, name, t)
        elif t.fmt == "int4_packed":
            _check_int4_scale(source, name, t)


def _check_fp8_scale(source: SourceCheckpoint, name: str, t: LogicalTensor) -> None:
    scale = name + "_scale_inv"
    entry = source.headers[t.parts[scale]].tensors[scale]
    bh, bw = source.fp8_block_size
    if len(t.shape) != 2:
        raise QuantkitError(f"{source.root / t.shard}: FP8 tensor {name} has shape {list(t.shape)}; block FP8 "
                            "weights are 2-D")
    expected = (-(-t.shape[0] // bh), -(-t.shape[1] // bw))
    if entry.shape != expected:
        raise QuantkitError(f"{source.root / t.parts[scale]}: tensor {scale} has shape {list(entry.shape)}, "
                            f"expected {list(expected)} for blocks {bh}x{bw}")


def _check_int4_scale(source: SourceCheckpoint, name: str, t: LogicalTensor) -> None:
    module = name.rsplit(".", 1)[0]
    scale = f"{module}.weight_scale"
    entry = source.headers[t.parts[scale]].tensors[scale]
    rows, cols = t.shape
    group = source.int4_group_size
    ok = len(entry.shape) == 2 and entry.shape[0] == rows and entry.shape[1] > 0 and cols % entry.shape[1] == 0
    if ok and group is not None:
        ok = entry.shape[1] * group == cols
    if not ok:
        raise QuantkitError(f"{source.root / t.parts[scale]}: tensor {scale} has shape {list(entry.shape)}, which "
                            f"does not fit weight {[rows, cols]} with group size {group}")


def _assemble(headers: dict[str, ShardHeader]) -> dict[str, LogicalTensor]:
    """Group physical tensors into logical ones: FP8 pairs and INT4 triples become one `X.weight`."""
    where: dict[str, tuple[str, HeaderEntry]] = {
        name: (f, entry) for f, h in headers.items() for name, entry in h.tensors.items()
    }
    logical: dict[str, LogicalTensor] = {}
    absorbed: set[str] = set()
    for name, (f, entry) in where.items():
        module, _, param = name.rpartition(".")
        if param == "weight_packed":
            parts = {f"{module}.{p}": where[f"{module}.{p}"][0] for p in _INT4_PARTS if f"{module}.{p}" in where}
            if len(parts) < 3:
                raise QuantkitError(f"{headers[f].path}: tensor {name} has no matching weight_scale / weight_shape")
            shape = _int4_shape(headers, parts, module)
            absorbed.update(parts)
            logical[f"{module}.weight"] = LogicalTensor(
                f"{module}.weight", "int4_packed", shape, entry.dtype, f, parts, _bytes(where, parts)
            )
        elif param == "weight" and entry.dtype in _FP8_DTYPES:
            scale = f"{module}.weight_scale_inv"
            if scale not in where:
                raise QuantkitError(f"{headers[f].path}: FP8 tensor {name} has no {scale}")
            parts = {name: f, scale: where[scale][0]}
            absorbed.add(scale)
            logical[name] = LogicalTensor(name, "fp8_block", entry.shape, entry.dtype, f, parts, _bytes(where, parts))
    for name, (f, entry) in where.items():
        if name in absorbed or name in logical:
            continue
        if name.endswith("_scale_inv"):
            raise QuantkitError(f"{headers[f].path}: {name} has no FP8 weight it belongs to")
        logical[name] = LogicalTensor(name, "plain", entry.shape, entry.dtype, f, {name: f}, entry.nbytes)
    return dict(sorted(logical.items(), key=lambda kv: _natural_key(kv[0])))


def _int4_shape(headers: dict[str, ShardHeader], parts: dict[str, str], module: str) -> tuple[int, int]:
    """The unpacked shape: read `weight_shape` (2 int64) straight from the file; it is tiny."""
    f = parts[f"{module}.weight_shape"]
    entry = headers[f].tensors[f"{module}.weight_shape"]
    if entry.dtype != "I64" or entry.shape != (2,):
        raise QuantkitError(f"{headers[f].path}: {module}.weight_shape must be int64 [2]")
    with open(headers[f].path, "rb") as fh:
        fh.seek(8 + headers[f].header_len + entry.start)
        out, inp = struct.unpack("<qq", fh.read(16))
    packed = headers[parts[f"{module}.weight_packed"]].tensors[f"{module}.weight_packed"].shape
    if packed != (out, inp // 8):
        raise QuantkitError(
            f"{headers[f].path}: {module}.weight_shape {[out, inp]} does not match weight_packed {list(packed)}"
        )
    return out, inp


def _bytes(where: dict[str, tuple[str, HeaderEntry]], parts: dict[str, str]) -> int:
    return sum(where[p][1].nbytes for p in parts)


def _natural_key(name: str) -> list[Any]:
    """Sort `layers.2` before `layers.10` so processing follows the model's order."""
    return [int(tok) if tok.isdigit() else tok for tok in name.split(".")]


def _check_inventory(source: SourceCheckpoint) -> None:
    """Every tensor the config implies must be present with the shape it implies.

    A wholly absent MTP layer is a warning (some re-uploads strip it); a partly absent one is an error.
    """
    specs = source.adapter.inventory()
    mtp_missing = [s.name for s in specs if s.mtp and s.name not in source.logical]
    if mtp_missing and len(mtp_missing) == sum(s.mtp for s in specs):
        source.warnings.append("the source has no MTP layer although config.json declares one")
        specs = [s for s in specs if not s.mtp]
    for spec in specs:
        found = source.logical.get(spec.name)
        if found is None:
            raise QuantkitError(f"{source.root}: missing tensor {spec.name} (config.json implies it)")
        if tuple(found.shape) != spec.shape:
            raise QuantkitError(
                f"{source.root / found.shard}: tensor {spec.name} has shape {list(found.shape)}, "
                f"config.json implies {list(spec.shape)}"
            )
