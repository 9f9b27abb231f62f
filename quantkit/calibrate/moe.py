"""Routed experts for calibration: real routing for the layer output, all experts for the statistics.

`ExpertMoE` replaces a transformers MoE block inside a decoder layer. Its router and shared experts are
transformers' own modules; the routed experts are run one at a time from per-expert weights. While
collecting, every calibration token goes through every expert (by default) so that each expert's Hessian
has real data even when routing rarely picks it, but the layer *output* always uses the real top-k
routing and weights. With all tokens sent everywhere, the gate/up input is the same for every expert, so
one Hessian (and one factorisation) serves all of them; each expert's `down_proj` gets its own.

`quantize_experts` then runs GPTQ per expert and returns the packed results plus one coverage record per
expert: tokens under real routing, samples in its Hessians, damping, RTN fallback, relative
reconstruction error `||WX - QX|| / ||WX||` (and what RTN would have given).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from quantkit.calibrate.gptq import Factor, HessianAccumulator, prepare, quantize_many, quantize_rows, relative_error
from quantkit.quant.int4 import PackedInt4, dequantize_group, pack_int4, quantize_rtn

__all__ = ["ExpertMoE", "quantize_experts"]

PROJS = ("gate_proj", "up_proj", "down_proj")
_ROWS_PER_CHUNK = 16384  # rows of stacked expert weights quantized in one GPTQ call (bounds memory)


class ExpertMoE(nn.Module):
    """A MoE block with per-expert weights and optional per-expert Hessian collection."""

    def __init__(self, gate: nn.Module, shared: nn.Module | None, experts: list[dict[str, torch.Tensor]],
                 act: Any) -> None:
        super().__init__()
        self.gate = gate
        self.shared_experts = shared
        self.experts = experts  # plain tensors, not parameters: swapped for dequantized ones after GPTQ
        self.act = act
        self.collect: str | None = None  # None | "all" (every token to every expert) | "routed"
        self.routed_tokens = torch.zeros(len(experts), dtype=torch.long)
        self.h_in: HessianAccumulator | None = None
        self.h_in_expert: list[HessianAccumulator] = []
        self.h_down: list[HessianAccumulator] = []

    @classmethod
    def from_source(cls, source: Any, cfg: Any, base: str, hf_moe: nn.Module) -> ExpertMoE:
        """Load router, shared experts and per-expert weights (names under `base` = `...mlp.`)."""
        gate = hf_moe.gate
        gate.load_state_dict(_read(source, base + "gate.", gate), strict=True, assign=True)
        shared = getattr(hf_moe, "shared_experts", None)
        if shared is not None:
            shared.load_state_dict(_read(source, base + "shared_experts.", shared), strict=True, assign=True)
        n = int(cfg.n_routed_experts)
        experts = [
            {p: source.read(f"{base}experts.{e}.{p}.weight", torch.float32) for p in PROJS} for e in range(n)
        ]
        return cls(gate, shared, experts, hf_moe.experts.act_fn)

    def _apply(self, fn: Any, recurse: bool = True) -> ExpertMoE:
        """`.to(device)` must move the plain expert tensors too (they are not parameters)."""
        super()._apply(fn, recurse)
        self.experts = [{k: fn(v) for k, v in w.items()} for w in self.experts]
        return self

    def start_collecting(self, mode: str = "all") -> None:
        w = self.experts[0]
        hidden, inter, dev = w["gate_proj"].shape[1], w["down_proj"].shape[1], w["gate_proj"].device
        self.collect = mode
        if mode == "all":
            self.h_in = HessianAccumulator(hidden, dev)
        else:
            self.h_in_expert = [HessianAccumulator(hidden, dev) for _ in self.experts]
        self.h_down = [HessianAccumulator(inter, dev) for _ in self.experts]

    def stop_collecting(self) -> None:
        self.collect = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, weights, index = self.gate(x)
        out = torch.zeros_like(x)
        if self.collect == "all":
            self.h_in.add(x)
        for e, w in enumerate(self.experts):
            token, slot = torch.where(index == e)
            if self.collect is None or self.collect == "routed":
                self.routed_tokens[e] += token.numel() if self.collect else 0
                if token.numel() == 0:
                    continue
                a = self.act(x[token] @ w["gate_proj"].t()) * (x[token] @ w["up_proj"].t())
                if self.collect == "routed":
                    self.h_in_expert[e].add(x[token])
                    self.h_down[e].add(a)
                y = a @ w["down_proj"].t()
            else:  # every token through expert e for its statistics; only routed tokens reach the output
                self.routed_tokens[e] += token.numel()
                a_all = self.act(x @ w["gate_proj"].t()) * (x @ w["up_proj"].t())
                self.h_down[e].add(a_all)
                if token.numel() == 0:
                    continue
                y = a_all[token] @ w["down_proj"].t()
            out.index_add_(0, token, y * weights[token, slot, None].to(y.dtype))
        out = out.view(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out


def _read(source: Any, base: str, module: nn.Module) -> dict[str, torch.Tensor]:
    """A submodule's state dict read from the source (names `base` + local name)."""
    names = set(source.logical_names())
    keys = list(module.state_dict(keep_vars=True).keys())
    return {k: source.read(base + k, torch.float32) for k in keys if base + k in names}


