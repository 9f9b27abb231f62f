"""`quantkit report`: what a checkpoint really holds, read from its shard headers (no weights loaded).

Sizes come from each tensor's `data_offsets`, so header bytes + tensor bytes add up to the bytes on
disk exactly, and the report says so. Tensors are grouped by role (the architecture adapter's
classification), by stored dtype and by logical format (int4 / fp8 / bf16 ...), compared with a
source checkpoint or model when given, and turned into per-GPU memory stacks and KV capacity.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from quantkit.arch import Adapter, get_adapter
from quantkit.checkpoint.safetensors_header import read_header
from quantkit.core.errors import QuantkitError
from quantkit.core.jsontypes import JSONObject
from quantkit.plan.inventory import (
    HeaderTensor,
    SizedTensor,
    logical_name,
    native_plan,
    read_shard_headers,
    size_model,
    totals_by,
)
from quantkit.plan.kv import KV_DTYPES
from quantkit.plan.models import ModelSource, load_config, resolve_model
from quantkit.plan.planner import Deployment, plan_compare, plan_one

__all__ = ["checkpoint_report", "disk_accounting", "sized_from_headers"]

_DTYPE_FORMAT = {
    "BF16": "bf16",
    "F16": "fp16",
    "F32": "fp32",
    "F8_E4M3": "fp8",
    "I64": "int64",
    "I32": "int32",
}


def _format_of(members: list[HeaderTensor]) -> str:
    packed = next((m for m in members if m.name.endswith(".weight_packed")), None)
    if packed is not None and packed.dtype == "U8":  # FP4: E8M0 (U8) scales are MXFP4, e4m3 ones NVFP4
        scale = next((m for m in members if m.name.endswith(".weight_scale")), None)
        return "mxfp4" if scale is not None and scale.dtype == "U8" else "nvfp4"
    if packed is not None:
        return "int4"
    main = next((m for m in members if m.name.endswith(".weight")), members[0])
    return _DTYPE_FORMAT.get(main.dtype, main.dtype.lower())


def _logical_shape(members: list[HeaderTensor]) -> tuple[int, ...]:
    for m in members:
        if m.name.endswith(".weight_packed") and len(m.shape) == 2:
            return (m.shape[0], m.shape[1] * (2 if m.dtype == "U8" else 8))
    main = next((m for m in members if m.name.endswith(".weight")), members[0])
    return main.shape


def sized_from_headers(headers: list[HeaderTensor], adapter: Adapter) -> list[SizedTensor]:
    """Group stored tensors into logical weights (packed + scale + shape -> one) with their real bytes."""
    groups: dict[str, list[HeaderTensor]] = defaultdict(list)
    for h in headers:
        groups[logical_name(h.name)].append(h)
    out = []
    for name, members in groups.items():
        info = adapter.classify(name)
        nbytes = sum(m.nbytes for m in members)
        out.append(
            SizedTensor(
                name, _logical_shape(members), info.role, info.layer, info.mtp, _format_of(members), nbytes
            )
        )
    return out


def disk_accounting(directory: Path) -> JSONObject:
    """Bytes on disk: shards (header + tensor data, which must add up), index, other files."""
    headers, files = read_shard_headers(directory)
    header_bytes = sum(8 + read_header(directory / name).header_len for name in files)
    tensor_bytes = sum(h.nbytes for h in headers)
    shard_bytes = sum(files.values())
    others = {
        p.name: p.stat().st_size for p in sorted(directory.iterdir()) if p.is_file() and p.name not in files
    }
    return {
        "shards": files,
        "shard_bytes_on_disk": shard_bytes,
        "header_bytes": header_bytes,
        "tensor_bytes": tensor_bytes,
        "headers_plus_tensors_equal_disk": header_bytes + tensor_bytes == shard_bytes,
        "other_files": others,
        "total_bytes_on_disk": shard_bytes + sum(others.values()),
        "stored_tensors": len(headers),
    }


def _index_check(directory: Path, headers: list[HeaderTensor]) -> JSONObject:
    path = directory / "model.safetensors.index.json"
    if not path.is_file():
        return {"present": False}
    try:
        weight_map = json.loads(path.read_text(encoding="utf-8")).get("weight_map", {})
    except (OSError, json.JSONDecodeError) as exc:
        raise QuantkitError(f"{path}: unreadable index ({exc})") from exc
    where = {h.name: h.file for h in headers}
    missing = sorted(set(where) - set(weight_map))
    stale = sorted(n for n, f in weight_map.items() if where.get(n) != f)
    return {"present": True, "ok": not missing and not stale, "unindexed": missing[:20], "stale": stale[:20]}


def _source_sizes(spec: str) -> JSONObject:
    """Bytes by role of the source: its shard headers if it is a checkpoint, else its config's plan."""
    source = resolve_model(spec)
    adapter = get_adapter(source.config)
    if source.checkpoint_dir is not None:
        headers, _ = read_shard_headers(source.checkpoint_dir)
        tensors = sized_from_headers(headers, adapter)
        origin = "shard headers"
    else:
        plan = native_plan(source.config)
        tensors = size_model(source.config, plan)
        origin = f"config.json inventory, {plan.label} plan"
    return {
        "name": source.name,
        "from": origin,
        "tensor_bytes": sum(t.nbytes for t in tensors),
        "by_role": totals_by(tensors, "role"),
        "by_format": totals_by(tensors, "fmt"),
    }


def checkpoint_report(directory: Path, dep: Deployment, source: str | None = None) -> JSONObject:
    """Everything `quantkit report` prints (JSON-ready)."""
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise QuantkitError(f"{directory}: no config.json (is this a checkpoint directory?)")
    config = load_config(config_path)
    adapter = get_adapter(config)
    headers, _ = read_shard_headers(directory)
    tensors = sized_from_headers(headers, adapter)
    disk = disk_accounting(directory)
    planned = sum(t.nbytes for t in size_model(config, native_plan(config)))
    model = ModelSource(directory.name, config, directory)
    per_gpu = [plan_one(model, dep, native_plan(config), kv, tensors, "shard headers") for kv in KV_DTYPES]
    report: JSONObject = {
        "checkpoint": str(directory),
        "disk": disk,
        "index": _index_check(directory, headers),
        "logical_tensors": len(tensors),
        "by_role": totals_by(tensors, "role"),
        "by_stored_dtype": totals_by(headers, "dtype"),
        "by_format": totals_by(tensors, "fmt"),
        "planned_tensor_bytes": planned,
        "planned_matches_disk": planned == disk["tensor_bytes"],
        "per_gpu": per_gpu,
        "plans": plan_compare(model, dep),
    }
    manifest = directory / "quantkit.json"
    if manifest.is_file():  # the converter's record, without its per-tensor table
        report["manifest"] = {k: v for k, v in load_config(manifest).items() if k != "tensors"}
    if source:
        src = _source_sizes(source)
        src["ratio"] = disk["tensor_bytes"] / src["tensor_bytes"] if src["tensor_bytes"] else None
        report["source"] = src
    return report
