"""Mixed precision sized to a budget: every unit's bytes per format, and the plan that minimises predicted KL.

The problem is a multiple-choice knapsack: each quantization unit (quant/units.py) takes exactly one of its
candidate formats (engines/mixed.py: what both engines load), each with a cost (checkpoint bytes, or weight
bytes on one GPU of the deployment) and a predicted KL from the sensitivity table; the sum of costs stays
within the budget and the sum of predicted KL is minimal. `solve` is exact up to the cost resolution: a
dynamic programme over the extra bytes each unit spends above its cheapest format, in at most
`RESOLUTION` steps, every cost rounded *up* (a plan never exceeds the budget), then the bytes the rounding
left are spent greedily on the best remaining upgrades. One programme gives the whole frontier (predicted
KL against size) too. Units the table has no prediction for (MTP layers, which do not change the main
model's output) keep their recipe format.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from quantkit.arch import get_adapter
from quantkit.calibrate.sensitivity_table import SensitivityTable
from quantkit.core.errors import QuantkitError
from quantkit.engines.mixed import candidate_formats
from quantkit.plan.inventory import PrecisionPlan as SizingPlan
from quantkit.plan.inventory import SizedTensor, size_model
from quantkit.plan.memory import per_gpu_weights, shard_divisor
from quantkit.quant.scheme import FORMATS, FormatName
from quantkit.quant.units import Unit, list_units, unit_of

__all__ = ["Axis", "Choice", "ModelCosts", "Option", "Solution", "frontier", "model_costs", "solve"]

Axis = Literal["bytes", "per_gpu"]  # what the budget bounds: checkpoint bytes, or weight bytes on one GPU
RESOLUTION = 100_000  # cost steps of the dynamic programme (rounding loses at most units/RESOLUTION of the room)
HEADER_BYTES_PER_TENSOR = 256  # safetensors header allowance per stored tensor (JSON entry; measured < 200)


@dataclass(frozen=True)
class Option:
    fmt: FormatName
    nbytes: int
    per_gpu: int
    kl: float


@dataclass
class Choice:
    """One unit's candidates (only those the table predicts, and kept formats at 0) and what it was given."""

    unit: Unit
    options: list[Option]

    def cost(self, fmt: str, axis: Axis) -> int:
        o = next(o for o in self.options if o.fmt == fmt)
        return o.nbytes if axis == "bytes" else o.per_gpu


@dataclass
class ModelCosts:
    """Everything a budget is checked against: the fixed part and each unit's options."""

    fixed_bytes: int  # tensors outside the units (embeddings, norms, routers, lm_head...) + headers
    fixed_per_gpu: int
    choices: list[Choice]  # units with a choice
    pinned: dict[str, Option]  # units with one format (no prediction: MTP layers)
    tp: int

    def total(self, plan: dict[str, str], axis: Axis) -> int:
        fixed = self.fixed_bytes if axis == "bytes" else self.fixed_per_gpu
        pinned = sum(o.nbytes if axis == "bytes" else o.per_gpu for o in self.pinned.values())
        return fixed + pinned + sum(c.cost(plan[c.unit.name], axis) for c in self.choices)


@dataclass
class Solution:
    units: dict[str, FormatName]  # every unit (pinned included)
    predicted_kl: dict[str, float]
    total_bytes: int
    per_gpu_bytes: int

    @property
    def kl(self) -> float:
        return sum(self.predicted_kl.values())

    def to_json(self) -> dict[str, Any]:
        return {"units": self.units, "predicted_kl": self.predicted_kl, "total_bytes": self.total_bytes,
                "per_gpu_bytes": self.per_gpu_bytes, "kl": self.kl}


@dataclass
class FrontierPoint:
    cost: int
    kl: float
    plan: dict[str, FormatName] = field(default_factory=dict)


def _unit_key(t: SizedTensor) -> str:
    return t.name.replace(".experts.*.", ".experts.0.")  # collapsed expert tensors: classify as one expert


