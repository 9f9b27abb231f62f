"""Asymmetric calibration (GPTAQ-style) and expert-internal sequential order for GPTQ.

Plain GPTQ is *symmetric*: each module is fitted on the quantized model's inputs `X~` to its own output
on them, `min ||X~ W^T - X~ Q^T||`, so the error the earlier quantized modules left in `X~` is never
corrected. Asymmetric calibration (Li et al. 2025, "GPTAQ") fits the quantized module to the
*full-precision* model's output instead: `min ||X W^T - X~ Q^T||`, with `X` what the same module receives
in the unquantized model, token by token.

Closed form used here (rows are tokens). With `H = X~^T X~ / n`, the damped `H_d = H + l I` GPTQ already
factorises, and the cross term `C = (X - X~)^T X~ / n`, the ridge objective
`||X W^T - X~ Q^T||^2 / n + l ||Q - W||^2` equals `tr((Q - W*) H_d (Q - W*)^T) + const` with

    W* = W + W C H_d^-1

so GPTQ with the same Hessian on the shifted target `W*` is exactly the greedy asymmetric solution (each
rounding error pushed onto the remaining columns optimally, as in the paper's column-wise update). The
shift costs one `[in, in]` product per factorisation and one `[out, in] x [in, in]` product per weight;
`asymmetric_strength` scales it (1 = the full correction, 0 = plain GPTQ).

Where the two streams come from (`PairedPass`): the runner keeps a second activation stream — the inputs
of every layer in the full-precision model — spilled like the quantized one (`fp_NNNN/`, resumable).
Pass 1 of a layer runs the source layer on each full-precision batch (its output is the next layer's
full-precision input) and then on the matching quantized batch; forward hooks pair each target module's
inputs token by token and accumulate `C` next to `H`. For the routed experts in "all" mode every token
goes through every expert, so the gate/up cross term, like their Hessian, is one matrix shared by all
experts; each `down_proj` pairs the per-expert inner activations `act(x Wg^T) * (x Wu^T)` of both streams
(built from the kept MoE inputs when the activations are in RAM, accumulated during the forward when they
are streamed from disk).

`expert_order: gate_up_first` quantizes each expert's gate/up before its `down_proj`, whose Hessian is
then taken from the *quantized* gate/up outputs (true-sequential inside the expert; with asymmetric
calibration its target stays the full-precision inner activation). It needs the MoE inputs kept in RAM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch import nn

from quantkit.calibrate.experts import ROWS_PER_CHUNK, chunks, finish_module, record
from quantkit.calibrate.gptq import Factor, GPTQScheme, HessianAccumulator, prepare, quantize_many, quantize_rows
from quantkit.calibrate.moe import ExpertMoE, token_weights
from quantkit.core.errors import QuantkitError
from quantkit.quant.int4 import PackedInt4

__all__ = ["CrossAccumulator", "PairedPass", "inverse_hessian", "shifted_target", "quantize_experts_ordered"]

Phase = Literal["fp", "q"]
Batch = dict[str, torch.Tensor]


class CrossAccumulator:
    """Running `sum w (x - x~)^T x~` over paired input rows (fp32) and the total weight (as `HessianAccumulator`)."""

    def __init__(self, columns: int, device: torch.device | str = "cpu") -> None:
        self.sum = torch.zeros(columns, columns, dtype=torch.float32, device=device)
        self.weight = 0.0

    def add(self, x_fp: torch.Tensor, x_q: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        """Add paired rows: `x_fp` (full-precision stream) and `x_q` (quantized stream), same shape."""
        xq = x_q.reshape(-1, x_q.shape[-1]).to(self.sum.device, torch.float32)
        if xq.shape[0] == 0:
            return
        delta = x_fp.reshape(xq.shape).to(xq) - xq
        if weight is not None:
            weight = weight.reshape(-1, 1).to(xq)
            delta = delta * weight
            self.weight += float(weight.sum())
        else:
            self.weight += float(xq.shape[0])
        self.sum.addmm_(delta.t(), xq)

    def cross(self) -> torch.Tensor:
        """`(X - X~)^T W X~ / sum(W)` (zeros when nothing was seen)."""
        return self.sum / (self.weight if self.weight > 0 else 1.0)


def inverse_hessian(factor: Factor) -> torch.Tensor | None:
    """`H_d^-1` in natural column order, from the factor GPTQ uses (None when GPTQ fell back to RTN)."""
    if factor.hinv is None:
        return None
    inv = factor.hinv.t() @ factor.hinv  # the factor is the upper Cholesky factor of H_d^-1, processing order
    if factor.perm is None:
        return inv
    out = torch.empty_like(inv)
    p = factor.perm.to(inv.device)
    out[p.unsqueeze(1), p.unsqueeze(0)] = inv
    return out


def shift_matrix(cross: torch.Tensor, factor: Factor, strength: float) -> torch.Tensor | None:
    """`strength * C H_d^-1` ([in, in]): a weight's asymmetric target is `W + W @ shift_matrix`."""
    inv = inverse_hessian(factor)
    if inv is None or not strength:
        return None
    return strength * (cross.to(inv) @ inv)


