"""The result of a served evaluation as text (CLI), Markdown (model card), HTML (report) and its record
in quantkit.json["eval"]."""

from __future__ import annotations

import html
import json
import time
from pathlib import Path
from typing import Any

from quantkit.errors import QuantkitError

__all__ = ["rows", "format_text", "markdown", "html_section", "record"]

HEADER = ["task", "metric", "items", "candidate", "baseline", "diff [95% CI]", "limit", "verdict", "time"]


def _f(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def rows(result: dict[str, Any]) -> list[list[str]]:
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


def format_text(result: dict[str, Any]) -> str:
    table = [HEADER, *rows(result)]
    widths = [max(len(r[i]) for r in table) for i in range(len(HEADER))]
    lines = [f"candidate {result['candidate']['url']} ({result['candidate']['model']})"]
    if result.get("baseline"):
        lines.append(f"baseline  {result['baseline']['url']} ({result['baseline']['model']})")
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in table]
    lines.append(f"verdict: {result['verdict'].upper()}  (per-item answers: {result['answers']})")
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(result)]
    base = result.get("baseline") or {}
    head = (f"Served evaluation (`quantkit eval --endpoint`): candidate `{result['candidate']['model']}` vs "
            f"baseline `{base.get('model', 'none')}`; verdict **{result['verdict']}** (a task fails when it drops "
            f"more than {result['threshold_points']:g} points; KL is a top-k lower bound).")
    return head + "\n\n" + "\n".join(lines)


def html_section(result: dict[str, Any]) -> str:
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows(result))
    head = "<tr>" + "".join(f"<th>{h}</th>" for h in HEADER) + "</tr>"
    return (f"<h2 id='eval'>Served evaluation: {html.escape(result['verdict'])}</h2>"
            f"<table>{head}{cells}</table>")


def record(directory: Path, result: dict[str, Any]) -> Path:
    """Store `result` as quantkit.json["eval"] in checkpoint `directory` (atomic rewrite of the manifest), then
    regenerate a quantkit-written card and re-hash SHA256SUMS, so `verify` and `push` carry the result."""
    from quantkit.durable import write_json_atomic

    manifest = directory / "quantkit.json"
    if not manifest.is_file():
        raise QuantkitError(f"{manifest}: not found (--record takes a checkpoint directory written by quantkit)")
    data = json.loads(manifest.read_text(encoding="utf-8"))
    data["eval"] = {**result, "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_json_atomic(manifest, data)
    from quantkit.hub.refresh import refresh_outputs

    refresh_outputs(directory, ["quantkit.json"])  # the card's Quality section and SHA256SUMS follow
    return manifest
