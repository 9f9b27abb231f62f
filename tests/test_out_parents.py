"""A fresh OUT path: `convert`, `kv-scales --out` and `pull` create its missing parent directories (as
`save_pretrained` and `hf download --local-dir` do), each created component under the path rule (never through
a link); an ancestor that is a file is refused in one line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from quantkit.convert.pipeline import convert
from quantkit.core.errors import QuantkitError
from quantkit.core.paths import make_parents
from quantkit.quant.recipe import load_recipe


def test_convert_creates_missing_parents(ckpt_factory, tmp_path, cli):
    src = ckpt_factory("deepseek_v3", "bf16")
    out = tmp_path / "runs" / "2026" / "dsv3" / "out"
    convert(src, out, load_recipe("deepseek-v3-w4a16-g32", {}))
    assert (out / "quantkit.json").is_file() and not (out.parent / "out.partial").exists()
    code, _, err = cli("convert", str(src), str(tmp_path / "cli" / "nested" / "out"), "--quiet")
    assert code == 0, err
    assert (tmp_path / "cli" / "nested" / "out" / "config.json").is_file()


def test_an_ancestor_that_is_a_file_is_refused_before_anything_is_written(ckpt_factory, tmp_path, cli):
    (tmp_path / "afile").write_text("x")
    code, _, err = cli("convert", str(ckpt_factory("deepseek_v3", "bf16")), str(tmp_path / "afile" / "sub" / "out"))
    assert code == 2 and f"{tmp_path / 'afile'}: not a directory" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_each_created_component_is_checked_for_a_planted_link(tmp_path, monkeypatch):
    """A link planted at a component between the existence check and its mkdir is refused, its target untouched
    (mkdir(exist_ok) would accept a link to a directory)."""
    victim = tmp_path / "victim"
    victim.mkdir()
    real_mkdir = Path.mkdir

    def planting(self: Path, *args, **kwargs) -> None:
        if self == tmp_path / "a" / "b":
            os.symlink(victim, self)
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", planting)
    with pytest.raises(QuantkitError, match=f"{tmp_path / 'a' / 'b'}: is a symbolic link"):
        make_parents(tmp_path / "a" / "b" / "c" / "out")
    assert list(victim.iterdir()) == [] and (tmp_path / "a").is_dir()


def test_existing_ancestors_are_the_users_and_only_missing_ones_are_created(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "mine").symlink_to(tmp_path / "real")  # the user's own link above OUT: followed, as before
    created = make_parents(tmp_path / "mine" / "x" / "y" / "out")
    assert created == [tmp_path / "mine" / "x", tmp_path / "mine" / "x" / "y"]
    assert (tmp_path / "real" / "x" / "y").is_dir() and make_parents(tmp_path / "mine" / "x" / "y" / "out") == []


def test_kv_scales_out_creates_missing_parents(tmp_path, cli):
    import shutil

    from quantkit.calibrate.tiny import build_tokenizer
    from quantkit.checkpoint.synth import make_checkpoint

    src = make_checkpoint(tmp_path / "src", "deepseek_v3", "int4", config_overrides={"vocab_size": 512})
    build_tokenizer(tmp_path / "tok")
    for f in (tmp_path / "tok").iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy2(f, src / f.name)
    out = tmp_path / "kv" / "nested" / "out"
    code, _, err = cli("kv-scales", str(src), "--out", str(out), "--samples", "2", "--seq-len", "16")
    assert code == 0, err
    assert (out / "config.json").is_file() and (out / "kv_cache_report.json").is_file()
