"""vLLM 0.33.0's own config parsing, model construction and `load_weights`, executed on quantkit outputs.

Each test launches tests/engines/run_vllm.py in a fresh interpreter (harness.run_engine) and checks the
report against what engines.md says vLLM does with today's quantkit output: the routed experts get
`CompressedTensorsWNA16MoEMethod`, every tensor lands (MTP layer in the DeepSeekMTP / Glm4MoeMTP /
DeepseekV32MTP draft), nothing the model expects is left without data; MLA drops calibrated KV scales
(the attention reads 1.0) while GLM-4.x GQA loads them; a checkpoint quantizing a module vLLM builds
unquantized (lm_head, embeddings, router, indexer wk/weights_proj, MTP eh_proj) fails to load.

The synthetic checkpoints use the real MLA dimensions (qk_nope 128, rope 64, v 128: vLLM's Hopper MLA
prefill backends accept no others; kv_lora_rank 512: its sparse-MLA FP8 backend needs head size 576)
and `topk_method: noaux_tc` (as the released configs have; vLLM builds `e_score_correction_bias` only then).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import SOURCES, run_engine
from safetensors.torch import load_file, save_file

from quantkit.calibrate.tiny import build_tokenizer
from quantkit.checkpoint.synth import make_checkpoint, write_kimi_processor_files
from quantkit.quant.int4 import pack_int4, quantize_rtn

pytestmark = pytest.mark.skipif(not SOURCES["vllm"].is_dir(), reason="vLLM wheel not unpacked: run `make engines`")

REAL_MLA = {"qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "kv_lora_rank": 512}
RELEASE_ROUTER = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
EXPERTS = re.compile(r"\.mlp\.experts(\.routed_experts)?$")
RUNNER = Path(__file__).resolve().parent / "run_vllm.py"


def _convert(src: Path, out: Path, *args: str) -> Path:
    proc = subprocess.run([sys.executable, "-m", "quantkit", "convert", str(src), str(out), *args],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def _kv_scales(ckpt: Path) -> Path:
    """Calibrate FP8 KV scales into an INT4 checkpoint with `quantkit kv-scales` (in place); the calibrated values
    forced (--kv-scales calibrated): these tests check how vLLM loads calibrated scales."""
    proc = subprocess.run([sys.executable, "-m", "quantkit", "kv-scales", str(ckpt), "--samples", "4",
                           "--seq-len", "32", "--kv-scales", "calibrated"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return ckpt


# Crafted variants of the GLM-5 output: (tensor names to store INT4 too, ignore entry to drop) per role a
# recipe could ask to quantize (quantkit refuses these roles, so they are written here).
QUANTIZED_ALSO = {
    "lm_head": (["lm_head.weight"], "re:.*lm_head$"),
    "embedding": (["model.embed_tokens.weight"], None),
    "router": (["model.layers.1.mlp.gate.weight"], r"re:.*mlp\.gate$"),
    "indexer": (["model.layers.1.self_attn.indexer.wk.weight", "model.layers.1.self_attn.indexer.weights_proj.weight"],
                None),
    "mtp_eh_proj": (["model.layers.3.eh_proj.weight"], r"re:.*(eh_proj|shared_head\.head)$"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """ckpt(name) -> a checkpoint, built once per module. Names: FAMILY (quantkit's default output),
    FAMILY:kv (plus `quantkit kv-scales`), glm_moe_dsa:q-ROLE (QUANTIZED_ALSO), glm_moe_dsa:pattern-FSF
    (index_topk_pattern set), glm_moe_dsa:no-indexer-1 (layer 1's indexer tensors removed)."""
    cache: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name in cache:
            return cache[name]
        family, _, variant = name.partition(":")
        root = tmp_path_factory.mktemp(name.replace(":", "-"))
        if variant.startswith("q-"):
            out = _quantize_also(make(family), root / "out", *QUANTIZED_ALSO[variant[2:]])
        elif variant.startswith("pattern-"):
            out = _edit_config(make(family), root / "out", index_topk_pattern=variant.split("-", 1)[1])
        elif variant == "no-indexer-1":
            out = _drop_tensors(make(family), root / "out", "model.layers.1.self_attn.indexer.")
        else:
            out = _convert_synthetic(family, root, kv=variant == "kv")
        cache[name] = out
        return out

    return make


def _convert_synthetic(family: str, root: Path, kv: bool) -> Path:
    overrides = dict(RELEASE_ROUTER, vocab_size=512)
    if family != "glm4_moe":
        overrides.update(REAL_MLA)
    base = "deepseek_v3" if family == "kimi_k25" else family
    fmt = "int4" if family == "kimi_k25" else "bf16"  # Kimi ships INT4 experts: quantkit passes them through
    src = make_checkpoint(root / "src", base, fmt, config_overrides=overrides)
    build_tokenizer(src)
    if family == "kimi_k25":
        src = _wrap_kimi(src, root / "kimi-src")
    out = _convert(src, root / "out")
    return _kv_scales(out) if kv else out


def _edit_config(ckpt: Path, dst: Path, **fields: object) -> Path:
    shutil.copytree(ckpt, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(fields)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _drop_tensors(ckpt: Path, dst: Path, prefix: str) -> Path:
    shutil.copytree(ckpt, dst)
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    gone = [n for n in index["weight_map"] if n.startswith(prefix)]
    assert gone, prefix
    for shard in sorted({index["weight_map"][n] for n in gone}):
        tensors = {k: v for k, v in load_file(dst / shard).items() if k not in gone}
        save_file(tensors, dst / shard, metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in gone}
    index_path.write_text(json.dumps(index))
    return dst


# The runs `make test` does, in one `run_vllm.py --batch` (vLLM imported once, each run in a forked child).
CORE_RUNS: list[tuple[str, tuple[str, ...]]] = [
    ("glm_moe_dsa", ()),
    ("deepseek_v3:kv", ("--kv-cache-dtype", "auto", "--no-draft")),
    ("deepseek_v3:kv", ("--kv-cache-dtype", "fp8", "--no-draft")),
    ("glm4_moe:kv", ("--no-draft",)),
    ("glm_moe_dsa:q-lm_head", ()),
    ("glm_moe_dsa:no-indexer-1", ("--no-draft",)),
    ("glm_moe_dsa", ("--kv-cache-dtype", "fp8", "--no-draft")),
]


def _run_batch(runs: list[tuple[Path, tuple[str, ...]]], tmp: Path) -> list[dict]:
    jobs = [{"ckpt": str(c), "args": list(a), "out": str(tmp / f"report-{i}.json")} for i, (c, a) in enumerate(runs)]
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(RUNNER), "--batch", str(tmp / "jobs.json")], capture_output=True,
                          text=True, timeout=1200, env=env, cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(Path(j["out"]).read_text()) for j in jobs]


@pytest.fixture(scope="module")
def vllm(checkpoints, tmp_path_factory: pytest.TempPathFactory):
    """vllm(name, *args) -> the runner's report for checkpoint `name` with vLLM CLI `args`; the CORE_RUNS
    are run together on first use, any other run alone through harness.run_engine."""
    reports: dict[tuple[str, tuple[str, ...]], dict] = {}

    def report(name: str, *args: str) -> dict:
        key = (name, args)
        if key not in reports and key in CORE_RUNS:
            runs = [(checkpoints(n), a) for n, a in CORE_RUNS]
            reports.update(zip(CORE_RUNS, _run_batch(runs, tmp_path_factory.mktemp("vllm-batch")), strict=True))
        if key not in reports:
            reports[key] = run_engine("vllm", checkpoints(name), list(args))
        return reports[key]

    return report


def _wrap_kimi(src: Path, dst: Path) -> Path:
    """Kimi K2.5's multimodal layout (`language_model.` prefix, wrapper config) plus the image processor
    config a release ships (vLLM's Kimi processing info reads it while building the model config)."""
    shutil.copytree(src, dst)
    weight_map = {}
    for shard in sorted(dst.glob("*.safetensors")):
        tensors = {f"language_model.{k}": v for k, v in load_file(shard).items()}
        save_file(tensors, shard, metadata={"format": "pt"})
        weight_map.update({k: shard.name for k in tensors})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    text = json.loads((dst / "config.json").read_text())
    wrapper = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
               "quantization_config": text.pop("quantization_config"), "text_config": text}
    (dst / "config.json").write_text(json.dumps(wrapper))
    write_kimi_processor_files(dst)
    return dst


