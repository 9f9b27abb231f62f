"""The calibration journal: `layer_NNNN.safetensors` per finished layer (packed results, coverage, module
records, KV statistics, W4A4 input amax), with per-rank part files under torch.distributed; its existence marks
the layer done, so a rerun starts from the first layer without one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from quantkit.calibrate.kv import KVStats
from quantkit.core.distributed import SINGLE, World
from quantkit.core.durable import fsync_dir, fsync_file
from quantkit.core.errors import QuantkitError
from quantkit.core.paths import refuse_link, replace
from quantkit.quant.int4 import PackedInt4

__all__ = ["layer_file", "fp_dir", "first_unfinished", "save_layer", "part_file"]


def layer_file(work_dir: Path, layer: int) -> Path:
    return work_dir / f"layer_{layer:04d}.safetensors"


def fp_dir(work_dir: Path, layer: int) -> Path:
    """The full-precision model's inputs of `layer` (asymmetric calibration); layer 0's are the embeddings."""
    return work_dir / ("acts_0000" if layer == 0 else f"fp_{layer:04d}")


def first_unfinished(work_dir: Path, n: int, asymmetric: bool = False) -> int:
    for layer in range(n):
        if not layer_file(work_dir, layer).exists():
            # its inputs must be there (written before the previous layer's file)
            needed = [work_dir / f"acts_{layer:04d}"] + ([fp_dir(work_dir, layer)] if asymmetric else [])
            if layer > 0 and not all((d / "done").exists() for d in needed):
                raise QuantkitError(f"{work_dir}: layer {layer} inputs are missing; delete the directory to restart")
            return layer
    return n



def save_layer(work_dir: Path, layer: int, packed: dict[str, PackedInt4], coverage: list[dict[str, Any]],
                modules: list[dict[str, Any]], stats: KVStats | None, world: World = SINGLE,
                order: list[str] | None = None, amax: dict[str, float] | None = None) -> None:
    """The layer's results, published atomically: the existence of `layer_NNNN.safetensors` marks the
    layer as finished. One process: everything in that file. Several ranks (a collective): each rank's
    packed results in its part file, then rank 0 publishes the layer file with the gathered records, the
    KV statistics of all ranks and the list of parts. `order` is the dense modules' order; `amax` (W4A4, already
    merged over the ranks): module -> input amax."""
    tensors: dict[str, torch.Tensor] = {}
    for name, p in packed.items():
        tensors.update({k: v.contiguous() for k, v in p.tensors(name).items()})
    path = layer_file(work_dir, layer)
    if world.size == 1:
        meta = {
            "coverage": json.dumps(coverage),
            "modules": json.dumps(modules),
            "kv": json.dumps(stats.to_json() if stats else None),
            "amax": json.dumps(amax),
        }
        _publish(path, tensors, meta)
        return
    part = part_file(work_dir, layer, world.rank, world.size)
    _publish(part, tensors, {"rank": str(world.rank), "world_size": str(world.size)})
    gathered = world.all_gather_object({"coverage": coverage, "modules": modules,
                                        "kv": stats.to_json() if stats else None})  # also: all parts written
    if world.is_main:
        ranks: list[dict[str, Any]] = gathered  # type: ignore[assignment]
        position = {m: i for i, m in enumerate(order or [])}
        parts = [part_file(work_dir, layer, r, world.size).name for r in range(world.size)]
        meta = {
            "coverage": json.dumps(sorted((c for g in ranks for c in g["coverage"]), key=lambda c: c["expert"])),
            "modules": json.dumps(sorted((m for g in ranks for m in g["modules"]),
                                         key=lambda m: position.get(m["module"], 0))),
            "kv": json.dumps(_merge_kv([g["kv"] for g in ranks])),
            "parts": json.dumps(parts),
            "amax": json.dumps(amax),
        }
        _publish(path, {}, meta)
        for stale in work_dir.glob(f"layer_{layer:04d}.part*"):  # from an interrupted run of another size
            if stale.name not in parts:
                stale.unlink(missing_ok=True)
    world.barrier()


def part_file(work_dir: Path, layer: int, rank: int, size: int) -> Path:
    """Rank `rank`'s packed results of `layer` in a world of `size` ranks."""
    return work_dir / f"layer_{layer:04d}.part{rank}of{size}.safetensors"


def _merge_kv(parts: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The KV statistics of all ranks as one (max of the maxima, sums of the counts and histograms)."""
    if parts[0] is None:
        return None
    merged = KVStats.from_json(parts[0])
    for p in parts[1:]:
        merged = merged.merge(KVStats.from_json(p))  # type: ignore[arg-type]
    return merged.to_json()


def _publish(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    refuse_link(tmp, path)  # safetensors' writer follows links: check its name first
    save_file(tensors, str(tmp), metadata=meta)
    fsync_file(tmp)
    replace(tmp, path)
    fsync_dir(path.parent)
