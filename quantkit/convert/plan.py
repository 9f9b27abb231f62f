"""Deciding, before any work, what happens to every source tensor and what the output will hold.

The plan is the single source of truth for the writer (it knows each output tensor's dtype and shape
in advance, so shards stream with one tensor in memory), for the accounting in `quantkit.json`, and
for early errors: a group size that does not divide a weight fails here, before OUT is created.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from quantkit.arch import Role
from quantkit.checkpoint.safetensors_header import ST_TO_TORCH
from quantkit.checkpoint.source import LogicalTensor, SourceCheckpoint
from quantkit.checkpoint.writer import PlannedTensor
from quantkit.quant.fp4 import check_fp4_shape, fp4_group_size
from quantkit.quant.int4 import check_group_size
from quantkit.quant.recipe import Recipe

__all__ = ["TensorAction", "TensorPlan", "plan_conversion"]

TensorAction = Literal["quantize", "passthrough", "keep", "dequantize"]

# Why each action happens; written into quantkit.json next to every tensor.
REASONS: dict[TensorAction, str] = {
    "quantize": "role {role} is quantized by the recipe ({scheme})",
    "passthrough": "already INT4 with the recipe's scheme: copied unchanged",
    "keep": "role {role} is kept by the recipe: copied unchanged",
    "dequantize": "role {role} is kept by the recipe: {fmt} dequantized to {dtype}",
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

    @property
    def module(self) -> str:
        return self.name.rsplit(".", 1)[0]


def plan_conversion(source: SourceCheckpoint, recipe: Recipe) -> dict[str, list[TensorPlan]]:
    """Per source shard, in order: the plan of every logical tensor whose primary part lives there."""
    roles = set(recipe.quantize_roles)
    plans: dict[str, list[TensorPlan]] = {shard: [] for shard in source.shard_files}
    for name, tensor in source.logical.items():
        plans[tensor.shard].append(_plan_tensor(source, recipe, roles, name, tensor))
    return plans


def _plan_tensor(source: SourceCheckpoint, recipe: Recipe, roles: set[Role], name: str, t: LogicalTensor) -> TensorPlan:
    info = source.adapter.classify(name)
    dtype = source.model_dtype
    quantizable = info.role in roles and name.endswith(".weight") and len(t.shape) == 2
    plan = TensorPlan(name, "keep", info.role, info.layer, t)
    if quantizable and recipe.fp4 is not None:
        check_fp4_shape(t.shape, recipe.fp4, f"{source.root / t.shard}: tensor {name}")
        out, inp = t.shape
        m, group = plan.module, fp4_group_size(recipe.fp4)
        plan.action = "quantize"
        plan.outputs = [
            PlannedTensor(f"{m}.weight_packed", torch.uint8, (out, inp // 2)),
            PlannedTensor(f"{m}.weight_scale", torch.float8_e4m3fn if recipe.fp4 == "nvfp4" else torch.uint8,
                          (out, inp // group)),
        ]
        if recipe.fp4 == "nvfp4":
            plan.outputs.append(PlannedTensor(f"{m}.weight_global_scale", torch.float32, (1,)))
        if recipe.scheme == "nvfp4":  # W4A4
            plan.outputs.append(PlannedTensor(f"{m}.input_global_scale", torch.float32, (1,)))
    elif quantizable and t.fmt == "int4_packed" and _same_scheme(source, recipe):
        plan.action = "passthrough"
        plan.outputs = [PlannedTensor(p, ST_TO_TORCH[source.headers[f].tensors[p].dtype],
                                      source.headers[f].tensors[p].shape) for p, f in sorted(t.parts.items())]
    elif quantizable:
        check_group_size(t.shape, recipe.group_size, f"{source.root / t.shard}: tensor {name}")
        out, inp = t.shape
        m = plan.module
        plan.action = "quantize"
        plan.outputs = [
            PlannedTensor(f"{m}.weight_packed", torch.int32, (out, inp // 8)),
            PlannedTensor(f"{m}.weight_scale", dtype, (out, inp // recipe.group_size)),
            PlannedTensor(f"{m}.weight_shape", torch.int64, (2,)),
        ]
    elif t.fmt in ("fp8_block", "int4_packed"):
        plan.action = "dequantize"
        plan.outputs = [PlannedTensor(name, dtype, t.shape)]
    else:
        plan.outputs = [PlannedTensor(name, ST_TO_TORCH[t.dtype], t.shape)]
    fmt = {"fp8_block": "FP8-block", "int4_packed": "INT4"}.get(t.fmt, t.fmt)
    scheme = f"INT4 group {recipe.group_size}" if recipe.fp4 is None else recipe.scheme.upper()
    plan.reason = REASONS[plan.action].format(role=info.role.value, scheme=scheme, fmt=fmt,
                                              dtype=str(dtype).removeprefix("torch."))
    return plan


def _same_scheme(source: SourceCheckpoint, recipe: Recipe) -> bool:
    """An INT4 source is copied as is when its scheme equals the recipe's: its values already sit on that grid."""
    return source.int4_group_size == recipe.group_size and source.int4_symmetric
