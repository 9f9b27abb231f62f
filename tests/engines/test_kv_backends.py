"""Which SGLang MLA attention backends apply a calibrated FP8 KV scale consistently, decided by executing them.

`run_sglang_attn.py` runs each backend's Python `forward_decode` on SGLang's real `MLATokenToKVPool` (CPU) with
quantkit's calibrated scale of layer 0, up to the attention kernel (stubbed: it records its arguments). From what
ran: does the pool hold latent / scale (the write divided) or a plain cast, and is the kernel handed the scale
(the read multiplies)? Consistent = both; ignored = neither (scale 1.0 in effect); inconsistent = only one.
The table in `quantkit.engines.kv_backends` and the serving record must agree with that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from harness import HERE, REPO, SOURCES, EngineRunError
from safetensors import safe_open

from quantkit.engines.kv_backends import BACKENDS

MLA_CASE = ("deepseek_v3", "fp8", 32, "fp8-calibrated")  # calibrated MLA KV scales (--kv-scales calibrated)
RULE_CASE = ("deepseek_v3", "fp8", 32, "fp8")  # the KV scales the measured rule ships (quantkit/engines/kv_choice.py)
EXECUTED = ("triton", "flashmla", "trtllm_mla", "cutedsl_mla", "flashinfer", "fa3")


def _k_scale(out) -> float:
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.0.self_attn.k_proj.k_scale"
    with safe_open(out / index[name], "pt") as f:
        return float(f.get_tensor(name))


@pytest.fixture(scope="module")
def executed(converted, tmp_path_factory) -> dict[str, Any]:
    if not SOURCES["sglang"].is_dir():
        raise EngineRunError(f"{SOURCES['sglang']} is missing: run `make engines` first")
    out = converted(MLA_CASE)[1]
    record = json.loads((out / "quantkit.json").read_text())["serving"]["sglang"]
    scale = _k_scale(out)
    assert scale != 1.0
    tmp = tmp_path_factory.mktemp("sglang-attn")
    proc = subprocess.run([sys.executable, str(HERE / "run_sglang_attn.py"), str(tmp / "attn.json"), str(out),
                           repr(scale), "--record-args", json.dumps(record["args"])], capture_output=True, text=True,
                          timeout=600, cwd=tmp, env={**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1",
                                                     "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode != 0:
        raise EngineRunError(f"run_sglang_attn.py exited {proc.returncode}: {proc.stderr[-3000:]}")
    report = json.loads((tmp / "attn.json").read_text())
    return {"report": report, "record": record, "scale": scale}


def _value(arg: Any) -> float | None:
    if isinstance(arg, dict):
        return arg["value"][0] if arg.get("value") else None
    return float(arg) if isinstance(arg, (int, float)) and not isinstance(arg, bool) else None


def _read_multiplies(name: str, calls: list[dict[str, Any]], scale: float) -> bool:
    """Whether the kernel call the backend reached is handed the scale (where each kernel takes it)."""
    kernel = calls[-1]
    if name == "triton":  # decode_attention_fwd(q, k_buf, v_buf, o, ..., max_kv_splits, sm_scale, k_descale, v_descale)
        assert _value(kernel["args"][-3]) == pytest.approx(0.1)  # the layer's softmax scale: positions as read
        return _value(kernel["args"][-2]) == pytest.approx(scale) and _value(kernel["args"][-1]) == pytest.approx(
            scale)
    if name == "flashmla":
        return _value(kernel["kwargs"]["descale_k"]) == pytest.approx(scale)
    if name in ("trtllm_mla", "cutedsl_mla"):  # bmm1_scale = q_scale * k_scale * softmax scale (0.1 here)
        return kernel["kwargs"]["bmm1_scale"] == pytest.approx(scale * 0.1)
    if name == "flashinfer":  # wrapper.run(q_nope, q_rope, k_nope, k_rope, out=, return_lse=): no scale argument
        return set(kernel["kwargs"]) != {"out", "return_lse"} or len(kernel["args"]) != 4
    if name == "fa3":  # prepare_paged_mha_query -> (q, q_rope, k_rope, k_descale, v_descale)
        return kernel["args"][3] is not None
    raise AssertionError(name)


def _write_divides(name: str, result: dict[str, Any]) -> bool | None:
    if name == "fa3":
        return None  # only the descale decision is executed for fa3 (its MLA write is the pool's plain cast)
    assert result["written"], result
    assert result["write_is_plain_cast"] != result["write_divides_by_scale"], result
    if name in ("trtllm_mla", "cutedsl_mla"):
        # the FP8 quantize kernel (fused, stubbed) is handed the four tensors and no scale
        quantize = next(c for c in result["calls"] if c["kernel"] == "mla_quantize_without_rope_for_fp8")
        assert len(quantize["args"]) == 4 and not quantize["kwargs"]
    return result["write_divides_by_scale"]


@pytest.mark.parametrize("name", EXECUTED)
def test_backend_verdict_from_execution_matches_the_table(executed, name: str) -> None:
    result = executed["report"]["backends"][name]
    assert result["error"] is None, result["error"]
    reads = _read_multiplies(name, result["calls"], executed["scale"])
    writes = _write_divides(name, result)
    verdict = ("consistent" if reads and writes else "ignored" if not reads and not writes else "inconsistent")
    table = next(b for b in BACKENDS if b.engine == "sglang" and b.name == name)
    assert verdict == table.verdict, (name, reads, writes)


def test_rule_record_pins_the_backend_its_scale_needs(converted, tmp_path) -> None:
    """The record of a default conversion follows the rule (kv_choice.py): calibrated scales pin triton (checked
    above); scales of 1.0 pin the fastest backend, SGLang resolves that backend for the record's args, the
    checkpoint's scale tensors are 1.0 and the backend's executed decode writes and reads at 1.0."""
    from quantkit.engines.kv_choice import UNIT_BACKEND

    out = converted(RULE_CASE)[1]
    record = json.loads((out / "quantkit.json").read_text())["serving"]["sglang"]
    if record["kv_cache"]["scale"] == "calibrated":
        assert record["kv_cache"]["attention_backend"] == "triton"
        return
    assert record["kv_cache"]["scale"] == "1.0" and _k_scale(out) == 1.0
    backend = record["kv_cache"]["attention_backend"]
    assert backend == UNIT_BACKEND["sm90"] and record["kv_choice"]["shipped"] == "unit"
    proc = subprocess.run([sys.executable, str(HERE / "run_sglang_attn.py"), str(tmp_path / "attn.json"), str(out),
                           "1.0", backend, "--record-args", json.dumps(record["args"])], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO),
                               "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "attn.json").read_text())
    assert report["record_backend"] == backend
    result = report["backends"][backend]
    assert result["error"] is None and result["write_is_plain_cast"] and result["write_divides_by_scale"]
    assert _read_multiplies(backend, result["calls"], 1.0)  # the descale it is handed is the checkpoint's 1.0


def test_record_runs_the_calibrated_mla_scale_on_a_backend_that_applies_it(executed) -> None:
    """The serving record says `calibrated`; the backend SGLang resolves for the record's args must divide on
    write and multiply on read (before the pin: fa3 on an H200, which ignores the scale at MLA width 576)."""
    record = executed["record"]
    assert record["kv_cache"]["scale"] == "calibrated"
    backend = executed["report"]["record_backend"]
    assert backend == record["kv_cache"]["attention_backend"], backend
    result = executed["report"]["backends"][backend]
    assert _write_divides(backend, result) and _read_multiplies(backend, result["calls"], executed["scale"])
