"""`convert --max-size / --fit`: the sensitivity table (given, or measured first), the solver, the recipe.

    sensitivity (OUT.sensitivity/ work directory, resumable; or --sensitivity S.json)
    -> costs of every unit per candidate format (plan/mixed.py) -> the plan of least predicted KL within the budget
    -> the recipe with that plan (`Recipe.units`), converted as any recipe

A budget below the smallest loadable plan is refused before anything is written (exit 2, one line naming the
smallest reachable size). The measured table waits beside the output (`OUT.sensitivity.json`, reused by a rerun
with the same calibration) until the conversion is published; `record_plan` then stores it in the output
(`quantkit_sensitivity.json`), adds each unit's predicted KL and the budget to quantkit.json, regenerates the card
and re-hashes SHA256SUMS (as `eval --record` does).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantkit.calibrate.sensitivity_table import SensitivityTable, load_table
from quantkit.core.distributed import SINGLE, World
from quantkit.core.errors import QuantkitError
from quantkit.engines.mixed import plan_refusals
from quantkit.plan.budget import Budget
from quantkit.plan.mixed import Solution, model_costs, solve
from quantkit.quant.precision import PrecisionPlan
from quantkit.quant.recipe import Recipe

__all__ = ["BudgetedRecipe", "budgeted_recipe", "table_path", "work_path"]


@dataclass
class BudgetedRecipe:
    recipe: Recipe
    solution: Solution
    table: SensitivityTable
    budget: Budget

    def summary(self) -> dict[str, Any]:
        return {"budget": self.budget.to_json(), **self.solution.to_json()}


def work_path(out: Path) -> Path:
    return out.with_name(out.name + ".sensitivity")


def table_path(out: Path) -> Path:
    return out.with_name(out.name + ".sensitivity.json")


def budgeted_recipe(src: Path, out: Path, recipe: Recipe, config: dict[str, Any], budget: Budget,
                    sensitivity: Path | None = None, device: str | None = None, world: World = SINGLE,
                    progress: Callable[[str], None] | None = None) -> BudgetedRecipe:
    """The recipe whose per-unit plan fits `budget` with the least predicted KL (every rank calls it)."""
    say = progress or (lambda _m: None)
    if recipe.units:
        raise QuantkitError(f"recipe {recipe.name}: it already has per-unit formats (units:); a budget chooses them")
    table = load_table(sensitivity) if sensitivity is not None else None
    if table is not None and table.model_type != str(config.get("model_type")):
        raise QuantkitError(f"{sensitivity}: a sensitivity table of a {table.model_type} model, not "
                            f"{config.get('model_type')}")
    fp8 = _fp8_source(config)
    fp4 = recipe.fp4 == "nvfp4"
    costs_probe = model_costs(config, None, tp=budget.fit.n if budget.fit else 8, fp8_source=fp8, fp4=fp4,
                              pinned_format=recipe.uniform_format.name)
    from quantkit.plan.mixed import smallest

    low = smallest(costs_probe, budget.axis)
    if budget.limit < low:  # refused before any sensitivity work: the cheapest plan does not fit
        what = "checkpoint size" if budget.axis == "bytes" else "weights per GPU"
        raise QuantkitError(f"budget {budget.label} is below the smallest loadable plan ({what} {low:,} B, "
                            f"{low / 2**30:.2f} GiB)")
    c = recipe.calibration
    if table is None and table_path(out).is_file():  # measured by an earlier run of this command: reuse
        previous = load_table(table_path(out))
        if (previous.model_type == str(config.get("model_type")) and previous.sequences == c.samples
                and previous.seq_len == c.seq_len and previous.extra.get("calibration") == str(c.dataset)):
            say(f"sensitivity: reusing {table_path(out)}")
            table = previous
    if table is None:
        from quantkit.calibrate.sensitivity_run import sensitivity_of

        if not c.dataset:
            raise QuantkitError("a budget needs calibration data for the sensitivity pass (pass --calib FILE)")
        say(f"sensitivity: {c.samples} x {c.seq_len} tokens of {c.dataset}")
        world.start()  # under torchrun: the ranks join before the first collective (idempotent)
        table = sensitivity_of(src, c.dataset, work_path(out), samples=c.samples, seq_len=c.seq_len,
                               device=device, world=world, progress=say, seed=c.seed)
        if world.is_main:
            from quantkit.calibrate.sensitivity import write_table

            write_table(table, table_path(out))
            shutil.rmtree(work_path(out), ignore_errors=True)
        world.barrier()
    costs = model_costs(config, table, tp=budget.fit.n if budget.fit else 8, fp8_source=fp8, fp4=fp4,
                        dp_attention=budget.fit.dp_attention if budget.fit else False,
                        speculative=budget.fit.assumptions.speculative if budget.fit else False,
                        pinned_format=recipe.uniform_format.name)
    solution = solve(costs, budget.limit, budget.axis)
    plan = PrecisionPlan(units=solution.units, predicted_kl=solution.predicted_kl)
    from quantkit.arch import get_adapter

    refused = plan_refusals(plan, get_adapter(config))
    if refused:
        raise QuantkitError(f"the solver's plan is refused: {refused[0].line()}")
    data = recipe.model_dump(mode="json")
    data["units"] = dict(solution.units)
    return BudgetedRecipe(Recipe.model_validate(data), solution, table, budget)


def _fp8_source(config: dict[str, Any]) -> bool:
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config") or {}
    return qc.get("quant_method") == "fp8"


SENSITIVITY_FILE = "quantkit_sensitivity.json"
_COVERAGE_FILE = "calibration_coverage.json"


def _gptq_gain(out: Path) -> dict[str, float]:
    """Per unit: `sum rel_error^2 / sum rtn_rel_error^2` over its modules in the calibration records (the output
    error GPTQ left relative to what RTN of the same format leaves; KL scales with its square)."""
    path = out / _COVERAGE_FILE
    if not path.is_file():
        return {}
    from quantkit.arch import get_adapter
    from quantkit.quant.units import unit_of

    cov = json.loads(path.read_text(encoding="utf-8"))
    adapter = get_adapter(json.loads((out / "config.json").read_text(encoding="utf-8")))
    sums: dict[str, list[float]] = {}
    for rec in cov.get("experts", []):
        acc = sums.setdefault(f"layers.{rec['layer']}.experts", [0.0, 0.0])
        for proj, err in rec.get("rel_error", {}).items():
            acc[0] += err ** 2
            acc[1] += rec["rtn_rel_error"][proj] ** 2
    for rec in cov.get("modules", []):
        unit = unit_of(adapter, rec["module"])
        if unit is not None and rec.get("rtn_rel_error"):
            acc = sums.setdefault(unit, [0.0, 0.0])
            acc[0] += rec["rel_error"] ** 2
            acc[1] += rec["rtn_rel_error"] ** 2
    return {u: a / b for u, (a, b) in sums.items() if b > 0}


def record_plan(out: Path, result: BudgetedRecipe) -> None:
    """After publishing: the table into the output, each unit's predicted KL and the budget into quantkit.json,
    the card and SHA256SUMS refreshed; the table beside the output removed."""
    from quantkit.core.durable import write_json_atomic
    from quantkit.hub.refresh import refresh_outputs

    write_json_atomic(out / SENSITIVITY_FILE, result.table.to_json())
    manifest = out / "quantkit.json"
    data = json.loads(manifest.read_text(encoding="utf-8"))
    kl = result.solution.predicted_kl
    gain = _gptq_gain(out) if result.recipe.method == "gptq" else {}
    for row in (data.get("precision") or {}).get("units", []):
        if row.get("unit") in kl:
            row["predicted_kl"] = kl[row["unit"]]
            if row["unit"] in gain:  # the table predicts RTN; GPTQ's error relative to RTN's, squared
                row["predicted_kl_gptq"] = kl[row["unit"]] * gain[row["unit"]]
    s = result.solution
    data["budget"] = {**result.budget.to_json(), "planned_bytes": s.total_bytes, "planned_per_gpu_bytes":
                      s.per_gpu_bytes, "predicted_kl": s.kl, "sensitivity": SENSITIVITY_FILE,
                      "method": result.table.method}
    write_json_atomic(manifest, data)
    refresh_outputs(out, ["quantkit.json", SENSITIVITY_FILE])
    table_path(out).unlink(missing_ok=True)
