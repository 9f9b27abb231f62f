"""quantkit's engine rules (quantkit.engines.verdicts) on generated checkpoints: verdicts, args, KV-scale use, refusals.

What the engines really do with the same checkpoints is executed in tests/engines/; these tests pin the
decisions quantkit takes from it: the CLI contract (exit 2 and the reason), the record in quantkit.json
and the planner's launch flags coming from one place.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from quantkit.arch import Role, get_adapter
from quantkit.checkpoint.synth import make_checkpoint
from quantkit.convert.pipeline import convert
from quantkit.engines.verdicts import engine_verdicts, facts_from_checkpoint, facts_from_recipe, read_checkpoint_facts
from quantkit.quant.recipe import Recipe, load_recipe
from quantkit.validate.checkpoint import validate_checkpoint


def _convert(ckpt_factory, tmp_path, family: str, **fields):
    src = ckpt_factory(family, "fp8")
    out = tmp_path / f"out-{family}"
    convert(src, out, load_recipe(None, json.loads((src / "config.json").read_text()), fields))
    return src, out


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, "-m", "quantkit", *args], capture_output=True, text=True, env=env)


def test_recipe_quantizing_a_role_vllm_builds_unquantized_is_refused_with_exit_2(ckpt_factory, tmp_path) -> None:
    src = ckpt_factory("deepseek_v3", "fp8")
    recipe = tmp_path / "lm-head.yaml"
    recipe.write_text("name: lm-head\nquantize_roles: [routed_expert, lm_head]\n")
    res = _cli("convert", str(src), str(tmp_path / "out"), "--recipe", str(recipe))
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip()
    assert "\n" not in line and "lm_head" in line and "ParallelLMHead" in line and "Traceback" not in line
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    with pytest.raises(Exception, match="MLA attention"):  # SGLang and vLLM both split kv_b_proj at load
        convert(src, tmp_path / "attn", Recipe(quantize_roles=[Role.ROUTED_EXPERT, Role.ATTENTION]))


def test_glm4_record_disables_fusion_and_keeps_sglang_off_fp8_at_scale_one(ckpt_factory, tmp_path) -> None:
    src, out = _convert(ckpt_factory, tmp_path, "glm4_moe")
    record = json.loads((out / "quantkit.json").read_text())["serving"]
    assert "--disable-shared-experts-fusion" in record["sglang"]["args"]
    assert "--disable-shared-experts-fusion" not in record["vllm"]["args"]
    # the same facts with GQA KV scales written: vLLM applies them, SGLang cannot (no k_scale parameter)
    config = json.loads((out / "config.json").read_text())
    facts = facts_from_recipe(config, 32, {Role.ROUTED_EXPERT}, True, kv_scale_mode="calibrated")
    v = engine_verdicts(facts)
    assert v["vllm"].kv_cache.scale == "calibrated" and v["vllm"].args[-2:] == ["--kv-cache-dtype", "fp8"]
    assert v["sglang"].kv_cache.scale == "none" and v["sglang"].args[-2:] == ["--kv-cache-dtype", "bfloat16"]
    assert v["sglang"].verdict == "loads-with-warnings"
    # scales of 1.0 (the measured rule's choice for GQA): SGLang's unloaded scale is the checkpoint's, FP8 KV
    unit = engine_verdicts(facts_from_recipe(config, 32, {Role.ROUTED_EXPERT}, True))
    assert unit["sglang"].kv_cache.scale == "1.0" and unit["sglang"].args[-2:] == ["--kv-cache-dtype", "fp8_e4m3"]


def test_deepseek_needs_no_fusion_flag(ckpt_factory, tmp_path) -> None:
    """DeepSeek V3 / Kimi / GLM-5 turn shared-expert fusion off for W4A16 themselves (deepseek_v2.py)."""
    _, out = _convert(ckpt_factory, tmp_path, "deepseek_v3")
    assert "--disable-shared-experts-fusion" not in json.loads((out / "quantkit.json").read_text())["serving"][
        "sglang"]["args"]


def test_mla_scales_under_the_old_name_fail_sglang_and_validate_exits_2(ckpt_factory, tmp_path) -> None:
    """Today's-main layout: only `self_attn.k_scale` with kv_cache_scheme -> SGLang runs FP8 at scale 1.0."""
    _, out = _convert(ckpt_factory, tmp_path, "deepseek_v3")
    config = json.loads((out / "config.json").read_text())
    adapter = get_adapter(config)
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    old = list(names) + [f"model.layers.{i}.self_attn.{p}_scale" for i in range(adapter.num_layers) for p in "kv"]
    config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                        "dynamic": False, "symmetric": True}
    verdicts = engine_verdicts(facts_from_checkpoint(config, old))
    assert verdicts["sglang"].verdict == "fails" and verdicts["sglang"].kv_cache.scale == "1.0"
    assert verdicts["vllm"].verdict == "loads-with-warnings" and verdicts["vllm"].kv_cache.scale == "none"
    new = old + [f"model.layers.{i}.self_attn.{p}_proj.{p}_scale" for i in range(adapter.num_layers) for p in "kv"]
    assert engine_verdicts(facts_from_checkpoint(config, new))["sglang"].kv_cache.scale == "calibrated"


def test_dsa_indexer_placement_disagreeing_with_vllms_rule_fails_validation(ckpt_factory, tmp_path) -> None:
    """transformers/SGLang read `indexer_types`; vLLM derives the layers from index_topk_freq/offset only."""
    src = make_checkpoint(tmp_path / "src", "glm_moe_dsa", "fp8",
                          config_overrides={"indexer_types": ["full", "shared", "full"]})
    out = tmp_path / "dsa"
    convert(src, out, load_recipe(None, json.loads((src / "config.json").read_text())))
    report = validate_checkpoint(out)
    assert report.engines["sglang"].verdict != "fails"
    assert report.engines["vllm"].verdict == "fails" and "[1]" in report.engines["vllm"].problems[0]
    assert not report.ok
    # the same model with the vLLM keys saying the same thing validates
    fixed = json.loads((out / "config.json").read_text())
    fixed.update(index_topk_freq=2, index_skip_topk_offset=1)  # layers 0 and 2 full, 1 shared
    (out / "config.json").write_text(json.dumps(fixed))
    assert read_checkpoint_facts(out).indexer_layers == (0, 2, 3)
    assert validate_checkpoint(out).engines["vllm"].verdict != "fails"


def test_validate_engine_option_and_json(ckpt_factory, tmp_path) -> None:
    _, out = _convert(ckpt_factory, tmp_path, "glm4_moe", group_size=64)
    res = _cli("validate", str(out), "--engine", "sglang", "--json")
    assert res.returncode == 0, res.stderr
    engines = json.loads(res.stdout)["engines"]
    assert list(engines) == ["sglang"] and engines["sglang"]["version"] == "0.5.23"
    assert any("group 64" in w for w in engines["sglang"]["warnings"])
    text = _cli("validate", str(out))
    assert text.returncode == 0 and "vllm 0.33.0" in text.stdout and "sglang 0.5.23" in text.stdout
    assert "--disable-shared-experts-fusion" in text.stdout
