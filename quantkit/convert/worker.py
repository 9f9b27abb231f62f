"""Converting one source shard into one or more output part files (runs in a worker thread).

Memory: the output header is planned, so each tensor is read, transformed and written before the next
is read. Peak memory per worker is one logical tensor in fp32 plus its outputs, whatever the shard size.

Speed: on the CPU, BF16 models' RTN and FP8 dequantization run through the fused single-pass kernels of
`quantkit.quant.fused` (read the stored bytes, write packed nibbles + scales). Every other case — an
FP16 model, `--scale-search mse`, `--device cuda` — runs the device-generic torch path of
`quantkit.quant.int4`; both give the same bytes (tested), and the same bytes as compressed-tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from quantkit.checkpoint.source import LogicalTensor, SourceCheckpoint
from quantkit.checkpoint.writer import StreamingShardWriter, split_parts
from quantkit.convert.plan import TensorPlan
from quantkit.core.durable import fsync_dir, write_json_atomic
from quantkit.core.errors import QuantkitError
from quantkit.quant import fused
from quantkit.quant.int4 import (
    PackedInt4,
    fp8_block_to_float32,
    mse_group_scales,
    pack_int,
    quantize_group,
    quantize_rtn,
)
from quantkit.quant.recipe import Recipe
from quantkit.quant.scheme import WeightFormat

if TYPE_CHECKING:  # workers never import the calibration stack (it pulls in transformers)
    from quantkit.calibrate.result import CalibrationResult

__all__ = ["ShardCancelled", "ShardJob", "convert_shard", "journal_path", "part_name", "quantize_rtn_tensor",
           "source_files"]


@dataclass
class ShardJob:
    """Everything a worker needs for one source shard (picklable)."""

    index: int
    shard: str
    plans: list[TensorPlan]
    work_dir: Path
    recipe: Recipe
    device: str = "cpu"  # where RTN runs: "cpu" (fused kernels) or a torch device such as "cuda"


def part_name(shard_index: int, part: int) -> str:
    return f"part-{shard_index:05d}-{part:03d}.safetensors"


def journal_path(work_dir: Path, shard_index: int) -> Path:
    return work_dir / "journal" / f"shard-{shard_index:05d}.json"


def source_files(job: ShardJob) -> list[str]:
    """Every source file the shard's tensors are read from (an FP8 scale may live in another shard)."""
    return sorted({f for plan in job.plans for f in plan.source.parts.values()} | {job.shard})