def shifted_target(w: torch.Tensor, cross: torch.Tensor, factor: Factor, strength: float = 1.0) -> torch.Tensor:
    """The asymmetric target `W* = W + strength * W C H_d^-1` (fp32); `W` itself when GPTQ is not possible."""
    w = w.to(torch.float32)
    m = shift_matrix(cross, factor, strength)
    return w if m is None else w + w @ m.to(w.device)


# ------------------------------------------------------------------------------------------ paired pass 1
class PairedPass:
    """Pass 1 of a layer on both activation streams, pairing every target module's inputs token by token.

    `hessians` (one per target Linear) receive the quantized stream's inputs, `cross[name]` the paired cross
    term. For `moe` (collecting, mode "all"): the gate/up cross term, and (`expert_down`) either the
    full-precision MoE inputs (`keep_inputs`, next to the quantized ones the MoE keeps itself) or per-expert
    `down_proj` cross terms accumulated here.
    """

    def __init__(self, linears: dict[str, nn.Linear], hessians: dict[str, HessianAccumulator],
                 moe: ExpertMoE | None, keep_inputs: bool, expert_down: bool = True) -> None:
        self.phase: Phase = "fp"
        self.hessians = hessians
        self.cross = {name: CrossAccumulator(lin.in_features, lin.weight.device) for name, lin in linears.items()}
        self._fp: dict[str, list[torch.Tensor]] = {name: [] for name in linears}
        self.moe = moe
        self.moe_fp: list[torch.Tensor] | None = None
        self.moe_cross: CrossAccumulator | None = None
        self.down_cross: list[CrossAccumulator] = []
        self._moe_x: torch.Tensor | None = None
        self.hooks = [lin.register_forward_pre_hook(self._linear_hook(name)) for name, lin in linears.items()]
        if moe is not None:
            w = moe.experts[0]
            hidden, inter, dev = w["gate_proj"].shape[1], w["down_proj"].shape[1], w["gate_proj"].device
            self.moe_cross = CrossAccumulator(hidden, dev)
            if keep_inputs:
                self.moe_fp = []
            elif expert_down:
                self.down_cross = [CrossAccumulator(inter, dev) for _ in moe.experts]
            self.hooks.append(moe.register_forward_pre_hook(self._moe_hook))

    def _linear_hook(self, name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].detach()
            if self.phase == "fp":
                self._fp[name].append(x.clone())
            else:
                self.hessians[name].add(x)
                self.cross[name].add(self._fp[name].pop(0), x)

        return hook

    def _moe_hook(self, _module: nn.Module, args: tuple[Any, ...]) -> None:
        assert self.moe is not None and self.moe_cross is not None
        x = args[0].detach()
        x = x.reshape(-1, x.shape[-1])
        if self.phase == "fp":
            self._moe_x = x.clone()
            return
        xf, self._moe_x = self._moe_x, None
        assert xf is not None, "the full-precision batch must run before its quantized pair"
        self.moe_cross.add(xf, x)
        if self.moe_fp is not None:
            self.moe_fp.append(xf)
        elif self.down_cross:
            for e, acc in enumerate(self.down_cross):
                acc.add(self.moe._inner(e, xf), self.moe._inner(e, x))

    def run(self, pairs: Iterable[tuple[Batch, Batch]], forward: Callable[[Batch], tuple[torch.Tensor, Any]],
            fp_out: Callable[[torch.Tensor, Any], None] | None) -> None:
        """For each (quantized, full-precision) batch pair: the source layer on the full-precision batch
        (no statistics; its output goes to `fp_out`), then on the quantized one (statistics)."""
        for q, fp in pairs:
            self.phase = "fp"
            collect = self.moe.collect if self.moe is not None else None
            if self.moe is not None:
                self.moe.collect = None  # plain routed forward: the fp stream adds no statistics
            out, topk = forward(fp)
            if self.moe is not None:
                self.moe.collect = collect
            if fp_out is not None:
                fp_out(out, topk)
            self.phase = "q"
            forward(q)
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def linear_cross(self, name: str) -> torch.Tensor:
        return self.cross[name].cross()


