"""`quantkit inspect`: what a source checkpoint holds, and what the default recipe would make of it."""

from __future__ import annotations

from pathlib import Path

from quantkit.checkpoint.source import open_source
from quantkit.core.jsontypes import JSONObject

__all__ = ["inspect_source"]


def inspect_source(path: str | Path, recipe: str | None = None) -> JSONObject:
    """Validate the source (as `convert` would) and summarise it by role, with the planned output size."""
    source = open_source(path)  # torch-free: a bad source is reported without importing torch
    from quantkit.convert.plan import plan_conversion
    from quantkit.quant.recipe import load_recipe

    resolved = load_recipe(recipe, source.config)
    plans = plan_conversion(source, resolved)
    roles: dict[str, JSONObject] = {}
    params = 0
    for plan in (p for ps in plans.values() for p in ps):
        row = roles.setdefault(plan.role.value, {"tensors": 0, "params": 0, "source_bytes": 0, "output_bytes": 0,
                                                 "actions": []})
        numel = 1
        for d in plan.source.shape:
            numel *= d
        row["tensors"] += 1
        row["params"] += numel
        row["source_bytes"] += plan.source.nbytes
        row["output_bytes"] += sum(o.nbytes for o in plan.outputs)
        if plan.action not in row["actions"]:
            row["actions"].append(plan.action)
        params += numel
    config = source.config
    return {
        "path": str(source.root),
        "architecture": (config.get("architectures") or ["?"])[0],
        "family": source.adapter.family,
        "kv_layout": source.adapter.kv_layout,
        "format": source.source_format,
        "shards": len(source.shard_files),
        "bytes": source.source_bytes,
        "params": params,
        "mtp_layers": source.adapter.num_mtp_layers,
        "recipe": resolved.name,
        "roles": dict(sorted(roles.items())),
        "estimated_output_bytes": sum(r["output_bytes"] for r in roles.values()),
        "warnings": source.warnings,
    }
