"""Crash-safety: an interrupted run leaves only OUT.partial, a rerun resumes and gives the same bytes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

import quantkit.convert.pipeline as convert_module
from quantkit.convert.pipeline import convert
from quantkit.quant.recipe import load_recipe


def digest_tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def source(ckpt_factory):
    return ckpt_factory("glm_moe_dsa", "fp8", size="small", shards=5)


@pytest.fixture(scope="module")
def clean_run(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean") / "out"
    convert(source, out, load_recipe("glm5-w4a16-g32", {}, {"max_shard_size": "1MB"}))
    return digest_tree(out)


def test_rerun_produces_identical_bytes(source, clean_run, tmp_path):
    convert(source, tmp_path / "again", load_recipe("glm5-w4a16-g32", {}, {"max_shard_size": "1MB"}))
    assert digest_tree(tmp_path / "again") == clean_run
    assert sum(1 for f in clean_run if f.endswith(".safetensors")) > 5  # 1MB cap split shards into parts


def test_interrupted_run_resumes_to_identical_bytes(source, clean_run, tmp_path, monkeypatch):
    recipe = load_recipe("glm5-w4a16-g32", {}, {"max_shard_size": "1MB"})
    real = convert_module.convert_shard
    calls = []

    def crash_on_third(src, job, *args, **kwargs):
        calls.append(job.index)
        if len(calls) == 3:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the third shard
        return real(src, job, *args, **kwargs)

    monkeypatch.setattr(convert_module, "convert_shard", crash_on_third)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        convert(source, out, recipe)
    assert not out.exists()  # nothing that looks complete
    partial = tmp_path / "out.partial"
    assert len(list((partial / "journal").glob("shard-*.json"))) == 2
    monkeypatch.setattr(convert_module, "convert_shard", real)
    result = convert(source, out, recipe)
    assert result.resumed_shards == 2
    assert not partial.exists()
    assert digest_tree(out) == clean_run


def test_changed_recipe_discards_stale_partial(source, tmp_path, monkeypatch):
    real = convert_module.convert_shard

    def crash(src, job, *args, **kwargs):
        if job.index == 1:
            raise RuntimeError("boom")
        return real(src, job, *args, **kwargs)

    monkeypatch.setattr(convert_module, "convert_shard", crash)
    with pytest.raises(RuntimeError):
        convert(source, tmp_path / "out", load_recipe("glm5-w4a16-g32", {}))
    monkeypatch.setattr(convert_module, "convert_shard", real)
    result = convert(source, tmp_path / "out", load_recipe("glm5-w4a16-g32", {}, {"group_size": 64}))
    assert result.resumed_shards == 0
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 64


def test_parallel_workers_give_identical_bytes(source, clean_run, tmp_path):
    convert(source, tmp_path / "par", load_recipe("glm5-w4a16-g32", {}, {"max_shard_size": "1MB"}), workers=2)
    assert digest_tree(tmp_path / "par") == clean_run


def test_force_replaces_existing_output(source, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    convert(source, out, load_recipe("glm5-w4a16-g32", {}), force=True)
    assert not (out / "stale.txt").exists() and (out / "quantkit.json").exists()
