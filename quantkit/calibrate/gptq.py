"""GPTQ for symmetric group-wise INT4 and INT8, as plain functions over tensors.

GPTQ (Frantar et al., 2022) quantizes a weight `W [out, in]` one input column at a time and pushes each
column's rounding error onto the columns not yet quantized, weighted by the inverse Hessian of the layer
inputs `H = X^T X / n`, so that `||W X - Q X||` stays small on real inputs. Here:

- codes and scales follow `quantkit.quant.int4` (= compressed-tensors): `scale = absmax / 7.5` per group of
  input columns, codes in [-8, 7] (INT8: `absmax / 127.5`, [-128, 127]), scales in bf16 — the converter packs
  them unchanged; what one solve needs (bits, group, the recipe's GPTQ settings, the scale dtype) is one
  `GPTQScheme`, built from the unit's format (`quantkit.quant.scheme`);
- *static* activation order: columns are processed in order of decreasing `diag(H)` but each group keeps
  its original columns and a scale fixed up front from the source weights (refitted after the loop,
  below), so the checkpoint needs no `g_idx` and engines run their fast kernels;
- block updates (`block_size` columns at a time, a rank-`block_size` update for the rest);
- relative damping `damp * mean(diag(H))`; if the Cholesky factorisation fails the damping is raised
  ten-fold (twice), and after that the caller falls back to RTN and records it;
- scale refit (`refit=True`, the default): with the codes GPTQ chose held fixed, each row's group scales
  are re-solved in closed form for the same objective — `min_s (w - dq(s)) H_d (w - dq(s))^T` is a small
  least-squares problem, one `groups x groups` system per row — and a row keeps its refitted scales only
  where they lower that objective after rounding to the checkpoint's scale dtype. Static scales are fixed
  before any GPTQ update; the refit lets them follow the updated weights.

`prepare` factorises one Hessian; `quantize_rows` runs GPTQ on any number of rows that share it — all the
routed experts of a layer share the Hessian of their gate/up inputs when every token is sent through every
expert, so one factorisation serves hundreds of experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from quantkit.core.distributed import World
from quantkit.quant.int4 import group_scales, mse_group_scales, qrange, quantize_rtn
from quantkit.quant.recipe import GPTQSettings
from quantkit.quant.scheme import WeightFormat

__all__ = ["Factor", "GPTQScheme", "HessianAccumulator", "ScaleSearch", "gptq", "prepare", "quantize_many",
           "quantize_rows", "refit_scales", "relative_error"]

ScaleSearch = Literal["minmax", "mse"]  # group scales: absmax / 7.5, or the input-weighted MSE-best clipping


@dataclass(frozen=True)
class GPTQScheme:
    """What one GPTQ solve needs: the unit's bits and group, the recipe's GPTQ settings, the scale dtype."""

    group_size: int = 32
    bits: int = 4
    scale_dtype: torch.dtype = torch.bfloat16
    settings: GPTQSettings = field(default_factory=GPTQSettings)

    @classmethod
    def of(cls, fmt: WeightFormat, settings: GPTQSettings, scale_dtype: torch.dtype) -> GPTQScheme:
        """The scheme of an INT format (`int4-g32`, `int8-g128`, ...) under `settings`."""
        if fmt.kind != "int" or fmt.group is None:
            raise ValueError(f"GPTQ computes INT formats only, not {fmt.name}")
        return cls(fmt.group, fmt.bits, scale_dtype, settings)

    @property
    def block_size(self) -> int:
        return self.settings.block_size

    @property
    def scale_search(self) -> ScaleSearch:
        return self.settings.scale_search

    @property
    def refit(self) -> bool:
        return self.settings.refit_scales

    @property
    def damp(self) -> float:
        return self.settings.dampening_frac

    @property
    def actorder(self) -> bool:
        return self.settings.actorder == "static"

DAMP_RETRIES = 2  # damping tried: d, 10 d, 100 d


class HessianAccumulator:
    """Running `sum w x x^T` over input rows (fp32), the number of rows seen and their total weight."""

    def __init__(self, columns: int, device: torch.device | str = "cpu") -> None:
        self.sum = torch.zeros(columns, columns, dtype=torch.float32, device=device)
        self.count = 0
        self.weight = 0.0

    def add(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        """Add input rows `x [..., columns]`; `weight` (per row) scales each row's contribution."""
        x = x.reshape(-1, x.shape[-1]).to(self.sum.device, torch.float32)
        if x.shape[0] == 0:
            return
        if weight is None:
            xt, total = x.t(), float(x.shape[0])
        else:
            weight = weight.reshape(-1, 1).to(x)
            xt, total = (x * weight).t(), float(weight.sum())
        self.sum.addmm_(xt, x)
        self.count += x.shape[0]
        self.weight += total

    def hessian(self) -> torch.Tensor:
        """`X^T W X / sum(W)` (`X^T X / n` unweighted; zeros when nothing was seen)."""
        return self.sum / (self.weight if self.weight > 0 else 1.0)

    def all_reduce(self, world: World) -> None:
        """Sum the accumulations of every rank into every rank's (a no-op for one process)."""
        if world.size == 1:
            return
        self.sum = world.all_reduce(self.sum)
        seen = world.all_reduce(torch.tensor([float(self.count), self.weight], dtype=torch.float64))
        self.count, self.weight = int(seen[0]), float(seen[1])