# ------------------------------------------------------------------------------------ routed experts
def quantize_experts_ordered(moe: ExpertMoE, paired: PairedPass | None, module_base: str, layer: int,
                             scheme: GPTQScheme) -> tuple[dict[str, PackedInt4], list[dict[str, Any]]]:
    """`experts.quantize_experts` with asymmetric targets (`paired` given) and/or gate/up before down.

    Same results contract as `quantize_experts`: packed modules by name (CPU) and one coverage record per
    expert; relative errors are measured against the target GPTQ fitted (`W*` when asymmetric).
    """
    settings = scheme.settings
    if moe.h_in is None:
        raise QuantkitError("gptq: asymmetric calibration / expert_order need all-expert statistics (mode 'all')")
    gate_up_first = settings.expert_order == "gate_up_first"
    if gate_up_first and moe.inputs is None:
        raise QuantkitError("gptq.expert_order: gate_up_first needs the calibration activations in RAM "
                            "(they were streamed from disk); use down_first")
    n = len(moe.experts)
    damp, actorder = scheme.damp, scheme.actorder
    strength = settings.asymmetric_strength if paired is not None else 0.0
    packed: dict[str, PackedInt4] = {}
    records = [record(moe, layer, e) for e in range(n)]
    experts = list(range(n))  # one process holds them all (see runner.run)
    limit = ROWS_PER_CHUNK.get(moe._device().type, ROWS_PER_CHUNK["cpu"])
    inter = moe.experts[0]["gate_proj"].shape[0]

    weighted = settings.routed_weight_gate_up and bool(settings.routed_token_weight) and moe.inputs is not None
    # gate/up: one Hessian, one factor and one shift for every expert (unless routed tokens are weighted)
    h_in, count_in = moe.in_hessian(0)
    f_in = prepare(h_in, damp, actorder) if not weighted else None
    m_in = shift_matrix(paired.moe_cross.cross(), f_in, strength) if paired and paired.moe_cross and f_in else None

    def finish_gate_up(e: int, rows: torch.Tensor, q: torch.Tensor, s: torch.Tensor, f: Factor, h: torch.Tensor,
                       count: int) -> None:
        records[e]["samples"]["gate_up"] = count
        for j, proj in enumerate(("gate_proj", "up_proj")):
            moe.experts[e][proj] = rows[j * inter:(j + 1) * inter]  # the target fitted (errors are against it)
            finish_module(moe, e, proj, q[j * inter:(j + 1) * inter], s[j * inter:(j + 1) * inter], f, h, scheme,
                          records[e], packed, module_base)

    def do_gate_up(chunk: list[int]) -> None:
        if f_in is not None:
            rows = torch.cat([moe.experts[e][p] for e in chunk for p in ("gate_proj", "up_proj")]).float()
            if m_in is not None:
                rows = rows + rows @ m_in.to(rows.device)
            q, s = quantize_rows(rows, f_in, scheme)
            for i, e in enumerate(chunk):
                lo, hi = 2 * i * inter, (2 * i + 2) * inter
                finish_gate_up(e, rows[lo:hi], q[lo:hi], s[lo:hi], f_in, h_in, count_in)
            return
        stats = [_gate_up_stats(moe, paired, e, settings.routed_token_weight) for e in chunk]
        factors = [prepare(h, damp, actorder) for h, _, _ in stats]
        ws = []
        for e, f, (_, _, cross) in zip(chunk, factors, stats, strict=True):
            w = torch.cat([moe.experts[e]["gate_proj"], moe.experts[e]["up_proj"]])
            ws.append(shifted_target(w, cross, f, strength) if cross is not None else w.float())
        results = quantize_many(ws, factors, scheme)
        for e, w, f, (h, count, _), (q, s) in zip(chunk, ws, factors, stats, results, strict=True):
            finish_gate_up(e, w, q, s, f, h, count)

    down_paired = paired if settings.asymmetric_down else None

    def do_down(chunk: list[int], source_gate_up: dict[int, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        stats = [_down_stats(moe, down_paired, e, settings.routed_token_weight,
                             source_gate_up[e] if source_gate_up else None) for e in chunk]
        factors = [prepare(h, damp, actorder) for h, _, _ in stats]
        ws = []
        for e, f, (_, count, cross) in zip(chunk, factors, stats, strict=True):
            records[e]["samples"]["down"] = count
            w = moe.experts[e]["down_proj"]
            ws.append(shifted_target(w, cross, f, strength) if cross is not None else w)
        results = quantize_many(ws, factors, scheme)
        for e, w, f, (h, _, _), (q, s) in zip(chunk, ws, factors, stats, results, strict=True):
            moe.experts[e]["down_proj"] = w
            finish_module(moe, e, "down_proj", q, s, f, h, scheme, records[e], packed, module_base)

    hidden = moe.experts[0]["down_proj"].shape[0]
    if gate_up_first:  # per chunk: gate/up, then down on the quantized gate/up outputs
        for chunk in chunks(experts, max(2 * inter, hidden), limit):
            source = ({e: (moe.experts[e]["gate_proj"], moe.experts[e]["up_proj"]) for e in chunk}
                      if down_paired else None)
            do_gate_up(chunk)
            do_down(chunk, source)
    else:
        for chunk in chunks(experts, hidden, limit):
            do_down(chunk, None)
        for chunk in chunks(experts, 2 * inter, limit):
            do_gate_up(chunk)
    return packed, records


def _gate_up_stats(moe: ExpertMoE, paired: PairedPass | None, e: int, routed_weight: float
                   ) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """Expert `e`'s gate/up Hessian with its routed tokens weighted 1 + w (kept inputs), count and cross term."""
    assert moe.inputs is not None
    h, count = moe.in_hessian(e, routed_weight)
    if paired is None or paired.moe_fp is None:
        return h, count, None
    acc = CrossAccumulator(h.shape[0], h.device)
    for x, xf, index in zip(moe.inputs, paired.moe_fp, moe.routes, strict=True):
        acc.add(xf, x, token_weights(index, e, routed_weight))
    return h, count, acc.cross()


def _down_stats(moe: ExpertMoE, paired: PairedPass | None, e: int, routed_weight: float,
                source_gate_up: tuple[torch.Tensor, torch.Tensor] | None
                ) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """Expert `e`'s down_proj Hessian (on the quantized stream, through its *current* gate/up), sample count
    and cross term (None without `paired`); the full-precision side uses `source_gate_up` when the expert's
    gate/up are already quantized."""
    if moe.inputs is None:  # streamed: accumulated during the forward (source gate/up)
        cross = paired.down_cross[e].cross() if paired is not None else None
        return moe.h_down[e].hessian(), moe.h_down[e].count, cross
    dev = moe.inputs[0].device
    acc = HessianAccumulator(moe.experts[e]["down_proj"].shape[1], dev)
    cross_acc = CrossAccumulator(acc.sum.shape[0], dev) if paired is not None else None
    fps = paired.moe_fp if paired is not None and paired.moe_fp is not None else [None] * len(moe.inputs)
    g, u = moe.weight(e, "gate_proj").t(), moe.weight(e, "up_proj").t()  # dequantized once, not per batch
    gf, uf = (g, u) if source_gate_up is None else (source_gate_up[0].float().t(), source_gate_up[1].float().t())
    for x, xf, index in zip(moe.inputs, fps, moe.routes, strict=True):
        weight = token_weights(index, e, routed_weight)
        a = moe.act(x @ g) * (x @ u)
        acc.add(a, weight)
        if cross_acc is not None and xf is not None:
            cross_acc.add(moe.act(xf @ gf) * (xf @ uf), a, weight)
    return acc.hessian(), acc.count, cross_acc.cross() if cross_acc is not None else None
