"""The prefill model: compute-bound, per token for the whole TP group, fitted on the production GLM-5.2 figures.

    t_token = Linear FLOPs / (N x peak x eff_compute)   FP8 weights at the FP8 rate; BF16 and INT4 at the BF16
                                                        rate, INT4 GEMMs x (1 + dequant penalty)
            + attention FLOPs at context / 2            (DSA: capped at index_topk)
            + layers x t_layer_token                    fitted (communication, norms, everything else)

The dequant penalty and `t_layer_token` are solved from the report's 10,160 (FP8) / 8,660 (INT4) tok/s.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from quantkit.core.jsontypes import JSONObject
from quantkit.plan.catalog import GPU, get_gpu
from quantkit.plan.inventory import PrecisionPlan
from quantkit.plan.models import resolve_model
from quantkit.plan.throughput import EFF_COMPUTE, PRODUCTION, step_profile

__all__ = ["PrefillFit", "fit_prefill", "prefill_tok_s"]


@dataclass(frozen=True)
class PrefillFit:
    """Fitted prefill constants: INT4 dequant penalty (fraction of GEMM time) and seconds per layer-token."""

    int4_dequant_penalty: float
    t_layer_token: float
    eff_compute: float = EFF_COMPUTE



def _prefill_parts(config: JSONObject, plan: PrecisionPlan, gpu: GPU, tp: int, context: int) -> dict:
    """Node-wide seconds per prefilled token: GEMMs by dtype and attention, before fitted terms."""
    p = step_profile(config, plan, tp, "bf16")
    eff = EFF_COMPUTE
    gemm = {
        d: tp * f / (gpu.flops("fp8" if d == "fp8" else "bf16") * eff * tp)
        for d, f in p.flops_per_token.items()
    }
    mean_pos = context / 2.0
    attended = min(mean_pos, p.index_topk) if p.index_topk else mean_pos
    attention = p.attn_flops_per_pos * attended / (gpu.flops("bf16") * eff * tp)
    return {"gemm": gemm, "attention": attention, "layers": p.layers}


@lru_cache(maxsize=1)
def fit_prefill() -> PrefillFit:
    """Solve the INT4 dequant penalty and the per-layer-token cost from 10,160 / 8,660 tok/s."""
    prod = PRODUCTION
    config = resolve_model(prod["model"]).config
    gpu = get_gpu(prod["gpu"])
    fp8 = _prefill_parts(config, PrecisionPlan("fp8"), gpu, prod["tp"], prod["context"])
    int4 = _prefill_parts(config, PrecisionPlan("int4"), gpu, prod["tp"], prod["context"])
    t8 = 1.0 / prod["prefill_tok_s"]["fp8"] - sum(fp8["gemm"].values()) - fp8["attention"]
    t_layer_token = t8 / fp8["layers"]
    rest = 1.0 / prod["prefill_tok_s"]["int4"] - sum(int4["gemm"].values()) - int4["attention"]
    rest -= t_layer_token * int4["layers"]
    penalty = rest / int4["gemm"]["int4"] if int4["gemm"]["int4"] else 0.0
    return PrefillFit(int4_dequant_penalty=penalty, t_layer_token=t_layer_token)


def prefill_tok_s(config: JSONObject, plan: PrecisionPlan, gpu: GPU, tp: int, context: int) -> float:
    """Modelled prefill throughput of the whole TP group (tokens/s)."""
    fit = fit_prefill()
    parts = _prefill_parts(config, plan, gpu, tp, context)
    gemm = parts["gemm"]
    t = gemm["bf16"] + gemm["fp8"] + gemm["int4"] * (1.0 + fit.int4_dequant_penalty)
    t += parts["attention"] + fit.t_layer_token * parts["layers"]
    return 1.0 / t
