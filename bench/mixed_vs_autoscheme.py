"""Mixed precision sized to a budget, side by side with AutoRound 0.16.1's AutoScheme, on the tiny trained MLA-MoE.

    .venv/bin/python bench/mixed_vs_autoscheme.py [--method gptq|rtn] [--skip-autoscheme] [--draws 1]

Everything on one model (quantkit.calibrate.tiny deepseek_v3), the same 32 x 128 calibration windows of
calibration_data/default.jsonl (seed 0; AutoRound gets them decoded to text, its loader wants text), the same
held-out evaluation (calibration_data/heldout.jsonl, 64 x 128 tokens, mean KL(source || model), as
bench/gptq_vs_llmcompressor.py), each step in its own fresh process, one after the other, 2 threads:

1. quantkit uniform INT4 g32 GPTQ (the default recipe: routed experts only): the KL and the cost baseline;
2. `quantkit sensitivity` (the table), timed;
3. `quantkit convert --max-size B --sensitivity S.json` for three budgets: the uniform INT4 size ("precision
   moved"), AutoScheme's size (uniform + layer 0's experts at INT8 g32) and uniform + 15% of (BF16 - uniform);
4. AutoScheme (options INT4 / INT8 g32, routed experts only, its default SignRound tuning), in its own venv
   (bench/autoscheme_anchor.py says how to make it), timed.

Prints a Markdown table and one JSON line (docs/benchmarks.md quotes them). CPU seconds are reported beside wall
seconds: on a shared machine the wall time of a step depends on what else runs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
AUTOROUND_PY = Path(os.environ.get("AUTOROUND_PY", "/work/venvs/autoround/bin/python"))


def _timed(cmd: list[str], env_extra: dict[str, str] | None = None) -> dict[str, float | str]:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO),
           **(env_extra or {})}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        print(proc.stdout[-2000:], proc.stderr[-3000:])
        raise SystemExit(f"failed: {' '.join(cmd)}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "stdout": proc.stdout}


def _bytes(out: Path) -> int:
    return sum(p.stat().st_size for p in out.glob("*.safetensors"))


def _calib_text(src: Path, path: Path) -> None:
    """quantkit's calibration windows decoded to text (AutoScheme takes a dataset path of text records)."""
    from transformers import AutoTokenizer

    from quantkit.calibrate.data import calibration_tokens
    from quantkit.calibrate.tiny import CORPUS

    tok = AutoTokenizer.from_pretrained(str(src))
    windows = calibration_tokens(CORPUS, tok, 32, 128, 0)
    path.write_text(json.dumps([tok.decode(row.tolist()) for row in windows]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="gptq", choices=["gptq", "rtn"])
    ap.add_argument("--draws", type=int, default=1)
    ap.add_argument("--skip-autoscheme", action="store_true")
    ap.add_argument("--work", type=Path)
    ap.add_argument("--resume", action="store_true", help="Keep the steps already done in --work (steps.json).")
    a = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from quantkit.calibrate.tiny import CORPUS, HELDOUT, build_tiny

    src = build_tiny("deepseek_v3")
    work = a.work or Path(tempfile.mkdtemp(prefix="quantkit-mixed-"))
    work.mkdir(parents=True, exist_ok=True)
    calib = ["--calib", str(CORPUS), "--samples", "32", "--seq-len", "128"]
    qk = [PY, "-m", "quantkit"]
    journal = work / "steps.json"
    steps: dict[str, dict] = json.loads(journal.read_text()) if a.resume and journal.exists() else {}

    def step(name: str, cmd: list[str], env: dict[str, str] | None = None) -> None:
        if name not in steps:
            steps[name] = _timed(cmd, env)
            journal.write_text(json.dumps(steps))

    step("uniform GPTQ", [*qk, "convert", str(src), str(work / "uniform"), "--method", "gptq", *calib, "--force",
                          "--quiet"])
    uniform = _bytes(work / "uniform")
    source = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    step("sensitivity", [*qk, "sensitivity", str(src), "--out", str(work / "S.json"), *calib, "--draws",
                         str(a.draws), "--quiet"])
    as_extra = 196_608  # layer 0's experts at INT8 g32 instead of INT4 g32 (AutoScheme's choice), pack-quantized
    budgets = {"+0 (same size)": uniform, "AutoScheme's size": uniform + as_extra,
               "+15% of (BF16 - INT4)": uniform + int(0.15 * (source - uniform))}
    models = [work / "uniform"]
    for label, budget in budgets.items():
        out = work / f"mixed_{budget}"
        step(f"mixed {label}", [*qk, "convert", str(src), str(out), "--method", a.method, *calib, "--max-size",
                                 str(budget), "--sensitivity", str(work / "S.json"), "--force", "--json", "--quiet"])
        models.append(out)
    if not a.skip_autoscheme:
        _calib_text(src, work / "calib.json")
        # -P: bench/ must not shadow AutoRound's imports (bench/kernels.py vs the `kernels` package)
        step("AutoScheme", [str(AUTOROUND_PY), "-P", str(REPO / "bench" / "autoscheme_anchor.py"), str(src),
                            str(work / "calib.json"), str(work / "autoscheme")],
             {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
              "AR_AUTO_SCHEME_CACHE": tempfile.mkdtemp(prefix="ar-cache-"), "PYTHONPATH": ""})
        models.append(work / "autoscheme" / "fake")
    ev = _timed([PY, "-m", "quantkit.calibrate.eval", *map(str, models), "--data", str(HELDOUT), "--reference",
                 str(src), "--seq-len", "128", "--windows", "64", "--json"])
    res = json.loads(str(ev["stdout"]).strip().splitlines()[-1])
    base = res["models"][str(work / "uniform")]["kl_mean"]
    rows = ["| model | bytes vs uniform INT4 | KL | x uniform GPTQ | top-1 | wall s | CPU s |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    names = ["uniform GPTQ", *[f"mixed {k}" for k in budgets], *([] if a.skip_autoscheme else ["AutoScheme"])]
    report: dict[str, object] = {"method": a.method, "uniform_bytes": uniform, "source_bytes": source,
                                 "sensitivity": {k: steps["sensitivity"][k] for k in ("wall_s", "cpu_s")}}
    for name, path in zip(names, models, strict=True):
        m = res["models"][str(path)]
        size = _bytes(path) if name != "AutoScheme" else uniform + as_extra
        step = steps[name]
        rows.append(f"| {name} | {size - uniform:+,} | {m['kl_mean']:.3e} | {m['kl_mean'] / base:.3f} | "
                    f"{m['top1_agreement']:.2%} | {step['wall_s']} | {step['cpu_s']} |")
        report[name] = {"bytes": size, "kl": m["kl_mean"], "x_uniform": m["kl_mean"] / base,
                        "wall_s": step["wall_s"], "cpu_s": step["cpu_s"]}
    g, s = steps["uniform GPTQ"], steps["sensitivity"]
    rows.append(f"\nsensitivity / one GPTQ run: wall {float(s['wall_s']) / float(g['wall_s']):.2f}x, "
                f"CPU {float(s['cpu_s']) / float(g['cpu_s']):.2f}x")
    print("\n".join(rows))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
