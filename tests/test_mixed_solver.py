"""The budget solver (plan/mixed.py) and the budgets users state (plan/budget.py): exact choices, never over the
budget, a one-line refusal below the smallest loadable plan, sizes that agree with the planner's."""

from __future__ import annotations

import itertools
import random

import pytest

from quantkit.calibrate.sensitivity_table import SensitivityTable, UnitScores
from quantkit.core.errors import QuantkitError
from quantkit.plan.budget import budget_from_options, parse_fit
from quantkit.plan.catalog import GIB, get_gpu
from quantkit.plan.frontier import kv_tokens_for
from quantkit.plan.inventory import PrecisionPlan as SizingPlan
from quantkit.plan.mixed import Choice, ModelCosts, Option, frontier, model_costs, smallest, solve
from quantkit.plan.models import resolve_model
from quantkit.plan.planner import Deployment, plan_one
from quantkit.quant.units import Unit


def _costs(seed: int, n_units: int = 6) -> ModelCosts:
    rnd = random.Random(seed)
    choices = []
    for i in range(n_units):
        unit = Unit(f"layers.{i}.experts", "experts", i, False, (((64, 64), 3),))
        opts = [Option(f, rnd.randint(10, 200), rnd.randint(1, 50), rnd.random() * 10 ** -rnd.randint(2, 6))
                for f in ("int4-g32", "int4-g64", "int4-g128", "int8-g128")]
        opts.append(Option("bf16", 400, 100, 0.0))
        choices.append(Choice(unit, opts))
    return ModelCosts(1000, 10, choices, {}, 8)


def _brute(costs: ModelCosts, budget: int, axis: str) -> float:
    best = float("inf")
    for combo in itertools.product(*[c.options for c in costs.choices]):
        cost = (costs.fixed_bytes if axis == "bytes" else costs.fixed_per_gpu) + sum(
            o.nbytes if axis == "bytes" else o.per_gpu for o in combo)
        if cost <= budget:
            best = min(best, sum(o.kl for o in combo))
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("axis", ["bytes", "per_gpu"])
def test_solver_is_exact_and_within_budget(seed: int, axis: str) -> None:
    costs = _costs(seed)
    low = smallest(costs, axis)
    for room in (0, 37, 150, 600, 5000):
        s = solve(costs, low + room, axis)
        assert (s.total_bytes if axis == "bytes" else s.per_gpu_bytes) <= low + room
        assert s.kl == pytest.approx(_brute(costs, low + room, axis), rel=1e-12, abs=1e-18)
        assert set(s.units) == {c.unit.name for c in costs.choices}


def test_below_the_smallest_plan_is_one_line_naming_it() -> None:
    costs = _costs(1)
    low = smallest(costs, "bytes")
    with pytest.raises(QuantkitError, match=f"smallest loadable plan: checkpoint size {low:,} B"):
        solve(costs, low - 1, "bytes")


def test_frontier_is_monotone_and_spans_the_range() -> None:
    costs = _costs(3)
    pts = frontier(costs, "bytes", 9)
    assert pts[0].cost == smallest(costs, "bytes")
    assert all(b.kl <= a.kl for a, b in itertools.pairwise(pts))
    assert pts[-1].kl == 0.0  # everything kept at the top of the range


@pytest.mark.parametrize("text,expected", [("421GB", 421 * 10**9), ("392GiB", 392 * 2**30), ("123456789", 123456789)])
def test_max_size_accepts_decimal_binary_and_bytes(text: str, expected: int) -> None:
    config = resolve_model("glm-5.2").config
    b = budget_from_options(config, max_size=text)
    assert b is not None and b.axis == "bytes" and b.limit == expected


@pytest.mark.parametrize("kwargs,msg", [
    ({"max_size": "400GB", "fit": "h200:8", "kv_tokens": 1}, "give one budget"),
    ({"fit": "h200:8"}, "--kv-tokens N or --context L --concurrency C"),
    ({"fit": "h200:8", "context": 4096}, "go together"),
    ({"kv_tokens": 5}, "pass --fit GPU:N too"),
    ({"fit": "h200", "kv_tokens": 5}, "expected GPU:N"),
    ({"fit": "h999:8", "kv_tokens": 5}, "unknown GPU"),
    ({"max_size": "lots"}, "bad size"),
])
def test_bad_budgets_are_one_line_errors(kwargs: dict, msg: str) -> None:
    with pytest.raises(QuantkitError, match=msg):
        budget_from_options(resolve_model("glm-5.2").config, **kwargs)


def test_fit_limit_leaves_exactly_the_kv_asked_for() -> None:
    """The weights limit of --fit is the planner's memory model run backwards: weights at the limit leave at least
    the requested tokens, a page more weights would not."""
    config = resolve_model("glm-5.2").config
    gpu, n = parse_fit("h200:8")
    dep = Deployment(gpu, n)
    for tokens in (100_000, 300_000):
        b = budget_from_options(config, fit="h200:8", kv_tokens=tokens)
        assert b is not None and b.axis == "per_gpu"
        assert kv_tokens_for(config, dep, "bf16", b.limit) >= tokens
        assert kv_tokens_for(config, dep, "bf16", b.limit + 64 * 2**20) < tokens
    small = budget_from_options(config, fit="h200:8", kv_tokens=100_000)
    large = budget_from_options(config, fit="h200:8", context=65536, concurrency=4)
    assert small is not None and large is not None and large.limit < small.limit


