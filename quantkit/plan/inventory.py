"""Checkpoint bytes per precision plan, from the adapter's inventory or from real shard headers.

A *precision plan* says how each tensor is stored: BF16, FP8-block (e4m3 + fp32 scale per
128x128 block, as the DeepSeek V3 / GLM-5 FP8 releases) or INT4 group-wise (compressed-tensors
pack-quantized: int32 words of 8 nibbles + bf16 scale per group + int64 `weight_shape`).
Sizes from config.json use exactly those byte layouts, so they match the files a converter writes.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from quantkit.arch import Role, TensorSpec, get_adapter
from quantkit.checkpoint.safetensors_header import read_header
from quantkit.core.errors import QuantkitError
from quantkit.core.jsontypes import JSONObject

__all__ = [
    "WEIGHT_PLANS",
    "collapse_experts",
    "size_collapsed",
    "HeaderTensor",
    "PrecisionPlan",
    "SizedTensor",
    "format_bytes",
    "logical_name",
    "native_plan",
    "read_shard_headers",
    "size_inventory",
    "size_model",
    "tensor_format",
    "totals_by",
]

WEIGHT_PLANS = ("bf16", "fp8", "int4", "nvfp4", "mxfp4")  # nvfp4 / mxfp4: A16 routed experts (docs/fp4.md)
FP4_PLANS = ("nvfp4", "mxfp4")
FP8_BLOCK = 128
# Roles whose 2-D `.weight` is never a quantized Linear. FP8 releases keep them BF16 too; the MTP
# `eh_proj` is a plain nn.Linear in SGLang's and vLLM's draft models, so it stays BF16 as well.
_NOT_LINEAR = {Role.EMBEDDING, Role.LM_HEAD, Role.NORM, Role.ROUTER, Role.INDEXER, Role.OTHER, Role.MTP_OTHER}
_FP32_SUFFIXES = ("e_score_correction_bias",)


@dataclass(frozen=True)
class PrecisionPlan:
    """How weights are stored: `bf16`, `fp8` (block 128) or `int4` (routed experts, group `group_size`)."""

    weights: str
    group_size: int = 32

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_PLANS:
            raise QuantkitError(f"weights {self.weights!r}: expected one of {', '.join(WEIGHT_PLANS)}")

    @property
    def label(self) -> str:
        return f"int4-g{self.group_size}" if self.weights == "int4" else f"{self.weights}a16" \
            if self.weights in FP4_PLANS else self.weights


@dataclass(frozen=True)
class SizedTensor:
    """A logical tensor (or `count` identical routed-expert tensors, named `experts.*`) under a plan.

    `nbytes` covers all `count` tensors; collapsing the experts keeps a 1T model at ~1K entries.
    """

    name: str
    shape: tuple[int, ...]
    role: Role
    layer: int | None
    mtp: bool
    fmt: str
    nbytes: int
    count: int = 1

    @property
    def each(self) -> int:
        return self.nbytes // self.count


def native_plan(config: JSONObject) -> PrecisionPlan:
    """The plan a release ships in, read from its `quantization_config` (none = BF16)."""
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not qc:
        return PrecisionPlan("bf16")
    method = qc.get("quant_method")
    if method == "fp8":
        return PrecisionPlan("fp8")
    if method == "compressed-tensors":
        for group in (qc.get("config_groups") or {}).values():
            weights = group.get("weights") or {}
            if weights.get("num_bits") == 4 and weights.get("type") == "int":
                return PrecisionPlan("int4", int(weights.get("group_size") or 32))
            if weights.get("num_bits") == 4 and weights.get("type") == "float":
                return PrecisionPlan("nvfp4" if weights.get("group_size") == 16 else "mxfp4")
    raise QuantkitError(f"config.json: quantization_config {method!r} is not one quantkit can size")


def _is_linear(spec: TensorSpec) -> bool:
    return len(spec.shape) == 2 and spec.name.endswith(".weight") and spec.role not in _NOT_LINEAR


def tensor_format(spec: TensorSpec, plan: PrecisionPlan) -> str:
    """Storage format of one logical tensor under `plan`: bf16, fp32, fp8 or int4."""
    if spec.name.endswith(_FP32_SUFFIXES):
        return "fp32"
    if not _is_linear(spec):
        return "bf16"
    if plan.weights == "fp8":
        return "fp8"
    if plan.weights in ("int4", *FP4_PLANS) and spec.role == Role.ROUTED_EXPERT:
        return plan.weights
    return "bf16"


def format_bytes(shape: tuple[int, ...], fmt: str, group_size: int = 32) -> int:
    """Bytes of a tensor stored in `fmt` (scales and shape tensors included)."""
    numel = math.prod(shape)
    if fmt == "bf16":
        return 2 * numel
    if fmt == "fp32":
        return 4 * numel
    out, cols = shape
    if fmt == "fp8":
        return numel + 4 * math.ceil(out / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK)
    if fmt == "int4":
        if cols % group_size:
            raise QuantkitError(f"int4 group {group_size} does not divide input size {cols}")
        return 4 * out * math.ceil(cols / 8) + 2 * out * (cols // group_size) + 16
    if fmt in FP4_PLANS:  # packed E2M1 + e4m3 per 16 + fp32 global (NVFP4: 4.5 bits) | E8M0 per 32 (4.25 bits)
        group = 16 if fmt == "nvfp4" else 32
        if cols % group:
            raise QuantkitError(f"{fmt} group {group} does not divide input size {cols}")
        return out * (cols // 2) + out * (cols // group) + (4 if fmt == "nvfp4" else 0)
    raise ValueError(f"unknown format {fmt}")


_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")


def collapse_experts(specs: Iterable[TensorSpec]) -> list[tuple[TensorSpec, int]]:
    """Group routed-expert tensors that differ only in the expert index: (representative, count)."""
    groups: dict[tuple, list] = {}
    for spec in specs:
        if spec.role == Role.ROUTED_EXPERT:
            name = _EXPERT_INDEX.sub(".experts.*.", spec.name)
            key = (name, spec.shape, spec.layer, spec.mtp)
            if key in groups:
                groups[key][1] += 1
            else:
                groups[key] = [TensorSpec(name, spec.shape, spec.role, spec.layer, None, spec.mtp), 1]
        else:
            groups[(spec.name,)] = [spec, 1]
    return [(spec, count) for spec, count in groups.values()]


def size_inventory(specs: Iterable[TensorSpec], plan: PrecisionPlan) -> list[SizedTensor]:
    """Every tensor of the inventory with its bytes under `plan` (routed experts collapsed)."""
    return size_collapsed(collapse_experts(specs), plan)


def size_collapsed(groups: Iterable[tuple[TensorSpec, int]], plan: PrecisionPlan) -> list[SizedTensor]:
    """`size_inventory` of already-collapsed (spec, count) groups."""
    out = []
    for spec, count in groups:
        fmt = tensor_format(spec, plan)
        each = format_bytes(spec.shape, fmt, plan.group_size)
        out.append(
            SizedTensor(spec.name, spec.shape, spec.role, spec.layer, spec.mtp, fmt, each * count, count)
        )
    return out


class _HasBytes(Protocol):
    """A sized tensor or a header tensor: `nbytes` and the attribute `totals_by` groups on."""

    @property
    def nbytes(self) -> int: ...


def totals_by(tensors: Iterable[_HasBytes], key: str) -> dict[str, int]:
    """Sum of `nbytes` grouped by an attribute (`role`, `fmt`, `dtype`); enum values are unwrapped."""
    sums: dict[str, int] = defaultdict(int)
    for t in tensors:
        value = getattr(t, key)
        sums[getattr(value, "value", value)] += t.nbytes
    return dict(sorted(sums.items(), key=lambda kv: -kv[1]))


# ---- real checkpoints ----------------------------------------------------------------------------
_QUANT_SUFFIXES = (
    ".weight_packed",
    ".weight_scale_inv",
    ".weight_scale",
    ".weight_shape",
    ".weight_zero_point",
    ".weight_g_idx",
    ".weight_global_scale",  # NVFP4
    ".input_global_scale",
)


@dataclass(frozen=True)
class HeaderTensor:
    """One tensor as a safetensors header records it (no data is read)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: str


