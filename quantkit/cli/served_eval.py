"""`quantkit eval --endpoint URL [--baseline URL] ...`: options -> EvalConfig -> run -> print / record."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TypedDict

from quantkit.core.errors import QuantkitError
from quantkit.core.locations import CALIBRATION_DATA

__all__ = ["ServedEvalOptions", "served_eval"]



class ServedEvalOptions(TypedDict):
    """The `quantkit eval` options a served evaluation reads (the command passes its locals())."""

    endpoint: str
    baseline: str | None
    tasks: str
    limit: int | None
    record: Path | None
    data: Path
    threshold: float
    max_kl: float
    max_flip: float
    state: Path
    logprobs: int
    api: str
    tool_choice: str
    tool_max_tokens: int
    max_length: int
    max_gen_toks: int
    tokenizer: str | None
    lm_eval_python: Path | None
    lm_eval_include: Path | None
    concurrency: int
    as_json: bool


def served_eval(opts: ServedEvalOptions) -> bool:
    """Run the served evaluation from the CLI's options; True when no task regressed."""
    from quantkit.evaluate.client import open_endpoint
    from quantkit.evaluate.lmeval import LmEvalOptions, default_python
    from quantkit.evaluate.report import format_text
    from quantkit.evaluate.run import EvalConfig, run_eval
    from quantkit.hub.refresh import record_eval

    if opts["api"] not in ("openai", "sglang"):
        raise QuantkitError(f"--api {opts['api']}: choose openai or sglang")
    if opts["tool_choice"] not in ("auto", "required"):
        raise QuantkitError(f"--tool-choice {opts['tool_choice']}: choose auto or required")
    tasks = [t.strip() for t in opts["tasks"].split(",") if t.strip()]
    if not tasks:
        raise QuantkitError("--tasks: empty")
    if opts["record"] is not None and not (opts["record"] / "quantkit.json").is_file():
        raise QuantkitError(f"--record {opts['record']}: no quantkit.json there")
    cand = open_endpoint(opts["endpoint"])
    base = open_endpoint(opts["baseline"]) if opts["baseline"] else None
    lm = LmEvalOptions(python=opts["lm_eval_python"] or default_python(), tokenizer=opts["tokenizer"],
                       max_length=opts["max_length"], max_gen_toks=opts["max_gen_toks"],
                       concurrency=opts["concurrency"], limit=opts["limit"], include_path=opts["lm_eval_include"],
                       model="sglang-generate" if opts["api"] == "sglang" else "local-completions")
    log = (lambda m: print(m, file=sys.stderr)) if opts["as_json"] else print
    cfg = EvalConfig(candidate=cand, baseline=base, tasks=tasks, state=opts["state"], heldout=opts["data"],
                     toolcall_items=CALIBRATION_DATA / "toolcall.jsonl", lm_eval=lm, limit=opts["limit"],
                     threshold=opts["threshold"], max_kl=opts["max_kl"], max_flip=opts["max_flip"],
                     logprobs=opts["logprobs"], api=opts["api"], tool_choice=opts["tool_choice"],
                     tool_max_tokens=opts["tool_max_tokens"], concurrency=opts["concurrency"], log=log)
    result = run_eval(cfg)
    if opts["record"] is not None:
        log(f"recorded in {record_eval(opts['record'], result)}")
    print(json.dumps(result, indent=2) if opts["as_json"] else format_text(result))
    return result["verdict"] != "fail"
