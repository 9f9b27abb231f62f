"""Paired differences, bootstrap confidence intervals and the pass/fail verdict."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal

__all__ = ["Interval", "bootstrap_ci", "Comparison", "compare", "Verdict"]

Verdict = Literal["pass", "fail", "inconclusive", "unpaired"]


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float


def bootstrap_ci(values: Sequence[float], resamples: int = 2000, level: float = 0.95, seed: int = 0) -> Interval:
    """Percentile bootstrap of the mean of `values` (seeded: the same items give the same interval)."""
    n = len(values)
    if n == 0:
        return Interval(float("nan"), float("nan"), float("nan"))
    mean = sum(values) / n
    rng = random.Random(seed)
    means = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    tail = (1.0 - level) / 2
    lo = means[int(tail * (resamples - 1))]
    hi = means[int(round((1.0 - tail) * (resamples - 1)))]
    return Interval(mean, lo, hi)


@dataclass(frozen=True)
class Comparison:
    """One metric of one task, candidate vs baseline, in points (percent) for rates."""

    metric: str
    items: int
    candidate: float
    baseline: float | None
    diff: Interval | None  # candidate - baseline, per-item paired, bootstrap CI
    threshold: float
    verdict: Verdict

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def compare(metric: str, candidate: Sequence[float], baseline: Sequence[float] | None, threshold: float,
            scale: float = 100.0, gate: bool = True) -> Comparison:
    """Per-item paired comparison of candidate - baseline (times `scale`: points for 0/1 scores).

    `pass` when the mean difference is >= -threshold; `fail` when it is below -threshold AND the bootstrap
    interval lies entirely below zero (the drop is real, not one unlucky item of a few dozen); otherwise
    `inconclusive` (below the bar but within noise: more items needed). Items must be paired (same order,
    same length). `gate=False` reports without judging."""
    cand = [scale * v for v in candidate]
    if baseline is None:
        return Comparison(metric, len(cand), _mean(cand), None, None, threshold, "unpaired")
    if len(baseline) != len(candidate):
        raise ValueError(f"{metric}: {len(candidate)} candidate items vs {len(baseline)} baseline items")
    base = [scale * v for v in baseline]
    diff = bootstrap_ci([c - b for c, b in zip(cand, base, strict=True)])
    verdict: Verdict = "pass"
    if gate and diff.mean < -threshold:
        verdict = "fail" if diff.high < 0 else "inconclusive"
    return Comparison(metric, len(cand), _mean(cand), _mean(base), diff, threshold, verdict)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
