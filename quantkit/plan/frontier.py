"""The planner's frontier: predicted KL against size for the plans a deployment can hold.

`frontier_report` sizes the default uniform recipe (INT4 routed experts) and the solver's mixed plans from the
smallest loadable one up to the largest that still leaves KV room, each with its checkpoint bytes, weights per
GPU, KV tokens and predicted KL (from a sensitivity table of *this* model: a table of another model is
refused). `frontier_text` prints it; `frontier_html` plots KL against checkpoint size with the deployment's
limits marked (plan/html.py renders the page).
"""

from __future__ import annotations

import math
from typing import Any

from quantkit.arch import get_adapter
from quantkit.calibrate.sensitivity_table import SensitivityTable
from quantkit.core.errors import QuantkitError
from quantkit.plan.catalog import GIB
from quantkit.plan.kv import kv_bytes_per_token_per_gpu
from quantkit.plan.memory import has_vision
from quantkit.plan.mixed import ModelCosts, frontier, model_costs, smallest
from quantkit.plan.models import ModelSource
from quantkit.plan.planner import Deployment

__all__ = ["frontier_report", "frontier_text", "kv_tokens_for"]


def kv_tokens_for(config: dict[str, Any], dep: Deployment, kv: str, weights_per_gpu: int) -> int:
    """KV tokens the deployment holds next to `weights_per_gpu` (plan/memory.py's model; 0 when it does not fit)."""
    adapter = get_adapter(config)
    a = dep.assumptions
    fraction = a.mem_fraction * (a.multimodal_factor if has_vision(config) else 1.0)
    pool = int(dep.gpu.memory_bytes * fraction) - int(a.reserve_gib * GIB) - weights_per_gpu
    cell = kv_bytes_per_token_per_gpu(adapter.config, adapter.kv_layout, kv, dep.tp,
                                      draft_layers=adapter.num_mtp_layers if a.speculative else 0,
                                      shared_indexer=a.shared_indexer)
    tokens = max(0, pool) // cell // a.page_size * a.page_size
    return tokens * (dep.tp if dep.dp_attention else 1)


def _uniform(costs: ModelCosts, config: dict[str, Any]) -> dict[str, str]:
    """The default recipe's plan over the units the costs list (its roles quantized, the rest kept)."""
    from quantkit.quant.precision import resolve_precision
    from quantkit.quant.recipe import load_recipe

    units = resolve_precision(load_recipe(None, config), get_adapter(config)).units
    out = {}
    for c in costs.choices:
        want = units.get(c.unit.name, "bf16")
        fmts = [o.fmt for o in c.options]
        out[c.unit.name] = want if want in fmts else ("bf16" if "bf16" in fmts else fmts[0])
    return out


def frontier_report(source: ModelSource, dep: Deployment, kv: str, table: SensitivityTable,
                    points: int = 12) -> dict[str, Any]:
    """Uniform INT4 and the mixed plans, for `table`'s model on `dep` (JSON-ready)."""
    config = source.config
    if table.model_type != str(config.get("model_type")) or table.layers != get_adapter(config).num_layers:
        raise QuantkitError(f"--sensitivity: the table is of a {table.model_type} model with {table.layers} layers, "
                            f"not {source.name} ({config.get('model_type')}, {get_adapter(config).num_layers} layers)"
                            "; measure it on this model with `quantkit sensitivity`")
    missing = [c.unit.name for c in model_costs(config, None, dep.tp).choices if c.unit.name not in table.units
               and not c.unit.mtp]
    if missing:
        raise QuantkitError(f"--sensitivity: the table has no scores for unit {missing[0]} of {source.name}")
    costs = model_costs(config, table, tp=dep.tp, dp_attention=dep.dp_attention,
                        speculative=dep.assumptions.speculative)
    fits_at = _largest_fitting(config, dep, kv, costs)

    def row(label: str, plan: dict[str, str]) -> dict[str, Any]:
        gpu = costs.total(plan, "per_gpu")
        kl = sum(next(o.kl for o in c.options if o.fmt == plan[c.unit.name]) for c in costs.choices)
        return {"plan": label, "checkpoint_bytes": costs.total(plan, "bytes"), "weights_per_gpu_bytes": gpu,
                "kv_tokens": kv_tokens_for(config, dep, kv, gpu), "predicted_kl": kl,
                "changed_units": sum(1 for c in costs.choices if plan[c.unit.name] != uniform[c.unit.name]),
                "units": plan}

    uniform = _uniform(costs, config)
    rows = [row("uniform (default recipe)", uniform)]
    if fits_at is not None:
        for p in frontier(costs, "per_gpu", points, top=fits_at):
            rows.append(row("mixed", p.plan))
    base = rows[0]["predicted_kl"]
    for r in rows:
        r["kl_vs_uniform"] = r["predicted_kl"] / base if base > 0 else math.nan
    return {"model": source.name, "gpu": dep.gpu.key, "tp": dep.tp, "kv": kv, "table": {
        "model_type": table.model_type, "sequences": table.sequences, "seq_len": table.seq_len,
        "method": table.method}, "smallest_checkpoint_bytes": smallest(costs, "bytes"),
        "weights_per_gpu_limit_bytes": fits_at, "rows": rows}


