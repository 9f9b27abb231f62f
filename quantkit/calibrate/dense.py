"""GPTQ of a decoder layer's dense Linears (attention, shared experts, dense MLPs): which ones, with which
scheme (their unit's format, `quantkit.quant.precision.tensor_format`), and on which rank.

Across ranks the Hessians are summed first (by the caller); each Linear's solve runs on one rank, chosen by its
cost, and its codes and scales are broadcast so every rank swaps in the same dequantized weight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from quantkit.arch import Adapter, Role
from quantkit.calibrate.asymmetric import shifted_target
from quantkit.calibrate.experts import module_errors
from quantkit.calibrate.gptq import GPTQScheme, HessianAccumulator, prepare, quantize_rows
from quantkit.core.distributed import SINGLE, World
from quantkit.quant.int4 import PackedInt4, dequantize_group, pack_int
from quantkit.quant.precision import PrecisionPlan, tensor_format
from quantkit.quant.recipe import Recipe

__all__ = ["hessian_hook", "linear_owners", "quantize_linear", "role_linears", "target_linears"]


def linear_owners(linears: dict[str, nn.Linear], world: World) -> dict[str, int]:
    """The rank that solves each dense Linear: dealt by GPTQ cost (~ in^2 (in + out)), largest first."""
    names = list(linears)
    cost = [linears[n].in_features ** 2 * (linears[n].in_features + linears[n].out_features) for n in names]
    owner = dict.fromkeys(names, 0)
    for r in range(world.size):
        for i in World(r, world.size).balanced(cost):
            owner[names[i]] = r
    return owner


def target_linears(module: nn.Module, base: str, adapter: Adapter, recipe: Recipe, plan: PrecisionPlan | None,
                   dtype: torch.dtype) -> dict[str, tuple[nn.Linear, GPTQScheme]]:
    """Non-expert Linear modules of this layer that GPTQ computes (an INT format), each with its scheme."""
    out = {}
    for name, sub in module.named_modules():
        if not isinstance(sub, nn.Linear):
            continue
        if adapter.classify(base + name + ".weight").role in (Role.ROUTER, Role.ROUTED_EXPERT):
            continue
        fmt = tensor_format(recipe, adapter, plan, base + name)
        if fmt is not None and fmt.kind == "int":
            fmt.check_shape(tuple(sub.weight.shape), f"{base}{name}")
            out[name] = (sub, GPTQScheme.of(fmt, recipe.gptq, dtype))
    return out


def role_linears(module: nn.Module, base: str, adapter: Adapter, roles: set[Role]) -> dict[str, nn.Linear]:
    """Non-expert Linear modules of this layer whose role is in `roles` (W4A4 observes their inputs)."""
    out = {}
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Linear) and adapter.classify(base + name + ".weight").role in roles:
            if adapter.classify(base + name + ".weight").role not in (Role.ROUTER, Role.ROUTED_EXPERT):
                out[name] = sub
    return out


def hessian_hook(acc: HessianAccumulator) -> Callable[..., None]:
    def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
        acc.add(args[0])

    return hook


def quantize_linear(lin: nn.Linear, h: torch.Tensor, scheme: GPTQScheme, world: World = SINGLE,
                    owner: int = 0, cross: torch.Tensor | None = None) -> tuple[PackedInt4, dict[str, Any]] | None:
    """GPTQ of one dense Linear on rank `owner`; every rank gets its codes and scales (a broadcast) and swaps
    in the dequantized weight. Returns the packed result and its record on the owner, None elsewhere.
    With `cross` (asymmetric calibration, one process) GPTQ fits the target `W + W C H^-1`."""
    gs, dtype = scheme.group_size, scheme.scale_dtype
    w = lin.weight.data
    mine = owner == world.rank
    if mine:
        factor = prepare(h, scheme.damp, scheme.actorder)
        target = w if cross is None else shifted_target(w, cross, factor, scheme.settings.asymmetric_strength)
        q, s = quantize_rows(target, factor, scheme)
        gptq_err, rtn_err = module_errors(target, q, s, h, scheme)
        rec = {
            "damping": factor.damping,
            "fallback": f"rtn: {factor.failure}" if factor.failure else None,
            "rel_error": gptq_err,
            "rtn_rel_error": rtn_err,
        }
    else:
        q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
        s = torch.empty((w.shape[0], w.shape[1] // gs), dtype=dtype, device=w.device)
    q, s = world.broadcast_exact(q, owner), world.broadcast_exact(s, owner)
    lin.weight.data = dequantize_group(q, s, gs).to(w.dtype)
    return (pack_int(q.cpu(), s.to(dtype).cpu(), 4 if scheme.bits == 4 else 8), rec) if mine else None