def convert_shard(
    source: SourceCheckpoint,
    job: ShardJob,
    calibration: CalibrationResult | None = None,
    on_bytes: Callable[[int], None] | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """Write the shard's part files, then its journal entry (the resume marker); return the entry.

    `cancelled()` is polled before each tensor: when it turns true the shard stops, its unfinished part
    is removed and `ShardCancelled` is raised (nothing is journaled, so a resume redoes the shard).
    """
    planned = [t for plan in job.plans for t in plan.outputs]
    parts = split_parts(planned, job.recipe.max_shard_bytes)
    produced = _produce(source, job, calibration, on_bytes, cancelled)
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
    entry = {"shard": job.shard, "parts": written, "sources": source.stamps(source_files(job))}
    fsync_dir(job.work_dir / "parts")  # the parts' directory entries are durable before the journal says done
    write_json_atomic(journal_path(job.work_dir, job.index), entry)
    return entry


class ShardCancelled(Exception):
    """Another worker failed or the run was interrupted: this shard stopped unfinished."""


def _produce(
    source: SourceCheckpoint, job: ShardJob, calibration: CalibrationResult | None,
    on_bytes: Callable[[int], None] | None, cancelled: Callable[[], bool] | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Output tensors in planned order, one logical tensor at a time."""
    device = torch.device(job.device)
    for plan in job.plans:
        if cancelled is not None and cancelled():
            raise ShardCancelled(job.shard)
        yield from _transform(source, plan, job.recipe, calibration, device)
        if on_bytes:
            on_bytes(plan.source.nbytes)


def _transform(
    source: SourceCheckpoint, plan: TensorPlan, recipe: Recipe, calibration: CalibrationResult | None,
    device: torch.device,
) -> Iterator[tuple[str, torch.Tensor]]:
    t = plan.source
    if plan.action == "keep":
        yield plan.name, _checked(source, t.shard, plan.name, source.read_physical(plan.name, t.shard))
    elif plan.action == "dequantize":
        yield plan.name, _dequantize(source, t, device)
    elif plan.action == "passthrough":
        for out in plan.outputs:
            shard = t.parts[out.name]
            yield out.name, _checked(source, shard, out.name, source.read_physical(out.name, shard))
    elif plan.action == "keep-fp8":
        raw, scale = source.fp8_parts(t)  # the scale grid and its values checked
        yield plan.name, raw
        yield plan.outputs[1].name, scale.to(plan.outputs[1].dtype)
    elif plan.format is not None and plan.format.kind == "fp4":
        from quantkit.convert.fp4 import quantize_fp4_tensor

        fp4 = "mxfp4" if plan.format.name == "mxfp4a16" else "nvfp4"
        yield from quantize_fp4_tensor(source, plan, fp4).tensors(plan.module).items()
    else:
        packed = calibration.quantized(plan.module) if calibration is not None else None
        if packed is None:
            packed = quantize_rtn_tensor(source, t, recipe, device, plan.format)
        yield from packed.tensors(plan.module).items()


def _checked(source: SourceCheckpoint, shard: str, name: str, value: torch.Tensor) -> torch.Tensor:
    if value.is_floating_point() and fused.count_nonfinite(value):
        raise QuantkitError(f"{source.root / shard}: tensor {name} contains NaN or Inf values")
    return value


def _fused_ok(source: SourceCheckpoint, t: LogicalTensor, device: torch.device) -> bool:
    """Whether the fused CPU kernels apply: BF16 model, FP8-block or BF16 stored weight, on the CPU."""
    return (device.type == "cpu" and fused.available() and source.model_dtype == torch.bfloat16
            and (t.fmt == "fp8_block" or (t.fmt == "plain" and t.dtype == "BF16")))


def _read_float32(source: SourceCheckpoint, t: LogicalTensor, device: torch.device) -> torch.Tensor:
    """The logical weight as fp32 on `device` (FP8 decoded there; NaN/Inf not checked here)."""
    if t.fmt == "fp8_block":
        raw, scale = source.fp8_parts(t)
        return fp8_block_to_float32(raw.to(device), scale.to(device), source.fp8_block_size)
    return source.read(t.name, torch.float32, check_finite=False).to(device)


def _dequantize(source: SourceCheckpoint, t: LogicalTensor, device: torch.device) -> torch.Tensor:
    """A kept FP8 / INT4 weight in the model dtype, refused when it holds NaN or Inf."""
    if _fused_ok(source, t, device) and t.fmt == "fp8_block":
        value, bad = fused.dequant_fp8_block_bf16(*source.fp8_parts(t), source.fp8_block_size)
    else:
        value = _read_float32(source, t, device).to(source.model_dtype)
        bad = int((~torch.isfinite(value)).sum())
        value = value.cpu()
    if bad:
        raise QuantkitError(f"{source.root / t.shard}: tensor {t.name} contains NaN or Inf values")
    return value


def quantize_rtn_tensor(source: SourceCheckpoint, t: LogicalTensor, recipe: Recipe,
                        device: torch.device, fmt: WeightFormat | None = None) -> PackedInt4:
    """RTN of one logical weight in `fmt` (default: the recipe's uniform INT format) in the model dtype's
    arithmetic (bit-identical to compressed-tensors for `minmax`), through the fused CPU kernels where they apply
    (INT4), else with torch ops on `device`."""
    fmt = fmt or recipe.uniform_format
    if recipe.scale_search == "minmax" and fmt.bits == 4 and _fused_ok(source, t, device):
        if t.fmt == "fp8_block":
            raw, scale = source.fp8_parts(t)
            packed, scales, bad = fused.rtn_fp8_block(raw, scale, source.fp8_block_size, _group(fmt))
        else:
            packed, scales, bad = fused.rtn_bf16(source.read_physical(t.name, t.shard), _group(fmt))
        result = PackedInt4(packed, scales, torch.tensor(list(t.shape), dtype=torch.int64))
    else:
        result = _rtn_torch(source, t, recipe, device, fmt)
        bad = int(not bool(torch.isfinite(result.weight_scale).all()))  # NaN/Inf in a group reaches its scale
    if bad:
        raise QuantkitError(f"{source.root / t.shard}: tensor {t.name} contains NaN or Inf values")
    return result


def _group(fmt: WeightFormat) -> int:
    assert fmt.kind == "int" and fmt.group is not None, fmt
    return fmt.group


def _rtn_torch(source: SourceCheckpoint, t: LogicalTensor, recipe: Recipe, device: torch.device,
               fmt: WeightFormat | None = None) -> PackedInt4:
    dtype = source.model_dtype
    fmt = fmt or recipe.uniform_format
    gs, bits = _group(fmt), fmt.bits
    weight = _read_float32(source, t, device)
    if recipe.scale_search == "mse":
        weight = weight.to(dtype).float()  # the value a checkpoint in the model dtype would hold
        scale = mse_group_scales(weight, gs, dtype, bits=bits)
        q, scale = quantize_group(weight, scale, gs, dtype, bits), scale.to(dtype)
    else:
        q, scale = quantize_rtn(weight, gs, dtype, bits)
    packed = pack_int(q, scale, 4 if bits == 4 else 8)
    return PackedInt4(packed.weight_packed.cpu(), packed.weight_scale.cpu(), packed.weight_shape)
