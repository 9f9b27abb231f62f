"""Deciding, before any work, what happens to every source tensor and what the output will hold.

The plan is the single source of truth for the writer (it knows each output tensor's dtype and shape
in advance, so shards stream with one tensor in memory), for the accounting in `quantkit.json`, and
for early errors: a group size that does not divide a weight fails here, before OUT is created.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from quantkit.arch import Role
from quantkit.checkpoint.safetensors_header import ST_TO_TORCH
from quantkit.checkpoint.source import LogicalTensor, SourceCheckpoint
from quantkit.checkpoint.writer import PlannedTensor
from quantkit.core.errors import QuantkitError
from quantkit.quant.fp4 import check_fp4_shape
from quantkit.quant.precision import PrecisionPlan, resolve_precision, tensor_format
from quantkit.quant.recipe import Recipe
from quantkit.quant.scheme import WeightFormat
from quantkit.quant.units import unit_of

__all__ = ["TensorAction", "TensorPlan", "plan_conversion"]

TensorAction = Literal["quantize", "passthrough", "keep", "dequantize", "keep-fp8"]

# Why each action happens; written into quantkit.json next to every tensor.
REASONS: dict[TensorAction, str] = {
    "quantize": "role {role} is quantized by the recipe ({scheme})",
    "passthrough": "already INT4 with the recipe's scheme: copied unchanged",
    "keep": "role {role} is kept by the recipe: copied unchanged",
    "dequantize": "role {role} is kept by the recipe: {fmt} dequantized to {dtype}",
    "keep-fp8": "unit {unit} is kept as the source's FP8 blocks: copied unchanged (scale as weight_scale)",
}
# A tensor of a unit whose format a per-unit plan sets says so (the uniform recipe's reasons stay as they were).
UNIT_REASONS: dict[TensorAction, str] = {
    "quantize": "unit {unit} is {label} in the precision plan",
    "passthrough": "unit {unit} is {label} in the precision plan; the source already is: copied unchanged",
    "keep": "unit {unit} is kept in the precision plan: copied unchanged",
    "dequantize": "unit {unit} is kept in the precision plan: {fmt} dequantized to {dtype}",
    "keep-fp8": REASONS["keep-fp8"],
}


@dataclass
class TensorPlan:
    """What happens to one logical tensor."""

    name: str
    action: TensorAction
    role: Role
    layer: int | None
    source: LogicalTensor
    outputs: list[PlannedTensor] = field(default_factory=list)
    reason: str = ""
    group_amax: float | None = None  # NVFP4: amax over the engines' fused group (set by the pre-pass)
    input_amax: float | None = None  # NVFP4 W4A4: activation amax over the fused group (from calibration)
    format: WeightFormat | None = None  # the written format of a quantized / passed-through / FP8-kept weight
    unit: str | None = None  # its quantization unit (quantkit/quant/units.py), None for other tensors

    @property
    def module(self) -> str:
        return self.name.rsplit(".", 1)[0]


def plan_conversion(source: SourceCheckpoint, recipe: Recipe,
                    precision: PrecisionPlan | None = None) -> dict[str, list[TensorPlan]]:
    """Per source shard, in order: the plan of every logical tensor whose primary part lives there.

    `precision` (default: what the recipe resolves to for this model) gives each unit's format; a uniform recipe
    plans exactly what it always did."""
    if precision is None and recipe.mixed:
        precision = resolve_precision(recipe, source.adapter)
    roles = set(recipe.quantize_roles)
    plans: dict[str, list[TensorPlan]] = {shard: [] for shard in source.shard_files}
    for name, tensor in source.logical.items():
        plans[tensor.shard].append(_plan_tensor(source, recipe, roles, name, tensor, precision))
    return plans


def _plan_tensor(source: SourceCheckpoint, recipe: Recipe, roles: set[Role], name: str, t: LogicalTensor,
                 precision: PrecisionPlan | None) -> TensorPlan:
    info = source.adapter.classify(name)
    dtype = source.model_dtype
    weight = name.endswith(".weight") and len(t.shape) == 2
    unit = unit_of(source.adapter, name) if precision is not None and weight else None
    plan = TensorPlan(name, "keep", info.role, info.layer, t, unit=unit)
    where = f"{source.root / t.shard}: tensor {name}"
    fmt = tensor_format(recipe, source.adapter, precision, name) if weight else None
    m = plan.module
    if fmt is not None and fmt.kind == "fp8":
        if t.fmt != "fp8_block":
            raise QuantkitError(f"{where}: unit {unit} is fp8-block in the precision plan, but the source stores it "
                                f"as {t.fmt} (fp8-block keeps an FP8-block source's blocks; use bf16 or an INT format)")
        scale = next(p for p in t.parts if p != name)
        plan.action, plan.format = "keep-fp8", fmt
        plan.outputs = [PlannedTensor(name, ST_TO_TORCH[t.dtype], t.shape),
                        PlannedTensor(f"{m}.weight_scale", ST_TO_TORCH[source.headers[t.parts[scale]].tensors[
                            scale].dtype], source.headers[t.parts[scale]].tensors[scale].shape)]
    elif fmt is not None and fmt.computed and _same_format(source, t, fmt):
        plan.action, plan.format = "passthrough", fmt
        plan.outputs = [PlannedTensor(p, ST_TO_TORCH[source.headers[f].tensors[p].dtype],
                                      source.headers[f].tensors[p].shape) for p, f in sorted(t.parts.items())]
    elif fmt is not None and fmt.computed:
        if fmt.kind == "fp4":
            check_fp4_shape(t.shape, "mxfp4" if fmt.name == "mxfp4a16" else "nvfp4", where)
        else:
            fmt.check_shape(t.shape, where)
        plan.action, plan.format = "quantize", fmt
        plan.outputs = [PlannedTensor(f"{m}.{suffix}", d, s) for suffix, d, s in fmt.stored(t.shape, dtype)]
    elif t.fmt != "plain":
        plan.action = "dequantize"
        plan.outputs = [PlannedTensor(name, dtype, t.shape)]
    else:
        plan.outputs = [PlannedTensor(name, ST_TO_TORCH[t.dtype], t.shape)]
    src_fmt = {"fp8_block": "FP8-block", "int4_packed": "INT4", "int8_packed": "INT8"}.get(t.fmt, t.fmt)
    scheme = f"INT4 group {recipe.group_size}" if recipe.fp4 is None else recipe.scheme.upper()
    text = UNIT_REASONS if unit is not None else REASONS
    plan.reason = text[plan.action].format(role=info.role.value, scheme=scheme, fmt=src_fmt, unit=unit,
                                           label=fmt.label if fmt else "", dtype=str(dtype).removeprefix("torch."))
    return plan


def _same_format(source: SourceCheckpoint, t: LogicalTensor, fmt: WeightFormat) -> bool:
    """A packed INT source weight is copied as is when it already has the format: its values sit on that grid."""
    if fmt.kind != "int" or t.fmt not in ("int4_packed", "int8_packed"):
        return False
    bits = 4 if t.fmt == "int4_packed" else 8
    return bits == fmt.bits and source.int_group_size(t) == fmt.group and source.int4_symmetric