@dataclass
class Factor:
    """A damped, factorised Hessian ready for `quantize_rows`."""

    hinv: torch.Tensor | None  # upper Cholesky factor of H^-1 in processing order; None = use RTN
    perm: torch.Tensor | None  # processing order of the columns (None = natural order)
    dead: torch.Tensor  # bool [in]: columns no input ever reached (their weights are zeroed)
    damping: float  # relative damping that succeeded (or the last one tried)
    failure: str | None = None  # why GPTQ was not possible (-> RTN)
    diag: torch.Tensor | None = None  # diag(H) in natural column order: each input's energy
    damped: torch.Tensor | None = None  # the damped Hessian GPTQ minimised, natural column order (scale refit)


def prepare(h: torch.Tensor, damp: float = 0.01, actorder: bool = True) -> Factor:
    """Dampen and factorise `h [in, in]` (not modified), raising the damping if Cholesky fails."""
    h = h.to(torch.float32)
    diag = torch.diagonal(h)
    dead = diag == 0
    if bool(dead.all()):
        return Factor(None, None, dead, damp, "no calibration input (Hessian is zero)")
    if not bool(torch.isfinite(h).all()):
        return Factor(None, None, dead, damp, "Hessian has NaN/Inf")
    energy = diag.clone()
    perm = torch.argsort(diag, descending=True) if actorder else None
    work = h.clone()
    wd = torch.diagonal(work)
    wd[dead] = 1.0
    if perm is not None:
        work = work[perm][:, perm]
    mean = float(torch.diagonal(work).mean())
    for attempt in range(DAMP_RETRIES + 1):
        frac = damp * 10**attempt
        trial = work.clone()
        torch.diagonal(trial).add_(frac * mean)
        chol, info = torch.linalg.cholesky_ex(trial)
        if int(info) == 0:
            hinv = torch.cholesky_inverse(chol)
            del chol
            hinv, info = torch.linalg.cholesky_ex(hinv, upper=True)
            if int(info) == 0 and bool(torch.isfinite(hinv).all()):
                if perm is not None:  # back to natural order, in place of the trial copy
                    inv = torch.argsort(perm)
                    trial = trial[inv][:, inv]
                return Factor(hinv, perm, dead, frac, diag=energy, damped=trial)
    return Factor(None, perm, dead, frac, f"Hessian not positive definite even with damping {frac:g}")