def model_costs(config: dict[str, Any], table: SensitivityTable | None, tp: int = 8, dp_attention: bool = False,
                speculative: bool = False, fp8_source: bool = False, fp4: bool = False,
                pinned_format: FormatName = "int4-g32", formats: tuple[str, ...] | None = None) -> ModelCosts:
    """Each unit's bytes (whole checkpoint and per GPU at `tp`) per candidate format, with the table's KL.

    Without a table every candidate gets KL 0 (sizes only: the planner's size axis)."""
    adapter = get_adapter(config)
    tensors = size_model(config, SizingPlan("bf16"))
    by_unit: dict[str, list[SizedTensor]] = {}
    fixed: list[SizedTensor] = []
    for t in tensors:
        u = unit_of(adapter, _unit_key(t)) if t.name.endswith(".weight") and len(t.shape) == 2 else None
        (by_unit.setdefault(u, []) if u is not None else fixed).append(t)
    stored = sum(t.count for t in fixed)
    fixed_bytes = sum(t.nbytes for t in fixed) + HEADER_BYTES_PER_TENSOR * stored
    fixed_gpu = sum(per_gpu_weights(fixed, adapter, tp, dp_attention, speculative).values())
    choices, pinned = [], {}
    for unit in list_units(adapter):
        members = by_unit.get(unit.name, [])
        counted = not unit.mtp or speculative

        def option(fmt: FormatName, kl: float, members: list[SizedTensor] = members, counted: bool = counted
                   ) -> Option:
            f = FORMATS[fmt]
            nbytes, gpu = 0, 0
            for t in members:
                each = f.matrix_bytes(t.shape)
                nbytes += each * t.count + HEADER_BYTES_PER_TENSOR * t.count * len(f.stored(t.shape))
                gpu += math.ceil(each / shard_divisor(t, adapter, tp, dp_attention)) * t.count if counted else 0
            return Option(fmt, nbytes, gpu, kl)

        scores = table.units.get(unit.name) if table is not None else None
        allowed = [f for f in candidate_formats(unit, fp8_source, fp4, adapter) if formats is None or f in formats
                   or not FORMATS[f].computed]
        opts = []
        for fmt in allowed:
            if not _fits(fmt, unit):
                continue
            if not FORMATS[fmt].computed:
                opts.append(option(fmt, 0.0))
            elif table is None:
                opts.append(option(fmt, 0.0))
            elif scores is not None and fmt in scores.kl:
                opts.append(option(fmt, scores.kl[fmt]))
        if table is not None and scores is None:  # not scored (MTP): the recipe's format, not chosen
            fmt = pinned_format if _fits(pinned_format, unit) else "bf16"
            pinned[unit.name] = option(fmt, 0.0)
        else:
            choices.append(Choice(unit, opts))
    return ModelCosts(fixed_bytes, fixed_gpu, choices, pinned, tp)


def _fits(fmt: FormatName, unit: Unit) -> bool:
    try:
        for shape, _ in unit.matrices:
            FORMATS[fmt].check_shape(shape, unit.name)
    except QuantkitError:
        return False
    return True


