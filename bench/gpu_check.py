"""The driver of the one-command H200 check (issue 14); `bench/gpu_check.sh` runs it, a section at a time.

    python bench/gpu_check.py SECTION --out DIR --work TMP [--smoke] [--budget-s S]
    python bench/gpu_check.py stub --name SECTION --out DIR --status timeout|error --reason TEXT [--log LOG]
    python bench/gpu_check.py summary --out DIR [--smoke]
    python bench/gpu_check.py boxes [--smoke]     # "name seconds" per section, in the order they run

Each section (one module under `bench/gpu_sections/`, listed in its registry) runs in its own process and
writes `DIR/<section>.json` (atomically, also while it runs, so a section the driver has to kill still leaves
what it measured); `stub` records a section the driver killed (time box, crash) without losing what it
wrote; `summary` turns the files into `summary.md` with pass/fail against the issue's targets
(`bench/gpu_check_summary.py`).

`--smoke` runs the same code at tiny sizes on the CPU (CI); its timings are not measurements.
torch is imported inside the sections only, so `stub`, `summary` and `boxes` run anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # quantkit from this checkout

from gpu_check_summary import write_summary  # noqa: E402 - bench/ sits on sys.path[0]
from gpu_sections import BY_NAME, SECTIONS, run_order  # noqa: E402
from gpu_sections.common import Context, OverBudget, Report, Skip  # noqa: E402


def run_section(name: str, ctx: Context) -> Report:
    """Run one section; whatever happens, its JSON file says how it ended."""
    rep = Report(name, SECTIONS[name], ctx.smoke, ctx.out)
    rep.save()
    try:
        BY_NAME[name].runner()(ctx, rep)
        if rep.status == "running":
            rep.status = "ok"
    except Skip as exc:
        rep.status, rep.skip_reason = "skipped", str(exc)
    except OverBudget as exc:
        rep.status = "partial"
        rep.notes.append(f"stopped: {exc}; the figures are of what ran")
    except Exception as exc:  # one failure must not kill the other sections: record it
        rep.status, rep.error = "error", f"{type(exc).__name__}: {exc}"[:500]
        rep.notes.append("traceback tail: " + " | ".join(traceback.format_exc().strip().splitlines()[-6:])[:1500])
    rep.seconds = time.monotonic() - ctx.start
    rep.save()
    return rep


def stub(name: str, out: Path, smoke: bool, status: Literal["timeout", "error"], reason: str,
         log: Path | None) -> None:
    """The driver killed or lost a section: keep its last saved figures, mark how it ended."""
    rep = Report(name, SECTIONS[name], smoke, out)
    if rep.path.exists():
        data = json.loads(rep.path.read_text())
        rep.figures, rep.notes, rep.device = data.get("figures", {}), data.get("notes", []), data.get("device", "")
        rep.skip_reason, rep.error = data.get("skip_reason"), data.get("error")
    rep.status = status
    rep.notes.append(f"section {reason}")
    if log is not None and log.exists():
        rep.notes.append("log tail: " + " | ".join(log.read_text(errors="replace").strip().splitlines()[-8:])[:1500])
    if not rep.figures and not rep.skip_reason:
        rep.skip_reason = f"no figures: the section {reason}"
    rep.save()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("section", choices=[*SECTIONS, "stub", "summary", "boxes"])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a folder under --out's parent)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--budget-s", type=float, default=120.0)
    ap.add_argument("--name", choices=list(SECTIONS), help="stub: the section to mark")
    ap.add_argument("--status", choices=["timeout", "error"], default="error", help="stub: how it ended")
    ap.add_argument("--reason", default="was stopped", help="stub: what happened")
    ap.add_argument("--log", type=Path, default=None, help="stub: the section's log")
    a = ap.parse_args(argv)
    if a.section == "boxes":
        for section in run_order():
            print(section.name, section.smoke_box_s if a.smoke else section.box_s, int(section.extra))
        return 0
    if a.out is None:
        ap.error("the following arguments are required: --out")
    a.out.mkdir(parents=True, exist_ok=True)
    if a.section == "summary":
        write_summary(a.out, a.smoke)
        return 0
    if a.section == "stub":
        stub(a.name, a.out, a.smoke, a.status, a.reason, a.log)
        return 0
    work = a.work or Path(a.out).parent / f".gpu-check-work-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    try:
        rep = run_section(a.section, Context(a.out, work, a.smoke, a.budget_s))
    finally:
        if a.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{a.section}: {rep.status}" + (f" ({rep.skip_reason or rep.error})" if rep.skip_reason or rep.error else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
