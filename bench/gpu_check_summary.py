"""summary.md of the GPU check: the issue's targets with pass/fail, then each section's figures.

It only reads the section files `bench/gpu_check.py` wrote and derives ratios from their rows; each
section's own block comes from its module's `summary_lines` (bench/gpu_sections/). A section that is
missing, skipped or killed shows up as such. In a smoke run (CPU, tiny shapes) every
target reads "n/a": those timings are not measurements.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gpu_sections import REGISTRY, SECTIONS
from gpu_sections.common import JSONObject, SectionData, fmt

Verdict = Literal["pass", "FAIL", "n/a"]
DECODE_BATCHES = (1, 8, 32, 64)  # the MoE target's "decode batch sizes"; 256 is reported beside them
TARGETS = {
    "gemv_roofline": 80.0,  # % of the HBM roofline, W4A16 GEMV at M = 1
    "gemv_vs_bf16": 3.0,  # x BF16 torch.matmul at M = 1
    "moe_vs_bf16": 2.0,  # x BF16 grouped GEMM at decode batch sizes
    "integrity_pct": 0.3,  # % of a decode step
}


@dataclass
class Target:
    """One line of the targets table."""

    name: str
    target: str
    measured: str
    verdict: Verdict
    detail: str = ""


def load_sections(out: Path) -> dict[str, SectionData | None]:
    """Every section's JSON (None where the file is missing)."""
    found: dict[str, SectionData | None] = {}
    for name in SECTIONS:
        path = out / f"{name}.json"
        found[name] = json.loads(path.read_text()) if path.exists() else None
    return found


def _usable(section: SectionData | None) -> bool:
    return bool(section and section.get("figures") and section.get("status") in ("ok", "partial", "timeout"))


def _why_not(section: SectionData | None) -> str:
    if section is None:
        return "section not run"
    return section.get("skip_reason") or section.get("error") or f"status {section.get('status')}, no figures"


# --------------------------------------------------------------------------------------- targets
def best_m1(kernels: SectionData) -> list[JSONObject]:
    """Per dense shape at M = 1: the faster W4A16 backend's row (with the BF16 time of the same shape)."""
    best: dict[tuple[str, str], JSONObject] = {}
    for r in kernels["figures"].get("rows", []):
        if r["kind"] != "linear" or r["m"] != 1 or r["time_us"] is None:
            continue
        key = (r["model"], r["layer"])
        if key not in best or r["time_us"] < best[key]["time_us"]:
            best[key] = r
    return list(best.values())


def gemv_targets(kernels: SectionData | None, smoke: bool) -> list[Target]:
    """W4A16 GEMV at M = 1: >= 80% of the HBM roofline and >= 3x BF16, over one decode step's projections.

    The verdict is on the whole set of shapes (bytes over time, as a decode step adds them up); how many
    shapes pass on their own is given beside it.
    """
    roof = f">= {TARGETS['gemv_roofline']:.0f}% HBM roofline at M = 1"
    speed = f">= {TARGETS['gemv_vs_bf16']:.0f}x BF16 at M = 1"
    if not _usable(kernels):
        why = _why_not(kernels)
        return [Target("W4A16 GEMV bandwidth", roof, "-", "n/a", why),
                Target("W4A16 GEMV vs BF16", speed, "-", "n/a", why)]
    rows = best_m1(kernels)
    peak = kernels["figures"].get("hbm_gbps")
    if not rows or not peak:
        return [Target("W4A16 GEMV bandwidth", roof, "-", "n/a", "no M = 1 rows"),
                Target("W4A16 GEMV vs BF16", speed, "-", "n/a", "no M = 1 rows")]
    gbps = sum(r["gbytes"] for r in rows) / (sum(r["time_us"] for r in rows) * 1e-6)
    pct = 100.0 * gbps / peak
    timed = [r for r in rows if r.get("bf16_us")]
    ratio = sum(r["bf16_us"] for r in timed) / sum(r["time_us"] for r in timed) if timed else None
    n_roof = sum((r["pct_roofline"] or 0) >= TARGETS["gemv_roofline"] for r in rows)
    n_speed = sum((r["speedup_vs_bf16"] or 0) >= TARGETS["gemv_vs_bf16"] for r in timed)
    verdict_roof: Verdict = "n/a" if smoke else "pass" if pct >= TARGETS["gemv_roofline"] else "FAIL"
    verdict_speed: Verdict = "n/a" if smoke or ratio is None else (
        "pass" if ratio >= TARGETS["gemv_vs_bf16"] else "FAIL")
    return [
        Target("W4A16 GEMV bandwidth", roof, f"{pct:.1f}% (all M = 1 shapes together)", verdict_roof,
               f"{n_roof}/{len(rows)} shapes on their own; per shape the faster of Triton / CUDA GEMV"),
        Target("W4A16 GEMV vs BF16", speed, f"{fmt(ratio, '.2f', 'x')} (all M = 1 shapes together)", verdict_speed,
               f"{n_speed}/{len(timed)} shapes on their own"),
    ]