# ---------------------------------------------------------------------------------------- quantization
def quantize_experts(
    moe: ExpertMoE,
    module_base: str,
    layer: int,
    group_size: int,
    damp: float,
    block_size: int,
    actorder: bool,
) -> tuple[dict[str, PackedInt4], list[dict[str, Any]]]:
    """GPTQ every routed expert of `moe` (collected statistics required); swap in dequantized weights.

    `module_base` is the experts' module prefix (`model.layers.N.mlp.experts.`). Returns packed results by
    module name and one coverage record per expert.
    """
    n = len(moe.experts)
    packed: dict[str, PackedInt4] = {}
    records = [_record(moe, layer, e) for e in range(n)]
    in_factors = _input_factors(moe, damp, actorder)
    gate_up_chunks = _chunks(n, moe.experts[0]["gate_proj"].shape[0] * 2) if moe.h_in is not None else [
        [e] for e in range(n)]
    for chunk in gate_up_chunks:
        rows = torch.cat([torch.cat([moe.experts[e]["gate_proj"], moe.experts[e]["up_proj"]]) for e in chunk])
        factor = in_factors[chunk[0]]  # shared by the chunk (per-expert factors: chunks of one expert)
        q, s = quantize_rows(rows, factor, group_size, block_size)
        inter = moe.experts[0]["gate_proj"].shape[0]
        for i, e in enumerate(chunk):
            for j, proj in enumerate(("gate_proj", "up_proj")):
                sl = slice((2 * i + j) * inter, (2 * i + j + 1) * inter)
                _finish(moe, e, proj, q[sl], s[sl], factor, group_size, records[e], packed, module_base)
    for chunk in _chunks(n, moe.experts[0]["down_proj"].shape[0]):
        factors = [prepare(moe.h_down[e].hessian(), damp, actorder) for e in chunk]
        results = quantize_many([moe.experts[e]["down_proj"] for e in chunk], factors, group_size, block_size)
        for e, factor, (q, s) in zip(chunk, factors, results, strict=True):
            _finish(moe, e, "down_proj", q, s, factor, group_size, records[e], packed, module_base)
    return packed, records


def _input_factors(moe: ExpertMoE, damp: float, actorder: bool) -> list[Factor]:
    """The gate/up factor of each expert (one shared object when all tokens went to all experts)."""
    if moe.h_in is not None:
        shared = prepare(moe.h_in.hessian(), damp, actorder)
        return [shared] * len(moe.experts)
    return [prepare(acc.hessian(), damp, actorder) for acc in moe.h_in_expert]


def _chunks(n: int, rows_per_expert: int) -> list[list[int]]:
    per = max(1, _ROWS_PER_CHUNK // max(rows_per_expert, 1))
    return [list(range(i, min(i + per, n))) for i in range(0, n, per)]


def _record(moe: ExpertMoE, layer: int, e: int) -> dict[str, Any]:
    samples_in = moe.h_in.count if moe.h_in is not None else moe.h_in_expert[e].count
    return {
        "layer": layer,
        "expert": e,
        "routed_tokens": int(moe.routed_tokens[e]),
        "samples": {"gate_up": samples_in, "down": moe.h_down[e].count},
        "damping": {},
        "fallback": {},
        "rel_error": {},
        "rtn_rel_error": {},
    }


def _finish(moe: ExpertMoE, e: int, proj: str, q: torch.Tensor, s: torch.Tensor, factor: Factor,
            group_size: int, record: dict[str, Any], packed: dict[str, PackedInt4], base: str) -> None:
    """Record errors, pack, and swap the expert's weight for its dequantized value."""
    w = moe.experts[e][proj]
    h = moe.h_down[e].hessian() if proj == "down_proj" else (
        moe.h_in.hessian() if moe.h_in is not None else moe.h_in_expert[e].hessian())
    dq = dequantize_group(q, s, group_size)
    rq, rs = quantize_rtn(w, group_size)
    record["damping"][proj] = factor.damping
    if factor.failure:
        record["fallback"][proj] = f"rtn: {factor.failure}"
    record["rel_error"][proj] = relative_error(w, dq, h)
    record["rtn_rel_error"][proj] = relative_error(w, dequantize_group(rq, rs, group_size), h)
    packed[f"{base}{e}.{proj}"] = pack_int4(q.cpu(), s.cpu())
    moe.experts[e][proj] = dq
