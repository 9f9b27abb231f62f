"""GPTQ as pure tensor functions: beats RTN on output error, keeps compressed-tensors conventions,
handles dead inputs and singular Hessians (damping raised, then RTN), rows independent given a factor."""

from __future__ import annotations

import torch

from quantkit.calibrate.gptq import (
    GPTQScheme,
    HessianAccumulator,
    gptq,
    prepare,
    quantize_rows,
    refit_scales,
    relative_error,
)
from quantkit.quant.int4 import dequantize_group, group_scales, pack_int4, quantize_rtn, unpack_int4
from quantkit.quant.recipe import GPTQSettings

GS = 32


def _inputs(n: int = 2048, cols: int = 128, seed: int = 0) -> torch.Tensor:
    """Correlated inputs with uneven channel scales, like real activations."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(cols, cols, generator=g) * 0.3 + torch.eye(cols)
    return (torch.randn(n, cols, generator=g) @ mix) * torch.linspace(0.05, 4.0, cols)


def _hessian(x: torch.Tensor) -> torch.Tensor:
    acc = HessianAccumulator(x.shape[1])
    acc.add(x[: len(x) // 2])
    acc.add(x[len(x) // 2 :])
    assert acc.count == len(x)
    return acc.hessian()


def test_hessian_accumulator_matches_direct_formula():
    x = _inputs(300, 64)
    assert torch.allclose(_hessian(x), x.t() @ x / 300, rtol=1e-5, atol=1e-5)


def test_gptq_beats_rtn_on_output_error_and_keeps_conventions():
    x = _inputs()
    h = _hessian(x)
    g = torch.Generator().manual_seed(1)
    for rows in (64, 96):
        w = torch.randn(rows, 128, generator=g) * 0.02
        q, s, factor = gptq(w, h, GS)
        q0, s0, _ = gptq(w, h, GS, refit=False)
        rq, rs = quantize_rtn(w, GS)
        assert factor.failure is None and factor.damping == 0.01
        assert q.dtype == torch.int8 and int(q.min()) >= -8 and int(q.max()) <= 7
        assert s0.dtype == torch.bfloat16 and torch.equal(s0, rs)  # static groups: the source weights' scales
        assert torch.equal(q, q0) and s.dtype == torch.bfloat16  # the refit changes scales only
        e_gptq = relative_error(w, dequantize_group(q, s, GS), h)
        e_rtn = relative_error(w, dequantize_group(rq, rs, GS), h)
        assert e_gptq < 0.8 * e_rtn
        # measured error agrees with the Hessian formula on the real inputs
        direct = torch.linalg.norm(x @ (w - dequantize_group(q, s, GS)).t()) / torch.linalg.norm(x @ w.t())
        assert abs(float(direct) - e_gptq) < 1e-3
        p = pack_int4(q, s)  # the converter's packing round-trips the codes
        assert torch.equal(unpack_int4(p.weight_packed, (rows, 128)), q)


def test_static_actorder_helps_and_needs_no_g_idx():
    x = _inputs(seed=3)
    h = _hessian(x)
    w = torch.randn(128, 128, generator=torch.Generator().manual_seed(4)) * 0.02
    q_act, s_act, _ = gptq(w, h, GS, actorder=True, refit=False)
    q_nat, s_nat, _ = gptq(w, h, GS, actorder=False, refit=False)
    assert torch.equal(s_act, s_nat)  # groups keep their columns and scales either way
    e_act = relative_error(w, dequantize_group(q_act, s_act, GS), h)
    e_nat = relative_error(w, dequantize_group(q_nat, s_nat, GS), h)
    assert e_act <= e_nat * 1.05


def _objective(w: torch.Tensor, dq: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Per row `(w - dq) H (w - dq)^T` (float64)."""
    d = (w - dq).double()
    return ((d @ h.double()) * d).sum(-1)


