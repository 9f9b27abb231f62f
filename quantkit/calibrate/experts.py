"""GPTQ of a layer's routed experts, held by `ExpertMoE` with their collected statistics.

One scheme for the whole layer (its experts unit's format: SGLang and vLLM require one scheme for every expert
and projection of an MoE layer). The down projections go first, their Hessians built from the source gate/up
weights; gate/up share one Hessian and one factorisation when every token went through every expert. Each expert
gets a coverage record: tokens under real routing, samples in its Hessians, damping, RTN fallback, relative
reconstruction error `||WX - QX|| / ||WX||` (and what RTN would have given). The asymmetric / gate-up-first
variants are in `quantkit.calibrate.asymmetric`.
"""

from __future__ import annotations

from typing import Any

import torch

from quantkit.calibrate.gptq import Factor, GPTQScheme, prepare, quantize_many, quantize_rows, relative_error
from quantkit.calibrate.memory import release_free_memory
from quantkit.calibrate.moe import ExpertMoE
from quantkit.quant.int4 import PackedInt4, dequantize_group, pack_int, quantize_rtn

__all__ = ["ROWS_PER_CHUNK", "chunks", "finish_module", "module_errors", "quantize_experts", "record"]

# rows of stacked expert weights quantized in one GPTQ call (bounds memory). On a GPU the column loop is
# bound by kernel launches, not arithmetic: far more rows per loop (65536 rows x 7168 columns fp32 is
# under 2 GB) cut the sequential column steps of a rank's 32 GLM-5 experts from ~262k to ~20k.
ROWS_PER_CHUNK = {"cpu": 4096, "cuda": 65536}


def quantize_experts(moe: ExpertMoE, module_base: str, layer: int, scheme: GPTQScheme
                     ) -> tuple[dict[str, PackedInt4], list[dict[str, Any]]]:
    """GPTQ every routed expert this rank holds (collected statistics required); swap in the packed results.

    `module_base` is the experts' module prefix (`model.layers.N.mlp.experts.`), `scheme` the layer's experts
    unit's (bits, group, GPTQ settings, scale dtype). Returns packed results (on the CPU) by module name and one
    coverage record per expert, in expert order. The down projections go first: their Hessians are built from
    the source gate/up weights.
    """
    owned = moe.owned
    settings = scheme.settings
    packed: dict[str, PackedInt4] = {}
    records = {e: record(moe, layer, e) for e in owned}
    if not owned:
        return packed, []
    first = moe.held(owned[0])

    def finish(e: int, proj: str, q: torch.Tensor, s: torch.Tensor, factor: Factor, h: torch.Tensor) -> None:
        finish_module(moe, e, proj, q, s, factor, h, scheme, records[e], packed, module_base)

    def _finish_gate_up(e: int, q: torch.Tensor, s: torch.Tensor, factor: Factor, h: torch.Tensor,
                        count: int) -> None:
        """q, s: expert e's gate rows then its up rows."""
        inter = q.shape[0] // 2
        records[e]["samples"]["gate_up"] = count
        finish(e, "gate_proj", q[:inter], s[:inter], factor, h)
        finish(e, "up_proj", q[inter:], s[inter:], factor, h)

    limit = ROWS_PER_CHUNK.get(moe._device().type, ROWS_PER_CHUNK["cpu"])
    for chunk in chunks(owned, first["down_proj"].shape[0], limit):
        hessians = [moe.down_hessian(e, settings.routed_token_weight) for e in chunk]
        moe.load(chunk, ("down_proj",))
        for e, (_, count) in zip(chunk, hessians, strict=True):
            records[e]["samples"]["down"] = count
        factors = [prepare(h, scheme.damp, scheme.actorder) for h, _ in hessians]
        results = quantize_many([moe.held(e)["down_proj"] for e in chunk], factors, scheme)
        for e, factor, (h, _), (q, s) in zip(chunk, factors, hessians, results, strict=True):
            finish(e, "down_proj", q, s, factor, h)
        del hessians, factors, results
        release_free_memory()  # the chunk's work and the source weights it replaced

    inter = first["gate_proj"].shape[0]
    weighted = settings.routed_weight_gate_up and bool(settings.routed_token_weight) and moe.inputs is not None
    if moe.h_in is not None and not weighted:  # one gate/up Hessian and factor for all experts
        h, count = moe.in_hessian(owned[0])
        factor = prepare(h, scheme.damp, scheme.actorder)
        for chunk in chunks(owned, 2 * inter, limit):
            moe.load(chunk, ("gate_proj", "up_proj"))
            rows = torch.cat([moe.held(e)[p] for e in chunk for p in ("gate_proj", "up_proj")])
            q, s = quantize_rows(rows, factor, scheme)
            del rows
            for i, e in enumerate(chunk):
                _finish_gate_up(e, q[2 * i * inter:(2 * i + 2) * inter], s[2 * i * inter:(2 * i + 2) * inter],
                                factor, h, count)
            del q, s
            release_free_memory()
    else:  # a gate/up Hessian per expert: routed-only statistics, or routed tokens weighted
        for chunk in chunks(owned, 2 * inter, limit):
            hessians = [moe.in_hessian(e, settings.routed_token_weight if weighted else 0.0) for e in chunk]
            factors = [prepare(h, scheme.damp, scheme.actorder) for h, _ in hessians]
            moe.load(chunk, ("gate_proj", "up_proj"))
            rows = [torch.cat([moe.held(e)["gate_proj"], moe.held(e)["up_proj"]]) for e in chunk]
            results = quantize_many(rows, factors, scheme)
            del rows
            for e, factor, (h, count), (q, s) in zip(chunk, factors, hessians, results, strict=True):
                _finish_gate_up(e, q, s, factor, h, count)
            del hessians, factors, results
            release_free_memory()
    return packed, [records[e] for e in owned]


