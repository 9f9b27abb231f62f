"""The result of a served evaluation as text (CLI), Markdown (model card) and HTML (report). Recording it in a
checkpoint's quantkit.json["eval"] is `quantkit.hub.refresh.record_eval` (the card and SHA256SUMS follow)."""

from __future__ import annotations

import html

from quantkit.core.jsontypes import JSONObject

__all__ = ["rows", "format_text", "markdown", "html_section"]

HEADER = ["task", "metric", "items", "candidate", "baseline", "diff [95% CI]", "limit", "verdict", "time"]


def _f(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def rows(result: JSONObject) -> list[list[str]]:
    """One row per (task, metric): the shared content of every rendering."""
    out = []
    for task, res in result["tasks"].items():
        secs = f"{res.get('seconds', 0):.0f}s"
        if task == "kl":
            metric = f"KL nats/token (lower bound; rest mass {res['rest_mass']:.2f})"
            out.append([task, metric, str(res["items"]), _f(res["kl_mean"], ".2e"), "-",
                        f"[{_f(res['kl_ci'][0], '.2e')}, {_f(res['kl_ci'][1], '.2e')}]",
                        f"<= {res['limits']['max_kl']:g}", res["verdict"], secs])
            out.append([task, "top-1 flip, points", str(res["items"]), _f(res["flip_points"]), "-",
                        f"[{_f(res['flip_ci'][0])}, {_f(res['flip_ci'][1])}]",
                        f"<= {res['limits']['max_flip_points']:g}", res["verdict"], ""])
            continue
        for c in res["comparisons"]:
            d = c["diff"]
            diff = "-" if d is None else f"{d['mean']:+.2f} [{d['low']:+.2f}, {d['high']:+.2f}]"
            limit = f">= -{c['threshold']:g}" if c["verdict"] != "unpaired" else "-"
            out.append([task, c["metric"] + ", %", str(c["items"]), _f(c["candidate"]), _f(c["baseline"]), diff,
                        limit, c["verdict"], secs])
            secs = ""
    return out


def format_text(result: JSONObject) -> str:
    table = [HEADER, *rows(result)]
    widths = [max(len(r[i]) for r in table) for i in range(len(HEADER))]
    lines = [f"candidate {result['candidate']['url']} ({result['candidate']['model']})"]
    if result.get("baseline"):
        lines.append(f"baseline  {result['baseline']['url']} ({result['baseline']['model']})")
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in table]
    lines.append(f"verdict: {result['verdict'].upper()}  (per-item answers: {result['answers']})")
    return "\n".join(lines)


def markdown(result: JSONObject) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(result)]
    base = result.get("baseline") or {}
    head = (f"Served evaluation (`quantkit eval --endpoint`): candidate `{result['candidate']['model']}` vs "
            f"baseline `{base.get('model', 'none')}`; verdict **{result['verdict']}** (a task fails when it drops "
            f"more than {result['threshold_points']:g} points; KL is a top-k lower bound).")
    return head + "\n\n" + "\n".join(lines)


def html_section(result: JSONObject) -> str:
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows(result))
    head = "<tr>" + "".join(f"<th>{h}</th>" for h in HEADER) + "</tr>"
    return (f"<h2 id='eval'>Served evaluation: {html.escape(result['verdict'])}</h2>"
            f"<table>{head}{cells}</table>")
