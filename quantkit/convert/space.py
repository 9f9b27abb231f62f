"""Free-space preflight: how many bytes a conversion will write, checked against the disk before it starts.

The estimate is exact for the shards (the plan knows every output tensor's dtype and shape) and
generous for the rest: headers, index, config and quantkit.json, the carried-over files, and for
calibrated recipes the spill in `OUT.partial/calibration` (per-layer GPTQ results plus two layers of
activations). A resumed run needs only what is not on disk yet.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from quantkit.checkpoint.source import INDEX_NAME, PICKLE_SUFFIXES, SourceCheckpoint
from quantkit.convert.plan import TensorPlan
from quantkit.core.durable import tree_bytes
from quantkit.core.errors import QuantkitError
from quantkit.quant.recipe import Recipe

__all__ = ["NeededBytes", "planned_bytes", "preflight"]

_HEADER_BYTES_PER_TENSOR = 160  # safetensors header JSON per tensor, generously
_METADATA_BYTES_PER_TENSOR = 640  # index + quantkit.json entries per tensor, generously
_FIXED_BYTES = 1 << 20  # config.json, recipe, reports


@dataclass(frozen=True)
class NeededBytes:
    """What a conversion writes at its peak, by kind (bytes)."""

    shards: int
    metadata: int
    carried: int
    calibration: int

    @property
    def total(self) -> int:
        return self.shards + self.metadata + self.carried + self.calibration


def planned_bytes(source: SourceCheckpoint, plans: dict[str, list[TensorPlan]], recipe: Recipe) -> NeededBytes:
    """The peak bytes under OUT.partial for this plan (work files are removed only at publish)."""
    outputs = [o for ps in plans.values() for p in ps for o in p.outputs]
    shards = sum(o.nbytes + _HEADER_BYTES_PER_TENSOR for o in outputs)
    physical = sum(len(h.tensors) for h in source.headers.values())
    metadata = _FIXED_BYTES + _METADATA_BYTES_PER_TENSOR * (len(outputs) + physical)
    carried = _carried_bytes(source)
    calibration = 0
    if recipe.needs_calibration:
        hidden = int(source.adapter.config.get("hidden_size") or 0)
        c = recipe.calibration
        acts = 2 * c.samples * c.seq_len * hidden * 4  # a layer's fp32 inputs and outputs on disk
        quantized = sum(o.nbytes for ps in plans.values() for p in ps if p.action == "quantize" for o in p.outputs)
        calibration = acts + (quantized if recipe.method == "gptq" else 0)
    return NeededBytes(shards, metadata, carried, calibration)


def preflight(partial: Path, needed: NeededBytes, resumable: bool) -> None:
    """Refuse, before writing anything, a run whose output cannot fit on OUT's file system."""
    existing = tree_bytes(partial)
    still = needed.total - existing if resumable else needed.total
    free = shutil.disk_usage(_existing_ancestor(partial)).free + (0 if resumable else existing)
    if still > free:
        raise QuantkitError(
            f"{partial.parent}: not enough free space: this conversion needs {still} more bytes "
            f"({still / 1e9:.2f} GB: shards {needed.shards}, calibration spill {needed.calibration}, other "
            f"{needed.metadata + needed.carried}) but {free} are free"
        )


def _carried_bytes(source: SourceCheckpoint) -> int:
    weights = set(source.shard_files) | {INDEX_NAME, "config.json"}
    total = 0
    for path in source.root.rglob("*"):
        rel = path.relative_to(source.root).as_posix()
        if path.is_file() and rel not in weights and not rel.endswith((*PICKLE_SUFFIXES, ".safetensors")):
            total += path.stat().st_size
    return total


def _existing_ancestor(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path