def chunks(experts: list[int], rows_per_expert: int, limit: int) -> list[list[int]]:
    """Experts in groups of at most `limit` stacked rows (one GPTQ call each)."""
    per = max(1, limit // max(rows_per_expert, 1))
    return [experts[i : i + per] for i in range(0, len(experts), per)]


def record(moe: ExpertMoE, layer: int, e: int) -> dict[str, Any]:
    """Expert `e`'s coverage record, filled as its projections are quantized."""
    return {
        "layer": layer,
        "expert": e,
        "routed_tokens": int(moe.routed_tokens[e]),
        "samples": {"gate_up": 0, "down": 0},
        "damping": {},
        "fallback": {},
        "rel_error": {},
        "rtn_rel_error": {},
    }


def finish_module(moe: ExpertMoE, e: int, proj: str, q: torch.Tensor, s: torch.Tensor, factor: Factor,
                  h: torch.Tensor, scheme: GPTQScheme, rec: dict[str, Any], packed: dict[str, PackedInt4],
                  base: str) -> None:
    """Record errors, pack, and swap the expert's source weight for its packed result."""
    rec["damping"][proj] = factor.damping
    if factor.failure:
        rec["fallback"][proj] = f"rtn: {factor.failure}"
    rec["rel_error"][proj], rec["rtn_rel_error"][proj] = module_errors(moe.held(e)[proj], q, s, h, scheme)
    result = pack_int(q, s.to(scheme.scale_dtype), 4 if scheme.bits == 4 else 8)
    packed[f"{base}{e}.{proj}"] = PackedInt4(result.weight_packed.cpu(), result.weight_scale.cpu(),
                                             result.weight_shape)
    moe.held(e)[proj] = result


def module_errors(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor, h: torch.Tensor, scheme: GPTQScheme,
                  max_rows: int = 256) -> tuple[float, float]:
    """Relative output error of the GPTQ result and of RTN, on at most `max_rows` evenly spaced rows."""
    step = max(1, -(-w.shape[0] // max_rows))
    gs = scheme.group_size
    w, q, s = w[::step].float(), q[::step], s[::step]
    rq, rs = quantize_rtn(w, gs, scheme.scale_dtype, scheme.bits)
    return (relative_error(w, dequantize_group(q, s, gs), h), relative_error(w, dequantize_group(rq, rs, gs), h))
