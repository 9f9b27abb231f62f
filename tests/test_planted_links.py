"""The path-safety rule (`quantkit.core.paths`): a symbolic link planted at any path quantkit creates, writes, renames
onto or deletes — OUT, OUT.partial, OUT.old, the lock, the work folders, part files, journal entries, carried-over
files, the calibration spill — is refused by name (exit 2, one line), and the link's target is left untouched."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from quantkit.core.errors import QuantkitError


def _fingerprint(path: Path) -> dict[str, str]:
    """Every file under a directory (or the file itself) with its sha256: the target must not change."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.fixture(scope="module")
def identity(ckpt_factory, tmp_path_factory) -> dict:
    """The run identity of a default conversion of the fp8 source (what OUT.partial/journal/run.json holds)."""
    from quantkit.convert.pipeline import convert
    from quantkit.quant.recipe import load_recipe

    src = ckpt_factory("glm_moe_dsa", "fp8")
    out = tmp_path_factory.mktemp("ref") / "out"
    convert(src, out, load_recipe(None, json.loads((src / "config.json").read_text()), {}))
    manifest = json.loads((out / "quantkit.json").read_text())
    return {"fingerprint": manifest["source"]["fingerprint"], "recipe": manifest["recipe"],
            "versions": manifest["tool_versions"]}


def _victim(tmp_path: Path, kind: str) -> Path:
    victim = tmp_path / "victim"
    if kind == "dir":
        victim.mkdir()
        (victim / "precious.txt").write_text("do not touch")
    else:
        victim.write_text("do not touch")
    return victim


# where the link goes (relative to OUT's parent; OUT is "out"), what it points to, whether the partial is a
# resumable one of this very run (so the run reaches the files inside it)
LINKS = {
    "OUT": ("out", "dir", False),
    "OUT.partial": ("out.partial", "dir", False),
    "OUT.partial/.quantkit.lock": ("out.partial/.quantkit.lock", "file", False),
    "OUT.partial/parts": ("out.partial/parts", "dir", False),
    "OUT.partial/journal": ("out.partial/journal", "dir", False),
    "OUT.partial/calibration": ("out.partial/calibration", "dir", False),
    "OUT.partial/dist": ("out.partial/dist", "dir", False),
    "part file": ("out.partial/parts/part-00000-000.safetensors", "file", True),
    "part file .tmp": ("out.partial/parts/part-00001-000.safetensors.tmp", "file", True),
    "journal run.json": ("out.partial/journal/run.json", "file", True),
    "journal run.json.tmp": ("out.partial/journal/run.json.tmp", "file", True),
    "journal entry .tmp": ("out.partial/journal/shard-00000.json.tmp", "file", True),
    "carried-over file": ("out.partial/chat_template.jinja", "file", True),
    "digest sidecar .tmp": ("out.partial/parts/part-00000-000.safetensors.sha256.tmp", "file", True),
}


@pytest.mark.parametrize("case", list(LINKS))
def test_a_planted_link_is_refused_and_its_target_untouched(case, ckpt_factory, identity, tmp_path, cli):
    where, kind, resumable = LINKS[case]
    src = ckpt_factory("glm_moe_dsa", "fp8")
    out = tmp_path / "out"
    link = tmp_path / where
    link.parent.mkdir(parents=True, exist_ok=True)
    if resumable:
        (tmp_path / "out.partial" / "journal").mkdir(parents=True, exist_ok=True)
        (tmp_path / "out.partial" / "parts").mkdir(exist_ok=True)
        if where != "out.partial/journal/run.json":
            (tmp_path / "out.partial" / "journal" / "run.json").write_text(json.dumps(identity))
    victim = _victim(tmp_path, kind)
    before = _fingerprint(victim)
    link.symlink_to(victim)
    code, _, err = cli("convert", str(src), str(out), "--quiet")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"error: {link}: is a symbolic link"), lines[0]
    assert _fingerprint(victim) == before and sorted(victim.parent.glob("victim*")) == [victim]
    assert link.is_symlink(), "the planted link itself is left for the user to inspect"
    if case != "OUT":
        assert not out.exists()


def test_a_link_at_out_old_is_refused_with_force(ckpt_factory, tmp_path, cli):
    src = ckpt_factory("glm_moe_dsa", "fp8")
    out = tmp_path / "out"
    assert cli("convert", str(src), str(out), "--quiet")[0] == 0
    victim = _victim(tmp_path, "dir")
    before, published = _fingerprint(victim), _fingerprint(out)
    (tmp_path / "out.old").symlink_to(victim)
    code, _, err = cli("convert", str(src), str(out), "--quiet", "--force")
    assert code == 2 and f"{tmp_path / 'out.old'}: is a symbolic link" in err, err
    assert _fingerprint(victim) == before and _fingerprint(out) == published


def test_a_link_in_the_calibration_spill_is_refused(tmp_path):
    """The spill's layer files are written by safetensors' own writer, which follows links: checked by name."""
    import torch

    from quantkit.calibrate.acts import ActsWriter
    from quantkit.calibrate.layer_store import _publish

    victim = _victim(tmp_path, "file")
    work = tmp_path / "calibration"
    work.mkdir()
    (work / "layer_0000.safetensors.tmp").symlink_to(victim)
    with pytest.raises(QuantkitError, match="layer_0000.safetensors.tmp: is a symbolic link"):
        _publish(work / "layer_0000.safetensors", {"x": torch.zeros(2)}, {})
    (work / "acts_0001.tmp").symlink_to(tmp_path)
    with pytest.raises(QuantkitError, match="acts_0001.tmp: is a symbolic link"):
        ActsWriter(work / "acts_0001")
    assert victim.read_text() == "do not touch" and (work / "acts_0001.tmp").is_symlink()


def test_durable_writer_and_lock_never_follow_links(tmp_path):
    from quantkit.core.durable import RunLock, write_json_atomic

    victim = _victim(tmp_path, "file")
    (tmp_path / "a.json").symlink_to(victim)
    with pytest.raises(QuantkitError, match="a.json: is a symbolic link"):
        write_json_atomic(tmp_path / "a.json", {"x": 1})
    work = tmp_path / "work"
    work.mkdir()
    (work / RunLock.NAME).symlink_to(victim)
    with pytest.raises(QuantkitError, match="quantkit.lock: is a symbolic link"):
        RunLock(work).acquire()
    assert victim.read_text() == "do not touch"


def test_kv_scales_out_that_is_a_link_is_refused_before_any_work(ckpt_factory, tmp_path, cli):
    victim = _victim(tmp_path, "dir")
    before = _fingerprint(victim)
    (tmp_path / "kvout").symlink_to(victim)
    code, _, err = cli("kv-scales", str(ckpt_factory("glm_moe_dsa", "fp8")), "--out", str(tmp_path / "kvout"))
    assert code == 2 and f"{tmp_path / 'kvout'}: is a symbolic link" in err and "Traceback" not in err, err
    assert _fingerprint(victim) == before and sorted(p.name for p in tmp_path.iterdir() if "kv" in p.name) == ["kvout"]


def test_kv_scales_shard_is_never_written_through_a_link(tmp_path):
    from quantkit.calibrate.kv import KV_SHARD, _atomic

    victim = _victim(tmp_path, "file")
    (tmp_path / (KV_SHARD + ".tmp")).symlink_to(victim)
    with pytest.raises(QuantkitError, match="is a symbolic link"):
        _atomic(tmp_path / KV_SHARD, lambda p: p.write_text("scales"))
    assert victim.read_text() == "do not touch"