def moe_target(kernels: SectionData | None, smoke: bool) -> Target:
    """Grouped MoE >= 2x BF16 at every decode batch size (M <= 64), on every model and projection."""
    target = f">= {TARGETS['moe_vs_bf16']:.0f}x BF16 at M = {', '.join(map(str, DECODE_BATCHES))}"
    if not _usable(kernels):
        return Target("grouped MoE vs BF16", target, "-", "n/a", _why_not(kernels))
    rows = [r for r in kernels["figures"].get("rows", []) if r["kind"] == "moe" and r["backend"] != "torch"
            and r["m"] in DECODE_BATCHES and r.get("speedup_vs_bf16")]
    if not rows:
        return Target("grouped MoE vs BF16", target, "-", "n/a", "no timed MoE rows at decode batch sizes")
    worst = min(rows, key=lambda r: r["speedup_vs_bf16"])
    verdict: Verdict = "n/a" if smoke else "pass" if worst["speedup_vs_bf16"] >= TARGETS["moe_vs_bf16"] else "FAIL"
    ok = sum(r["speedup_vs_bf16"] >= TARGETS["moe_vs_bf16"] for r in rows)
    return Target("grouped MoE vs BF16", target, f"min {worst['speedup_vs_bf16']:.2f}x ({worst['model']} "
                  f"{worst['layer']} M={worst['m']})", verdict, f"{ok}/{len(rows)} rows pass")


def integrity_target(integrity: SectionData | None, smoke: bool) -> Target:
    """Integrity check < 0.3% of the decode step at batch 1..64, for every configuration that fits the pool."""
    target = f"< {TARGETS['integrity_pct']}% of a decode step, batch 1..64"
    if not _usable(integrity):
        return Target("integrity check", target, "-", "n/a", _why_not(integrity))
    worst, where, left_out = None, "", 0
    for r in integrity["figures"].get("rows", []):
        for model, frac in r["fractions"].items():
            if not r["fits_pool"][model]:
                left_out += 1
                continue
            if worst is None or frac > worst:
                worst, where = frac, f"{model}, batch {r['batch']}, context {r['context']}, page {r['page_size']}"
    if worst is None:
        return Target("integrity check", target, "-", "n/a", "no configuration within a KV pool")
    verdict: Verdict = "n/a" if smoke else "pass" if 100 * worst < TARGETS["integrity_pct"] else "FAIL"
    return Target("integrity check", target, f"max {100 * worst:.3f}% ({where})", verdict,
                  f"{left_out} model/config pairs beyond the KV pool not counted")


def tests_target(tests: SectionData | None, smoke: bool) -> Target:
    if not _usable(tests):
        return Target("kernel + serving tests on the GPU", "all pass", "-", "n/a", _why_not(tests))
    totals = tests["figures"].get("totals", {})
    bad = totals.get("failed", 0) + totals.get("error", 0) + totals.get("collection_error", 0)
    counts = ", ".join(f"{v} {k}" for k, v in sorted(totals.items())) or "nothing ran"
    not_run = len(tests["figures"].get("not_run", {}))
    verdict: Verdict = "n/a" if smoke else "pass" if bad == 0 and totals.get("passed") else "FAIL"
    return Target("kernel + serving tests on the GPU", "all pass", counts, verdict,
                  f"{not_run} file(s) not run (missing packages)" if not_run else "")


def rtn_target(rtn: SectionData | None, smoke: bool) -> Target:
    """Not an issue target: the device's RTN codes must equal the CPU's (the converter's) bit for bit."""
    if not _usable(rtn) or "codes_and_scales_identical_to_cpu" not in rtn["figures"]:
        return Target("RTN on cuda == RTN on CPU (check)", "100% identical", "-", "n/a", _why_not(rtn))
    same = rtn["figures"]["codes_and_scales_identical_to_cpu"]
    verdict: Verdict = "pass" if same == 1.0 else "FAIL"
    return Target("RTN on cuda == RTN on CPU (check)", "100% identical", f"{100 * same:.4f}%",
                  "n/a" if smoke else verdict, "one expert's three matrices")


# ------------------------------------------------------------------------------------------ write
def write_summary(out: Path, smoke: bool) -> Path:
    """Write `out/summary.md` from the section files there."""
    s = load_sections(out)
    devices = sorted({x["device"] for x in s.values() if x and x.get("device") not in (None, "", "unknown")})
    dates = sorted({x["date"] for x in s.values() if x})
    lines = [f"# GPU check: {', '.join(devices) or 'no device recorded'} ({', '.join(dates) or '-'})", ""]
    if smoke:
        lines += ["**Smoke run (CPU, tiny shapes): it checks the script, not the GPU. No figure here is a "
                  "measurement and every target reads n/a.**", ""]
    targets = [tests_target(s["tests"], smoke), *gemv_targets(s["kernels"], smoke), moe_target(s["kernels"], smoke),
               integrity_target(s["integrity"], smoke), rtn_target(s["rtn"], smoke)]
    lines += ["## Targets", "", "| what | target | measured | verdict | detail |", "|---|---|---|---|---|"]
    lines += [f"| {t.name} | {t.target} | {t.measured} | {t.verdict} | {t.detail} |" for t in targets]
    lines += ["", "## Sections", "", "| section | status | seconds | reason / notes |", "|---|---|---:|---|"]
    for name, sec in s.items():
        if sec is None:
            lines.append(f"| {SECTIONS[name]} | not run | - | no {name}.json |")
            continue
        reason = sec.get("skip_reason") or sec.get("error") or "; ".join(sec.get("notes", []))[:300]
        lines.append(f"| {SECTIONS[name]} | {sec['status']} | {fmt(sec.get('seconds'))} | {reason.replace('|', '/')} |")
    for section in REGISTRY:  # each section's own block, where its module renders one
        render = section.renderer()
        if render is None:
            continue
        lines += ["", f"## {section.title}", ""]
        sec = s[section.name]
        if _usable(sec):
            try:
                lines += render(sec)
            except (KeyError, TypeError, ZeroDivisionError) as exc:  # a half-written section: say so, go on
                lines.append(f"(figures incomplete: {type(exc).__name__}: {exc})")
        else:
            lines.append(f"Skipped: {_why_not(sec)}")
    path = out / "summary.md"
    tmp = path.with_name(".summary.md.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    return path
