"""One decoder layer's part of the sensitivity pass: its backward step and every unit's score per format.

Given the layer's inputs (one batch), the gradient of the sampled-label log-likelihood at its output
(`g_out`, from the layers above) and a fake-quantizer per candidate format, `score_batch`

1. runs the layer forward with autograd and back-propagates `g_out`: the gradient at its input (for the
   layer below) and at the residual stream after attention (`g_mid`);
2. for each unit of the layer and each format, computes the unit's output error `delta` with that unit's
   weights fake-quantized (the rest of the model at the source) and, per sequence, the first-order change
   of the log-likelihood `d = sum_tokens g . delta` (g: `g_mid` for attention, `g_out` for the MLP parts).

`d^2` averaged over sequences and label draws is the Fisher quadratic form of the unit's error, i.e. twice
the predicted KL(source || quantized) summed over the sequence's tokens (sensitivity.py explains why).

The routed experts are scored one expert at a time on the tokens real routing sends them (fixed routing,
the source's top-k weights), so a layer never holds a second copy of its experts; under expert
parallelism each rank scores its own experts on every rank's tokens and the per-sequence sums are added
over the ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from quantkit.calibrate.moe import ExpertMoE

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["FakeQuant", "Fits", "Kept", "LayerUnits", "UnitSpec", "backward_batch", "differentiable_routing",
           "idle_backward", "layer_call", "score_units"]

FakeQuant = Callable[[torch.Tensor], torch.Tensor]  # fp32 weight -> its quantize-dequantize value (fp32)
Fits = Callable[[str, tuple[int, int]], bool]  # format name, weight shape -> whether the format can store it


@dataclass(frozen=True)
class UnitSpec:
    """One unit of a decoder layer: its kind, the Linears it quantizes (names relative to the decoder layer;
    routed experts: none, they are `ExpertMoE`'s) and its weight matrices ((out, in), count) model-wide."""

    kind: str  # experts | shared_experts | attention | mlp
    names: tuple[str, ...]
    matrices: tuple[tuple[tuple[int, int], int], ...]

    @property
    def params(self) -> int:
        return sum(o * i * n for (o, i), n in self.matrices)


@dataclass(frozen=True)
class LayerUnits:
    """The units of one decoder layer to score, by unit name."""

    units: dict[str, UnitSpec]


def layer_call(module: nn.Module, rope: nn.Module, h: torch.Tensor, batch: dict[str, torch.Tensor],
               cfg: PretrainedConfig, dsa: bool) -> torch.Tensor:
    """The decoder layer on hidden states `h` (as the calibration runner calls it; autograd allowed)."""
    from quantkit.calibrate import layers as L

    b, s = h.shape[:2]
    pos = torch.arange(s, device=h.device).unsqueeze(0)
    kwargs: dict[str, Any] = {"position_embeddings": rope(h, pos), "position_ids": pos, "past_key_values": None}
    if dsa:
        kwargs["attention_mask"] = L.causal_mask(b, s).to(h.device)
        kwargs["prev_topk_indices"] = batch["topk"].to(h.device) if "topk" in batch else None
    out = module(h, **kwargs)
    return out[0] if isinstance(out, tuple) else out


# ------------------------------------------------------------------------------------ routed experts
def _local_routed(moe: ExpertMoE, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """This rank's experts' contribution to the routed output of tokens `x` (no collective)."""
    out = torch.zeros_like(x)
    for e in moe.owned:
        token, slot = torch.where(index == e)
        if token.numel() == 0:
            continue
        y = moe._inner(e, x[token]) @ moe.weight(e, "down_proj").t()
        out = out.index_add(0, token, y * weights[token, slot, None].to(y.dtype))
    return out


class _Routed(torch.autograd.Function):
    """The routed experts with a backward that works expert-parallel: every rank's tokens and output
    gradients are gathered, each rank differentiates its own experts, the input and routing-weight
    gradients are summed over the ranks and each rank keeps its own rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor, moe: ExpertMoE) -> torch.Tensor:
        ctx.moe = moe
        ctx.save_for_backward(x, weights, index)
        return ExpertMoE._routed(moe, x, weights, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        x, weights, index = ctx.saved_tensors
        gx, gw = routed_vjp(ctx.moe, x, weights, index, grad)
        return gx, gw.to(weights.dtype), None, None


def routed_vjp(moe: ExpertMoE, x_own: torch.Tensor, w_own: torch.Tensor, i_own: torch.Tensor,
               g_own: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of the routed output (this rank's rows) w.r.t. its tokens and top-k weights (a collective
    under expert parallelism; ranks without tokens call it with zero rows)."""
    world = moe.world
    (x, w, i, g), rows = world.all_gather_rows([x_own.detach(), w_own.detach().float(), i_own, g_own.detach()])
    with torch.enable_grad():
        x = x.clone().requires_grad_(True)
        w = w.clone().requires_grad_(True)
        out = _local_routed(moe, x, w, i)
        if out.requires_grad:
            gx, gw = torch.autograd.grad(out, (x, w), g, allow_unused=True)
        else:
            gx, gw = None, None
    gx = torch.zeros_like(x) if gx is None else gx
    gw = torch.zeros_like(w) if gw is None else gw
    if world.size > 1:
        start = sum(rows[: world.rank])
        gx = world.all_reduce(gx)[start : start + rows[world.rank]]
        gw = world.all_reduce(gw)[start : start + rows[world.rank]]
    return gx.detach(), gw.detach()


@contextmanager
def differentiable_routing(module: nn.Module) -> Iterator[ExpertMoE | None]:
    """While inside, the layer's `ExpertMoE` (if any) back-propagates through its routed experts."""
    moe = getattr(module, "mlp", None)
    if not isinstance(moe, ExpertMoE):
        yield None
        return
    moe._routed = lambda x, w, i: _Routed.apply(x, w, i, moe)  # type: ignore[method-assign]
    try:
        yield moe
    finally:
        del moe._routed


# ------------------------------------------------------------------------------------------- scores
@dataclass
class Kept:
    """What the unit scores need from one batch's backward step (`draws` gradients each)."""

    attn_args: tuple[Any, ...]
    attn_kwargs: dict[str, Any]
    attn_out: torch.Tensor
    g_mid: list[torch.Tensor]  # gradient at the residual stream after attention, per draw
    mlp_in: torch.Tensor
    g_out: list[torch.Tensor]  # gradient at the layer output, per draw


def backward_batch(module: nn.Module, rope: nn.Module, cfg: PretrainedConfig, batch: dict[str, torch.Tensor],
                   g_out: list[torch.Tensor], device: torch.device, dsa: bool) -> tuple[list[torch.Tensor], Kept]:
    """The layer's backward step on one batch: the gradients at its input (one per label draw) and what the unit
    scores need (`g_out[k]`: the gradient at the layer output for draw k, `[b, s, h]`)."""
    h = batch["hidden"].to(device).requires_grad_(True)
    cap: dict[str, Any] = {}

    def attn_hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        cap["args"], cap["kwargs"], cap["out"] = args, kwargs, out[0] if isinstance(out, tuple) else out

    hooks = [module.self_attn.register_forward_hook(attn_hook, with_kwargs=True),
             module.mlp.register_forward_pre_hook(lambda _m, args: cap.__setitem__("mlp_in", args[0]))]
    try:
        with differentiable_routing(module):
            out = layer_call(module, rope, h, batch, cfg, dsa)
    finally:
        for hk in hooks:
            hk.remove()
    g_in, g_mid = [], []
    for k, g in enumerate(g_out):
        gh, gm = torch.autograd.grad(out, [h, cap["out"]], g.to(device), retain_graph=k < len(g_out) - 1)
        g_in.append(gh.detach())
        g_mid.append(gm.detach())
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in cap["args"])
    kwargs = {k: (v.detach() if isinstance(v, torch.Tensor) else
                  tuple(t.detach() for t in v) if isinstance(v, tuple) else v) for k, v in cap["kwargs"].items()}
    return g_in, Kept(args, kwargs, cap["out"].detach(), g_mid, cap["mlp_in"].detach(), [g.to(device) for g in g_out])


def idle_backward(module: nn.Module, draws: int) -> None:
    """Join one expert-parallel step's forward and backward collectives with no tokens of this rank's own."""
    moe = getattr(module, "mlp", None)
    if not isinstance(moe, ExpertMoE):
        return
    moe.idle_step()
    hid, k = moe.gate.weight.shape[1], int(moe.gate.top_k)
    dev = moe.gate.weight.device
    for _ in range(draws):
        routed_vjp(moe, torch.zeros(0, hid, device=dev), torch.zeros(0, k, device=dev),
                   torch.zeros(0, k, dtype=torch.long, device=dev), torch.zeros(0, hid, device=dev))


def score_units(module: nn.Module, kept: list[Kept], units: LayerUnits, formats: dict[str, FakeQuant],
                fits: Fits | None = None, seq_len: int = 0, draws: int = 1) -> dict[str, dict[str, torch.Tensor]]:
    """Every unit x format on the kept batches: `dots[unit][format]` is `[draws + 1, sequences]`, per sequence the
    first-order log-likelihood change for each draw and, last, the unit's output error energy
    `sum_tokens |delta|^2` (each unit's weights are fake-quantized once per format for all the batches).
    Routed experts are a collective under expert parallelism (`seq_len` then names the sequence length for a
    rank with no batch, `draws` the label draws per batch)."""
    dots: dict[str, dict[str, torch.Tensor]] = {}
    with torch.no_grad():
        for unit, spec in units.units.items():
            fmts = {f: fq for f, fq in formats.items() if _fits(spec, fits, f)}
            if spec.kind == "experts":
                dots[unit] = _routed_dots(module.mlp, kept, fmts, seq_len, draws)
                continue
            dots[unit] = {}
            if spec.kind == "attention":
                def run(kp: Kept) -> torch.Tensor:
                    o = module.self_attn(*kp.attn_args, **kp.attn_kwargs)
                    return o[0] if isinstance(o, tuple) else o
                refs = [kp.attn_out for kp in kept]
                grads = [kp.g_mid for kp in kept]
            else:  # shared experts or a dense MLP: on the MLP input, added to the residual stream
                sub = module.mlp.shared_experts if spec.kind == "shared_experts" else module.mlp
                def run(kp: Kept, sub: nn.Module = sub) -> torch.Tensor:
                    return sub(kp.mlp_in)
                refs = [run(kp) for kp in kept]
                grads = [kp.g_out for kp in kept]
            for fmt, fq in fmts.items():
                with _swapped(module, spec.names, fq):
                    parts = [_dots(run(kp) - ref, g) for kp, ref, g in zip(kept, refs, grads, strict=True)]
                dots[unit][fmt] = torch.cat(parts, dim=1) if parts else torch.zeros(0, 0, dtype=torch.float64)
    return dots


def _fits(spec: UnitSpec, fits: Fits | None, fmt: str) -> bool:
    """Whether `fmt` can store every matrix of the unit (decided from the config: the same on every rank)."""
    return fits is None or all(fits(fmt, shape) for shape, _ in spec.matrices)


@contextmanager
def _swapped(module: nn.Module, names: tuple[str, ...], fq: FakeQuant) -> Iterator[None]:
    """The Linears `names` (relative to `module`) hold their fake-quantized weights while inside."""
    saved = {}
    for n in names:
        lin = module.get_submodule(n)
        saved[n] = lin.weight.data
        lin.weight.data = fq(saved[n].float()).to(saved[n].dtype)
    try:
        yield
    finally:
        for n, w in saved.items():
            module.get_submodule(n).weight.data = w


def _per_sequence(prod: torch.Tensor) -> torch.Tensor:
    """`[b, s, h]` elementwise products -> per-sequence sums `[b]` (float64)."""
    return prod.double().sum(dim=(1, 2))


def _dots(delta: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    """`[draws + 1, b]`: per sequence, `g_k . delta` for each label draw k, then the error energy `|delta|^2`."""
    return torch.stack([*(_per_sequence(delta * g) for g in grads), _per_sequence(delta * delta)])


def _routed_dots(moe: ExpertMoE, kept: list[Kept], formats: dict[str, FakeQuant], seq_len: int, draws: int
                 ) -> dict[str, torch.Tensor]:
    """Per format, per sequence: `sum g . delta` of the routed experts with every owned expert fake-quantized
    (per draw) and the error energy, `[draws + 1, b]` for this rank's sequences. Every rank's tokens are gathered
    once, each rank runs its experts (each fake-quantized once per format), the sums are added over the ranks."""
    world = moe.world
    hid = moe.gate.weight.shape[1]
    s = kept[0].mlp_in.shape[1] if kept else seq_len
    dev = moe.gate.weight.device
    if kept:
        x = torch.cat([kp.mlp_in.reshape(-1, hid) for kp in kept])
        _, weights, index = moe.gate(x)
        gs = torch.cat([torch.stack([g.reshape(-1, hid) for g in kp.g_out], dim=1) for kp in kept])
    else:
        k = int(moe.gate.top_k)
        x, weights = torch.zeros(0, hid, device=dev), torch.zeros(0, k, device=dev)
        index, gs = torch.zeros(0, k, dtype=torch.long, device=dev), torch.zeros(0, draws, hid, device=dev)
    (x, weights, index, gs), rows = world.all_gather_rows([x, weights.float(), index, gs])
    seq = torch.arange(x.shape[0], device=x.device) // s  # ranks' rows are whole sequences, in rank order
    n_seq = x.shape[0] // s
    acc = {f: torch.zeros(draws + 1, n_seq, dtype=torch.float64, device=x.device) for f in formats}
    err = {f: torch.zeros_like(x) for f in formats}  # the routed output error per token (this rank's experts)
    for e in moe.owned:
        token, slot = torch.where(index == e)
        if token.numel() == 0:
            continue
        xt, wt, gt = x[token], weights[token, slot, None], gs[token].double()
        w = {p: moe.weight(e, p) for p in ("gate_proj", "up_proj", "down_proj")}
        ref = moe._inner(e, xt, (w["gate_proj"], w["up_proj"])) @ w["down_proj"].t()
        for f, fq in formats.items():
            wq = {p: fq(v) for p, v in w.items()}
            delta = (moe._inner(e, xt, (wq["gate_proj"], wq["up_proj"])) @ wq["down_proj"].t() - ref) * wt
            acc[f][:-1].index_add_(1, seq[token], torch.einsum("th,tkh->kt", delta.double(), gt))
            err[f][token] += delta  # a token meets an expert once: no duplicate rows
    start = sum(r // s for r in rows[: world.rank])
    mine = slice(start, start + rows[world.rank] // s)
    out = {}
    for f in formats:
        a = world.all_reduce(acc[f])[:, mine]
        e = world.all_reduce(err[f])[mine.start * s : mine.stop * s]
        a[-1] = e.double().pow(2).sum(-1).view(-1, s).sum(-1)
        out[f] = a
    return out