def logical_name(name: str) -> str:
    """The weight a stored tensor belongs to: `X.weight_packed` / `X.weight_scale_inv` -> `X.weight`."""
    for suffix in _QUANT_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".weight"
    return name


def read_shard_headers(directory: Path) -> tuple[list[HeaderTensor], dict[str, int]]:
    """All tensors of the `*.safetensors` shards of `directory`, plus bytes on disk per shard.

    Bytes per tensor come from the header's `data_offsets`, so header + tensors add up to the file size.
    """
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise QuantkitError(f"{directory}: no *.safetensors shards")
    tensors: list[HeaderTensor] = []
    files: dict[str, int] = {}
    for shard in shards:
        header = read_header(shard)  # bounds-checked: a truncated shard is a clean error
        files[shard.name] = header.file_size
        for name, entry in header.tensors.items():
            tensors.append(HeaderTensor(name, entry.dtype, entry.shape, entry.nbytes, shard.name))
    return tensors, files


_GROUPS: dict[str, list[tuple[TensorSpec, int]]] = {}
_CACHE: dict[tuple[str, PrecisionPlan], list[SizedTensor]] = {}


def size_model(config: JSONObject, plan: PrecisionPlan) -> list[SizedTensor]:
    """`size_inventory` of a config's adapter inventory, memoised per config and plan."""
    key = json.dumps(config, sort_keys=True)
    if key not in _GROUPS:
        _GROUPS[key] = collapse_experts(get_adapter(config).inventory())
    if (key, plan) not in _CACHE:
        _CACHE[(key, plan)] = size_collapsed(_GROUPS[key], plan)
    return _CACHE[(key, plan)]
