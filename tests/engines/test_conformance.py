"""Engine conformance: SGLang's and vLLM's own loader code, executed on every quantkit output, agrees with
the serving record quantkit writes (quantkit.json `serving`, `quantkit validate --engine`).

For each case the engine is launched (config parsing, model construction, `load_weights`) with exactly the
args the record gives, and must: raise nothing; put every checkpoint tensor into a parameter, except the
ones the record says that engine skips by design; leave no parameter that expects data without it; give
the routed experts the WNA16 MoE method and everything else an unquantized method; and read, in the
attention, the KV scale the record promises (the calibrated value, 1.0 where the checkpoint ships 1.0, or none).
"""

from __future__ import annotations

import json
import re

import pytest
from cases import ALL_CASES, Case, engine_params

from quantkit.engines.verdicts import ENGINES

EXPERTS = re.compile(r"\.mlp\.experts(\.routed_experts)?$")  # vLLM names the fused MoE routed_experts
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _record(out) -> dict:
    return json.loads((out / "quantkit.json").read_text())["serving"]


def _kv_values(out) -> dict[str, float]:
    """KV scale tensors of a checkpoint (name -> value)."""
    from safetensors import safe_open

    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    values = {}
    for name, shard in index.items():
        if name.endswith(("k_scale", "v_scale")):
            with safe_open(out / shard, "pt") as fh:
                values[name] = float(fh.get_tensor(name).item())
    return values


def check_kv_read(kv_use: dict, report: dict, out) -> None:
    """The KV scale the engine's attention reads is the one the record promises: 1.0 where the checkpoint ships
    1.0, the calibrated value where it ships calibrated scales, FP8 only with one of those (or per-tile rows)."""
    read = {m: v for m, v in report["kv"].items() if _LAYER.search(m)}
    if kv_use["scale"] == "1.0" and "fp8" in kv_use["dtype"]:  # scales of 1.0 shipped (kv_choice: "unit")
        assert all(v == 1.0 for v in _kv_values(out).values()), _kv_values(out)
        # None: no KV scale parameter (GLM-4.x in SGLang), the backends apply 1.0 (triton_backend.py: k_descale)
        assert all(s.get("k_scale") in (None, 1.0) for s in read.values()), read
        assert "fp8" in str(report["kv_cache_dtype"]).lower(), report["kv_cache_dtype"]
    elif kv_use["scale"] == "calibrated":
        written = _kv_values(out)
        assert read, "no attention module reports a KV scale"
        for module, scales in read.items():
            layer = int(_LAYER.search(module).group(1))
            k = [v for n, v in written.items() if f"layers.{layer}.self_attn" in n and n.endswith("k_scale")]
            if not k:  # the MTP layer carries no calibrated scale
                continue
            assert scales["k_scale"] == pytest.approx(k[0], rel=1e-6), (module, scales, k[0])
        assert "fp8" in str(report["kv_cache_dtype"]).lower(), report["kv_cache_dtype"]
    else:
        assert "fp8" not in str(report["kv_cache_dtype"]).lower() or kv_use["scale"] == "per-tile", (
            kv_use, report["kv_cache_dtype"])


def _sections(report: dict) -> list[dict]:
    return [report] + ([report["draft"]] if report.get("draft") else [])


def check_engine_agrees(engine: str, case: Case, out, report: dict) -> dict:
    verdict = _record(out)[engine]
    assert verdict["verdict"] != "fails", verdict["problems"]
    for section in _sections(report):
        assert section["error"] is None, section["error"]
    # every tensor lands somewhere (the main model or the MTP draft), except those skipped by design
    skipped = set(report["skipped_tensors"])
    if report.get("draft"):
        skipped &= set(report["draft"]["skipped_tensors"])
    ignored = set(verdict["ignored_tensors"])
    assert skipped - ignored == set(), sorted(skipped - ignored)[:8]
    assert ignored <= skipped, f"record says {engine} skips {sorted(ignored - skipped)[:4]}, but it loads them"
    for section in _sections(report):
        # a multimodal wrapper's vision tower: the synthetic checkpoints carry no vision weights
        unloaded = [p for p in section["unloaded_params"] if not p.startswith(("vision_tower.", "mm_projector."))]
        assert unloaded == [], unloaded[:8]
        for module, method in section["methods"].items():
            if EXPERTS.search(module):
                assert "WNA16" in method, (module, method)
            else:
                assert method is None or "WNA16" not in method and "Int4" not in method, (module, method)
    check_kv_read(verdict["kv_cache"], report, out)
    return report


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", engine_params(ALL_CASES))
def test_engine_loads_quantkit_output_as_the_record_says(engine, case, converted, engine_report) -> None:
    out = converted(case)[1]
    report = check_engine_agrees(engine, case, out, engine_report(engine, case))
    if engine == "sglang" and case[0] == "glm4_moe":
        assert report["notes"]["shared_experts_fusion"] is False


_CT017_PARSE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import compressed_tensors
from compressed_tensors.quantization import QuantizationConfig
assert compressed_tensors.__file__.startswith(sys.argv[1]), compressed_tensors.__file__
for path in sys.argv[2:]:
    qc = json.load(open(path))["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)
    print(compressed_tensors.__version__, parsed.format, bool(parsed.kv_cache_scheme))
"""


def test_quantization_config_parses_with_vllms_compressed_tensors_017(converted) -> None:
    """vLLM 0.33.0 pins compressed-tensors 0.17.0; quantkit writes its config with 0.19.0."""
    import subprocess
    import sys

    from harness import CT017

    outs = [converted(c)[1] for c in [("deepseek_v3", "fp8", 32, "fp8"), ("glm4_moe", "bf16", 64, None)]]
    res = subprocess.run([sys.executable, "-c", _CT017_PARSE, str(CT017), *(str(o / "config.json") for o in outs)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["0.17.0", "pack-quantized", "True", "0.17.0", "pack-quantized", "False"]