def _quantize_also(ckpt: Path, dst: Path, names: list[str], drop_ignore: str | None) -> Path:
    """A copy of `ckpt` with `names` stored as INT4 pack-quantized too (and `drop_ignore` removed from the
    ignore list): what a recipe quantizing that role would write, crafted because quantkit refuses it."""
    shutil.copytree(ckpt, dst)
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in sorted({index["weight_map"][n] for n in names}):
        tensors = load_file(dst / shard)
        for name in [n for n in names if index["weight_map"][n] == shard]:
            weight = tensors.pop(name).float()
            q, scale = quantize_rtn(weight, 32, torch.bfloat16)
            packed = pack_int4(q, scale).tensors(name.removesuffix(".weight"))
            tensors.update(packed)
            del index["weight_map"][name]
            index["weight_map"].update({k: shard for k in packed})
        save_file(tensors, dst / shard, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    config = json.loads((dst / "config.json").read_text())
    qc = config["quantization_config"]
    qc["ignore"] = [p for p in qc["ignore"] if p != drop_ignore]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _assert_loads_clean(report: dict) -> None:
    for section in [report] + ([report["draft"]] if report.get("draft") else []):
        assert section["error"] is None, section["error"]
        assert section["unloaded_params"] == [], section["unloaded_params"][:8]
        moe = {m: v for m, v in section["methods"].items() if EXPERTS.search(m)}
        assert moe and set(moe.values()) == {"CompressedTensorsWNA16MoEMethod"}, moe
        others = {m: v for m, v in section["methods"].items() if m not in moe}
        assert not [m for m, v in others.items() if "WNA16" in v or "W4A16" in v], others
    assert report["skipped_tensors"] == [], report["skipped_tensors"][:8]  # nowhere: not target, not draft
    for section in [report] + ([report["draft"]] if report.get("draft") else []):
        assert section["notes"]["stubs_used_in_load"] == [], section["notes"]["stubs_used_in_load"]


@pytest.mark.parametrize("family, draft_arch", [
    pytest.param("deepseek_v3", "DeepSeekMTPModel", marks=pytest.mark.slow),
    pytest.param("glm4_moe", "Glm4MoeMTPModel", marks=pytest.mark.slow),
    ("glm_moe_dsa", "DeepseekV32MTPModel")])
def test_default_output_loads_with_mtp_draft(vllm, family, draft_arch) -> None:
    report = vllm(family)
    assert report["engine"] == "vllm" and report["version"] == "0.33.0"
    _assert_loads_clean(report)
    assert report["draft"]["architecture"] == draft_arch
    assert any(".layers.3." in m for m in report["draft"]["methods"])  # _rewrite_spec_layer_name kept layer 3
    assert report["notes"]["quant_config"] == "CompressedTensorsConfig"
    assert report["kv_cache_dtype"] == "auto"  # no kv_cache_scheme, no --kv-cache-dtype: BF16 KV
    if family == "glm_moe_dsa":  # index_topk_freq defaults to 1: every layer builds its DSA indexer
        assert report["notes"]["indexer_layers"] == [0, 1, 2]
        assert report["methods"]["model.layers.1.self_attn.indexer.wk_weights_proj"] == "UnquantizedLinearMethod"


@pytest.mark.slow
def test_kimi_k25_language_model_loads_but_mtp_is_refused(vllm) -> None:
    """The language model loads under `language_model.`; the vision tower is built from the default
    vision_config (the synthetic wrapper has no vision weights: listed apart); vLLM has no MTP draft for
    the kimi_k25 wrapper (SpeculativeConfig rewrites no such model_type)."""
    report = vllm("kimi_k25")
    assert report["error"] is None, report["error"]
    assert report["architecture"] == "KimiK25ForConditionalGeneration"
    assert report["unloaded_params"] == [], report["unloaded_params"][:8]
    assert report["notes"]["unloaded_vision_params"] > 0
    moe = {m: v for m, v in report["methods"].items() if m.startswith("language_model.") and EXPERTS.search(m)}
    assert moe and set(moe.values()) == {"CompressedTensorsWNA16MoEMethod"}
    assert "Unsupported speculative method: 'mtp'" in report["draft"]["error"]


@pytest.mark.slow
def test_index_topk_pattern_decides_which_layers_build_an_indexer(vllm) -> None:
    """DSA indexer placement follows index_topk_pattern ('S' = reuse the previous layer's top-k); the
    layer-1 indexer tensors of a checkpoint that has them then have nowhere to go."""
    report = vllm("glm_moe_dsa:pattern-FSF", "--no-draft")
    assert report["notes"]["indexer_layers"] == [0, 2]
    assert report["error"].startswith("KeyError: 'layers.1.self_attn.indexer."), report["error"]


def test_missing_indexer_tensors_load_silently_and_are_reported_unloaded(vllm) -> None:
    """The reverse: the config builds an indexer the checkpoint has no tensors for. vLLM loads without a
    word (no missing-weight check for quantized models); the runner's tracking names the parameters."""
    report = vllm("glm_moe_dsa:no-indexer-1", "--no-draft")
    assert report["error"] is None, report["error"]
    assert report["notes"]["indexer_layers"] == [0, 1, 2]
    assert report["unloaded_params"] == [
        "model.layers.1.self_attn.indexer.k_norm.bias", "model.layers.1.self_attn.indexer.k_norm.weight",
        "model.layers.1.self_attn.indexer.wk_weights_proj.weight", "model.layers.1.self_attn.indexer.wq_b.weight"]


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_mla_kv_scales_are_dropped_and_attention_reads_one(vllm, checkpoints, kv_dtype) -> None:
    written = json.loads((checkpoints("deepseek_v3:kv") / "config.json").read_text())["quantization_config"]
    assert written["kv_cache_scheme"]["type"] == "float"
    report = vllm("deepseek_v3:kv", "--kv-cache-dtype", kv_dtype, "--no-draft")
    assert report["error"] is None, report["error"]
    assert report["notes"]["kv_cache_scheme"]["num_bits"] == 8  # parsed by compressed-tensors 0.17.0:
    assert report["notes"]["compressed_tensors"] == "0.17.0"  # vLLM's pin, not the project's 0.19.0
    # every calibrated scale name is skipped (maybe_remap_kv_scale_name finds no MLA KV parameter) ...
    skipped = [n for n in report["skipped_tensors"] if n.endswith(("k_scale", "v_scale"))]
    assert {n.split(".self_attn.")[1] for n in skipped} == {"k_scale", "v_scale", "k_proj.k_scale", "v_proj.v_scale"}
    # ... MLAAttention gets no KV-cache method and reads 1.0; kv_cache_scheme does not switch it to FP8
    mla = {m: v for m, v in report["kv"].items() if m.endswith("mla_attn")}
    assert len(mla) == 3 and all(v == {"k_scale": 1.0, "v_scale": 1.0} for v in mla.values()), mla
    assert {report["methods"][m] for m in mla} == {"none"}
    assert report["kv_cache_dtype"] == kv_dtype


def test_dsa_fp8_kv_resolves_to_deepseek_sparse_layout_at_scale_one(vllm) -> None:
    """GLM-5 (DSA): quantkit writes no KV scales; `--kv-cache-dtype fp8` becomes FlashMLA-sparse's own
    `fp8_ds_mla` layout (per-tile scales in the cache), and the attention's tensor scale stays 1.0."""
    report = vllm("glm_moe_dsa", "--kv-cache-dtype", "fp8", "--no-draft")
    assert report["error"] is None, report["error"]
    assert report["kv_cache_dtype"] == "fp8_ds_mla"
    assert report["kv"] and all(v == {"k_scale": 1.0, "v_scale": 1.0} for v in report["kv"].values())


def test_gqa_kv_scales_load_into_self_attn_attn(vllm, checkpoints) -> None:
    from safetensors import safe_open

    ckpt = checkpoints("glm4_moe:kv")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(ckpt / index["model.layers.1.self_attn.k_scale"], "pt") as fh:
        k1 = float(fh.get_tensor("model.layers.1.self_attn.k_scale"))
    report = vllm("glm4_moe:kv", "--no-draft")
    assert report["error"] is None, report["error"]
    assert k1 != 1.0 and report["kv"]["model.layers.1.self_attn.attn"]["k_scale"] == pytest.approx(k1, rel=1e-6)
    assert report["methods"]["model.layers.1.self_attn.attn"] == "CompressedTensorsKVCacheMethod"
    assert report["kv_cache_dtype"] == "fp8"  # kv_cache_scheme turns --kv-cache-dtype auto into FP8
    assert not [n for n in report["skipped_tensors"] if n.endswith(("k_scale", "v_scale"))]


@pytest.mark.parametrize("role", [r if r == "lm_head" else pytest.param(r, marks=pytest.mark.slow)
                                  for r in QUANTIZED_ALSO])
def test_quantizing_a_module_vllm_builds_unquantized_fails_the_load(vllm, role) -> None:
    report = vllm(f"glm_moe_dsa:q-{role}")
    errors = [s["error"] for s in [report] + ([report["draft"]] if report.get("draft") else []) if s["error"]]
    assert errors, f"{role}: vLLM loaded a quantized {QUANTIZED_ALSO[role][0][0]}"
    assert any("weight_packed" in e or "weight_scale" in e for e in errors), errors
    if role == "lm_head":  # AutoWeightsLoader: ParallelLMHead has only `weight`
        assert "no module or parameter named 'lm_head.weight_packed'" in report["error"]
