"""The sensitivity table (`quantkit sensitivity --out S.json`): predicted KL per unit and format, as data.

Torch-free, so the planner and the solver read it without the calibration stack. `kl[format]` is the
predicted mean KL(source || model) per token when that unit alone is in that format (the rest at the source);
predictions add over units. A format the table has no entry for is not a candidate for that unit; the
source precision ("bf16", kept) predicts 0.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit.core.errors import QuantkitError

__all__ = ["SCHEMA", "SensitivityTable", "UnitScores", "load_table"]

SCHEMA = "quantkit-sensitivity/1"


@dataclass
class UnitScores:
    """One unit's scores. `kl` is the prediction the solver uses: `coefficient x energy[format]`, the unit's
    output error energy per token in that format times one coefficient per unit, fitted to the Fisher estimates
    of all its formats together (less noisy than each Fisher estimate alone, see sensitivity.py); `kl_fisher`
    and `stderr` are the raw Fisher estimates and their standard errors."""

    unit: str
    kind: str
    layer: int
    params: int
    kl: dict[str, float]
    kl_fisher: dict[str, float] = field(default_factory=dict)
    stderr: dict[str, float] = field(default_factory=dict)
    energy: dict[str, float] = field(default_factory=dict)
    coefficient: float = 0.0

    @classmethod
    def combine(cls, unit: str, kind: str, layer: int, params: int, fisher: dict[str, float],
                stderr: dict[str, float], energy: dict[str, float]) -> UnitScores:
        """The prediction from the raw estimates: `kl[f] = c * energy[f]`, `c = sum_f fisher / sum_f energy`."""
        total = sum(energy.values())
        c = sum(fisher.values()) / total if total > 0 else 0.0
        return cls(unit, kind, layer, params, {f: c * e for f, e in energy.items()}, fisher, stderr, energy, c)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "layer": self.layer, "params": self.params, "kl": self.kl,
                "kl_fisher": self.kl_fisher, "stderr": self.stderr, "energy": self.energy,
                "coefficient": self.coefficient}

    @classmethod
    def from_json(cls, unit: str, d: dict[str, Any]) -> UnitScores:
        def floats(key: str) -> dict[str, float]:
            return {str(k): float(v) for k, v in (d.get(key) or {}).items()}

        return cls(unit, str(d["kind"]), int(d["layer"]), int(d["params"]), floats("kl"), floats("kl_fisher"),
                   floats("stderr"), floats("energy"), float(d.get("coefficient", 0.0)))

    @classmethod
    def from_json_map(cls, d: dict[str, Any]) -> dict[str, UnitScores]:
        return {u: cls.from_json(u, v) for u, v in d.items()}


@dataclass
class SensitivityTable:
    model_type: str
    layers: int
    formats: list[str]
    sequences: int
    seq_len: int
    draws: int
    seed: int
    units: dict[str, UnitScores]
    seconds: float = 0.0
    method: str = "fisher-sampled-labels"
    extra: dict[str, str] = field(default_factory=dict)

    def predicted_kl(self, choice: dict[str, str]) -> float:
        """Predicted KL of a plan (unit -> format; units not named, or kept at the source, add 0)."""
        return sum(self.units[u].kl.get(f, 0.0) for u, f in choice.items() if u in self.units)

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "model_type": self.model_type, "layers": self.layers, "formats": self.formats,
                "method": self.method, "sequences": self.sequences, "seq_len": self.seq_len, "draws": self.draws,
                "seed": self.seed, "seconds": round(self.seconds, 2), "extra": self.extra,
                "units": {u: s.to_json() for u, s in self.units.items()}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SensitivityTable:
        return cls(str(d["model_type"]), int(d["layers"]), [str(f) for f in d["formats"]], int(d["sequences"]),
                   int(d["seq_len"]), int(d["draws"]), int(d["seed"]),
                   UnitScores.from_json_map(d["units"]), float(d.get("seconds", 0.0)),
                   str(d.get("method", "fisher-sampled-labels")), dict(d.get("extra") or {}))


def load_table(path: Path) -> SensitivityTable:
    """Read S.json; a bad file is one line naming it."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise QuantkitError(f"{path}: cannot read the sensitivity table ({type(exc).__name__})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise QuantkitError(f"{path}: not a quantkit sensitivity table (expected schema {SCHEMA})")
    try:
        return SensitivityTable.from_json(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise QuantkitError(f"{path}: malformed sensitivity table ({type(exc).__name__}: {exc})") from None
