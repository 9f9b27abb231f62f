"""GPU catalog: memory, bandwidth and dense FLOPS of the GPUs the planner sizes for.

The bundled `gpus.yaml` holds datasheet figures; users add or override GPUs with their own YAML
file of the same schema, so a new part needs no code change.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

import yaml

from quantkit.core.errors import QuantkitError
from quantkit.core.jsontypes import JSON

__all__ = ["GPU", "get_gpu", "load_catalog"]

MIB = 1024**2
GIB = 1024**3


@dataclass(frozen=True)
class GPU:
    """One GPU model: what the memory and roofline models need."""

    key: str
    name: str
    memory_mib: int
    bandwidth_tbs: float
    bf16_tflops: float
    fp8_tflops: float | None
    fp4_tflops: float | None = None  # dense FP4 tensor-core peak; set for Blackwell (NVFP4/MXFP4 native)

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MIB

    @property
    def bandwidth_bytes_s(self) -> float:
        return self.bandwidth_tbs * 1e12

    def flops(self, dtype: str) -> float:
        """Dense tensor-core FLOP/s for `bf16` or `fp8` (FP8 falls back to BF16 without FP8 units)."""
        if dtype == "fp8" and self.fp8_tflops:
            return self.fp8_tflops * 1e12
        return self.bf16_tflops * 1e12


def _parse(data: JSON, source: str) -> dict[str, GPU]:
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), dict):
        raise QuantkitError(f"{source}: expected a mapping with a top-level 'gpus:' mapping")
    out: dict[str, GPU] = {}
    for key, entry in data["gpus"].items():
        try:
            out[str(key).lower()] = GPU(
                key=str(key).lower(),
                name=str(entry.get("name", key)),
                memory_mib=int(entry["memory_mib"]),
                bandwidth_tbs=float(entry["bandwidth_tbs"]),
                bf16_tflops=float(entry["bf16_tflops"]),
                fp8_tflops=None if entry.get("fp8_tflops") is None else float(entry["fp8_tflops"]),
                fp4_tflops=None if entry.get("fp4_tflops") is None else float(entry["fp4_tflops"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise QuantkitError(
                f"{source}: GPU {key!r} needs memory_mib, bandwidth_tbs, bf16_tflops ({exc})"
            ) from exc
    return out


def load_catalog(extra: str | Path | None = None) -> dict[str, GPU]:
    """The bundled catalog, updated with the GPUs of `extra` (a YAML file) when given."""
    text = resources.files("quantkit.plan").joinpath("gpus.yaml").read_text(encoding="utf-8")
    catalog = _parse(yaml.safe_load(text), "quantkit/plan/gpus.yaml")
    if extra is not None:
        path = Path(extra)
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise QuantkitError(f"{path}: cannot read GPU catalog ({exc})") from exc
        catalog.update(_parse(data, str(path)))
    return catalog


@lru_cache(maxsize=8)
def _bundled() -> dict[str, GPU]:
    return load_catalog()


def get_gpu(key: str, extra: str | Path | None = None) -> GPU:
    """Look a GPU up by its catalog key (case-insensitive), e.g. `h200`."""
    catalog = load_catalog(extra) if extra is not None else _bundled()
    gpu = catalog.get(key.lower())
    if gpu is None:
        raise QuantkitError(f"--gpu {key!r}: unknown GPU (known: {', '.join(sorted(catalog))})")
    return gpu