def test_scale_refit_solves_each_rows_least_squares_and_never_hurts():
    """The refit's scales are the closed-form least-squares optimum for the codes GPTQ chose (checked against
    a generic solver on the explicit design matrix), rounded to bf16, and no row's objective gets worse."""
    x = _inputs(seed=7)
    h = _hessian(x)
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(8)) * 0.02
    w[3] = 0  # a row whose codes are all zero (GPTQ's updates stay inside a row): its scales must stay
    factor = prepare(h)
    q, s0 = quantize_rows(w, factor, GPTQScheme(GS, settings=GPTQSettings(refit_scales=False)))
    _, s1 = quantize_rows(w, factor, GPTQScheme(GS))
    hd = factor.damped.double()
    dq0, dq1 = dequantize_group(q, s0, GS), dequantize_group(q, s1, GS)
    before, after = _objective(w, dq0, hd), _objective(w, dq1, hd)
    assert bool((after <= before).all()) and float(after.sum()) < 0.99 * float(before.sum())
    assert not bool(q[3].any()) and torch.equal(s1[3], s0[3])
    q5 = q.clone()
    q5[5, :GS] = 0  # one all-zero group in a row that is refitted: that group's scale stays, the others move
    s5 = refit_scales(w, q5, s0, factor, GS)
    assert s5[5, 0] == s0[5, 0] and not torch.equal(s5[5, 1:], s0[5, 1:])
    assert _objective(w[5:6], dequantize_group(q5[5:6], s5[5:6], GS), hd) <= _objective(
        w[5:6], dequantize_group(q5[5:6], s0[5:6], GS), hd)
    chol = torch.linalg.cholesky(hd)  # H_d = L L^T: the objective is ||L^T (w - M s)||^2
    for r in (0, 7, 20):
        m = torch.zeros(128, 128 // GS, dtype=torch.float64)
        for g in range(128 // GS):
            m[g * GS:(g + 1) * GS, g] = q[r, g * GS:(g + 1) * GS].double()
        best = torch.linalg.lstsq(chol.t() @ m, chol.t() @ w[r].double()).solution
        assert torch.allclose(s1[r].double(), best.to(torch.bfloat16).double(), rtol=1e-2)
    # on the real inputs, not only in the Hessian's terms
    assert relative_error(w, dq1, h) < relative_error(w, dq0, h)


def test_rows_are_independent_given_a_shared_factor():
    """What lets all experts' gate/up rows share one factorisation."""
    h = _hessian(_inputs(seed=5))
    f = prepare(h)
    a, b = torch.randn(32, 128) * 0.02, torch.randn(48, 128) * 0.02
    qa, sa = quantize_rows(a, f, GPTQScheme(GS))
    qb, sb = quantize_rows(b, f, GPTQScheme(GS))
    qab, sab = quantize_rows(torch.cat([a, b]), f, GPTQScheme(GS))
    assert torch.equal(torch.cat([qa, qb]), qab) and torch.equal(torch.cat([sa, sb]), sab)


def test_dead_columns_are_zeroed_not_nan():
    x = _inputs(512, 64)
    x[:, 5] = 0  # an input channel that never fires
    h = _hessian(x)
    w = torch.randn(32, 64) * 0.02
    q, s, factor = gptq(w, h, GS)
    assert factor.dead[5] and int(q[:, 5].abs().sum()) == 0
    assert torch.isfinite(s.float()).all()


def test_singular_hessian_raises_damping_then_falls_back_to_rtn():
    w = torch.randn(16, 64) * 0.02
    # rank-deficient but PSD: Cholesky succeeds with damping
    x = torch.randn(8, 64)
    q, s, f = gptq(w, x.t() @ x / 8, GS)
    assert f.failure is None
    # indefinite: no damping fixes it -> RTN, recorded
    bad = -torch.eye(64) * 100
    bad[0, 0] = 1e4  # mean diagonal ~58: even 100% damping leaves negative pivots
    q, s, f = gptq(w, bad, GS)
    rq, rs = quantize_rtn(w, GS)
    assert f.failure and "positive definite" in f.failure and f.damping == 1.0
    assert torch.equal(q, rq) and torch.equal(s, rs)
    # no input at all (an expert nobody calibrated) -> RTN, recorded
    q, s, f = gptq(w, torch.zeros(64, 64), GS)
    assert f.failure and "no calibration input" in f.failure and torch.equal(q, rq)
    # NaN statistics -> RTN
    nan = torch.eye(64)
    nan[3, 3] = float("nan")
    assert prepare(nan).failure == "Hessian has NaN/Inf"


def test_scales_are_rtn_scales_for_every_group_size():
    """Without the refit the static scales are RTN's; with it every group size still refits (and only lowers
    the objective)."""
    h = _hessian(_inputs(256, 128))
    w = torch.randn(8, 128) * 0.05
    for gs in (32, 64, 128):
        q, s0, f = gptq(w, h, gs, refit=False)
        assert torch.equal(s0.float(), group_scales(w.bfloat16(), gs))  # RTN rounds w to bf16 first too
        _, s1, _ = gptq(w, h, gs)
        assert s1.shape == s0.shape and not torch.equal(s1, s0)
        assert bool((_objective(w, dequantize_group(q, s1, gs), f.damped)
                     <= _objective(w, dequantize_group(q, s0, gs), f.damped)).all())
