"""One evaluation run: candidate (and baseline) endpoints, the chosen tasks, resume store, verdict."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from quantkit.core.errors import QuantkitError
from quantkit.core.jsontypes import JSONObject
from quantkit.evaluate import kl as kl_task
from quantkit.evaluate import toolcall
from quantkit.evaluate.client import Endpoint
from quantkit.evaluate.lmeval import LmEvalOptions, run_task
from quantkit.evaluate.stats import bootstrap_ci, compare
from quantkit.evaluate.store import AnswerStore, Progress

__all__ = ["EvalConfig", "run_eval", "SIDES"]

SIDES = ("candidate", "baseline")
LOCAL_TASKS = ("kl", "toolcall")


@dataclass
class EvalConfig:
    candidate: Endpoint
    baseline: Endpoint | None
    tasks: list[str]
    state: Path
    heldout: Path
    toolcall_items: Path
    lm_eval: LmEvalOptions
    limit: int | None = None
    threshold: float = 0.8  # points (percent) a task's score may drop before the verdict is "fail"
    max_kl: float = 0.05  # nats / token
    max_flip: float = 5.0  # points
    logprobs: int = 20
    kl_chars: int = 2000
    api: kl_task.Api = "openai"
    tool_choice: toolcall.ToolChoice = "auto"
    tool_max_tokens: int = 1024
    concurrency: int = 8
    log: Callable[[str], None] = field(default=print)


def state_dir(root: Path, candidate: Endpoint, baseline: Endpoint | None) -> Path:
    """A per-pair subdirectory: rerunning the same pair resumes, another pair starts afresh."""
    key = json.dumps([candidate.url, candidate.model, baseline.url if baseline else None,
                      baseline.model if baseline else None])
    return root / hashlib.sha256(key.encode()).hexdigest()[:12]


Item = TypeVar("Item")  # what one question is: a document (KL) or a tool-call item

def _sides(cfg: EvalConfig) -> Iterator[tuple[str, Endpoint]]:
    yield "candidate", cfg.candidate
    if cfg.baseline is not None:
        yield "baseline", cfg.baseline


def _answer_all(store: AnswerStore, task: str, ep: Endpoint, side: str, items: list[tuple[str, Item]],
                ask: Callable[[Endpoint, Item], JSONObject], concurrency: int) -> list[JSONObject]:
    """Answers for every item, from the store where present, else asked (concurrently) and stored at once."""
    progress = Progress(f"{task} {side}", len(items))
    answers: dict[str, JSONObject] = {}
    todo = []
    for key, item in items:
        got = store.get(task, side, key)
        if got is None:
            todo.append((key, item))
        else:
            answers[key] = got
            progress.advance(resumed=True)
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        for key, answer in zip((k for k, _ in todo), pool.map(lambda kv: ask(ep, kv[1]), todo), strict=True):
            store.put(task, side, key, answer)
            answers[key] = answer
            progress.advance()
    return [answers[k] for k, _ in items]


def _kl(cfg: EvalConfig, store: AnswerStore) -> JSONObject:
    from quantkit.calibrate.data import load_records, render

    if cfg.baseline is None:
        raise QuantkitError("task kl needs --baseline (it measures the candidate against the baseline)")
    docs = [render(r, None)[: cfg.kl_chars] for r in load_records(cfg.heldout)][: cfg.limit]
    items = [(f"doc{i}", d) for i, d in enumerate(docs) if d.strip()]
    got = {side: _answer_all(store, "kl", ep, side, items,
                             lambda e, text: kl_task.fetch_logprobs(e, text, cfg.logprobs, cfg.api), cfg.concurrency)
           for side, ep in _sides(cfg)}
    scores = [kl_task.score_document(b, c, k) for (k, _), b, c in zip(items, got["baseline"], got["candidate"],
                                                                        strict=True)]
    kl = bootstrap_ci([s.kl for s in scores])
    flip = bootstrap_ci([100.0 * s.flip for s in scores])
    ok = kl.mean <= cfg.max_kl and flip.mean <= cfg.max_flip
    return {"items": len(scores), "positions": sum(s.positions for s in scores), "logprobs_k": cfg.logprobs,
            "kl_mean": kl.mean, "kl_ci": [kl.low, kl.high], "flip_points": flip.mean, "flip_ci": [flip.low, flip.high],
            "rest_mass": sum(s.rest_mass for s in scores) / len(scores),
            "nll_baseline": sum(s.nll_baseline for s in scores) / len(scores),
            "nll_candidate": sum(s.nll_candidate for s in scores) / len(scores),
            "limits": {"max_kl": cfg.max_kl, "max_flip_points": cfg.max_flip},
            "verdict": "pass" if ok else "fail"}


def _toolcall(cfg: EvalConfig, store: AnswerStore) -> JSONObject:
    items = [(it["id"], it) for it in toolcall.load_items(cfg.toolcall_items)][: cfg.limit]
    ask = lambda e, it: toolcall.ask(e, it, cfg.tool_choice, cfg.tool_max_tokens)  # noqa: E731
    scored = {side: [toolcall.score(it, a) for (_, it), a in
                     zip(items, _answer_all(store, "toolcall", ep, side, items, ask, cfg.concurrency), strict=True)]
              for side, ep in _sides(cfg)}
    base = scored.get("baseline")
    comps = [compare(m, [s[m] for s in scored["candidate"]], [s[m] for s in base] if base else None, cfg.threshold,
                     gate=(m == "valid")) for m in toolcall.METRICS]
    return {"items": len(items), "tool_choice": cfg.tool_choice, "comparisons": [c.to_json() for c in comps],
            "verdict": _worst(c.verdict for c in comps)}


def _lm_eval(cfg: EvalConfig, task: str, work: Path) -> JSONObject:
    opts = cfg.lm_eval
    with ThreadPoolExecutor(max_workers=2) as pool:  # both sides at once: one lm-eval process per server
        futures = {side: pool.submit(run_task, ep, task, opts, work / task / side, work / f"lm_eval-{task}-{side}.log")
                   for side, ep in _sides(cfg)}
        scores = {side: f.result() for side, f in futures.items()}
    cand = scores["candidate"]
    base = scores.get("baseline")
    keys = sorted(cand) if base is None else sorted(cand.keys() & base.keys())
    comp = compare("accuracy", [cand[k] for k in keys], [base[k] for k in keys] if base else None, cfg.threshold)
    return {"items": len(keys), "max_length": opts.max_length, "max_gen_toks": opts.max_gen_toks,
            "comparisons": [comp.to_json()], "verdict": comp.verdict}


def _worst(verdicts: Iterable[str]) -> str:
    vs = set(verdicts)
    return next((v for v in ("fail", "inconclusive", "unpaired") if v in vs), "pass")


def run_eval(cfg: EvalConfig) -> JSONObject:
    """Run every task (resuming from `cfg.state`); the result record (also written to state/result.json)."""
    work = state_dir(cfg.state, cfg.candidate, cfg.baseline)
    store = AnswerStore(work / "answers.jsonl")
    tasks: JSONObject = {}
    try:
        for task in cfg.tasks:
            cfg.log(f"task {task} ...")
            start = time.monotonic()
            if task == "kl":
                res = _kl(cfg, store)
            elif task == "toolcall":
                res = _toolcall(cfg, store)
            else:
                res = _lm_eval(cfg, task, work)
            res["seconds"] = round(time.monotonic() - start, 1)
            tasks[task] = res
    finally:
        store.close()
    result = {"candidate": {"url": cfg.candidate.url, "model": cfg.candidate.model},
              "baseline": {"url": cfg.baseline.url, "model": cfg.baseline.model} if cfg.baseline else None,
              "threshold_points": cfg.threshold, "limit": cfg.limit, "tasks": tasks,
              "verdict": _worst(t["verdict"] for t in tasks.values()), "answers": str(work / "answers.jsonl")}
    from quantkit.core.durable import write_json_atomic

    write_json_atomic(work / "result.json", result)
    return result
