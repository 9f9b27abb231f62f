"""summary.md of the GPU check: the issue's targets with pass/fail, then each section's figures.

It only reads the section files `bench/gpu_check.py` wrote and derives ratios from their rows; a
section that is missing, skipped or killed shows up as such. In a smoke run (CPU, tiny shapes) every
target reads "n/a": those timings are not measurements.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from gpu_check import DECODE_BATCHES, SECTIONS, TARGETS

Verdict = Literal["pass", "FAIL", "n/a"]
Section = dict[str, Any]


@dataclass
class Target:
    """One line of the targets table."""

    name: str
    target: str
    measured: str
    verdict: Verdict
    detail: str = ""


def load_sections(out: Path) -> dict[str, Section | None]:
    """Every section's JSON (None where the file is missing)."""
    found: dict[str, Section | None] = {}
    for name in SECTIONS:
        path = out / f"{name}.json"
        found[name] = json.loads(path.read_text()) if path.exists() else None
    return found


def _usable(section: Section | None) -> bool:
    return bool(section and section.get("figures") and section.get("status") in ("ok", "partial", "timeout"))


def _why_not(section: Section | None) -> str:
    if section is None:
        return "section not run"
    return section.get("skip_reason") or section.get("error") or f"status {section.get('status')}, no figures"


def _f(value: float | None, fmt: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{suffix}"


# --------------------------------------------------------------------------------------- targets
def best_m1(kernels: Section) -> list[dict[str, Any]]:
    """Per dense shape at M = 1: the faster W4A16 backend's row (with the BF16 time of the same shape)."""
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for r in kernels["figures"].get("rows", []):
        if r["kind"] != "linear" or r["m"] != 1 or r["time_us"] is None:
            continue
        key = (r["model"], r["layer"])
        if key not in best or r["time_us"] < best[key]["time_us"]:
            best[key] = r
    return list(best.values())


def gemv_targets(kernels: Section | None, smoke: bool) -> list[Target]:
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
        Target("W4A16 GEMV vs BF16", speed, f"{_f(ratio, '.2f', 'x')} (all M = 1 shapes together)", verdict_speed,
               f"{n_speed}/{len(timed)} shapes on their own"),
    ]


def moe_target(kernels: Section | None, smoke: bool) -> Target:
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


def integrity_target(integrity: Section | None, smoke: bool) -> Target:
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


def tests_target(tests: Section | None, smoke: bool) -> Target:
    if not _usable(tests):
        return Target("kernel + serving tests on the GPU", "all pass", "-", "n/a", _why_not(tests))
    totals = tests["figures"].get("totals", {})
    bad = totals.get("failed", 0) + totals.get("error", 0) + totals.get("collection_error", 0)
    counts = ", ".join(f"{v} {k}" for k, v in sorted(totals.items())) or "nothing ran"
    not_run = len(tests["figures"].get("not_run", {}))
    verdict: Verdict = "n/a" if smoke else "pass" if bad == 0 and totals.get("passed") else "FAIL"
    return Target("kernel + serving tests on the GPU", "all pass", counts, verdict,
                  f"{not_run} file(s) not run (missing packages)" if not_run else "")


def rtn_target(rtn: Section | None, smoke: bool) -> Target:
    """Not an issue target: the device's RTN codes must equal the CPU's (the converter's) bit for bit."""
    if not _usable(rtn) or "codes_and_scales_identical_to_cpu" not in rtn["figures"]:
        return Target("RTN on cuda == RTN on CPU (check)", "100% identical", "-", "n/a", _why_not(rtn))
    same = rtn["figures"]["codes_and_scales_identical_to_cpu"]
    verdict: Verdict = "pass" if same == 1.0 else "FAIL"
    return Target("RTN on cuda == RTN on CPU (check)", "100% identical", f"{100 * same:.4f}%",
                  "n/a" if smoke else verdict, "one expert's three matrices")


