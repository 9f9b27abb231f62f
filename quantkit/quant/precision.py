"""A precision plan: every quantization unit of a model and the format it is written in.

A plan is data. The solver (or a user's recipe) states it as `Recipe.units`; `resolve_precision` expands a recipe
against a model's units (the uniform scheme where no entry overrides it, `bf16` for units whose role the recipe
keeps); the conversion, the calibration, the config writer, quantkit.json and the card read the result. Whether
the engines load a plan is decided in `quantkit/engines/mixed.py`.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from quantkit.arch import Adapter
from quantkit.core.errors import QuantkitError
from quantkit.quant.recipe import Recipe
from quantkit.quant.scheme import FORMATS, FP8_BLOCK, FormatName, WeightFormat
from quantkit.quant.units import Unit, list_units, unit_of

if TYPE_CHECKING:
    import torch

__all__ = ["PrecisionPlan", "resolve_precision", "tensor_format", "unit_formats"]


class PrecisionPlan(BaseModel):
    """Unit name -> format for every unit of one model (plus what the solver predicted, when it made it)."""

    model_config = ConfigDict(extra="forbid")
    units: dict[str, FormatName]
    predicted_kl: dict[str, float] = Field(default_factory=dict)  # unit -> predicted KL of its format (solver)

    def format_of(self, unit: str) -> WeightFormat:
        return FORMATS[self.units[unit]]

    def bytes(self, units: list[Unit], model_dtype: torch.dtype | None = None,
              fp8_block: tuple[int, int] = FP8_BLOCK) -> int:
        """Stored bytes of the planned units (the rest of the checkpoint aside)."""
        return sum(u.nbytes(self.format_of(u.name), model_dtype, fp8_block) for u in units if u.name in self.units)

    def formats_used(self) -> list[FormatName]:
        return sorted(set(self.units.values()), key=list(FORMATS).index)

    @property
    def uniform(self) -> bool:
        return len(set(self.units.values())) <= 1

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = "precision plan") -> PrecisionPlan:
        try:
            return cls.model_validate(json.loads(text))
        except (json.JSONDecodeError, ValidationError) as exc:
            first = str(exc).splitlines()[0] if isinstance(exc, json.JSONDecodeError) else _first_error(exc)
            raise QuantkitError(f"{where}: not a precision plan ({first})") from None

    @classmethod
    def load(cls, path: Path) -> PrecisionPlan:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise QuantkitError(f"{path}: cannot read the precision plan ({exc.strerror})") from None
        return cls.from_json(text, str(path))


def _first_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    return f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"


def unit_formats(recipe: Recipe, units: list[Unit]) -> dict[str, FormatName]:
    """Each unit's format under `recipe`: its `units` entry (exact name, else the last matching pattern), else
    the uniform format when the recipe quantizes the unit's role, else `bf16` (kept)."""
    roles = set(recipe.quantize_roles)
    names = {u.name for u in units}
    for key in recipe.units:
        if not any(c in key for c in "*?[") and key not in names:
            sample = ", ".join(sorted(names, key=_layer_key)[:4])
            raise QuantkitError(f"recipe {recipe.name}: unit {key!r} does not exist in this model (units look like "
                                f"{sample}, ...)")
        if not any(fnmatch.fnmatchcase(n, key) for n in names):
            raise QuantkitError(f"recipe {recipe.name}: unit pattern {key!r} matches no unit of this model")
    uniform: FormatName = recipe.uniform_format.name
    out: dict[str, FormatName] = {}
    for u in units:
        fmt: FormatName = uniform if u.role in roles else "bf16"
        for key, value in recipe.units.items():
            if key != u.name and fnmatch.fnmatchcase(u.name, key):
                fmt = value
        out[u.name] = recipe.units.get(u.name, fmt)
    return out


def resolve_precision(recipe: Recipe, adapter: Adapter) -> PrecisionPlan:
    """The precision plan `recipe` means for the model `adapter` describes (config alone suffices)."""
    return PrecisionPlan(units=unit_formats(recipe, list_units(adapter)))


def tensor_format(recipe: Recipe, adapter: Adapter, plan: PrecisionPlan | None, name: str) -> WeightFormat | None:
    """The format the 2-D weight (or Linear module) `name` is written in, None when it is kept: its unit's format
    in `plan`, else the recipe's uniform format when the recipe quantizes its role. `plan` None: the uniform
    recipe (units then follow the roles, exactly as before per-unit plans existed)."""
    unit = unit_of(adapter, name) if plan is not None else None
    if unit is not None:
        assert plan is not None
        fmt = FORMATS[plan.units[unit]]
        return fmt if fmt.kind != "bf16" else None
    role = adapter.classify(name if name.endswith(".weight") else name + ".weight").role
    return recipe.uniform_format if role in set(recipe.quantize_roles) else None


def _layer_key(name: str) -> tuple[int, str]:
    parts = name.split(".")
    return int(parts[1]), parts[2]


def plan_summary(plan: PrecisionPlan) -> dict[str, Any]:
    """Format -> number of units (for one-line reports)."""
    counts: dict[str, int] = {}
    for name in plan.units.values():
        counts[name] = counts.get(name, 0) + 1
    return counts
