"""`quantkit report` on a tiny converted checkpoint: the bytes match the files exactly; HTML renders."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from quantkit.arch import Role, get_adapter
from quantkit.checkpoint.synth import make_checkpoint
from quantkit.convert.pipeline import convert
from quantkit.plan.catalog import get_gpu
from quantkit.plan.html import write_html
from quantkit.plan.inventory import PrecisionPlan, format_bytes, size_inventory
from quantkit.plan.planner import Deployment
from quantkit.plan.report import checkpoint_report
from quantkit.quant.recipe import load_recipe

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)

TINY = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "index_n_heads": 2,
    "index_head_dim": 32,
    "index_topk": 16,
    "vocab_size": 256,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
}


def _quant_config(group: int) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": group,
                },
            }
        },
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"],
    }


def write_checkpoint(out: Path, fmt: str, shards: int = 3, group: int = 32) -> Path:
    """A checkpoint with the real tensor names: pack-quantized INT4 routed experts (fmt int4) or all BF16."""
    import torch
    from safetensors.torch import save_file

    config = dict(TINY)
    if fmt == "int4":
        config["quantization_config"] = _quant_config(group)
    out.mkdir(parents=True)
    files: list[dict] = [{} for _ in range(shards)]
    for i, spec in enumerate(get_adapter(config).inventory()):
        tensors = files[i % shards]
        if fmt == "int4" and spec.role == Role.ROUTED_EXPERT:
            base, (rows, cols) = spec.name[: -len(".weight")], spec.shape
            tensors[base + ".weight_packed"] = torch.zeros(rows, cols // 8, dtype=torch.int32)
            tensors[base + ".weight_scale"] = torch.ones(rows, cols // group, dtype=torch.bfloat16)
            tensors[base + ".weight_shape"] = torch.tensor([rows, cols], dtype=torch.int64)
        elif spec.name.endswith("e_score_correction_bias"):
            tensors[spec.name] = torch.zeros(spec.shape, dtype=torch.float32)
        else:
            tensors[spec.name] = torch.zeros(spec.shape, dtype=torch.bfloat16)
    weight_map = {}
    for i, tensors in enumerate(files):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config))
    (out / "tokenizer_config.json").write_text("{}")
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {"int4": write_checkpoint(root / "int4", "int4"), "bf16": write_checkpoint(root / "bf16", "bf16")}


@pytest.fixture(scope="module")
def report(tiny: dict[str, Path]) -> dict:
    return checkpoint_report(
        tiny["int4"], Deployment(get_gpu("h200"), context=4096), source=str(tiny["bf16"])
    )


def test_report_bytes_match_the_files_exactly(tiny: dict[str, Path], report: dict) -> None:
    shards = sorted(tiny["int4"].glob("*.safetensors"))
    on_disk = sum(os.path.getsize(p) for p in shards)
    disk = report["disk"]
    assert disk["shard_bytes_on_disk"] == on_disk
    assert disk["header_bytes"] + disk["tensor_bytes"] == on_disk and disk["headers_plus_tensors_equal_disk"]
    assert disk["total_bytes_on_disk"] == sum(os.path.getsize(p) for p in tiny["int4"].iterdir())
    assert sum(report["by_role"].values()) == disk["tensor_bytes"] == sum(report["by_stored_dtype"].values())
    assert report["index"]["ok"]


def test_planned_bytes_from_config_equal_the_written_bytes(tiny: dict[str, Path], report: dict) -> None:
    # The planner's byte layouts (INT4 packed + bf16 scales + int64 shape) are exactly what is on disk.
    assert report["planned_matches_disk"], (report["planned_tensor_bytes"], report["disk"]["tensor_bytes"])
    assert report["by_format"]["int4"] == report["by_role"]["routed_expert"]
    assert report["by_stored_dtype"]["I32"] > 0 and report["by_stored_dtype"]["I64"] > 0
    assert format_bytes((64, 64), "int4", 32) == 64 * 8 * 4 + 64 * 2 * 2 + 16
    assert format_bytes((300, 200), "fp8") == 300 * 200 + 4 * 3 * 2


def test_before_after_against_the_source(report: dict, tiny: dict[str, Path]) -> None:
    src = report["source"]
    assert src["from"] == "shard headers"
    bf16 = sum(t.nbytes for t in size_inventory(get_adapter(TINY).inventory(), PrecisionPlan("bf16")))
    assert src["tensor_bytes"] == bf16
    saved = src["by_role"]["routed_expert"] - report["by_role"]["routed_expert"]
    assert saved > 0 and src["by_role"]["attention"] == report["by_role"]["attention"]
    assert report["per_gpu"][1]["kv_capacity_tokens"] > report["per_gpu"][0]["kv_capacity_tokens"]


def test_stale_index_is_reported(tmp_path: Path, tiny: dict[str, Path]) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(tiny["int4"], copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    dropped = sorted(index["weight_map"])[0]
    del index["weight_map"][dropped]
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    rep = checkpoint_report(copy, Deployment(get_gpu("h200"), context=4096))
    assert not rep["index"]["ok"] and rep["index"]["unindexed"] == [dropped]


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make sysdeps)")
def test_html_page_renders_in_headless_chromium(tmp_path: Path, report: dict) -> None:
    page = tmp_path / "report.html"
    write_html(report, page)
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--window-size=1200,2000",
    ]
    shot = tmp_path / "shot.png"
    dom = subprocess.run(  # one run: the screenshot and the DOM after rendering
        [CHROMIUM, *flags, f"--screenshot={shot}", "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    for plot in ("plot-bytes-by-role", "plot-memory-stacks", "plot-kv-concurrency"):
        assert f'id="{plot}"' in dom
    assert dom.count('src="data:image/png;base64,') == 3
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[0] >= 1000 and pixels.std() > 0.05  # a page with content, not a blank canvas


def test_plan_and_report_commands_on_a_checkpoint_directory(tiny: dict[str, Path], tmp_path: Path) -> None:
    import typer
    from typer.testing import CliRunner

    from quantkit.cli.plan import register

    app = typer.Typer()
    register(app, typer.Typer(), typer.Typer())
    planned = CliRunner().invoke(app, ["plan", str(tiny["int4"]), "--kv", "fp8", "--json"])
    assert planned.exit_code == 0, planned.output
    row = json.loads(planned.output)
    on_disk = sum(os.path.getsize(p) for p in tiny["int4"].glob("*.safetensors"))
    assert row["assumptions"]["tensors_from"] == "shard headers"
    assert row["weights"] == "int4-g32" and row["checkpoint_bytes"] < on_disk
    page = tmp_path / "r.html"
    reported = CliRunner().invoke(
        app, ["report", str(tiny["int4"]), "--source", str(tiny["bf16"]), "--json", "--html", str(page)]
    )
    assert reported.exit_code == 0, reported.output
    rep = json.loads(reported.output)
    assert (
        rep["disk"]["shard_bytes_on_disk"] == on_disk == rep["disk"]["header_bytes"] + row["checkpoint_bytes"]
    )
    assert page.read_text().count("data:image/png;base64,") == 3


def test_report_on_a_checkpoint_converted_by_quantkit(tmp_path: Path) -> None:
    """The converter's real output: report bytes = files; the planner's plans = the written bytes."""
    source = make_checkpoint(tmp_path / "src", "glm_moe_dsa", "fp8", size="tiny", shards=3)
    out = tmp_path / "int4"
    convert(source, out, load_recipe("glm5-w4a16-g32", {}))
    rep = checkpoint_report(out, Deployment(get_gpu("h200"), context=4096), source=str(source))
    shards = sum(os.path.getsize(p) for p in out.glob("*.safetensors"))
    assert (
        rep["disk"]["shard_bytes_on_disk"]
        == shards
        == rep["disk"]["header_bytes"] + rep["disk"]["tensor_bytes"]
    )
    assert rep["disk"]["total_bytes_on_disk"] == sum(os.path.getsize(p) for p in out.iterdir() if p.is_file())
    assert rep["index"]["ok"] and rep["by_format"]["int4"] > 0
    # config.json alone predicts the converter's output and the FP8 source to the byte.
    assert rep["planned_matches_disk"], (rep["planned_tensor_bytes"], rep["disk"]["tensor_bytes"])
    config = json.loads((source / "config.json").read_text())
    fp8 = sum(t.nbytes for t in size_inventory(get_adapter(config).inventory(), PrecisionPlan("fp8")))
    assert rep["source"]["from"] == "shard headers" and rep["source"]["tensor_bytes"] == fp8