def _largest_fitting(config: dict[str, Any], dep: Deployment, kv: str, costs: ModelCosts) -> int | None:
    """The most weight bytes per GPU that leave at least one page of KV plus the scheduler's headroom."""
    a = dep.assumptions
    need = a.headroom_tokens + a.page_size
    lo = smallest(costs, "per_gpu")
    if kv_tokens_for(config, dep, kv, lo) < need:
        return None
    hi = lo + 4 * GIB * 1024
    while hi - lo > 1 << 20:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if kv_tokens_for(config, dep, kv, mid) >= need else (lo, mid)
    return lo


def _size(n: float) -> str:
    for scale, unit in ((GIB, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def frontier_text(rep: dict[str, Any]) -> str:
    lines = [f"{rep['model']} on {rep['tp']} x {rep['gpu']} (KV {rep['kv']}): predicted KL from a "
             f"{rep['table']['model_type']} sensitivity table ({rep['table']['sequences']} x "
             f"{rep['table']['seq_len']} tokens)",
             f"{'plan':<26}{'checkpoint':>12}{'weights/GPU':>13}{'KV tokens':>13}{'pred. KL':>11}{'x unif.':>9}"
             f"{'units changed':>15}"]
    for r in rep["rows"]:
        lines.append(f"{r['plan']:<26}{_size(r['checkpoint_bytes']):>12}{_size(r['weights_per_gpu_bytes']):>13}"
                     f"{r['kv_tokens']:>13,}{r['predicted_kl']:>11.2e}{r['kl_vs_uniform']:>9.2f}"
                     f"{r['changed_units']:>15}")
    if rep["weights_per_gpu_limit_bytes"] is None:
        lines.append("no plan fits: even the smallest leaves no KV room on this deployment")
    return "\n".join(lines)


def frontier_html(rep: dict[str, Any], path: Any) -> None:
    """A self-contained page: predicted KL against checkpoint size, the deployment's limit marked, and the table."""
    import html as h

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from quantkit.core.durable import write_text_atomic
    from quantkit.plan.html import _png

    rows = rep["rows"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    mixed = [r for r in rows if r["plan"] == "mixed"]
    ax.plot([r["checkpoint_bytes"] / GIB for r in mixed], [r["predicted_kl"] for r in mixed], "o-",
            label="mixed plans (solver)")
    u = rows[0]
    ax.plot([u["checkpoint_bytes"] / GIB], [u["predicted_kl"]], "s", color="C3", label=u["plan"])
    if mixed:
        top = max(mixed, key=lambda r: r["weights_per_gpu_bytes"])
        ax.axvline(top["checkpoint_bytes"] / GIB, color="grey", ls="--",
                   label=f"{rep['tp']} x {rep['gpu']}: largest plan with KV room")
    ax.axvline(rep["smallest_checkpoint_bytes"] / GIB, color="grey", ls=":", label="smallest loadable plan")
    ax.set_xlabel("checkpoint (GiB)")
    ax.set_ylabel("predicted KL(source || model)")
    ax.set_yscale("log")
    ax.set_title(f"{rep['model']}: predicted KL against size")
    ax.legend(fontsize=8)
    image = _png(fig)
    cells = "".join(
        f"<tr><td>{h.escape(r['plan'])}</td><td>{r['checkpoint_bytes'] / GIB:.1f}</td>"
        f"<td>{r['weights_per_gpu_bytes'] / GIB:.2f}</td><td>{r['kv_tokens']:,}</td>"
        f"<td>{r['predicted_kl']:.3e}</td><td>{r['kl_vs_uniform']:.2f}</td></tr>" for r in rows)
    page = (f"<!doctype html><meta charset=utf-8><title>{h.escape(rep['model'])} frontier</title>"
            f"<h1>{h.escape(rep['model'])} on {rep['tp']} x {h.escape(rep['gpu'])}</h1><img src='{image}'>"
            "<table border=1 cellpadding=4><tr><th>plan</th><th>checkpoint GiB</th><th>weights/GPU GiB</th>"
            f"<th>KV tokens</th><th>predicted KL</th><th>x uniform</th></tr>{cells}</table>")
    write_text_atomic(path, page)
