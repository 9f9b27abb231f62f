"""The adapters' inventories equal what transformers saves, and real configs add up to the published sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quantkit.arch import Role, get_adapter
from quantkit.checkpoint.synth import tiny_config
from quantkit.core.errors import QuantkitError

REAL = Path(__file__).resolve().parent.parent / "quantkit" / "plan" / "configs"  # bundled copies of the releases


@pytest.mark.parametrize("family", ["glm_moe_dsa", "glm_moe_dsa-indexshare", "deepseek_v3", "glm4_moe"])
def test_inventory_matches_transformers_save_pretrained(family, tmp_path):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    if family.endswith("-indexshare"):  # GLM-5.2: "shared" layers reuse the previous top-k and hold no indexer
        config = tiny_config("glm_moe_dsa", indexer_types=["full", "shared", "shared"])
    else:
        config = tiny_config(family)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    model.save_pretrained(tmp_path)
    saved = {}
    for f in tmp_path.glob("*.safetensors"):
        with safe_open(f, "pt") as fh:
            saved.update({k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()})
    ours = {s.name: s.shape for s in get_adapter(config).inventory() if not s.mtp}
    assert ours == saved


def test_classification_of_real_names():
    config = json.loads((REAL / "glm-5.2" / "config.json").read_text()) if REAL.exists() else tiny_config("glm_moe_dsa")
    a = get_adapter(config)
    n = a.num_layers
    assert a.classify("model.layers.5.mlp.experts.17.up_proj.weight_packed").role == Role.ROUTED_EXPERT
    assert a.classify("model.layers.5.mlp.experts.17.up_proj.weight").expert == 17
    assert a.classify("model.layers.5.self_attn.indexer.wk.weight").role == Role.INDEXER
    assert a.classify("model.layers.5.mlp.gate.e_score_correction_bias").role == Role.ROUTER
    assert a.classify("model.layers.1.mlp.down_proj.weight").role == Role.DENSE_MLP
    mtp = a.classify(f"model.layers.{n}.eh_proj.weight")
    assert mtp.mtp and mtp.role == Role.MTP_OTHER
    assert a.classify(f"model.layers.{n}.mlp.experts.3.gate_proj.weight").mtp


def test_real_configs_add_up_to_published_parameter_counts():
    counts = {}
    for name in ("glm-5.2", "deepseek-v3", "kimi-k2.6"):
        inv = get_adapter(json.loads((REAL / name / "config.json").read_text())).inventory()
        counts[name] = sum(s.numel for s in inv) / 1e9
    assert abs(counts["glm-5.2"] - 753.9) < 1.0  # models-and-memory.md: 753.9B
    assert abs(counts["deepseek-v3"] - 684.5) < 2.0  # 671B + 14B MTP
    assert 1000 < counts["kimi-k2.6"] < 1050  # "~1T"


def test_unknown_architecture_is_a_clean_error():
    with pytest.raises(QuantkitError, match="unsupported model_type 'llama'"):
        get_adapter({"model_type": "llama"})


def test_ignore_patterns_follow_the_recipe():
    a = get_adapter(tiny_config("deepseek_v3"))
    assert r"re:.*self_attn.*" in a.ignore_patterns({Role.ROUTED_EXPERT})
    assert r"re:.*shared_experts.*" not in a.ignore_patterns({Role.ROUTED_EXPERT, Role.SHARED_EXPERT})
    torch.manual_seed(0)
