"""The CLI end to end: inspect, convert, validate (--json), demo — through the real entry point."""

from __future__ import annotations

import json


def test_inspect_convert_validate_json(ckpt_factory, tmp_path, cli):
    src = ckpt_factory("deepseek_v3", "fp8")
    code, out, _ = cli("inspect", str(src), "--json")
    info = json.loads(out)
    assert code == 0 and info["family"] == "deepseek_v3" and info["format"] == "fp8_block" and info["mtp_layers"] == 1
    assert info["roles"]["routed_expert"]["actions"] == ["quantize"]
    code, out, err = cli("convert", str(src), str(tmp_path / "out"), "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["actions"]["quantize"] == info["roles"]["routed_expert"]["tensors"]
    assert result["output_bytes"] == sum(f.stat().st_size for f in (tmp_path / "out").glob("*.safetensors"))
    # inspect's estimate counts tensor bytes; the real shards add only their headers
    assert 0 < result["output_bytes"] - info["estimated_output_bytes"] < 64 * 1024
    code, out, _ = cli("validate", str(tmp_path / "out"), "--source", str(src), "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["facts"]["quantized_modules"] == result["actions"]["quantize"]


def test_validate_fails_on_a_broken_output(ckpt_factory, tmp_path, cli):
    src = ckpt_factory("glm4_moe", "bf16")
    out = tmp_path / "out"
    assert cli("convert", str(src), str(out), "--quiet")[0] == 0
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].pop(next(iter(index["weight_map"])))  # a stale index: silent partial load in vLLM
    index_path.write_text(json.dumps(index))
    code, stdout, _ = cli("validate", str(out), "--json")
    assert code == 2
    report = json.loads(stdout)
    assert not report["ok"] and report["checks"][0]["status"] == "fail"
    assert "does not list" in report["checks"][0]["detail"]


def test_demo_runs_and_validates(tmp_path):
    from rich.console import Console

    from quantkit.cli.demo import run_demo

    console = Console(record=True, width=120)
    result = run_demo(tmp_path / "demo", console, size="small")
    assert result["ok"] and result["output_bytes"] < result["source_bytes"]
    assert "validation passed" in console.export_text()
    assert (tmp_path / "demo" / "glm5-int4" / "quantkit.json").exists()
