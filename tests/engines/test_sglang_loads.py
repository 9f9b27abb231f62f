"""The SGLang runner executes SGLang 0.5.23's own loader on quantkit outputs and detects what it gets wrong.

The checkpoints are quantkit conversions of generated models; `run_sglang.py` runs SGLang on them (its
argparse, config parsing, scheme selection, model construction and `load_weights`), all runs in one batch
process (SGLang imported once, a forked child per run). The known
SGLang behaviours (docs/engines.md) must show up in the report exactly where they happen:
GLM-4.x shared experts dropped under fusion, loaded with `--disable-shared-experts-fusion`; MLA
`self_attn.k_scale` skipped while `kv_cache_scheme` makes the KV cache FP8 at scale 1.0; GLM-4.x GQA
attention without a KV-scale parameter; group 64 with `--moe-runner-backend triton` raising.

Checkpoints come from the session's `converted` fixture (tests/engines/conftest.py), shared with the
conformance tests.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import run_engine, run_engine_batch
from safetensors.torch import load_file, save_file

from quantkit.checkpoint.synth import make_checkpoint, wrap_multimodal
from quantkit.convert.pipeline import convert
from quantkit.quant.recipe import load_recipe

MTP_LAYER = 3  # the tiny models have 3 layers; the MTP layer follows them


def _rewrite(src: Path, dst: Path, keep: Callable[[str], bool]) -> Path:
    """Copy a checkpoint keeping only the tensors `keep(name)` accepts (index rewritten)."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    for shard in sorted(dst.glob("*.safetensors")):
        tensors = load_file(shard)
        save_file({k: v for k, v in tensors.items() if keep(k)}, shard, metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if keep(k)}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def _kv_scales(out: Path) -> dict[str, float]:
    from safetensors import safe_open

    values = {}
    for shard in out.glob("*.safetensors"):
        with safe_open(shard, "pt") as fh:
            values.update({n: fh.get_tensor(n).item() for n in fh.keys() if n.endswith(("k_scale", "v_scale"))})
    return values


def _landed_nowhere(report: dict) -> set[str]:
    """Checkpoint tensors neither the target nor the NextN draft put into a parameter."""
    skipped = set(report["skipped_tensors"])
    return skipped & set(report["draft"]["skipped_tensors"]) if report.get("draft") else skipped


# MLA_KV: calibrated scales forced (--kv-scales calibrated): the test reads the calibrated value in attn_mqa
GLM4_KV, MLA_KV, GLM4_G64, DSA = ("glm4_moe", "fp8", 32, "fp8"), ("deepseek_v3", "fp8", 32, "fp8-calibrated"), \
    ("glm4_moe", "bf16", 64, None), ("glm_moe_dsa", "fp8", 32, None)
NO_FUSION = ("--disable-shared-experts-fusion",)


def _kimi_with_mtp(root: Path) -> Path:
    """Kimi K2.5 layout (`language_model.` prefix, tiny vision_config, no vision weights), with an MTP layer."""
    src = make_checkpoint(root / "k2", "deepseek_v3", "int4", group_size=32)
    src = wrap_multimodal(src, root / "kimi", "kimi_k25", vision_tensor=False)
    convert(src, root / "out", load_recipe(None, json.loads((src / "config.json").read_text()), {"group_size": 32}))
    return root / "out"


