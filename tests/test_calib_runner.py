"""The layer-by-layer runner: resume from the first unfinished layer with identical results, per-expert
coverage (experts real routing never reached are flagged yet calibrated), DSA top-k carried across layers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantkit.calibrate.layer_store import layer_file
from quantkit.calibrate.runner import RunOptions, run
from quantkit.calibrate.tiny import build_tiny
from quantkit.checkpoint.source import open_source
from quantkit.quant.recipe import Recipe

TOKENS = torch.randint(1, 500, (4, 64), generator=torch.Generator().manual_seed(1))
RECIPE = Recipe(method="gptq", kv_cache="fp8", calibration={"samples": 4, "seq_len": 64})


class Killed(Exception):
    pass


def _run(src: Path, work: Path, progress=None):
    return run(open_source(src), RECIPE, work, progress, RunOptions(tokens=TOKENS, batch_size=2))


@pytest.fixture(scope="module")
def tiny_ds() -> Path:
    return build_tiny("deepseek_v3")


@pytest.fixture(scope="module")
def full_run(tiny_ds, tmp_path_factory):
    work = tmp_path_factory.mktemp("full")
    return _run(tiny_ds, work), work


def test_killed_after_layer_k_resumes_at_k_plus_1_with_identical_results(tiny_ds, full_run, tmp_path):
    full, _ = full_run
    work = tmp_path / "w"

    def die_after_layer_2(msg: str) -> None:
        if msg.startswith("calibration: layer 2/"):
            raise Killed

    with pytest.raises(Killed):
        _run(tiny_ds, work, die_after_layer_2)
    assert layer_file(work, 1).exists() and not layer_file(work, 2).exists()
    done = {i: layer_file(work, i).stat().st_mtime_ns for i in (0, 1)}
    messages: list[str] = []
    resumed = _run(tiny_ds, work, messages.append)
    assert messages[0] == "calibration: resuming at layer 2 of 4"
    assert not any(m.startswith(("calibration: layer 1/", "calibration: layer 2/")) for m in messages)
    assert {i: layer_file(work, i).stat().st_mtime_ns for i in (0, 1)} == done
    assert resumed.modules_quantized() == full.modules_quantized()
    for m in full.modules_quantized():
        a, b = full.quantized(m), resumed.quantized(m)
        assert torch.equal(a.weight_packed, b.weight_packed) and torch.equal(a.weight_scale, b.weight_scale)
    assert resumed.kv_scales == full.kv_scales
    # a finished run resumes to "nothing left", and a changed recipe starts over
    assert _run(tiny_ds, work, messages.append).kv_scales == full.kv_scales
    assert messages[-1] == "calibration: all layers already done (resumed)"


def test_result_contract_and_coverage_report(full_run, tmp_path):
    res, _ = full_run
    mods = res.modules_quantized()
    assert len(mods) == 4 * 8 * 3 and all(".mlp.experts." in m for m in mods)
    p = res.quantized("model.layers.3.mlp.experts.7.down_proj.weight")
    assert p.weight_packed.dtype == torch.int32 and p.weight_packed.shape == (128, 16)
    assert p.weight_scale.dtype == torch.bfloat16 and p.weight_shape.tolist() == [128, 128]
    assert res.quantized("model.layers.0.self_attn.o_proj") is None
    files = res.write_reports(tmp_path)
    assert files == ["calibration_coverage.json", "kv_cache_report.json"]
    cov = json.loads((tmp_path / "calibration_coverage.json").read_text())
    assert len(cov["experts"]) == 32
    e = cov["experts"][0]
    assert e["samples"] == {"gate_up": 4 * 64, "down": 4 * 64}  # every token through every expert
    assert set(e["rel_error"]) == {"gate_proj", "up_proj", "down_proj"} and e["damping"]["down_proj"] == 0.01
    assert sum(r["routed_tokens"] for r in cov["experts"] if r["layer"] == 0) == 4 * 64 * 2  # top-2
    s = cov["summary"]
    assert s["gptq_better_than_rtn"] >= 0.9 * s["modules"] and s["mean_rel_error"] < s["mean_rtn_rel_error"]
    assert "GPTQ: 96 modules" in res.summary() and "FP8 KV (mla)" in res.summary()


def test_expert_never_routed_is_flagged_and_still_calibrated(tiny_ds, tmp_path):
    src = tmp_path / "biased"
    shutil.copytree(tiny_ds, src)
    tensors = load_file(src / "model.safetensors")
    bias = tensors["model.layers.1.mlp.gate.e_score_correction_bias"].clone()
    bias[5] = -100.0  # routing can never pick expert 5 of layer 1
    tensors["model.layers.1.mlp.gate.e_score_correction_bias"] = bias
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    res = run(open_source(src), Recipe(method="gptq", calibration={"samples": 3, "seq_len": 64}), tmp_path / "w",
              None, RunOptions(tokens=TOKENS[:3], batch_size=1, memory_budget=0))  # activations streamed from disk
    cov = res.coverage_report()
    assert {"layer": 1, "expert": 5} in cov["unreached_experts"]
    rec = next(r for r in cov["experts"] if r["layer"] == 1 and r["expert"] == 5)
    assert rec["routed_tokens"] == 0 and rec["samples"]["down"] == 3 * 64 and not rec["fallback"]
    assert rec["rel_error"]["down_proj"] < rec["rtn_rel_error"]["down_proj"]
    assert "never chosen by real routing" in res.summary() and "L1/E5" in res.summary()


def test_dsa_layers_run_with_sparse_top_k(tmp_path):
    src = build_tiny("glm_moe_dsa")
    res = run(open_source(src), Recipe(method="gptq", calibration={"samples": 3, "seq_len": 96}), tmp_path / "w",
              None, RunOptions(tokens=TOKENS[:3, :48].repeat(1, 2), batch_size=3))
    mods = res.modules_quantized()
    assert len(mods) == 3 * 8 * 3  # layer 0 is dense: nothing to quantize by default
    assert not any(".layers.0." in m for m in mods)
    assert res.coverage_report()["summary"]["mean_rel_error"] < res.coverage_report()["summary"]["mean_rtn_rel_error"]


def test_scale_refit_lowers_every_layers_error_and_changes_scales_only(tiny_ds, full_run, tmp_path):
    """The default refits scales after GPTQ: in layer 0 (same inputs either way) the same codes as
    `refit_scales: false` and other scales; every layer's relative output error (the coverage report's, on
    the calibration inputs) is lower — later layers also see the refitted layers' outputs."""
    res, _ = full_run
    plain = run(open_source(tiny_ds), RECIPE.model_copy(update={"gptq": RECIPE.gptq.model_copy(
        update={"refit_scales": False})}), tmp_path, None, RunOptions(tokens=TOKENS, batch_size=2))
    first = [m for m in res.modules_quantized() if m.startswith("model.layers.0.")]
    changed = 0
    for m in first:
        a, b = res.quantized(m), plain.quantized(m)
        assert torch.equal(a.weight_packed, b.weight_packed)
        changed += not torch.equal(a.weight_scale, b.weight_scale)
    assert len(first) == 24 and changed >= 0.9 * len(first)

    def per_layer(r) -> dict[int, float]:
        rows = r.coverage_report()["experts"]
        return {layer: sum(sum(e["rel_error"].values()) for e in rows if e["layer"] == layer)
                for layer in {e["layer"] for e in rows}}

    refit, fixed = per_layer(res), per_layer(plain)
    assert all(refit[layer] < fixed[layer] for layer in fixed), (refit, fixed)
