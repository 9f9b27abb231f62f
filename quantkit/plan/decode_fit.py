"""The decode model's fitted constants: four unknowns solved from four production figures (one linear system).

`t_layer` and `t_fp8_call` from GLM-5.2's 60 (FP8 weights) and 92 (INT4) tok/s at one request on 8 x H200 (FP8
KV, context 8192 assumed); `c_w` and `c_fp8` (the FP8 KV terms of quantkit.plan.attention) from Kimi-K2.6 INT4
on 8 x H200: FP8 KV "a few percent slower" than BF16 at one request (3%) and +41% maximum throughput (31 BF16 vs
64 FP8 requests at 21,437 tokens). The report names no attention backend for Kimi: FlashMLA is assumed
(`PRODUCTION_ATTENTION`). Figures the fit never sees are checked in tests/test_plan_attention.py and
tests/test_plan_throughput.py, printed by `python -m quantkit.plan.figures`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from quantkit.core.errors import QuantkitError
from quantkit.plan.catalog import get_gpu
from quantkit.plan.throughput import PRODUCTION, DecodeFit, _named_profile, _step

__all__ = ["PRODUCTION_ATTENTION", "PRODUCTION_KV", "ProductionKV", "fit_decode"]

# Kimi-K2.6 INT4 on 8 x H200 (production report): FP8 KV vs BF16 KV. "A few %" slower at one request is read as
# 3% (context assumed 8192, as for GLM-5.2); +41% maximum throughput where BF16 fits 31 requests of 21,437 tokens
# and FP8 64 (the planner's capacity boundary, docs/planner.md).
@dataclass(frozen=True)
class ProductionKV:
    """FP8 vs BF16 KV in production: `slower_at_1` at one request of `context_1` tokens; `gain` in maximum
    throughput with `requests_bf16` vs `requests_fp8` requests of `context_full` tokens."""

    model: str = "kimi-k2.6"
    weights: str = "int4"
    context_1: int = 8192
    slower_at_1: float = 0.03
    context_full: int = 686_000 // 32
    requests_bf16: int = 31
    requests_fp8: int = 64
    gain: float = 0.41


PRODUCTION_KV = ProductionKV()
# The attention backends the production figures ran on: GLM-5.2 DSA on SGLang's Hopper default; Kimi's report
# names none: FlashMLA is assumed (fa3 or flashinfer would make FP8 KV ~10x slower at Kimi's pool, sglang#35291).
PRODUCTION_ATTENTION: dict[str, str] = {"glm-5.2": "flashmla_kv", "kimi-k2.6": "flashmla"}

# The fitted unknowns, in the order of DecodeFit's constructor arguments.
_UNKNOWNS = ("t_layer", "t_fp8_call", "c_w", "c_fp8")


def _fit_rows() -> list[tuple[list[float], float]]:
    """The four production equations as rows (coefficients of _UNKNOWNS, right-hand side): each is linear in
    the unknowns, so its coefficients are differences of the model at unit values of each."""
    prod, kv = PRODUCTION, PRODUCTION_KV
    h200 = get_gpu(prod["gpu"])

    def linear(terms: list[tuple[float, str, str, str, int, int]]) -> tuple[list[float], float]:
        # terms: (weight, model, weights, kv, batch, context); the row is sum(weight * t_step) = 0
        def total(fit: DecodeFit) -> float:
            return sum(w * _step(_named_profile(m, prod["tp"], wt, k), h200, b, c, fit,
                                 PRODUCTION_ATTENTION[m]) for w, m, wt, k, b, c in terms)

        base = DecodeFit(0.0, 0.0)
        zero = total(base)
        return [total(DecodeFit(**{**_fit_fields(base), u: 1.0})) - zero for u in _UNKNOWNS], -zero

    rows = []
    for weights in ("fp8", "int4"):  # GLM-5.2 at one request: t_step = 1 / tok_s
        coeffs, rhs = linear([(1.0, prod["model"], weights, "fp8", 1, prod["context"])])
        rows.append((coeffs, rhs + 1.0 / prod["decode_tok_s_1"][weights]))
    m, w, c1 = kv.model, kv.weights, kv.context_1
    rows.append(linear([(1.0, m, w, "fp8", 1, c1), (-(1.0 + kv.slower_at_1), m, w, "bf16", 1, c1)]))
    n16, n8, c = kv.requests_bf16, kv.requests_fp8, kv.context_full
    rows.append(linear([(n8, m, w, "bf16", n16, c), (-(1.0 + kv.gain) * n16, m, w, "fp8", n8, c)]))
    return rows


def _fit_fields(fit: DecodeFit) -> dict[str, float]:
    return {f: getattr(fit, f) for f in (*_UNKNOWNS, "t_req")}


def _solve(rows: list[tuple[list[float], float]]) -> list[float]:
    """Gaussian elimination with partial pivoting (a 4 x 4 system; no numpy in the planner's import path)."""
    a = [list(coeffs) + [rhs] for coeffs, rhs in rows]
    n = len(a)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            raise QuantkitError("decode fit: the production equations do not determine the constants")
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[i][n] / a[i][i] for i in range(n)]


@lru_cache(maxsize=1)
def fit_decode() -> DecodeFit:
    """Solve t_layer, t_fp8_call, c_fp8 and t_req from the four production figures (see the module docstring)."""
    values = _solve(_fit_rows())
    fit = DecodeFit(**dict(zip(_UNKNOWNS, values, strict=True)))
    _check_positive(fit)
    return fit


def _check_positive(fit: DecodeFit) -> None:
    if not (fit.t_layer > 0 and fit.t_fp8_call > 0 and fit.c_fp8 >= 0 and fit.t_req >= 0
            and all(math.isfinite(v) for v in _fit_fields(fit).values())):
        raise QuantkitError(f"decode fit produced non-physical constants {fit}")
