"""One self-contained HTML page for a checkpoint report: tables plus matplotlib plots as data: URIs.

No scripts, no external files: the page opens the same from a laptop, a CI artifact or an email.
matplotlib is imported here only (the Agg backend), so the CLI stays light for other commands.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import TYPE_CHECKING

from quantkit.core.jsontypes import JSONObject
from quantkit.plan.catalog import GIB

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["render_html", "write_html"]

_STACK = [
    ("routed experts", ("routed_expert",)),
    ("attention + indexer", ("attention", "indexer")),
    ("other weights", None),
]


def _png(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _unit(largest: float) -> tuple[float, str]:
    for scale, name in ((GIB, "GiB"), (1024**2, "MiB"), (1024, "KiB")):
        if largest >= scale:
            return scale, name
    return 1.0, "B"


def _labels(rows: list[JSONObject]) -> list[str]:
    return [
        ("stored " if r["assumptions"]["tensors_from"] == "shard headers" else "")
        + f"{r['weights']}\nKV {r['kv']}"
        for r in rows
    ]


def _bytes_by_role(report: JSONObject) -> str:
    import matplotlib.pyplot as plt

    roles = list(report["by_role"])
    src = report.get("source", {}).get("by_role", {})
    for r in src:
        if r not in roles:
            roles.append(r)
    scale, unit = _unit(max([*report["by_role"].values(), *src.values(), 1]))
    fig, ax = plt.subplots(figsize=(9, 4))
    ys = range(len(roles))
    ax.barh(
        [y + 0.2 for y in ys], [report["by_role"].get(r, 0) / scale for r in roles], 0.4, label="checkpoint"
    )
    if src:
        ax.barh([y - 0.2 for y in ys], [src.get(r, 0) / scale for r in roles], 0.4, label="source")
    ax.set_yticks(list(ys), roles)
    ax.set_xlabel(unit)
    ax.set_title("Bytes by role")
    ax.legend()
    return _png(fig)


def _memory_stacks(rows: list[JSONObject]) -> str:
    import matplotlib.pyplot as plt

    xs = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    bottom = [0.0] * len(rows)

    def add(values: list[float], label: str) -> None:
        ax.bar(xs, values, bottom=bottom, label=label)
        for i, v in enumerate(values):
            bottom[i] += v

    for label, roles in _STACK:
        if roles is None:
            used = {x for _, rs in _STACK if rs for x in rs}
            add(
                [
                    sum(v for k, v in r["weights_per_gpu_by_role"].items() if k not in used) / GIB
                    for r in rows
                ],
                label,
            )
        else:
            add([sum(r["weights_per_gpu_by_role"].get(k, 0) for k in roles) / GIB for r in rows], label)
    add([r["reserve_bytes"] / GIB for r in rows], "reserve")
    add([r["kv_pool_bytes"] / GIB for r in rows], "KV pool")
    add([r["activation_bytes"] / GIB for r in rows], "activations + graphs (1 - fraction)")
    ax.axhline(rows[0]["gpu_memory_bytes"] / GIB, color="black", linestyle="--", linewidth=1)
    ax.set_xticks(xs, _labels(rows), fontsize=8)
    ax.set_ylabel("GiB per GPU")
    ax.set_title("Per-GPU memory stack per plan")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _png(fig)


def _kv_and_requests(rows: list[JSONObject]) -> str:
    import matplotlib.pyplot as plt

    xs = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar(xs, [r["node_kv_capacity_tokens"] / 1e3 for r in rows], color="tab:blue")
    ax.set_xticks(xs, _labels(rows), fontsize=8)
    ax.set_ylabel("KV capacity (K tokens)", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(xs, [r["max_concurrent_requests"] for r in rows], "o", color="tab:red")
    ax2.set_ylim(bottom=0)
    ax2.set_ylabel(f"max concurrent requests at {rows[0]['context']:,} tokens", color="tab:red")
    ax.set_title("KV capacity and max concurrency per plan")
    return _png(fig)


def _table(headers: list[str], rows: list[list[object]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _g(n: float) -> str:
    from quantkit.plan.render import gib_gb

    return gib_gb(n)


def render_html(report: JSONObject) -> str:
    """The page as a string."""
    disk = report["disk"]
    plans = report["per_gpu"] + report["plans"]
    role_rows = [[role, _g(b)] for role, b in report["by_role"].items()]
    plan_rows = [
        [
            r["weights"],
            r["kv"],
            _g(r["checkpoint_bytes"]),
            _g(r["weights_per_gpu_bytes"]),
            f"{r['kv_bytes_per_token_per_gpu']:,}",
            f"{r['node_kv_capacity_tokens']:,}",
            r["max_concurrent_requests"],
            f"{r['decode_curve_tok_s']['1']:,.0f}",
            f"{r['prefill_tok_s']:,.0f}",
        ]
        for r in plans
    ]
    assumptions = [[k, v] for k, v in report["per_gpu"][0]["assumptions"].items()]
    source = report.get("source")
    src_html = ""
    if source:
        src_html = (
            f"<p>Source <b>{html.escape(source['name'])}</b> ({html.escape(source['from'])}): "
            f"{_g(source['tensor_bytes'])} &rarr; this checkpoint {_g(disk['tensor_bytes'])} "
            f"(x{source['ratio']:.3f}).</p>"
        )
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>quantkit report</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;"
        "margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
        "img{max-width:100%;display:block;margin:1em 0}</style></head><body>",
        f"<h1>quantkit report: {html.escape(report['checkpoint'])}</h1>",
        f"<p>Shards on disk: {_g(disk['shard_bytes_on_disk'])} = headers {disk['header_bytes']:,} B "
        f"+ tensors {disk['tensor_bytes']:,} B &mdash; "
        f"{'adds up exactly' if disk['headers_plus_tensors_equal_disk'] else 'DOES NOT add up'}. "
        f"{disk['stored_tensors']:,} stored tensors, {report['logical_tensors']:,} logical weights.</p>",
        f"<p>Sized from config.json alone, the same plan gives {report['planned_tensor_bytes']:,} B of tensors: "
        f"{'identical' if report['planned_matches_disk'] else 'different'}.</p>",
        src_html,
        "<h2>Bytes by role</h2>",
        f"<img id='plot-bytes-by-role' alt='bytes by role' src='{_bytes_by_role(report)}'>",
        _table(["role", "bytes"], role_rows),
        "<h2>Per-GPU memory per plan</h2>",
        f"<img id='plot-memory-stacks' alt='per-GPU memory stacks' src='{_memory_stacks(plans)}'>",
        "<h2>KV capacity and concurrency per plan</h2>",
        f"<img id='plot-kv-concurrency' alt='KV tokens and max concurrency' src='{_kv_and_requests(plans)}'>",
        _table(
            [
                "weights",
                "KV",
                "checkpoint",
                "weights / GPU",
                "KV B/token/GPU",
                "KV tokens",
                "max requests",
                "decode tok/s @1 (model)",
                "prefill tok/s (model)",
            ],
            plan_rows,
        ),
        "<p>The first two rows are this checkpoint as stored; the rest are plans sized from its config.json. "
        "Throughput figures come from a fitted model, not measurements.</p>",
        _eval_section(report),
        "<h2>Assumptions</h2>",
        _table(["assumption", "value"], assumptions),
        "</body></html>",
    ]
    return "\n".join(parts)


def _eval_section(report: JSONObject) -> str:
    """The served evaluation recorded in quantkit.json (`quantkit eval --endpoint ... --record`), if any."""
    result = (report.get("manifest") or {}).get("eval")
    if not result or "tasks" not in result:
        return ""
    from quantkit.evaluate.report import html_section

    return html_section(result)


def write_html(report: JSONObject, path: Path) -> None:
    """Render with matplotlib's Agg backend and write the page."""
    import matplotlib

    matplotlib.use("Agg")
    Path(path).write_text(render_html(report), encoding="utf-8")