def quantize_rows(w: torch.Tensor, factor: Factor, scheme: GPTQScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ codes (int8 `[out, in]`) and scales (`[out, in/group]`, `scheme.scale_dtype`) of `w`.

    Rows are independent given the factor, so callers may pass any stack of rows that share it.
    With `factor.hinv is None` this is plain RTN.
    """
    return quantize_many([w], [factor], scheme)[0]


def quantize_many(ws: list[torch.Tensor], factors: list[Factor], scheme: GPTQScheme
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """GPTQ of several same-shape weights, each with its own factor, in one batched column loop.

    One loop over the columns for all of them (instead of one per module) is what makes hundreds of small
    experts cheap: the per-column work is a handful of batched tensor ops either way. The group scales
    are fixed before the loop from the (model-dtype) weights: `minmax` is compressed-tensors' absmax
    rule, `mse` searches clipping ratios per group minimising the error weighted by `diag(H)`. `refit`
    re-solves them afterwards for the codes chosen (`refit_scales`).
    """
    gs, dtype = scheme.group_size, scheme.scale_dtype
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(ws)
    todo = [i for i, f in enumerate(factors) if f.hinv is not None]
    for i, f in enumerate(factors):
        if f.hinv is None:
            out[i] = quantize_rtn(ws[i], gs, dtype, scheme.bits)
    if todo:
        scales = [_static_scales(ws[i], factors[i], scheme) for i in todo]
        perm = _perms(factors, todo, ws[todo[0]].shape[1]).to(ws[todo[0]].device)
        work = _permuted_work(ws, factors, todo, perm, dtype)
        hinv = torch.stack([factors[i].hinv for i in todo])
        codes = _gptq_loop(work, torch.stack(scales), perm // gs, hinv, scheme.block_size, scheme.bits)
        codes = _take_cols(codes, torch.argsort(perm, dim=1))
        del work
        for j, i in enumerate(todo):
            scale = scales[j].to(dtype)
            if scheme.refit and factors[i].damped is not None:
                scale = refit_scales(ws[i], codes[j], scale, factors[i], gs)
            out[i] = (codes[j], scale)
    return out  # type: ignore[return-value]


def refit_scales(w: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, factor: Factor, group_size: int,
                 rows_per_step: int = 1024) -> torch.Tensor:
    """Group scales re-solved for fixed `codes` (same dtype and shape as `scale`): per row, the minimiser of
    `(w - s*q) H_d (w - s*q)^T` over the scales `s` of its groups, `H_d = factor.damped`.

    With `M` the `[in, groups]` matrix holding the row's codes in its groups' columns, the objective is
    `s^T A s - 2 b^T s + const` with `A = M^T H_d M` and `b = M^T H_d w`: one Cholesky solve per row. A row
    keeps its old scales unless the new ones — rounded to the scale dtype, positive wherever its codes are
    not all zero — give a lower objective; groups whose codes are all zero keep theirs (any scale is exact).
    Cost: half of `A` is built, `groups / 2` products of `[rows, group] x [group, in]` and as many elementwise
    passes over `[rows, in]`: on one core 0.33 s for 4096 x 1024 (GPTQ itself: 0.8 s), 1.5 s for 4096 x 2048
    (GPTQ: 1.5 s); it grows with the group count, GPTQ's inner loop with its block size. Memory: a few
    `[rows_per_step, in]` fp32 temporaries at a time.
    """
    assert factor.damped is not None
    h = factor.damped.to(codes.device, torch.float32)
    dead = factor.dead.to(w.device)
    out = scale.clone()
    rows, cols = codes.shape
    groups = cols // group_size
    for r0 in range(0, rows, rows_per_step):
        q = codes[r0 : r0 + rows_per_step].to(torch.float32)
        n = q.shape[0]
        # what GPTQ fitted: the weights rounded to the scale dtype, dead columns zeroed
        target = w[r0 : r0 + n].to(scale.dtype).to(torch.float32).masked_fill(dead, 0)
        b = (q * (target @ h)).view(n, groups, group_size).sum(-1)
        del target
        a = torch.empty(n, groups, groups, dtype=torch.float32, device=q.device)
        for g in range(groups):  # A is symmetric: row g from column g on, mirrored
            lo, hi = g * group_size, (g + 1) * group_size
            a[:, g, g:] = (q[:, lo:] * (q[:, lo:hi] @ h[lo:hi, lo:])).view(n, groups - g, group_size).sum(-1)
            a[:, g + 1:, g] = a[:, g, g + 1:]
        used = q.view(n, groups, group_size).abs().sum(-1) > 0  # groups with a nonzero code
        old = scale[r0 : r0 + n].to(torch.float32)
        # unused groups: fixed at their old scale (a unit diagonal keeps A definite; b is 0 there)
        a = a * (used.unsqueeze(1) & used.unsqueeze(2)) + torch.diag_embed((~used).to(a.dtype))
        rhs = torch.where(used, b, old)
        chol, info = torch.linalg.cholesky_ex(a)
        new = torch.cholesky_solve(rhs.unsqueeze(-1), chol).squeeze(-1).to(scale.dtype).to(torch.float32)
        new = torch.where(used, new, old)
        better = (info == 0) & torch.isfinite(new).all(-1) & ((new > 0) | ~used).all(-1)
        better &= _quadratic(a, rhs, torch.where(better.unsqueeze(-1), new, old)) < _quadratic(a, rhs, old)
        out[r0 : r0 + n] = torch.where(better.unsqueeze(-1), new, old).to(scale.dtype)
    return out


def _quadratic(a: torch.Tensor, b: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """`s^T a s - 2 b^T s` per row (the refit objective up to a constant)."""
    return ((a @ s.unsqueeze(-1)).squeeze(-1) * s).sum(-1) - 2 * (b * s).sum(-1)


def _static_scales(w: torch.Tensor, factor: Factor, scheme: GPTQScheme) -> torch.Tensor:
    """The group scales of `w` as a checkpoint in the scale dtype holds it (what RTN quantizes too), fixed
    before any GPTQ update."""
    w = w.to(scheme.scale_dtype)
    if scheme.scale_search == "mse":
        return mse_group_scales(w, scheme.group_size, scheme.scale_dtype, col_weight=factor.diag, bits=scheme.bits)
    return group_scales(w, scheme.group_size, scheme.scale_dtype, scheme.bits)


def _permuted_work(ws: list[torch.Tensor], factors: list[Factor], todo: list[int], perm: torch.Tensor,
                   scale_dtype: torch.dtype) -> torch.Tensor:
    """fp32 `[B, out, in]`: each weight rounded to `scale_dtype`, dead columns zeroed, columns in processing
    order. Filled one weight at a time from a permuted copy in `scale_dtype`: the only full-size fp32
    tensor is the result (the values are the same as upcasting, masking, then permuting)."""
    rows, cols = ws[todo[0]].shape
    work = torch.empty(len(todo), rows, cols, dtype=torch.float32, device=ws[todo[0]].device)
    for j, i in enumerate(todo):
        work[j].copy_(torch.index_select(ws[i].to(scale_dtype), 1, perm[j]))
        work[j].masked_fill_(factors[i].dead.to(work.device)[perm[j]], 0)
    return work


def _perms(factors: list[Factor], todo: list[int], cols: int) -> torch.Tensor:
    natural = torch.arange(cols)
    return torch.stack([factors[i].perm if factors[i].perm is not None else natural for i in todo])


def _take_cols(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """x[b][:, perm[b]] for every b."""
    return torch.gather(x, 2, perm.unsqueeze(1).expand(-1, x.shape[1], -1))


def _gptq_loop(work: torch.Tensor, scale: torch.Tensor, group: torch.Tensor, hinv: torch.Tensor,
               block: int, bits: int = 4) -> torch.Tensor:
    """The GPTQ column loop over `work [B, out, in]` (modified) in processing order.

    `scale [B, out, groups]` holds the fixed group scales and `group [B, in]` the group of each processed
    column. Returns int8 codes in processing order.
    """
    batch, rows, cols = work.shape
    qmin, qmax, _ = qrange(bits)
    codes = torch.empty(work.shape, dtype=torch.int8, device=work.device)
    scale = scale.to(torch.float32)
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        w1, h1 = work[:, :, i1:i2], hinv[:, i1:i2, i1:i2]
        # this block's column scales, [B, out, block]: a small gather instead of a full [B, out, in] copy
        s1 = torch.gather(scale, 2, group[:, i1:i2].unsqueeze(1).expand(batch, rows, -1))
        err1 = torch.empty_like(w1)
        for i in range(i2 - i1):
            col, s = w1[:, :, i], s1[:, :, i]
            q = torch.clamp(torch.round(col / s), qmin, qmax)
            codes[:, :, i1 + i] = q.to(torch.int8)
            e = (col - q * s) / h1[:, i, i].unsqueeze(1)
            err1[:, :, i] = e
            w1[:, :, i + 1 :] -= e.unsqueeze(2) * h1[:, i, i + 1 :].unsqueeze(1)
        if i2 < cols:
            work[:, :, i2:] -= torch.bmm(err1, hinv[:, i1:i2, i2:])
    return codes


def relative_error(w: torch.Tensor, dq: torch.Tensor, h: torch.Tensor, max_rows: int = 256) -> float:
    """`||(W - DQ) X|| / ||W X||` computed from `H = X^T X / n` (0 when W X is 0).

    Estimated on at most `max_rows` evenly spaced rows: exact for small modules, and it keeps the cost of
    reporting far below the cost of GPTQ itself on 7168 x 2048 experts.
    """
    step = max(1, -(-w.shape[0] // max_rows))
    w, dq = w[::step].to(torch.float32), dq[::step].to(torch.float32)
    d = w - dq
    num = float(((d @ h) * d).sum())
    den = float(((w @ h) * w).sum())
    return (max(num, 0.0) / den) ** 0.5 if den > 0 else 0.0


def gptq(
    w: torch.Tensor,
    h: torch.Tensor,
    group_size: int,
    damp: float = 0.01,
    block_size: int = 128,
    actorder: bool = True,
    scale_dtype: torch.dtype = torch.bfloat16,
    scale_search: ScaleSearch = "minmax",
    refit: bool = True,
    bits: int = 4,
) -> tuple[torch.Tensor, torch.Tensor, Factor]:
    """One module: (codes, scales, factor) — the factor says which damping worked or why RTN was used."""
    factor = prepare(h, damp, actorder)
    settings = GPTQSettings(dampening_frac=damp, block_size=block_size, actorder="static" if actorder else None,
                            scale_search=scale_search, refit_scales=refit)
    q, scale = quantize_rows(w, factor, GPTQScheme(group_size, bits, scale_dtype, settings))
    return q, scale, factor
