"""The metadata of a per-unit (mixed) conversion: its `quantization_config` and the `precision` block of
quantkit.json (each unit's format, parameters and written bytes), from the plan every tensor was written by."""

from __future__ import annotations

from typing import Any

from quantkit.checkpoint.qconfig import build_mixed_quantization_config
from quantkit.checkpoint.source import SourceCheckpoint
from quantkit.convert.plan import TensorPlan
from quantkit.quant.precision import PrecisionPlan, resolve_precision
from quantkit.quant.recipe import Recipe
from quantkit.quant.scheme import FORMATS
from quantkit.quant.units import list_units

__all__ = ["mixed_metadata", "precision_record"]


def precision_record(plan: PrecisionPlan, source: SourceCheckpoint, plans: dict[str, list[TensorPlan]]
                     ) -> dict[str, Any]:
    """quantkit.json's `precision`: per unit (model order) its format and label, parameters, the bytes written for
    it (from the planned outputs) and, when a solver chose it, the predicted KL; totals per format."""
    written: dict[str, int] = {}
    for p in (p for ps in plans.values() for p in ps if p.unit is not None):
        written[p.unit] = written.get(p.unit, 0) + sum(o.nbytes for o in p.outputs)  # type: ignore[index]
    units = []
    per_format: dict[str, dict[str, int]] = {}
    for u in list_units(source.adapter):
        if u.name not in written:  # an MTP layer the source does not hold
            continue
        name = plan.units[u.name]
        row: dict[str, Any] = {"unit": u.name, "kind": u.kind, "layer": u.layer, "mtp": u.mtp, "format": name,
                               "label": FORMATS[name].label, "params": u.params, "bytes": written[u.name]}
        if u.name in plan.predicted_kl:
            row["predicted_kl"] = plan.predicted_kl[u.name]
        units.append(row)
        total = per_format.setdefault(name, {"units": 0, "params": 0, "bytes": 0})
        total["units"] += 1
        total["params"] += u.params
        total["bytes"] += written[u.name]
    return {"units": units, "formats": per_format}


def mixed_metadata(source: SourceCheckpoint, recipe: Recipe, plans: dict[str, list[TensorPlan]], kv_cache: bool,
                   plan: PrecisionPlan | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json's `quantization_config`, quantkit.json's `precision`) of a per-unit conversion."""
    plan = plan or resolve_precision(recipe, source.adapter)
    units = [u for u in list_units(source.adapter) if any(
        p.unit == u.name for ps in plans.values() for p in ps)]
    qconfig = build_mixed_quantization_config(source.adapter, units, plan.units, kv_cache, source.fp8_block_size)
    return qconfig, precision_record(plan, source, plans)