# ---------------------------------------------------------------------------------------- tables
def kernel_tables(kernels: Section) -> list[str]:
    """Dense rows (Triton, CUDA GEMV, BF16 side by side), grouped MoE rows, FP8 KV rows."""
    rows = kernels["figures"].get("rows", [])
    dense: dict[tuple[str, str, int], dict[str, Any]] = {}
    for r in rows:
        if r["kind"] == "linear":
            dense.setdefault((r["model"], r["layer"], r["m"]), {"n": r["n"], "k": r["k"]})[r["backend"]] = r
    lines = ["### W4A16 dense projections", "",
             "| model | layer | N | K | M | Triton us | CUDA us | BF16 us | best % roof | best x BF16 "
             "| CUDA vs Triton |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (model, layer, m), d in dense.items():
        timed = [r for b, r in d.items() if b not in ("n", "k") and r["time_us"] is not None]
        best = min(timed, key=lambda r: r["time_us"]) if timed else None
        tri, cu = d.get("triton"), d.get("cuda")
        t_us = tri["time_us"] if tri else (d["torch"]["time_us"] if "torch" in d else None)
        c_us = cu["time_us"] if cu else None
        bf16 = best["bf16_us"] if best else None
        vs = f"{t_us / c_us:.2f}x" if t_us and c_us else "-"
        lines.append(f"| {model} | {layer} | {d['n']} | {d['k']} | {m} | {_f(t_us)} | {_f(c_us)} | {_f(bf16)} "
                     f"| {_f(best and best['pct_roofline'])} | {_f(best and best['speedup_vs_bf16'], '.2f', 'x')} "
                     f"| {vs} |")
    lines += ["", "(`Triton us` is the torch reference in a smoke run without the interpreter; CUDA vs Triton > 1: "
              "the CUDA GEMV is faster.)", "", "### Grouped W4A16 MoE vs a BF16 grouped GEMM (same routing)", "",
              "| model | layer | N | K | tokens | backend | us | GB/s | % roof | BF16 us | x BF16 | BF16 path |",
              "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["kind"] == "moe":
            how = next((n[6:] for n in r["notes"] if n.startswith("bf16: ")), "-")
            lines.append(f"| {r['model']} | {r['layer']} | {r['n']} | {r['k']} | {r['m']} | {r['backend']} "
                         f"| {_f(r['time_us'])} | {_f(r['gbps'])} | {_f(r['pct_roofline'])} | {_f(r['bf16_us'])} "
                         f"| {_f(r['speedup_vs_bf16'], '.2f', 'x')} | {how} |")
    lines += ["", "### FP8 KV-cache quantization (576-wide MLA rows, scattered into cache slots)", "",
              "| rows | backend | us | GB/s | % roof | x torch reference |", "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        if r["kind"] == "fp8_kv":
            lines.append(f"| {r['m']} | {r['backend']} | {_f(r['time_us'])} | {_f(r['gbps'])} "
                         f"| {_f(r['pct_roofline'])} | {_f(r['speedup_vs_baseline'], '.2f', 'x')} |")
    failed = [f"{r['model']} {r['layer']} M={r['m']} {r['backend']}: {n}" for r in rows for n in r["notes"]
              if n.startswith("failed")]
    if failed:
        lines += ["", "Failed rows:", *[f"- {f}" for f in failed[:20]]]
    return lines


def integrity_table(integrity: Section) -> list[str]:
    rows = integrity["figures"].get("rows", [])
    models = list(rows[0]["fractions"]) if rows else []
    lines = [f"Backend: {integrity['figures'].get('backend', '-')}; step source: "
             f"{rows[0]['step_source'] if rows else '-'}; `*` = beyond the model's KV pool.", "",
             "| page | batch | context | entries | check us | no-op us | "
             + " | ".join(f"% of {m} step" for m in models) + " |",
             "|---:|---:|---:|---:|---:|---:|" + "---:|" * len(models)]
    for r in rows:
        cells = [f"{100 * r['fractions'][m]:.3f}{'' if r['fits_pool'][m] else ' *'}" for m in models]
        lines.append(f"| {r['page_size']} | {r['batch']} | {r['context']} | {r['entries']} | {r['check_us']:.1f} "
                     f"| {r['noop_us']:.2f} | " + " | ".join(cells) + " |")
    return lines


def sglang_plugin_table(sec: Section) -> list[str]:
    rows = sec["figures"].get("rows", [])
    lines = ["Record + check per decode step on cuda (target < 0.3% of a decode step).", "",
             "| page | batch | context | us | % of glm-5.2 step | % of kimi-k2.6 step |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['page_size']} | {r['batch']} | {r['context']} | {r['step_us']:.1f} | "
                     f"{r['pct_glm-5.2']:.3f} | {r['pct_kimi-k2.6']:.3f} |")
    return lines


def gptq_tiny_table(tiny: Section) -> list[str]:
    f = tiny["figures"]
    lines = [f"Model {f.get('model')}, {f.get('samples')} x {f.get('seq_len')} calibration tokens, group "
             f"{f.get('group_size')}; evaluated on {f.get('eval_tokens', '-')} held-out tokens "
             f"(source perplexity {_f(f.get('source_perplexity'), '.3f')}).", "",
             "| run | device | seconds | KL vs source | top-1 agreement | perplexity |",
             "|---|---|---:|---:|---:|---:|"]
    for label, r in f.get("runs", {}).items():
        lines.append(f"| {label} | {r['device']} | {r['seconds']:.1f} | {_f(r.get('kl_mean'), '.3e')} "
                     f"| {_f(r.get('top1_agreement') and 100 * r['top1_agreement'], '.2f', '%')} "
                     f"| {_f(r.get('perplexity'), '.3f')} |")
    lines += ["", f"KL(cuda) / KL(cpu): {_f(f.get('kl_cuda_over_cpu'), '.3f')}; packed words identical between "
              f"the two runs: {_f(f.get('packed_words_identical') and 100 * f['packed_words_identical'], '.2f', '%')}."]
    return lines


def gptq_layer_lines(layer: Section) -> list[str]:
    f = layer["figures"]
    d, st, so, pj = f.get("dims", {}), f.get("statistics"), f.get("solver"), f.get("projection")
    lines = [f"Layer: {f.get('model')} MoE, {d.get('experts')} experts of {d.get('hidden')} x {d.get('moe_inter')} "
             f"(gate, up, down), fp32 on the device, every token to every expert; {f.get('tokens')} calibration "
             f"tokens, {f.get('tokens_per_forward')} per forward; GPTQ group {f.get('group_size')}, damping "
             f"{f.get('damping')}, block {f.get('block_size')}, static act-order.", ""]
    if st:
        lines.append(f"- statistics: {st['tokens_done']} tokens in {st['seconds_measured']:.1f} s -> "
                     f"{st['seconds_full']:.1f} s for all {f.get('tokens')}"
                     + (" (EXTRAPOLATED linearly)" if st["extrapolated"] else ""))
    if so:
        lines.append(f"- GPTQ solver: {so['experts_done']} experts in {so['seconds_measured']:.1f} s -> "
                     f"{so['seconds_full']:.1f} s for the layer" + (" (EXTRAPOLATED linearly)" if so["extrapolated"]
                                                                     else "")
                     + f"; mean relative error {so['mean_rel_error']:.4f} vs RTN {so['mean_rtn_rel_error']:.4f} "
                     f"(GPTQ better on {100 * so['gptq_better_than_rtn']:.1f}% of {so['matrices']} matrices, "
                     f"{so['fallbacks']} RTN fallbacks)")
    peak = f.get("peak_gib")
    lines.append(f"- peak GPU memory: {_f(peak and peak['allocated'], '.1f', ' GiB')} allocated, "
                 f"{_f(peak and peak['reserved'], '.1f', ' GiB')} reserved")
    if pj:
        lines.append(f"- **{pj['label']}**: {pj['seconds_per_moe_layer']:.1f} s per MoE layer x {pj['moe_layers']} "
                     f"layers = {pj['one_gpu_hours']:.2f} h on one GPU, {pj['eight_h200_hours']:.2f} h on 8xH200; "
                     f"assumes {pj['assumes']}")
    return lines


def rtn_lines(rtn: Section) -> list[str]:
    f = rtn["figures"]
    t = f.get("throughput")
    lines = [f"Codes and scales identical to the CPU's (one expert): "
             f"{_f(f.get('codes_and_scales_identical_to_cpu', 0) * 100, '.4f', '%')}"]
    if t:
        lines.append(f"RTN + packing of {t['matrices']} bf16 matrices ({t['source_gb']:.2f} GB) in "
                     f"{t['seconds']:.3f} s: **{t['gb_per_s']:.1f} GB/s** of source weights"
                     + (" (time box hit: part of the layer)" if t["partial"] else ""))
    return lines


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
        lines.append(f"| {SECTIONS[name]} | {sec['status']} | {_f(sec.get('seconds'))} | {reason.replace('|', '/')} |")
    blocks = (("kernels", kernel_tables), ("integrity", integrity_table), ("sglang_plugin", sglang_plugin_table),
              ("gptq_tiny", gptq_tiny_table),
              ("gptq_layer", gptq_layer_lines), ("rtn", rtn_lines))
    for name, render in blocks:
        lines += ["", f"## {SECTIONS[name]}", ""]
        sec = s[name]
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