def _programme(costs: ModelCosts, axis: Axis, room: int) -> tuple[np.ndarray, np.ndarray, int, list[int]]:
    """The DP over extra cost: best[c] = least KL with extra <= c * step; choice[i, c] the option of unit i."""
    bases = [min((o.nbytes if axis == "bytes" else o.per_gpu) for o in c.options) for c in costs.choices]
    step = max(1, -(-room // RESOLUTION))
    cells = room // step + 1
    best = np.zeros(cells)
    choice = np.zeros((len(costs.choices), cells), dtype=np.int16)
    for i, (c, base) in enumerate(zip(costs.choices, bases, strict=True)):
        new = np.full(cells, np.inf)
        arg = np.zeros(cells, dtype=np.int16)
        for j, o in enumerate(c.options):
            d = -(-((o.nbytes if axis == "bytes" else o.per_gpu) - base) // step)
            if d >= cells:
                continue
            cand = np.full(cells, np.inf)
            cand[d:] = best[: cells - d] + o.kl
            better = cand < new
            new[better], arg[better] = cand[better], j
        best, choice[i] = new, arg
    return best, choice, step, bases


def _backtrack(costs: ModelCosts, choice: np.ndarray, cell: int, step: int, bases: list[int], axis: Axis
               ) -> dict[str, FormatName]:
    plan: dict[str, FormatName] = {}
    for i in reversed(range(len(costs.choices))):
        c = costs.choices[i]
        o = c.options[int(choice[i, cell])]
        plan[c.unit.name] = o.fmt
        cell -= -(-((o.nbytes if axis == "bytes" else o.per_gpu) - bases[i]) // step)
    return plan


def smallest(costs: ModelCosts, axis: Axis) -> int:
    """The smallest reachable total: every unit in its cheapest candidate."""
    return costs.total({c.unit.name: min(c.options, key=lambda o: o.nbytes if axis == "bytes" else o.per_gpu).fmt
                        for c in costs.choices}, axis)


def largest(costs: ModelCosts, axis: Axis) -> int:
    """The largest total: every unit in its most expensive candidate."""
    return costs.total({c.unit.name: max(c.options, key=lambda o: o.nbytes if axis == "bytes" else o.per_gpu).fmt
                        for c in costs.choices}, axis)


def solve(costs: ModelCosts, budget: int, axis: Axis = "bytes") -> Solution:
    """The plan of least predicted KL whose total cost on `axis` is within `budget` (a one-line error naming the
    smallest reachable size when none is)."""
    if any(not c.options for c in costs.choices):
        bad = next(c.unit.name for c in costs.choices if not c.options)
        raise QuantkitError(f"unit {bad}: no candidate format can store it")
    low = smallest(costs, axis)
    if budget < low:
        what = "checkpoint size" if axis == "bytes" else "weights per GPU"
        raise QuantkitError(f"budget {budget:,} B is below the smallest loadable plan: {what} {low:,} B "
                            f"({low / 2**30:.2f} GiB)")
    best, choice, step, bases = _programme(costs, axis, budget - low)
    plan = _backtrack(costs, choice, len(best) - 1, step, bases, axis)
    plan = _spend_rest(costs, plan, budget, axis)
    return _solution(costs, plan)


def _spend_rest(costs: ModelCosts, plan: dict[str, FormatName], budget: int, axis: Axis) -> dict[str, FormatName]:
    """Spend what the rounding left: the upgrade with the most KL saved per byte, while one fits."""
    plan = dict(plan)
    while True:
        left = budget - costs.total(plan, axis)
        best, pick = 0.0, None
        for c in costs.choices:
            now = next(o for o in c.options if o.fmt == plan[c.unit.name])
            for o in c.options:
                extra = (o.nbytes - now.nbytes) if axis == "bytes" else (o.per_gpu - now.per_gpu)
                gain = now.kl - o.kl
                if gain > 0 and extra <= left and gain / max(extra, 1) > best:
                    best, pick = gain / max(extra, 1), (c.unit.name, o.fmt)
        if pick is None:
            return plan
        plan[pick[0]] = pick[1]


def _solution(costs: ModelCosts, plan: dict[str, FormatName]) -> Solution:
    units: dict[str, FormatName] = {**{u: o.fmt for u, o in costs.pinned.items()}, **plan}
    kl = {c.unit.name: next(o.kl for o in c.options if o.fmt == plan[c.unit.name]) for c in costs.choices}
    return Solution(dict(sorted(units.items(), key=lambda kv: _order(kv[0]))), kl, costs.total(plan, "bytes"),
                    costs.total(plan, "per_gpu"))


def _order(unit: str) -> tuple[int, str]:
    parts = unit.split(".")
    return int(parts[1]), parts[2]


def frontier(costs: ModelCosts, axis: Axis = "bytes", points: int = 24, top: int | None = None
             ) -> list[FrontierPoint]:
    """Predicted KL against cost, from the smallest reachable plan to `top` (default: every unit at its most
    expensive candidate), `points` plans evenly spaced in cost (one programme for all of them)."""
    low = smallest(costs, axis)
    high = min(top, largest(costs, axis)) if top is not None else largest(costs, axis)
    best, choice, step, bases = _programme(costs, axis, max(high - low, 0))
    out = []
    for k in range(points):
        cell = round(k * (len(best) - 1) / max(points - 1, 1))
        plan = _backtrack(costs, choice, cell, step, bases, axis)
        out.append(FrontierPoint(costs.total(plan, axis), float(best[cell]), plan))
    return out