@pytest.fixture(scope="module")
def reports(converted, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every run these tests check, in one `run_sglang.py --batch` (SGLang imported once, one fork per run)."""
    mla = converted(MLA_KV)[1]
    legacy = _rewrite(mla, tmp_path_factory.mktemp("mla-legacy") / "out",
                      lambda n: not n.endswith(("k_proj.k_scale", "v_proj.v_scale")))
    runs: dict[str, tuple[Path, tuple[str, ...]]] = {
        "glm4 fused": (converted(GLM4_KV)[1], ()),
        "glm4 plain": (converted(GLM4_KV)[1], NO_FUSION),
        "mla legacy": (legacy, ()),
        "mla": (mla, ("--kv-cache-dtype", "fp8_e4m3")),
        "g64 triton": (converted(GLM4_G64)[1], ("--moe-runner-backend", "triton", *NO_FUSION)),
        "g64 auto": (converted(GLM4_G64)[1], NO_FUSION),
        "dsa": (converted(DSA)[1], ("--moe-runner-backend", "marlin")),
        "kimi": (_kimi_with_mtp(tmp_path_factory.mktemp("kimi")), ("--moe-runner-backend", "marlin")),
    }
    return dict(zip(runs, run_engine_batch("sglang", list(runs.values())), strict=True))


def test_glm4_shared_experts_dropped_under_fusion_and_loaded_without_it(converted, reports) -> None:
    out = converted(GLM4_KV)[1]
    fused = reports["glm4 fused"]
    assert fused["error"] is None, fused["error"]
    assert fused["architecture"] == "Glm4MoeForCausalLM"
    assert fused["notes"]["shared_experts_fusion"] is True  # glm4_moe.py refuses fusion only for w4afp8
    assert fused["notes"]["shared_experts_fusion_disable_reason"] is None
    shared = {n for n in fused["skipped_tensors"] if re.search(r"layers\.[12]\.mlp\.shared_experts\.", n)}
    assert len(shared) == 2 * 3, sorted(fused["skipped_tensors"])[:12]  # gate/up/down of both MoE layers
    # the fused slot (expert n_routed = 8) of the WNA16 MoE layer is never written
    assert fused["notes"]["unwritten_slices"]["model.layers.1.mlp.experts.w13_weight_packed"] == [8]
    assert "model.layers.1.mlp.experts.w13_weight_packed" in fused["unloaded_params"]
    assert "model.layers.1.mlp.shared_experts.gate_up_proj" not in fused["methods"]  # no separate module

    plain = reports["glm4 plain"]
    assert plain["error"] is None, plain["error"]
    assert plain["notes"]["shared_experts_fusion"] is False
    assert not [n for n in plain["skipped_tensors"] if "shared_experts" in n and f"layers.{MTP_LAYER}." not in n]
    assert plain["unloaded_params"] == [] and plain["draft"]["unloaded_params"] == []
    assert plain["methods"]["model.layers.1.mlp.shared_experts.gate_up_proj"] == "UnquantizedLinearMethod"
    assert plain["methods"]["model.layers.1.mlp.experts"].endswith("CompressedTensorsWNA16MoE")
    assert plain["draft"]["architecture"] == "Glm4MoeForCausalLMNextN"

    # GQA: Glm4MoeAttention builds RadixAttention without quant_config, so no k_scale parameter exists;
    # the calibrated scales are skipped while kv_cache_scheme still turns `auto` into FP8
    scales = [n for n in _kv_scales(out) if n.endswith("self_attn.k_scale")]
    assert scales and set(scales) <= _landed_nowhere(plain)
    assert plain["kv_cache_dtype"] == "fp8_e4m3"
    assert plain["notes"]["kv_cache_quant_algo"] == "FP8"
    for module in ("model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"):
        assert plain["methods"][module] is None
        assert plain["kv"][module] == {"k_scale": None, "v_scale": None}


def test_mla_kv_scales_load_only_under_the_k_proj_names(converted, reports) -> None:
    written = _kv_scales(converted(MLA_KV)[1])
    report = reports["mla legacy"]  # transformers' MLA spelling only (what quantkit wrote before issue 9)
    assert report["error"] is None, report["error"]
    assert {f"model.layers.{i}.self_attn.k_scale" for i in range(3)} <= set(report["skipped_tensors"])
    assert report["kv_cache_dtype"] == "fp8_e4m3"  # kv_cache_scheme flips --kv-cache-dtype auto to FP8 ...
    for i in range(3):  # ... while the attention reads the default scale
        assert report["kv"][f"model.layers.{i}.self_attn.attn_mqa"] == {"k_scale": 1.0, "v_scale": 1.0}

    # the names SGLang's deepseek loader remaps to attn_mqa: the calibrated value is what the attention reads
    loaded = reports["mla"]
    assert loaded["error"] is None, loaded["error"]
    assert loaded["architecture"] == "DeepseekV3ForCausalLM"
    assert loaded["notes"]["shared_experts_fusion"] is False  # deepseek_v2.py refuses it for W4A16
    for i in range(3):
        k = written[f"model.layers.{i}.self_attn.k_proj.k_scale"]
        assert loaded["kv"][f"model.layers.{i}.self_attn.attn_mqa"]["k_scale"] == pytest.approx(k, rel=1e-6)
        assert f"model.layers.{i}.self_attn.k_proj.k_scale" not in loaded["skipped_tensors"]
    assert loaded["draft"]["architecture"] == "DeepseekV3ForCausalLMNextN"
    assert loaded["unloaded_params"] == [] and loaded["draft"]["unloaded_params"] == []
    # the MTP layer's own embedding and head: the draft uses the target's (SGLang skips them)
    legacy_names = {n for n in written if n.endswith(("self_attn.k_scale", "self_attn.v_scale"))}
    mtp = f"model.layers.{MTP_LAYER}"
    assert _landed_nowhere(loaded) - legacy_names == {f"{mtp}.embed_tokens.weight", f"{mtp}.shared_head.head.weight"}


def test_group_64_triton_moe_backend_raises_auto_takes_marlin(reports) -> None:
    triton = reports["g64 triton"]
    assert triton["error"] is not None and "group_size=32 or 128" in triton["error"], triton["error"]
    assert triton["error"].startswith("ValueError")
    auto = reports["g64 auto"]  # Hopper + auto: the Marlin method
    assert auto["error"] is None, auto["error"]
    assert auto["notes"]["moe_runner_backend"] == "auto"
    assert auto["notes"]["group_size"] == 64
    assert auto["notes"]["triton_wna16_moe_supported_for_group"] is False
    assert auto["methods"]["model.layers.2.mlp.experts"] == "CompressedTensorsFusedMoEMethod:CompressedTensorsWNA16MoE"


@pytest.mark.slow
def test_legacy_kv_scales_json_fails_the_load(converted, tmp_path: Path) -> None:
    """`--quantization-param-path` with FP8 KV: none of these model classes has `load_kv_cache_scales`."""
    scales = tmp_path / "kv_cache_scales.json"
    scales.write_text(json.dumps({"model_type": "deepseek_v3", "kv_cache": {"dtype": "float8_e4m3fn",
                                  "scaling_factor": {"0": {str(i): 0.01 for i in range(3)}}}}))
    out = converted(MLA_KV)[1]
    report = run_engine("sglang", out, ["--kv-cache-dtype", "fp8_e4m3", "--quantization-param-path", str(scales)])
    assert report["error"] is not None and "does not support loading scaling factors" in report["error"]


def test_glm5_dsa_indexer_fused_and_nextn_draft_loaded(reports) -> None:
    report = reports["dsa"]
    assert report["error"] is None, report["error"]
    assert report["architecture"] == "GlmMoeDsaForCausalLM"
    # CUDA + interleaved indexer rope: wk and weights_proj fuse into one BF16 wk_weights_proj
    assert "model.layers.0.self_attn.indexer.wk_weights_proj" in report["methods"]
    assert "model.layers.0.self_attn.indexer.wk" not in report["methods"]
    draft = report["draft"]
    assert draft["error"] is None, draft["error"]
    assert draft["architecture"] == "GlmMoeDsaForCausalLMNextN"
    assert draft["methods"]["model.decoder.mlp.experts"].endswith("CompressedTensorsWNA16MoE")
    assert _landed_nowhere(report) == set()
    assert report["unloaded_params"] == [] and draft["unloaded_params"] == []
    assert any(f"layers.{MTP_LAYER}.self_attn.indexer.wk." in n for n in report["skipped_tensors"])
    assert not any(f"layers.{MTP_LAYER}.self_attn.indexer." in n for n in draft["skipped_tensors"])


def test_kimi_k25_language_model_loads_int4_passthrough(reports) -> None:
    report = reports["kimi"]
    assert report["error"] is None, report["error"]
    assert report["architecture"] == "KimiK25ForConditionalGeneration"
    assert report["notes"]["shared_experts_fusion"] is False  # kimi_k25.py refuses it for W4A16
    experts = report["methods"]["language_model.model.layers.1.mlp.experts"]
    assert experts.endswith("CompressedTensorsWNA16MoE")
    assert all(n.startswith(f"language_model.model.layers.{MTP_LAYER}.") for n in report["skipped_tensors"])
    assert report["unloaded_params"] and all(n.startswith(("vision_tower.", "mm_projector."))
                                             for n in report["unloaded_params"])
    # SGLang has no NextN draft for the Kimi wrapper: its MTP layer cannot be served
    assert report["draft"]["error"].startswith("no NextN draft class for KimiK25ForConditionalGeneration")
