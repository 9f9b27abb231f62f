"""The measured FP8-KV KL table of docs/serving.md (issue 28): 3 tiny trained models x the KV configurations.

    python bench/kv_backend_kl.py [--models deepseek_v3,glm4_moe,glm_moe_dsa] [--windows 24] [--seq 128]
                                  [--prompt 64] [--json OUT] [--keep DIR] [--from DIR]

Each model runs `tests/engines/run_sglang_kv_kl.py` (SGLang 0.5.23's KV write and attention read on the CPU, the
Triton decode kernel by its torch reproduction, which `tests/engines/test_kv_kl.py` checks against the kernel
run by the Triton interpreter) in its own process; `make engines` must have unpacked SGLang. Prints, per model:
KL(BF16-KV twin || served) at the decode positions for every configuration, its p99 and top-1 flips, the paired
difference to the consistent calibrated scale with its bootstrap standard error over windows, and the rule's
verdict (docs/serving.md): unit scale passes when its worst unit-scale read costs at most
max(10% of the INT4 weights' own KL, 2 standard errors) more than the calibrated scale.
The numbers `quantkit/engines/kv_choice.py` records come from this command (`--json`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RUNNER = REPO / "tests" / "engines" / "run_sglang_kv_kl.py"
MODELS = ("deepseek_v3", "glm4_moe", "glm_moe_dsa")
UNIT_READS = {"mla": ("a", "a_triton", "a_flashmla"), "gqa": ("a", "a_triton"), "dsa": ("a",)}
CALIBRATED = {"mla": "b", "gqa": "b", "dsa": "b"}
FRACTION_OF_INT4 = 0.10
SE_FLOOR = 2.0


def paired(a: list[float], b: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Mean of a - b over windows and its bootstrap standard error (windows resampled, pairs kept)."""
    diff = [x - y for x, y in zip(a, b, strict=True)]
    rng = random.Random(seed)
    means = []
    for _ in range(resamples):
        sample = [diff[rng.randrange(len(diff))] for _ in diff]
        means.append(sum(sample) / len(sample))
    mu = sum(means) / len(means)
    se = (sum((m - mu) ** 2 for m in means) / (len(means) - 1)) ** 0.5
    return sum(diff) / len(diff), se


def verdict(run: dict[str, Any]) -> dict[str, Any]:
    """The rule on one model's run: the worst unit-scale read against the consistent calibrated scale."""
    layout, configs = run["layout"], run["configs"]
    cal = configs[CALIBRATED[layout]]
    worst = max(UNIT_READS[layout], key=lambda n: configs[n]["kl_mean"])
    delta, se = paired(configs[worst]["window_kl"], cal["window_kl"])
    int4 = run["int4"]["kl_mean"]
    threshold = max(FRACTION_OF_INT4 * int4, SE_FLOOR * se)
    return {"unit_read": worst, "kl_unit": configs[worst]["kl_mean"], "kl_calibrated": cal["kl_mean"],
            "delta": delta, "se": se, "kl_int4": int4, "threshold": threshold,
            "choice": "unit" if delta <= threshold else "calibrated"}


def run_model(model: str, a: argparse.Namespace, out: Path) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false", "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    cmd = [sys.executable, str(RUNNER), str(out), "--model", model, "--windows", str(a.windows), "--seq",
           str(a.seq), "--prompt", str(a.prompt), "--calib", str(a.calib)]
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=out.parent)
    if proc.returncode != 0:
        raise SystemExit(f"{model}: runner exited {proc.returncode}: {proc.stderr[-2000:]}")
    run = json.loads(out.read_text())
    run["seconds"] = round(time.time() - start, 1)
    return run


def table(runs: dict[str, dict[str, Any]]) -> str:
    lines = []
    for model, run in runs.items():
        v = run["verdict"]
        lines += [f"### {model} ({run['layout']}, {run['windows']} windows x {run['seq'] - run['prompt']} decode "
                  f"positions, prompt {run['prompt']})", "",
                  "| config | what | KL mean | KL p99 | top-1 flips | vs calibrated (+- se) |",
                  "|---|---|---|---|---|---|"]
        cal = run["configs"][CALIBRATED[run["layout"]]]["window_kl"]
        for name, c in run["configs"].items():
            d, se = paired(c["window_kl"], cal)
            lines.append(f"| {name} | {c['what']} | {c['kl_mean']:.2e} | {c['kl_p99']:.2e} | {c['top1_flip']:.2%} "
                         f"| {d:+.2e} +- {se:.1e} |")
        lines.append(f"| int4 | {run['int4']['what']} | {run['int4']['kl_mean']:.2e} | {run['int4']['kl_p99']:.2e} "
                     f"| {run['int4']['top1_flip']:.2%} | |")
        choice = v["choice"] if run["layout"] != "dsa" else {  # DSA: the row layout, not a checkpoint scale
            "unit": "raw 576 B rows allowed", "calibrated": "per-tile 656 B rows (flashmla_kv)"}[v["choice"]]
        lines += ["", f"rule: worst unit read `{v['unit_read']}` {v['delta']:+.2e} vs calibrated; threshold "
                  f"max(10% x {v['kl_int4']:.2e}, 2 x {v['se']:.1e}) = {v['threshold']:.2e} -> **{choice}**", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--windows", type=int, default=24)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--calib", type=int, default=16)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--from", dest="source", type=Path, default=None, help="reuse <model>.json files of a run")
    ap.add_argument("--keep", type=Path, default=None, help="write each model's <model>.json here")
    a = ap.parse_args(argv)
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kv-kl-") as tmp:
        for model in a.models.split(","):
            if a.source is not None:
                run = json.loads((a.source / f"{model}.json").read_text())
            else:
                run = run_model(model, a, (a.keep or Path(tmp)) / f"{model}.json")
            run["verdict"] = verdict(run)
            runs[model] = run
            print(f"{model}: {run['verdict']['choice']} ({run.get('seconds', '?')} s)", file=sys.stderr)
    print(table(runs))
    if a.json is not None:
        a.json.write_text(json.dumps(runs, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
