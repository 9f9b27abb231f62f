"""Checks on a source checkpoint before any tensor is read: config.json values, the index, the paths it names
(no absolute paths, no `..`, no symlink out of the checkpoint or its hub-cache repo folder), the quantization
formats and the tensor inventory the config implies. Torch-free: `inspect` and `plan` errors never import it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from quantkit.arch import Adapter, text_config
from quantkit.checkpoint.safetensors_header import ShardHeader
from quantkit.core.errors import QuantkitError
from quantkit.core.jsontypes import JSONObject

__all__ = [
    "INDEX_NAME", "LogicalTensor", "PICKLE_SUFFIXES", "SourceView", "TensorFormat", "check_config",
    "check_config_size", "check_formats", "check_index", "check_inventory", "link_root", "read_config", "read_json",
    "weight_files",
]

INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
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

# The one format vocabulary: how a logical tensor is stored, and (its most specific one) a whole checkpoint.
# plain: BF16 / FP16 / FP32 values; fp8_block: e4m3 + per-block scale_inv; int4_packed / int8_packed:
# compressed-tensors pack-quantized.
TensorFormat = Literal["plain", "fp8_block", "int4_packed", "int8_packed"]


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


class SourceView(Protocol):
    """What the checks read of an opened source (`quantkit.checkpoint.source.SourceCheckpoint`)."""

    root: Path
    headers: dict[str, ShardHeader]
    logical: dict[str, LogicalTensor]
    adapter: Adapter
    warnings: list[str]

    @property
    def quantization_config(self) -> JSONObject: ...

    @property
    def fp8_block_size(self) -> tuple[int, int]: ...

    @property
    def int4_group_size(self) -> int | None: ...

    @property
    def int_group_sizes(self) -> set[int]: ...


def read_config(root: Path) -> JSONObject:
    """ROOT/config.json, size-bounded and checked (`check_config`) before anything uses its values."""
    path = root / "config.json"
    config = read_json(path, _MAX_CONFIG_BYTES)
    check_config(path, config)
    return config


def read_json(path: Path, max_bytes: int = _MAX_INDEX_BYTES) -> JSONObject:
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
    except RecursionError:
        raise QuantkitError(f"{path}: not valid JSON (nested too deeply)") from None
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


def weight_files(root: Path) -> list[str]:
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


def check_index(root: Path, files: list[str], headers: dict[str, ShardHeader]) -> None:
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


def check_config(path: Path, config: JSONObject) -> None:
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


def check_config_size(path: Path, config: JSONObject, n_tensors: int) -> None:
    """The config may not imply more tensors than the shards hold: `num_hidden_layers: 1e9` fails at once
    instead of building an inventory of billions of entries."""
    text = text_config(config)
    layers = text["num_hidden_layers"]
    implied = 2 * layers + 3 * (text.get("n_routed_experts") or 0)  # two norms per layer, one MoE layer at least
    if implied > n_tensors:
        raise QuantkitError(f"{path}: num_hidden_layers {layers} and n_routed_experts "
                            f"{text.get('n_routed_experts')} imply at least {implied} tensors, but the shards hold "
                            f"{n_tensors}")


def check_formats(source: SourceView) -> None:
    """The tensors must be what `quantization_config` says they are, and quantized parts must fit together."""
    qc = source.quantization_config
    path = source.root / "config.json"
    method = qc.get("quant_method")
    fmts = {t.fmt for t in source.logical.values()}
    ct_fp8 = method == "compressed-tensors" and any((g.get("weights") or {}).get("type") == "float" for g in (
        qc.get("config_groups") or {}).values())  # a mixed output's FP8-kept units
    if "fp8_block" in fmts and method != "fp8" and not ct_fp8:
        name = next(n for n, t in source.logical.items() if t.fmt == "fp8_block")
        raise QuantkitError(f"{path}: tensor {name} is FP8 but quantization_config.quant_method is {method!r}, "
                            "not 'fp8'")
    if method == "fp8" and "fp8_block" not in fmts:
        raise QuantkitError(f"{path}: quantization_config says fp8, but no tensor is stored as FP8 (F8_E4M3)")
    if fmts & {"int4_packed", "int8_packed"} and method != "compressed-tensors":
        name = next(n for n, t in source.logical.items() if t.fmt in ("int4_packed", "int8_packed"))
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
        elif t.fmt in ("int4_packed", "int8_packed"):
            _check_int4_scale(source, name, t)


def _check_fp8_scale(source: SourceView, name: str, t: LogicalTensor) -> None:
    scale = next(p for p in t.parts if p != name)
    entry = source.headers[t.parts[scale]].tensors[scale]
    bh, bw = source.fp8_block_size
    if len(t.shape) != 2:
        raise QuantkitError(f"{source.root / t.shard}: FP8 tensor {name} has shape {list(t.shape)}; block FP8 "
                            "weights are 2-D")
    expected = (-(-t.shape[0] // bh), -(-t.shape[1] // bw))
    if entry.shape != expected:
        raise QuantkitError(f"{source.root / t.parts[scale]}: tensor {scale} has shape {list(entry.shape)}, "
                            f"expected {list(expected)} for blocks {bh}x{bw}")


def _check_int4_scale(source: SourceView, name: str, t: LogicalTensor) -> None:
    module = name.rsplit(".", 1)[0]
    scale = f"{module}.weight_scale"
    entry = source.headers[t.parts[scale]].tensors[scale]
    rows, cols = t.shape
    groups = source.int_group_sizes  # a mixed output has several; the tensor must have one of them
    ok = len(entry.shape) == 2 and entry.shape[0] == rows and entry.shape[1] > 0 and cols % entry.shape[1] == 0
    if ok and groups:
        ok = any(entry.shape[1] * g == cols for g in groups)
    if not ok:
        group = " or ".join(str(g) for g in sorted(groups)) or None
        raise QuantkitError(f"{source.root / t.parts[scale]}: tensor {scale} has shape {list(entry.shape)}, which "
                            f"does not fit weight {[rows, cols]} with group size {group}")


def check_inventory(source: SourceView) -> None:
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
