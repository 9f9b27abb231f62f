"""Converting one source shard into one or more output part files (runs in a worker process).

Memory: the output header is planned, so each tensor is read, transformed and written before the next
is read. Peak memory per worker is one logical tensor in fp32 plus its outputs, whatever the shard size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quantkit.checkpoint.source import SourceCheckpoint
from quantkit.checkpoint.writer import StreamingShardWriter, split_parts
from quantkit.convert.plan import TensorPlan
from quantkit.durable import fsync_dir, write_json_atomic
from quantkit.errors import QuantkitError
from quantkit.quant.int4 import PackedInt4, mse_group_scales, pack_int4, quantize_group, quantize_rtn
from quantkit.recipe import Recipe

__all__ = ["ShardJob", "convert_shard", "journal_path", "part_name"]


@dataclass
class ShardJob:
    """Everything a worker needs for one source shard (picklable)."""

    index: int
    shard: str
    plans: list[TensorPlan]
    work_dir: Path
    recipe: Recipe


def part_name(shard_index: int, part: int) -> str:
    return f"part-{shard_index:05d}-{part:03d}.safetensors"


def journal_path(work_dir: Path, shard_index: int) -> Path:
    return work_dir / "journal" / f"shard-{shard_index:05d}.json"


def convert_shard(
    source: SourceCheckpoint,
    job: ShardJob,
    calibration: Any = None,
    on_bytes: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Write the shard's part files, then its journal entry (the resume marker); return the entry."""
    planned = [t for plan in job.plans for t in plan.outputs]
    parts = split_parts(planned, job.recipe.max_shard_bytes)
    produced = _produce(source, job, calibration, on_bytes)
    written = []
    for k, part in enumerate(parts):
        writer = StreamingShardWriter(job.work_dir / "parts" / part_name(job.index, k), part, record_digest=True)
        try:
            for _ in part:
                writer.write(*next(produced))  # the writer checks name, dtype and shape against the plan
            written.append(writer.finish().name)
        except BaseException:
            writer.abort()
            raise
    entry = {"shard": job.shard, "parts": written}
    fsync_dir(job.work_dir / "parts")  # the parts' directory entries are durable before the journal says done
    write_json_atomic(journal_path(job.work_dir, job.index), entry)
    return entry


def _produce(
    source: SourceCheckpoint, job: ShardJob, calibration: Any, on_bytes: Callable[[int], None] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Output tensors in planned order, one logical tensor at a time."""
    for plan in job.plans:
        yield from _transform(source, plan, job.recipe, calibration)
        if on_bytes:
            on_bytes(plan.source.nbytes)


def _transform(
    source: SourceCheckpoint, plan: TensorPlan, recipe: Recipe, calibration: Any
) -> Iterator[tuple[str, torch.Tensor]]:
    t = plan.source
    if plan.action == "keep":
        value = source.read_physical(plan.name, t.shard)
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise QuantkitError(f"{source.root / t.shard}: tensor {plan.name} contains NaN or Inf values")
        yield plan.name, value
    elif plan.action == "dequantize":
        yield plan.name, source.read(plan.name, torch.float32).to(source.model_dtype)
    elif plan.action == "passthrough":
        for out in plan.outputs:
            value = source.read_physical(out.name, t.parts[out.name])
            if value.is_floating_point() and not torch.isfinite(value).all():
                raise QuantkitError(f"{source.root / t.parts[out.name]}: tensor {out.name} contains NaN or Inf")
            yield out.name, value
    else:
        packed = calibration.quantized(plan.module) if calibration is not None else None
        if packed is None:
            packed = _quantize_rtn(source, plan, recipe)
        yield from packed.tensors(plan.module).items()


def _quantize_rtn(source: SourceCheckpoint, plan: TensorPlan, recipe: Recipe) -> PackedInt4:
    """RTN in the model dtype's arithmetic (bit-identical to compressed-tensors for `minmax`)."""
    dtype = source.model_dtype
    weight = source.read(plan.name, torch.float32, check_finite=False)
    if recipe.scale_search == "mse":
        weight = weight.to(dtype).float()  # the value a BF16 copy would hold
        scale = mse_group_scales(weight, recipe.group_size, dtype)
        q, scale = quantize_group(weight, scale, recipe.group_size, dtype), scale.to(dtype)
    else:
        q, scale = quantize_rtn(weight, recipe.group_size, dtype)
    if not torch.isfinite(scale).all():  # NaN/Inf anywhere in a group reaches its scale
        raise QuantkitError(f"{source.root / plan.source.shard}: tensor {plan.name} contains NaN or Inf values")
    return pack_int4(q, scale)
