"""Activation amax per quantized Linear input, for NVFP4 W4A4's `input_global_scale` (docs/fp4.md).

llm-compressor's calibrated `oneshot` NVFP4 preset observes each target Linear's *raw* input (before any
fake quantization) with a `static_minmax` observer: the running min and max over every calibration batch;
`input_global_scale = 2688 / max(|min|, |max|)` (compressed-tensors' `generate_gparam`). The runner does the
same with a forward pre-hook per dense Linear and, for routed experts (not `nn.Linear` here), inside
`moe.ExpertMoE`: every calibration token through every expert (llm-compressor's `moe_calibrate_all_experts`,
its default), so an expert real routing never picks still has an amax. The amaxes are stored per module in the
layer file (`amax` metadata); the converter takes the max over each fused group and computes the scale.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from quantkit.core.distributed import SINGLE, World

__all__ = ["AmaxHooks", "LayerAmax", "merge_amax", "observe_expert"]


class AmaxHooks:
    """max |input| of each Linear in `linears` (name -> module) over the forwards while attached."""

    def __init__(self, linears: dict[str, nn.Linear]) -> None:
        self.amax: dict[str, float] = {}
        self._hooks = [lin.register_forward_pre_hook(self._hook(name)) for name, lin in linears.items()]

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            a = float(args[0].detach().abs().amax()) if args[0].numel() else 0.0
            self.amax[name] = max(self.amax.get(name, 0.0), a)

        return hook

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def merge_amax(parts: dict[str, float], world: World = SINGLE) -> dict[str, float]:
    """The max of every rank's amaxes per module (each rank forwarded only its own batches). A collective."""
    merged: dict[str, float] = {}
    for ranks in world.all_gather_object(parts):
        for name, a in ranks.items():  # type: ignore[attr-defined]
            merged[name] = max(merged.get(name, 0.0), float(a))
    return merged


def observe_expert(store: dict[int, list[float]], e: int, x: torch.Tensor, inner: torch.Tensor) -> None:
    """Expert `e`'s gate/up input amax (`x`, the MoE input tokens) and down_proj input amax (`inner`)."""
    a = store.setdefault(e, [0.0, 0.0])
    if x.numel():
        a[0] = max(a[0], float(x.abs().amax()))
        a[1] = max(a[1], float(inner.abs().amax()))


class ExpertAmax(Protocol):
    """`moe.ExpertMoE` as the observation uses it (moe.py imports this module): where its experts' amaxes go."""

    amax: dict[int, list[float]] | None  # expert -> input amax [gate/up, down] while observing


class LayerAmax:
    """One decoder layer's observation: hooks on its dense target Linears plus the routed experts' amaxes."""

    def __init__(self, linears: dict[str, nn.Linear], moe: ExpertAmax | None) -> None:
        self.hooks = AmaxHooks(linears)
        self.moe = moe
        if moe is not None:
            moe.amax = {}

    def finish(self, base: str, world: World = SINGLE) -> dict[str, float]:
        """Module name -> amax of its input, merged over the ranks (a collective); detaches everything."""
        self.hooks.remove()
        out = {base + name: a for name, a in self.hooks.amax.items()}
        if self.moe is not None:
            for e, (gate_up, down) in self.moe.amax.items():
                expert = f"{base}mlp.experts.{e}."
                out.update({expert + "gate_proj": gate_up, expert + "up_proj": gate_up, expert + "down_proj": down})
            self.moe.amax = None
        return merge_amax(out, world)
