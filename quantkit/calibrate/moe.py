"""Routed experts for calibration: real routing for the layer output, all experts for the statistics.

`ExpertMoE` replaces a transformers MoE block inside a decoder layer. Its router and shared experts are
transformers' own modules; the routed experts are run one at a time from per-expert weights. While
collecting, every calibration token goes through every expert (by default) so that each expert's Hessian
has real data even when routing rarely picks it, but the layer *output* always uses the real top-k
routing and weights. With all tokens sent everywhere, the gate/up input is the same for every expert, so
one Hessian (and one factorisation) serves all of them; each expert's `down_proj` gets its own.

Memory: expert weights are held in the model dtype (BF16/FP16: what the checkpoint stores) and upcast
to fp32 one expert at a time; a quantized expert is held as its packed INT4 codes + scales (0.5 byte
per weight) and dequantized per use. When the calibration activations fit in RAM, the MoE inputs are
kept instead of one `down_proj` Hessian per expert, and each chunk of experts' down Hessians is built
from them just before it is quantized — so only a chunk's Hessians exist at once.

Expert-parallel (several ranks, `quantkit.core.distributed.World`): each rank holds only the experts it owns
(`experts[e]` is None for the others). Each step, the ranks' MoE inputs (and their routing) are gathered,
so every rank runs its experts on all the step's tokens — the statistics of an owned expert are complete
on its rank — and the partial outputs are summed back (all_reduce), each rank keeping its own tokens'
rows. A rank with fewer batches joins a step with no tokens (`idle_step`). The shared gate/up Hessian is
accumulated from each rank's own tokens and summed over the ranks after the pass (`reduce_statistics`).

`quantkit.calibrate.experts.quantize_experts` then runs GPTQ per (owned) expert with the layer's experts unit's
scheme (one format for every expert and projection of a layer, as the engines require).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from quantkit.calibrate.act_amax import observe_expert
from quantkit.calibrate.gptq import HessianAccumulator
from quantkit.checkpoint.source import SourceCheckpoint
from quantkit.core.distributed import SINGLE, World
from quantkit.quant.int4 import PackedInt4, dequantize_packed

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["ExpertMoE", "SourceWeight", "token_weights"]

PROJS = ("gate_proj", "up_proj", "down_proj")
Collect = Literal["all", "routed"]  # every token through every expert, or only the routed ones


@dataclass(frozen=True)
class SourceWeight:
    """An expert weight not read yet: where it is in the source, its shape, the dtype it is held in."""

    source: SourceCheckpoint
    name: str
    dtype: torch.dtype
    shape: torch.Size

    def read(self, device: torch.device) -> torch.Tensor:
        return self.source.read(self.name, self.dtype).to(device)


ExpertWeight = torch.Tensor | PackedInt4 | SourceWeight
ExpertWeights = dict[str, ExpertWeight]


class ExpertMoE(nn.Module):
    """A MoE block with per-expert weights and optional per-expert Hessian collection."""

    def __init__(self, gate: nn.Module, shared: nn.Module | None, experts: list[dict[str, torch.Tensor] | None],
                 act: Callable[[torch.Tensor], torch.Tensor], world: World = SINGLE) -> None:
        super().__init__()
        self.gate = gate
        self.shared_experts = shared
        # plain tensors (model dtype), not parameters; each becomes a PackedInt4 (INT4 / INT8) once quantized;
        # None for the experts another rank owns
        self.experts: list[ExpertWeights | None] = list(experts)
        self.owned = [e for e, w in enumerate(self.experts) if w is not None]
        self.world = world
        self.act = act
        self.collect: Collect | None = None
        self.routed_tokens = torch.zeros(len(experts), dtype=torch.long)  # all experts, whoever owns them
        self.h_in: HessianAccumulator | None = None
        # per expert (None for another rank's)
        self.h_in_expert: list[HessianAccumulator | None] = []
        self.h_down: list[HessianAccumulator | None] = []
        self.inputs: list[torch.Tensor] | None = None  # MoE inputs kept (mode "all", when they fit)
        self.routes: list[torch.Tensor] = []  # their top-k expert indices, for routed-token weighting
        self.outputs = True  # False while collecting: routed experts skipped, the output is not the model's
        self.amax: dict[int, list[float]] | None = None  # W4A4: expert -> input amax [gate/up, down] (act_amax.py)

    @classmethod
    def from_source(cls, source: SourceCheckpoint, cfg: PretrainedConfig, base: str, hf_moe: nn.Module,
                    lazy: bool = False, world: World = SINGLE) -> ExpertMoE:
        """Load router, shared experts and this rank's experts (names under `base` = `...mlp.`).

        `lazy`: the routed experts are left in the source (`SourceWeight`) and read when GPTQ reaches
        them (`load`), so a layer never holds all of them unquantized: for a statistics pass that keeps
        the MoE inputs and skips the routed experts (`start_collecting(outputs=False)`)."""
        gate = hf_moe.gate
        gate.load_state_dict(_read(source, base + "gate.", gate), strict=True, assign=True)
        shared = getattr(hf_moe, "shared_experts", None)
        if shared is not None:
            shared.load_state_dict(_read(source, base + "shared_experts.", shared), strict=True, assign=True)
        n, dtype = int(cfg.n_routed_experts), source.model_dtype
        def weight(name: str) -> torch.Tensor | SourceWeight:
            if lazy:
                return SourceWeight(source, name, dtype, torch.Size(source.logical[name].shape))
            return source.read(name, dtype)  # straight in the model dtype: no fp32 copy

        owned = set(world.mine(list(range(n))))
        experts = [{p: weight(f"{base}experts.{e}.{p}.weight") for p in PROJS} if e in owned else None
                   for e in range(n)]
        return cls(gate, shared, experts, hf_moe.experts.act_fn, world)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> ExpertMoE:
        """`.to(device)` must move the plain expert tensors too (they are not parameters)."""
        super()._apply(fn, recurse)
        self.experts = [None if w is None else {k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in w.items()}
                        for w in self.experts]
        return self

    # ---- weights ---------------------------------------------------------------------------------
    def _device(self) -> torch.device:
        """Where the experts run: a held expert weight's device, else the router's (lazy experts)."""
        for e in self.owned:
            w = self.held(e)["gate_proj"]
            if isinstance(w, torch.Tensor):
                return w.device
            if isinstance(w, PackedInt4):
                return w.weight_packed.device
        return next(iter(self.gate.parameters()), torch.empty(0)).device

    def held(self, e: int) -> ExpertWeights:
        """Expert `e`'s weights (this rank must own it)."""
        w = self.experts[e]
        if w is None:
            raise ValueError(f"expert {e} is owned by another rank")
        return w

    def weight(self, e: int, proj: str) -> torch.Tensor:
        """Expert `e`'s `proj` weight in fp32 (dequantized when already quantized, read when still lazy)."""
        w = self.held(e)[proj]
        if isinstance(w, PackedInt4):
            return dequantize_packed(w)
        if isinstance(w, SourceWeight):
            return w.read(self._device()).float()
        return w.float()

    def load(self, experts: Iterable[int], projs: Iterable[str]) -> None:
        """Read the lazy weights `projs` of `experts` from the source (no-op for those already held)."""
        for e in experts:
            for p in projs:
                w = self.held(e)[p]
                if isinstance(w, SourceWeight):
                    self.held(e)[p] = w.read(self._device())

    def _inner(self, e: int, x: torch.Tensor, gate_up: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> torch.Tensor:
        """The down_proj input of expert `e` for tokens `x`: act(x Wg^T) * (x Wu^T) (`gate_up`: the fp32
        weights, when the caller holds them)."""
        wg, wu = gate_up or (self.weight(e, "gate_proj"), self.weight(e, "up_proj"))
        return self.act(x @ wg.t()) * (x @ wu.t())

    # ---- statistics ------------------------------------------------------------------------------
    def start_collecting(self, mode: Collect = "all", keep_inputs: bool = False, outputs: bool = True) -> None:
        """Collect Hessians on the next forwards; `keep_inputs` (mode "all") keeps the MoE inputs instead of
        accumulating a down_proj Hessian per expert — use it when the calibration activations fit in RAM.
        `outputs=False` (with kept inputs) skips the routed experts: the forward's output is then the shared
        experts' only, for callers that discard it."""
        hidden = self.held(self.owned[0])["gate_proj"].shape[1] if self.owned else self.gate.weight.shape[1]
        dev = self._device()
        self.collect = mode
        if mode == "all":
            self.h_in = HessianAccumulator(hidden, dev)
        else:
            self.h_in_expert = [None if w is None else HessianAccumulator(hidden, dev) for w in self.experts]
        self.inputs = [] if keep_inputs and mode == "all" else None
        self.h_down = [] if self.inputs is not None else [
            None if w is None else HessianAccumulator(w["down_proj"].shape[1], dev) for w in self.experts]
        self.outputs = outputs or self.inputs is None

    def reduce_statistics(self) -> None:
        """After the collecting pass: sum the shared gate/up Hessian over the ranks (each rank added its own
        tokens; the per-expert statistics are complete on the expert's rank already). A collective."""
        if self.h_in is not None:
            self.h_in.all_reduce(self.world)

    def stop_collecting(self) -> None:
        """Drop every statistic (the output pass needs none: a `hidden x hidden` fp32 Hessian is 196 MiB
        on DeepSeek-V3)."""
        self.collect = None
        self.outputs = True
        self.h_in = None
        self.h_in_expert = []
        self.inputs = None
        self.routes = []
        self.h_down = []

    def down_hessian(self, e: int, routed_weight: float = 0.0) -> tuple[torch.Tensor, int]:
        """`down_proj` input Hessian of expert `e` and its sample count (from the source gate/up weights).

        With kept inputs, `routed_weight` > 0 counts the tokens real routing sends to `e` 1 + w times.
        """
        if self.inputs is None:
            return self.h_down[e].hessian(), self.h_down[e].count
        acc = HessianAccumulator(self.held(e)["down_proj"].shape[1], self.inputs[0].device)
        gate_up = self.weight(e, "gate_proj"), self.weight(e, "up_proj")  # upcast (or read) once, not per batch
        for x, index in zip(self.inputs, self.routes, strict=True):
            acc.add(self._inner(e, x, gate_up), token_weights(index, e, routed_weight))
        return acc.hessian(), acc.count

    def in_hessian(self, e: int, routed_weight: float = 0.0) -> tuple[torch.Tensor, int]:
        """gate/up input Hessian of expert `e` (shared by all experts unless `routed_weight` > 0 with kept
        inputs: then expert `e`'s routed tokens count 1 + w times)."""
        if routed_weight and self.inputs is not None:
            acc = HessianAccumulator(self.inputs[0].shape[-1], self.inputs[0].device)
            for x, index in zip(self.inputs, self.routes, strict=True):
                acc.add(x, token_weights(index, e, routed_weight))
        else:
            acc = self.h_in if self.h_in is not None else self.h_in_expert[e]
        return acc.hessian(), acc.count

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, weights, index = self.gate(x)
        out = self._routed(x, weights, index).view(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out

    def idle_step(self) -> None:
        """Join one expert-parallel step with no tokens of this rank's own (it has no batch left)."""
        dev = self.gate.weight.device
        k = int(self.gate.top_k)
        self._routed(torch.zeros(0, self.gate.weight.shape[1], device=dev), torch.zeros(0, k, device=dev),
                     torch.zeros(0, k, dtype=torch.long, device=dev))

    def _routed(self, x_own: torch.Tensor, w_own: torch.Tensor, i_own: torch.Tensor) -> torch.Tensor:
        """The routed experts' output for this rank's tokens `x_own` (their top-k weights and indices);
        statistics for this rank's experts from the tokens of every rank (collectives when several)."""
        if self.world.size > 1:
            (x, weights, index), rows = self.world.all_gather_rows([x_own, w_own.float(), i_own])
        else:
            x, weights, index, rows = x_own, w_own, i_own, [x_own.shape[0]]
        out = torch.zeros_like(x)
        if self.collect == "all":
            self.h_in.add(x_own)  # this rank's tokens; summed over the ranks by reduce_statistics
            if self.inputs is not None:
                self.inputs.append(x.detach().clone())
                self.routes.append(index.detach().clone())
        if self.collect is not None:
            self.routed_tokens += torch.bincount(index.flatten().cpu(), minlength=len(self.experts))
        for e in self.owned:
            token, slot = torch.where(index == e)
            if not self.outputs:
                continue
            if self.collect == "all" and self.inputs is None:
                # every token through expert e for its statistics; only routed tokens reach the output
                a_all = self._inner(e, x)
                self.h_down[e].add(a_all)
                a = a_all[token]
            elif self.amax is not None:  # W4A4 input amax: every token through expert e, as for the Hessians
                a_all = self._inner(e, x)
                observe_expert(self.amax, e, x, a_all)
                a = a_all[token]
            elif token.numel() == 0:
                continue
            else:
                a = self._inner(e, x[token])
                if self.collect == "routed":
                    self.h_in_expert[e].add(x[token])
                    self.h_down[e].add(a)
            if token.numel() == 0:
                continue
            y = a @ self.weight(e, "down_proj").t()
            out.index_add_(0, token, y * weights[token, slot, None].to(y.dtype))
        if self.world.size > 1:
            start = sum(rows[: self.world.rank])
            out = self.world.all_reduce(out)[start : start + rows[self.world.rank]]
        return out


def token_weights(index: torch.Tensor, e: int, routed_weight: float) -> torch.Tensor | None:
    """Per-token weights `1 + w * [routed to e]` (the accumulator divides by their sum: same scale)."""
    if not routed_weight:
        return None
    return 1.0 + routed_weight * (index == e).any(dim=-1).to(torch.float32)


def _read(source: SourceCheckpoint, base: str, module: nn.Module) -> dict[str, torch.Tensor]:
    """A submodule's state dict read from the source (names `base` + local name)."""
    names = set(source.logical_names())
    keys = list(module.state_dict(keep_vars=True).keys())
    return {k: source.read(base + k, torch.float32) for k in keys if base + k in names}
