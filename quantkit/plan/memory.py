"""Per-GPU memory: weights after TP/EP/DP-attention sharding, the KV pool, tokens and requests.

SGLang sizes its KV pool as `total_memory * mem_fraction_static - weights - other static buffers`;
everything outside the fraction is left for activations and CUDA graphs. Every number that model
needs and a config does not say is an `Assumptions` field with a documented default, and the
planner prints them all.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from quantkit.arch import Adapter, Role
from quantkit.core.jsontypes import JSONObject
from quantkit.plan.catalog import GIB, GPU
from quantkit.plan.inventory import SizedTensor
from quantkit.plan.kv import kv_bytes_per_token_per_gpu

__all__ = [
    "Assumptions",
    "MemoryPlan",
    "has_vision",
    "max_concurrent_requests",
    "per_gpu_weights",
    "plan_memory",
    "shard_divisor",
]

# Attention projections SGLang keeps whole on every rank (MLA down-projections; the DSA indexer).
_REPLICATED_ATTENTION = ("q_a_proj", "kv_a_proj_with_mqa")
_GQA_KV = ("k_proj", "v_proj")


@dataclass(frozen=True)
class Assumptions:
    """Inputs of the memory model that no config holds; each is printed with the plan."""

    mem_fraction: float = 0.88  # SGLang --mem-fraction-static: weights + KV pool share of GPU memory
    multimodal_factor: float = 0.95  # SGLang shrinks the fraction for models with a vision tower
    reserve_gib: float = 1.0  # other static buffers inside the fraction (req-to-token map, sampler)
    page_size: int = 64  # KV page size in tokens (FlashMLA / DSA kernels use 64)
    headroom_tokens: int = 8192  # free tokens the scheduler needs to admit work (one prefill chunk)
    speculative: bool = False  # size the MTP draft layer (weights + its KV pool) for speculative decoding
    shared_indexer: bool = False  # IndexShare models keep indexer caches only on 'full' layers

    def to_dict(self) -> JSONObject:
        return asdict(self)


@dataclass(frozen=True)
class MemoryPlan:
    """What one precision plan leaves on one GPU."""

    gpu_memory_bytes: int
    mem_fraction_effective: float
    static_budget_bytes: int
    weights_per_gpu_bytes: int
    weights_per_gpu_by_role: dict[str, int]
    reserve_bytes: int
    kv_pool_bytes: int
    kv_bytes_per_token_per_gpu: int
    kv_capacity_tokens: int
    node_kv_capacity_tokens: int
    activation_bytes: int
    fits: bool


def shard_divisor(t: SizedTensor, adapter: Adapter, tp: int, dp_attention: bool) -> int:
    """How many ways SGLang splits this tensor across the TP group (1 = replicated)."""
    name = t.name
    if t.role in (Role.NORM, Role.ROUTER, Role.INDEXER) or len(t.shape) < 2:
        return 1
    if t.role == Role.ATTENTION:
        if dp_attention or any(f".{p}." in name for p in _REPLICATED_ATTENTION):
            return 1
        if adapter.kv_layout == "gqa" and any(f".{p}." in name for p in _GQA_KV):
            return min(tp, int(adapter.config["num_key_value_heads"]))
        return tp
    if t.role == Role.MTP_OTHER and "eh_proj" in name:
        return 1
    return tp


def _draft_only_duplicate(t: SizedTensor) -> bool:
    """MTP layers' own embedding/head: SGLang's draft model shares the target's, loading no copy."""
    return t.mtp and (t.role == Role.EMBEDDING or "shared_head.head" in t.name)


def per_gpu_weights(
    tensors: Iterable[SizedTensor],
    adapter: Adapter,
    tp: int,
    dp_attention: bool = False,
    speculative: bool = False,
) -> dict[str, int]:
    """Weight bytes on one GPU by role. EP (--ep) splits experts by expert instead of by width:
    the same bytes per GPU, so it needs no case here."""
    out: dict[str, int] = defaultdict(int)
    for t in tensors:
        if t.mtp and (not speculative or _draft_only_duplicate(t)):
            continue
        out[t.role.value] += math.ceil(t.each / shard_divisor(t, adapter, tp, dp_attention)) * t.count
    return dict(out)


def max_concurrent_requests(capacity_tokens: int, context: int, page_size: int, headroom_tokens: int) -> int:
    """Requests of `context` tokens (each rounded up to whole pages) that fit next to the headroom."""
    per_request = math.ceil(context / page_size) * page_size
    return max(0, (capacity_tokens - headroom_tokens) // per_request)


def has_vision(config: JSONObject) -> bool:
    return isinstance(config.get("vision_config"), dict)


def plan_memory(
    tensors: list[SizedTensor],
    adapter: Adapter,
    config: JSONObject,
    gpu: GPU,
    tp: int,
    kv: str,
    assumptions: Assumptions,
    dp_attention: bool = False,
) -> MemoryPlan:
    """Weights, KV pool and token capacity on one GPU of a `tp`-GPU deployment."""
    speculative = _speculative(adapter, assumptions)
    by_role = per_gpu_weights(tensors, adapter, tp, dp_attention, speculative)
    weights = sum(by_role.values())
    fraction = assumptions.mem_fraction * (assumptions.multimodal_factor if has_vision(config) else 1.0)
    budget = int(gpu.memory_bytes * fraction)
    reserve = int(assumptions.reserve_gib * GIB)
    pool = budget - weights - reserve
    cell = kv_bytes_per_token_per_gpu(
        adapter.config,
        adapter.kv_layout,
        kv,
        tp,
        draft_layers=adapter.num_mtp_layers if speculative else 0,
        shared_indexer=assumptions.shared_indexer,
    )
    tokens = max(0, pool) // cell // assumptions.page_size * assumptions.page_size
    return MemoryPlan(
        gpu_memory_bytes=gpu.memory_bytes,
        mem_fraction_effective=round(fraction, 4),
        static_budget_bytes=budget,
        weights_per_gpu_bytes=weights,
        weights_per_gpu_by_role=by_role,
        reserve_bytes=reserve,
        kv_pool_bytes=max(0, pool),
        kv_bytes_per_token_per_gpu=cell,
        kv_capacity_tokens=tokens,
        node_kv_capacity_tokens=tokens * (tp if dp_attention else 1),
        activation_bytes=gpu.memory_bytes - budget,
        fits=pool > 0 and tokens > 0,
    )


def _speculative(adapter: Adapter, assumptions: Assumptions) -> bool:
    return bool(assumptions.speculative) and adapter.num_mtp_layers > 0
