"""Asymmetric (GPTAQ-style) calibration: the closed-form target is the ridge least-squares fit to the
full-precision outputs, GPTQ on it equals the greedy column-by-column asymmetric solution and beats plain
GPTQ on the full-precision target; through the runner the option changes the result, the fp stream
resumes bit-identically, RAM and disk paths agree, and the quantized model stays far closer to the source
than RTN's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quantkit.calibrate.asymmetric import CrossAccumulator, inverse_hessian, shifted_target
from quantkit.calibrate.gptq import GPTQScheme, HessianAccumulator, prepare, quantize_rows
from quantkit.calibrate.layer_store import fp_dir, layer_file
from quantkit.calibrate.runner import RunOptions, run
from quantkit.calibrate.tiny import build_tiny
from quantkit.checkpoint.source import open_source
from quantkit.quant.int4 import QMAX, QMIN, dequantize_group, group_scales
from quantkit.quant.recipe import GPTQSettings, Recipe

GS = 32


def _streams(n: int = 1024, cols: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-precision inputs X and a quantized stream X~ = X + correlated error (what earlier layers leave)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(cols, cols, generator=g) * 0.3 + torch.eye(cols)
    x = (torch.randn(n, cols, generator=g) @ mix) * torch.linspace(0.1, 3.0, cols)
    err = x @ (torch.randn(cols, cols, generator=g) * 0.05) + 0.05 * torch.randn(n, cols, generator=g)
    return x, x + err


def _stats(x: torch.Tensor, xq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h, c = HessianAccumulator(x.shape[1]), CrossAccumulator(x.shape[1])
    for lo in range(0, len(x), 300):  # several batches
        h.add(xq[lo:lo + 300])
        c.add(x[lo:lo + 300], xq[lo:lo + 300])
    return h.hessian(), c.cross()


def _err(w: torch.Tensor, q: torch.Tensor, x: torch.Tensor, xq: torch.Tensor) -> float:
    return float((x @ w.t() - xq @ q.t()).norm() / (x @ w.t()).norm())


def test_cross_accumulator_and_inverse_hessian():
    x, xq = _streams(500, 48)
    h, c = _stats(x, xq)
    assert torch.allclose(c, (x - xq).t() @ xq / 500, rtol=1e-4, atol=1e-5)
    for actorder in (True, False):
        f = prepare(h, 0.01, actorder)
        damped = h + 0.01 * float(torch.diagonal(h).mean()) * torch.eye(48)
        assert torch.allclose(inverse_hessian(f) @ damped, torch.eye(48), atol=1e-3)


def test_target_is_ridge_fit_to_full_precision_outputs():
    x, xq = _streams()
    h, c = _stats(x, xq)
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(3)) * 0.05
    f = prepare(h, 0.01)
    lam = 0.01 * float(torch.diagonal(h).mean())
    target = shifted_target(w, c, f)
    # normal equations of  ||X W^T - X~ Q^T||^2 / n + lam ||Q - W||^2
    direct = torch.linalg.solve(h + lam * torch.eye(64), (xq.t() @ x @ w.t() / len(x) + lam * w.t())).t()
    assert torch.allclose(target, direct, rtol=1e-3, atol=1e-5)
    assert torch.equal(shifted_target(w, c, f, 0.0), w)
    half = shifted_target(w, c, f, 0.5)
    assert torch.allclose(half, (w + target) / 2, atol=1e-6)


def _greedy_reference(w: torch.Tensor, x: torch.Tensor, xq: torch.Tensor, order: torch.Tensor, lam: float,
                      scales: torch.Tensor) -> torch.Tensor:
    """Column by column in `order`: round the current value, then re-fit every remaining column exactly to
    the full-precision outputs (ridge towards W). Slow, obviously correct."""
    n = len(x)
    hd = xq.t() @ xq / n + lam * torch.eye(x.shape[1], dtype=torch.float64)
    b = xq.t() @ x @ w.t() / n + lam * w.t()  # [in, out]
    q = torch.linalg.solve(hd, b)  # the unconstrained fit
    codes = torch.zeros(w.shape, dtype=torch.int64)
    fixed: list[int] = []
    for j in order.tolist():
        s = scales[:, j // GS]
        codes[:, j] = torch.clamp(torch.round(q[j] / s), QMIN, QMAX).long()
        q[j] = codes[:, j] * s
        fixed.append(j)
        free = [k for k in range(x.shape[1]) if k not in fixed]
        if free:
            rhs = b[free] - hd[free][:, fixed] @ q[fixed]
            q[free] = torch.linalg.solve(hd[free][:, free], rhs)
    return codes


def test_gptq_on_target_equals_greedy_asymmetric_and_beats_plain_gptq():
    x, xq = _streams(2048, 64)
    h, c = _stats(x, xq)
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(5)) * 0.05
    f = prepare(h, 0.01)
    target = shifted_target(w, c, f)
    q, s = quantize_rows(target, f, GPTQScheme(GS, 4, torch.float32, GPTQSettings(block_size=16)))
    lam = 0.01 * float(torch.diagonal(h).mean())
    ref = _greedy_reference(w.double(), x.double(), xq.double(), f.perm, lam,
                            group_scales(target, GS, torch.float32).double())
    assert float((q.long() == ref).float().mean()) > 0.98  # rounding ties aside, the same codes
    plain_q, plain_s = quantize_rows(w, f, GPTQScheme(GS, 4, torch.float32, GPTQSettings(block_size=16)))
    asym = _err(w, dequantize_group(q, s, GS), x, xq)
    plain = _err(w, dequantize_group(plain_q, plain_s, GS), x, xq)
    assert asym < 0.8 * plain


# ----------------------------------------------------------------------------------------- the runner
TOKENS = torch.randint(1, 500, (4, 64), generator=torch.Generator().manual_seed(1))
ASYM = Recipe(method="gptq", calibration={"samples": 4, "seq_len": 64}, gptq={"asymmetric": True})


class Killed(Exception):
    pass


@pytest.fixture(scope="module")
def tiny_ds() -> Path:
    return build_tiny("deepseek_v3")


def _run(src: Path, work: Path, recipe: Recipe = ASYM, progress=None, budget: int = 2 << 30):
    return run(open_source(src), recipe, work, progress, RunOptions(tokens=TOKENS, batch_size=2, memory_budget=budget))


def _same(a, b) -> bool:
    mods = a.modules_quantized()
    return mods == b.modules_quantized() and all(
        torch.equal(a.quantized(m).weight_packed, b.quantized(m).weight_packed)
        and torch.equal(a.quantized(m).weight_scale, b.quantized(m).weight_scale) for m in mods)


@pytest.fixture(scope="module")
def asym_run(tiny_ds, tmp_path_factory):
    return _run(tiny_ds, tmp_path_factory.mktemp("asym"))


def test_asymmetric_changes_the_result_and_ram_and_disk_paths_agree(tiny_ds, asym_run, tmp_path):
    plain = _run(tiny_ds, tmp_path / "plain", Recipe(method="gptq", calibration={"samples": 4, "seq_len": 64}))
    m = "model.layers.3.mlp.experts.2.down_proj.weight"
    assert not torch.equal(plain.quantized(m).weight_packed, asym_run.quantized(m).weight_packed)
    # layer 0 sees identical streams (both are the embeddings): asymmetric equals plain there
    first = "model.layers.0.mlp.experts.2.down_proj.weight"
    assert torch.equal(plain.quantized(first).weight_packed, asym_run.quantized(first).weight_packed)
    streamed = _run(tiny_ds, tmp_path / "streamed", budget=0)  # both streams read back from disk
    assert _same(streamed, asym_run)
    s = asym_run.coverage_report()["summary"]
    assert s["gptq_better_than_rtn"] >= 0.9 * s["modules"]


def test_asymmetric_resumes_with_its_full_precision_stream(tiny_ds, asym_run, tmp_path):
    work = tmp_path / "w"

    def die_after_layer_2(msg: str) -> None:
        if msg.startswith("calibration: layer 2/"):
            raise Killed

    with pytest.raises(Killed):
        _run(tiny_ds, work, progress=die_after_layer_2)
    assert layer_file(work, 1).exists() and (fp_dir(work, 2) / "done").exists()
    messages: list[str] = []
    resumed = _run(tiny_ds, work, progress=messages.append)
    assert messages[0] == "calibration: resuming at layer 2 of 4"
    assert _same(resumed, asym_run)
    assert not any(p.name.startswith("fp_") for p in work.iterdir())  # spilled streams cleaned up


def test_fp_stream_missing_is_an_error_not_a_silent_restart(tiny_ds, tmp_path):
    work = tmp_path / "w"

    def die_after_layer_1(msg: str) -> None:
        if msg.startswith("calibration: layer 1/"):
            raise Killed

    with pytest.raises(Killed):
        _run(tiny_ds, work, progress=die_after_layer_1)
    (fp_dir(work, 1) / "done").unlink()
    from quantkit.core.errors import QuantkitError

    with pytest.raises(QuantkitError, match="layer 1 inputs are missing"):
        _run(tiny_ds, work)


def test_expert_order_gate_up_first_changes_down_and_needs_kept_inputs(tiny_ds, asym_run, tmp_path):
    from quantkit.core.errors import QuantkitError

    recipe = Recipe(method="gptq", calibration={"samples": 4, "seq_len": 64},
                    gptq={"asymmetric": True, "expert_order": "gate_up_first"})
    res = _run(tiny_ds, tmp_path / "gu", recipe)
    down, gate = "model.layers.0.mlp.experts.0.down_proj.weight", "model.layers.0.mlp.experts.0.gate_proj.weight"
    assert not torch.equal(res.quantized(down).weight_packed, asym_run.quantized(down).weight_packed)
    assert torch.equal(res.quantized(gate).weight_packed, asym_run.quantized(gate).weight_packed)
    with pytest.raises(QuantkitError, match="gate_up_first needs the calibration activations in RAM"):
        _run(tiny_ds, tmp_path / "gu0", recipe, budget=0)


@pytest.mark.slow
def test_asymmetric_dense_linears_through_the_runner(tmp_path):
    """Attention and shared-expert linears (not quantized by default) use the asymmetric target too."""
    src = build_tiny("deepseek_v3")
    roles = ["routed_expert", "shared_expert", "attention"]
    calib = {"samples": 4, "seq_len": 64}
    asym = _run(src, tmp_path / "a", Recipe(method="gptq", quantize_roles=roles, calibration=calib,
                                           gptq={"asymmetric": True}))
    plain = _run(src, tmp_path / "p", Recipe(method="gptq", quantize_roles=roles, calibration=calib))
    dense = [m for m in asym.modules_quantized() if ".layers.2." in m and ".experts." not in m]
    assert dense and any(not torch.equal(asym.quantized(m).weight_packed, plain.quantized(m).weight_packed)
                         for m in dense)
    cov = asym.coverage_report()
    assert cov["summary"]["gptq_better_than_rtn"] >= 0.9 * cov["summary"]["modules"]


def test_asymmetric_keeps_gptq_far_better_than_rtn_in_kl(tmp_path):
    from quantkit.calibrate.eval import evaluate_in_subprocess
    from quantkit.calibrate.tiny import CORPUS, HELDOUT
    from quantkit.convert.pipeline import convert

    src = build_tiny("deepseek_v3")
    calib = {"dataset": str(CORPUS), "samples": 16, "seq_len": 128, "seed": 0}
    convert(src, tmp_path / "asym", Recipe(method="gptq", calibration=calib, gptq={"asymmetric": True}))
    convert(src, tmp_path / "rtn", Recipe(method="rtn"))
    res = evaluate_in_subprocess([tmp_path / "rtn", tmp_path / "asym"], HELDOUT, src, seq_len=128, windows=32,
                                 threads=1)
    rtn, asym = (res["models"][str(tmp_path / k)] for k in ("rtn", "asym"))
    assert asym["kl_mean"] < 0.75 * rtn["kl_mean"] and asym["top1_agreement"] >= rtn["top1_agreement"]
    cov = json.loads((tmp_path / "asym" / "calibration_coverage.json").read_text())
    assert cov["summary"]["gptq_better_than_rtn"] >= 0.9 * cov["summary"]["modules"]


@pytest.mark.parametrize("gptq", [{"asymmetric": True}, {"expert_order": "gate_up_first"}])
def test_options_of_one_process_are_refused_across_ranks(tiny_ds, tmp_path, gptq):
    """Neither option has an expert-parallel path: across ranks they stop before any collective or write."""
    from quantkit.core.distributed import World
    from quantkit.core.errors import QuantkitError

    recipe = Recipe(method="gptq", calibration={"samples": 4, "seq_len": 64}, gptq=gptq)
    with pytest.raises(QuantkitError, match="run in one process only"):
        run(open_source(tiny_ds), recipe, tmp_path / "w", None, RunOptions(threads=1), World(rank=0, size=2))
    assert not (tmp_path / "w").exists()