def test_unit_costs_agree_with_the_planner() -> None:
    """The uniform INT4 plan sized by the solver's costs is the planner's INT4 checkpoint (tensor bytes; the
    solver adds a header allowance per stored tensor) and the same weights per GPU."""
    source = resolve_model("glm-5.2")
    costs = model_costs(source.config, None, tp=8)
    plan = {c.unit.name: ("int4-g32" if c.unit.kind == "experts" else "bf16") for c in costs.choices}
    row = plan_one(source, Deployment(get_gpu("h200"), 8), SizingPlan("int4", 32), "bf16")
    total = costs.total(plan, "bytes")
    assert row["checkpoint_bytes"] <= total <= row["checkpoint_bytes"] * 1.001
    assert costs.total(plan, "per_gpu") == pytest.approx(row["weights_per_gpu_bytes"], rel=1e-4)
    assert 400 * GIB < total < 430 * GIB


def test_solver_spends_the_budget_on_the_most_sensitive_units() -> None:
    """With a table where one layer's experts dominate, a small room goes to that layer first."""
    source = resolve_model("deepseek-v3")
    costs0 = model_costs(source.config, None, tp=8)
    units = {}
    for c in costs0.choices:
        heavy = 100.0 if c.unit.name == "layers.5.experts" else 1.0
        units[c.unit.name] = UnitScores(c.unit.name, c.unit.kind, c.unit.layer, c.unit.params,
                                        {"int4-g32": heavy * 1e-4, "int4-g128": heavy * 1.3e-4,
                                         "int8-g128": heavy * 1e-7})
    table = SensitivityTable("deepseek_v3", 61, ["int4-g32", "int4-g128", "int8-g128"], 8, 128, 1, 0, units)
    costs = model_costs(source.config, table, tp=8)
    uniform = {c.unit.name: ("int4-g32" if c.unit.kind == "experts" else "bf16") for c in costs.choices}
    s = solve(costs, costs.total(uniform, "bytes"), "bytes")
    assert s.units["layers.5.experts"] == "int8-g128"
    assert s.kl < sum(next(o.kl for o in c.options if o.fmt == uniform[c.unit.name]) for c in costs.choices)
    assert all(f != "bf16" for u, f in s.units.items() if u.endswith(".experts"))


def _heavy_table() -> SensitivityTable:
    costs = model_costs(resolve_model("deepseek-v3").config, None, tp=8)
    units = {}
    for c in costs.choices:
        heavy = 100.0 if c.unit.name == "layers.5.experts" else 1.0
        units[c.unit.name] = UnitScores(c.unit.name, c.unit.kind, c.unit.layer, c.unit.params,
                                        {"int4-g32": heavy * 1e-4, "int4-g64": heavy * 1.1e-4,
                                         "int4-g128": heavy * 1.3e-4, "int8-g128": heavy * 1e-7})
    return SensitivityTable("deepseek_v3", 61, ["int4-g32", "int4-g64", "int4-g128", "int8-g128"], 8, 128, 1, 0,
                            units)


def test_frontier_report_text_json_and_html(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`plan --sensitivity`: the uniform recipe first, then mixed plans that all leave KV room, KL falling as they
    grow; the HTML page embeds the plot."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from quantkit.plan.frontier import frontier_html, frontier_report, frontier_text

    table = _heavy_table()
    rep = frontier_report(resolve_model("deepseek-v3"), Deployment(get_gpu("h200"), 8), "fp8", table, points=6)
    rows = rep["rows"]
    assert rows[0]["plan"].startswith("uniform") and rows[0]["kl_vs_uniform"] == 1.0
    mixed = rows[1:]
    assert len(mixed) == 6 and all(r["kv_tokens"] > 0 for r in mixed)
    assert all(b["predicted_kl"] <= a["predicted_kl"] for a, b in zip(mixed, mixed[1:], strict=False))
    assert mixed[-1]["weights_per_gpu_bytes"] <= rep["weights_per_gpu_limit_bytes"]
    assert "uniform (default recipe)" in frontier_text(rep)
    frontier_html(rep, tmp_path / "f.html")
    assert "data:image/png;base64," in (tmp_path / "f.html").read_text()
    (tmp_path / "S.json").write_text(json.dumps(table.to_json()))
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "quantkit", "plan", "deepseek-v3", "--gpu", "h200", "--tp", "8",
                           "--sensitivity", str(tmp_path / "S.json"), "--json"], capture_output=True, text=True,
                          env={**__import__("os").environ, "PYTHONPATH": str(repo)})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["rows"][0]["plan"].startswith("uniform")
