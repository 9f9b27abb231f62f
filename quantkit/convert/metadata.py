"""What a conversion writes besides the weight shards, once every shard is journaled: config.json with the
`quantization_config`, the index, the recipe, the carried-over files, the calibration reports and
`quantkit.json` (written last: it marks the metadata complete, see `quantkit.convert.publish.is_finished`);
and the calibrated KV-cache scales as one extra part file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from quantkit.arch import Adapter
from quantkit.checkpoint.qconfig import build_fp4_quantization_config, build_quantization_config
from quantkit.checkpoint.source import SourceCheckpoint
from quantkit.checkpoint.writer import PlannedTensor, StreamingShardWriter
from quantkit.convert.plan import TensorPlan
from quantkit.convert.publish import MANIFEST_FILE, RECIPE_FILE, account, carry_over_files
from quantkit.convert.worker import part_name
from quantkit.core.durable import write_json_atomic, write_text_atomic
from quantkit.core.errors import QuantkitError
from quantkit.core.jsontypes import JSONObject
from quantkit.engines.record import serving_record
from quantkit.engines.verdicts import facts_from_checkpoint
from quantkit.hub import read_origin
from quantkit.quant.recipe import Recipe

if TYPE_CHECKING:  # the calibration stack imports transformers: only when a recipe calibrates
    from quantkit.calibrate.result import CalibrationResult

__all__ = ["write_kv_scales", "write_metadata"]

_KV_SHARD_INDEX = 99_999  # KV scales are written as one extra part after all source shards


def write_kv_scales(partial: Path, kv_scales: dict[int, tuple[float, float]], adapter: Adapter) -> JSONObject:
    """KV scales as one extra part file, under the names of `quantkit.engines.verdicts.kv_scale_names`, float32 [1]."""
    from quantkit.calibrate.kv import scale_tensors

    tensors = scale_tensors(kv_scales, adapter)
    name = part_name(_KV_SHARD_INDEX, 0)
    planned = [PlannedTensor(n, torch.float32, (1,)) for n in tensors]
    writer = StreamingShardWriter(partial / "parts" / name, planned, record_digest=True)
    for n, t in tensors.items():
        writer.write(n, t)
    writer.finish()
    return {"shard": "(calibrated KV-cache scales)", "parts": [name]}


def write_metadata(
    source: SourceCheckpoint,
    recipe: Recipe,
    plans: dict[str, list[TensorPlan]],
    partial: Path,
    weight_map: dict[str, str],
    calibration: CalibrationResult | None,
    identity: JSONObject,
) -> int:
    """config.json, index, recipe, carried-over files, reports and quantkit.json (last: it marks the
    metadata complete, see `is_finished`); returns output bytes."""
    copied, skipped = carry_over_files(source, partial)
    config = dict(source.config)
    ignore = source.adapter.ignore_patterns(set(recipe.quantize_roles))
    kv = calibration is not None and bool(calibration.kv_scales)
    precision = None
    if recipe.mixed:
        from quantkit.convert.precision import mixed_metadata

        config["quantization_config"], precision = mixed_metadata(source, recipe, plans, kv)
    elif recipe.fp4 is None:
        config["quantization_config"] = build_quantization_config(recipe.group_size, ignore, kv_cache=kv)
    else:
        config["quantization_config"] = build_fp4_quantization_config(recipe.scheme, ignore, kv_cache=kv)
    write_json_atomic(partial / "config.json", config)
    reports = calibration.write_reports(partial) if calibration is not None else []
    write_text_atomic(partial / RECIPE_FILE, recipe.to_yaml())
    shard_bytes = {f: (partial / f).stat().st_size for f in sorted(set(weight_map.values()))}
    write_json_atomic(partial / "model.safetensors.index.json",
               {"metadata": {"total_size": _data_bytes(partial, shard_bytes)}, "weight_map": weight_map})
    tensors = account(plans, weight_map)
    summary: dict[str, dict[str, int]] = {}
    for plan in (p for ps in plans.values() for p in ps):
        row = summary.setdefault(plan.action, {"tensors": 0, "source_bytes": 0, "output_bytes": 0})
        row["tensors"] += 1
        row["source_bytes"] += plan.source.nbytes
        row["output_bytes"] += sum(o.nbytes for o in plan.outputs)
    manifest = {
        "format": "quantkit/1",
        "tool_versions": identity["versions"],
        "source": {"name": source.root.name, "fingerprint": identity["fingerprint"], "format": source.source_format,
                   "bytes": source.source_bytes, "shards": len(source.shard_files), "warnings": source.warnings,
                   "hub": read_origin(source.root)},
        "recipe": identity["recipe"],
        "output": {"bytes": sum(shard_bytes.values()), "shards": shard_bytes, "files_copied": copied,
                   "files_skipped": skipped, "reports": reports},
        "summary": summary,
        "serving": serving_record(facts_from_checkpoint(config, weight_map, _kv_report(partial, reports)),
                                  _kv_speed(source.config, recipe, kv)),
        "tensors": tensors,
    }
    if precision is not None:  # per-unit plans only: a uniform recipe's quantkit.json is as it always was
        manifest["precision"] = precision
    write_json_atomic(partial / MANIFEST_FILE, manifest)
    return sum(shard_bytes.values())


def _kv_speed(config: JSONObject, recipe: Recipe, kv: bool) -> JSONObject | None:
    """Both FP8 KV-scale options' modelled decode speed for the record (quantkit.plan.attention_plan)."""
    if not kv:
        return None
    from quantkit.plan.attention_plan import record_speed

    try:
        return record_speed(config, recipe.group_size)
    except (QuantkitError, KeyError, ValueError, TypeError):  # a config the planner cannot size: no speed figure
        return None


def _kv_report(partial: Path, reports: list[str]) -> JSONObject | None:
    from quantkit.calibrate.result import KV_REPORT_FILE

    return json.loads((partial / KV_REPORT_FILE).read_text(encoding="utf-8")) if KV_REPORT_FILE in reports else None


def _data_bytes(partial: Path, shard_bytes: dict[str, int]) -> int:
    from quantkit.checkpoint.safetensors_header import read_header

    return sum(read_header(partial / f).data_bytes for f in shard_bytes)
