"""Budgets a user states: a checkpoint size (`--max-size 421GB | 392GiB | <bytes>`) or a deployment (`--fit
h200:8` with `--kv-tokens N` or `--context L --concurrency C`), as one limit on one axis of the solver.

A deployment becomes a limit on the weight bytes of one GPU through the planner's memory model
(plan/memory.py): SGLang's static budget (`memory * mem_fraction_static`) minus the reserve minus the KV pool
the requested tokens need (`tokens x bytes per token per GPU`, whole pages; for a context and a concurrency:
`C` requests of `L` tokens in whole pages plus the scheduler's headroom, the inverse of
`max_concurrent_requests`). Activations and CUDA graphs live outside the fraction, as the planner assumes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from quantkit.arch import get_adapter
from quantkit.core.errors import QuantkitError
from quantkit.plan.catalog import GIB, GPU, get_gpu
from quantkit.plan.kv import KV_DTYPES, kv_bytes_per_token_per_gpu
from quantkit.plan.memory import Assumptions, has_vision
from quantkit.plan.mixed import Axis
from quantkit.quant.recipe import parse_size

__all__ = ["Budget", "Fit", "budget_from_options", "parse_fit"]


@dataclass(frozen=True)
class Fit:
    """A deployment to fit: `n` GPUs of one kind (tensor parallel over all of them) and the KV it must hold."""

    gpu: GPU
    n: int
    kv: str = "bf16"
    kv_tokens: int | None = None
    context: int | None = None
    concurrency: int | None = None
    dp_attention: bool = False
    assumptions: Assumptions = Assumptions()

    def tokens(self) -> int:
        """KV tokens the deployment must hold (node-wide)."""
        a = self.assumptions
        if self.kv_tokens is not None:
            return math.ceil(self.kv_tokens / a.page_size) * a.page_size
        assert self.context is not None and self.concurrency is not None
        return self.concurrency * math.ceil(self.context / a.page_size) * a.page_size + a.headroom_tokens

    def weights_limit(self, config: dict[str, Any]) -> int:
        """Weight bytes one GPU may hold so that the KV the deployment needs still fits."""
        adapter = get_adapter(config)
        a = self.assumptions
        fraction = a.mem_fraction * (a.multimodal_factor if has_vision(config) else 1.0)
        static = int(self.gpu.memory_bytes * fraction)
        cell = kv_bytes_per_token_per_gpu(adapter.config, adapter.kv_layout, self.kv, self.n,
                                          draft_layers=adapter.num_mtp_layers if a.speculative else 0,
                                          shared_indexer=a.shared_indexer)
        per_gpu_tokens = math.ceil(self.tokens() / self.n) if self.dp_attention else self.tokens()
        return static - int(a.reserve_gib * GIB) - per_gpu_tokens * cell

    def describe(self) -> str:
        need = f"{self.kv_tokens:,} KV tokens" if self.kv_tokens is not None else \
            f"{self.concurrency} requests of {self.context:,} tokens"
        return f"{self.n} x {self.gpu.name} with {need} ({self.kv} KV)"


@dataclass(frozen=True)
class Budget:
    """One limit on one axis: checkpoint bytes, or weight bytes per GPU."""

    axis: Axis
    limit: int
    label: str
    fit: Fit | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"axis": self.axis, "limit_bytes": self.limit, "label": self.label}
        if self.fit is not None:
            f = self.fit
            out["fit"] = {"gpu": f.gpu.key, "n": f.n, "kv": f.kv, "kv_tokens": f.kv_tokens, "context": f.context,
                          "concurrency": f.concurrency, "tokens": f.tokens()}
        return out


def parse_fit(text: str, extra_gpus: str | None = None) -> tuple[GPU, int]:
    """`h200:8` -> (the H200, 8)."""
    key, sep, count = text.partition(":")
    if not sep or not count.strip().isdigit() or int(count) < 1:
        raise QuantkitError(f"--fit {text!r}: expected GPU:N, e.g. h200:8")
    return get_gpu(key.strip(), extra_gpus), int(count)


def budget_from_options(config: dict[str, Any], max_size: str | None = None, fit: str | None = None,
                        kv_tokens: int | None = None, context: int | None = None, concurrency: int | None = None,
                        kv: str = "bf16", dp_attention: bool = False, assumptions: Assumptions | None = None,
                        extra_gpus: str | None = None) -> Budget | None:
    """The budget the options state (None: no budget). Exactly one of `max_size` and `fit`."""
    if max_size is not None and fit is not None:
        raise QuantkitError("--max-size and --fit: give one budget (the size, or the deployment to fit)")
    if fit is None:
        if kv_tokens is not None or context is not None or concurrency is not None:
            raise QuantkitError("--kv-tokens / --context / --concurrency size a deployment: pass --fit GPU:N too")
        if max_size is None:
            return None
        limit = parse_size(max_size)
        return Budget("bytes", limit, f"checkpoint <= {max_size} ({limit:,} B)")
    if kv not in KV_DTYPES:
        raise QuantkitError(f"KV dtype {kv!r}: expected one of {', '.join(KV_DTYPES)}")
    if (kv_tokens is None) == (context is None and concurrency is None):
        raise QuantkitError("--fit needs either --kv-tokens N or --context L --concurrency C")
    if kv_tokens is None and (context is None or concurrency is None):
        raise QuantkitError("--context and --concurrency go together (or pass --kv-tokens N)")
    for name, value in (("--kv-tokens", kv_tokens), ("--context", context), ("--concurrency", concurrency)):
        if value is not None and value < 1:
            raise QuantkitError(f"{name} {value}: must be >= 1")
    gpu, n = parse_fit(fit, extra_gpus)
    f = Fit(gpu, n, kv, kv_tokens, context, concurrency, dp_attention, assumptions or Assumptions())
    limit = f.weights_limit(config)
    if limit <= 0:
        raise QuantkitError(f"--fit {fit}: the KV cache alone ({f.tokens():,} tokens) leaves no memory for weights "
                            f"on {n} x {gpu.name}")
    return Budget("per_gpu", limit, f"{f.describe()}: weights <= {limit / GIB:.2f} GiB per GPU", f)
