"""The hostile-input corpus: every case is exit 2, one line naming the file (and tensor), no traceback,
nothing published, nothing left that a rerun could mistake for progress (or the line says what was kept and
why), bounded time and memory — through the real CLI entry point. The cases are in hostile_cases.py and
hostile_cases_more.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hostile_cases import CASES, _write_pickle, edit_header, shards
from hostile_cases_more import MORE_CASES

REPO = Path(__file__).resolve().parent.parent
ALL_CASES = {**CASES, **MORE_CASES}


def copy_source(ckpt_factory, tmp_path: Path, fmt: str) -> Path:
    src = tmp_path / "src"
    shutil.copytree(ckpt_factory("glm_moe_dsa" if fmt != "int4" else "deepseek_v3", fmt), src, symlinks=True)
    return src


def assert_contract(code: int, err: str, needle: str, src: Path, out: Path, seconds: float) -> None:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert needle in lines[0], lines[0]
    assert str(src) in lines[0] or str(out) in lines[0], f"the line names no file: {lines[0]}"
    assert not out.exists(), "something was published"
    partial = out.with_name(out.name + ".partial")
    assert not partial.exists() or f"{partial} keeps the" in lines[0], "OUT.partial left without a word about it"
    assert seconds < 60


@pytest.mark.parametrize("case", list(ALL_CASES))
def test_hostile_input(ckpt_factory, tmp_path, case, cli, monkeypatch):
    fmt, mutate = ALL_CASES[case]
    src = copy_source(ckpt_factory, tmp_path, fmt)
    marker = tmp_path / "unpickled"
    monkeypatch.setenv("QK_PICKLE_MARKER", str(marker))
    needle = mutate(src)
    out = tmp_path / "out"
    started = time.perf_counter()
    code, _, err = cli("convert", str(src), str(out), "--quiet")
    assert_contract(code, err, needle, src, out, time.perf_counter() - started)
    assert not marker.exists(), "a pickle was loaded"


_RSS_PROBE = ("import resource, subprocess, sys\n"
             "p = subprocess.run([sys.executable, '-m', 'quantkit', 'convert', sys.argv[1], sys.argv[2], '--quiet'],"
             " capture_output=True, text=True)\n"
             "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
             "sys.stderr.write(p.stderr)\n")


def convert_in_a_fresh_process(src: Path, out: Path) -> tuple[int, int, str]:
    """(exit code, peak RSS in kB, stderr) of `quantkit convert SRC OUT` in a child process."""
    proc = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(src), str(out)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    code, rss_kb = (int(x) for x in proc.stdout.split())
    return code, rss_kb, proc.stderr


@pytest.mark.parametrize("case", ["config.json 10^9 layers", "config.json 10^9 experts", "header nested 100,000 deep"])
def test_absurd_sizes_fail_in_bounded_memory(ckpt_factory, tmp_path, case):
    """In a fresh process: the peak RSS stays near the interpreter's own, whatever the file claims."""
    fmt, mutate = ALL_CASES[case]
    src = copy_source(ckpt_factory, tmp_path, fmt)
    needle = mutate(src)
    code, rss_kb, err = convert_in_a_fresh_process(src, tmp_path / "out")
    assert code == 2 and needle in err, err
    assert rss_kb < 1_500_000, f"peak RSS {rss_kb} kB"


def _metadata_of_50_mb(src: Path) -> None:
    edit_header(shards(src)[0], lambda h: h.__setitem__("__metadata__", {"format": "pt", "junk": "x" * (50 << 20)}))


def test_a_legal_50_mb_metadata_converts(ckpt_factory, tmp_path, cli):
    """Was: refused (exit 2). 50 MB of `__metadata__` is under safetensors' 100 MB header cap: a valid file."""
    src = copy_source(ckpt_factory, tmp_path, "fp8")
    _metadata_of_50_mb(src)
    code, _, err = cli("convert", str(src), str(tmp_path / "out"), "--quiet")
    assert code == 0, err
    assert (tmp_path / "out" / "quantkit.json").exists()


@pytest.mark.slow
def test_a_legal_50_mb_metadata_converts_in_bounded_memory(ckpt_factory, tmp_path):
    """The same in a fresh process whose peak RSS is measured."""
    src = copy_source(ckpt_factory, tmp_path, "fp8")
    _metadata_of_50_mb(src)
    code, rss_kb, err = convert_in_a_fresh_process(src, tmp_path / "out")
    assert code == 0, err
    assert (tmp_path / "out" / "quantkit.json").exists()
    assert rss_kb < 1_500_000, f"peak RSS {rss_kb} kB"


# ---- symlinks: the Hugging Face cache layout is allowed, escaping it is not -------------------------
def hf_cache_layout(src: Path, cache: Path) -> Path:
    """models--org--name/snapshots/<rev>/<file> -> ../../blobs/<sha256>, as huggingface_hub stores downloads."""
    repo = cache / "models--org--tiny"
    snapshot = repo / "snapshots" / ("0" * 40)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, repo / "blobs" / digest)
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / digest)
    return snapshot


def test_hugging_face_cache_snapshot_converts(ckpt_factory, tmp_path, cli):
    snapshot = hf_cache_layout(ckpt_factory("glm_moe_dsa", "fp8"), tmp_path / "hub")
    code, _, err = cli("convert", str(snapshot), str(tmp_path / "out"), "--quiet")
    assert code == 0, err
    manifest = json.loads((tmp_path / "out" / "quantkit.json").read_text())
    assert "README.md" in manifest["output"]["files_copied"]  # carried over through the blob symlink


def test_symlink_escaping_the_cache_repo_is_refused(ckpt_factory, tmp_path, cli):
    snapshot = hf_cache_layout(ckpt_factory("glm_moe_dsa", "fp8"), tmp_path / "hub")
    shard = sorted(snapshot.glob("model-*.safetensors"))[0]
    stolen = tmp_path / "elsewhere.safetensors"
    shutil.copyfile(shard, stolen)
    shard.unlink()
    shard.symlink_to(stolen)
    code, _, err = cli("convert", str(snapshot), str(tmp_path / "out"), "--quiet")
    assert code == 2 and f"is a symlink to {stolen}" in err and not (tmp_path / "out").exists()


def test_carried_file_symlinked_outside_is_not_copied(ckpt_factory, tmp_path, cli):
    src = copy_source(ckpt_factory, tmp_path, "fp8")
    secret = tmp_path / "secret.txt"
    secret.write_text("token=hf_not_for_you")
    (src / "notes.txt").symlink_to(secret)
    code, _, err = cli("convert", str(src), str(tmp_path / "out"), "--quiet")
    assert code == 0, err
    assert not (tmp_path / "out" / "notes.txt").exists()
    skipped = json.loads((tmp_path / "out" / "quantkit.json").read_text())["output"]["files_skipped"]
    assert {"file": "notes.txt", "reason": "symlink to a file outside the checkpoint: not copied"} in skipped


def test_pickle_next_to_safetensors_is_never_loaded_or_copied(ckpt_factory, tmp_path, cli, monkeypatch):
    src = copy_source(ckpt_factory, tmp_path, "fp8")
    marker = tmp_path / "unpickled"
    monkeypatch.setenv("QK_PICKLE_MARKER", str(marker))
    _write_pickle(src / "training_args.bin")
    code, _, err = cli("convert", str(src), str(tmp_path / "out"), "--quiet")
    assert code == 0, err
    assert not marker.exists() and not (tmp_path / "out" / "training_args.bin").exists()


# ---- OUT itself -----------------------------------------------------------------------------------
def test_out_is_an_existing_file(ckpt_factory, tmp_path, cli):
    src = ckpt_factory("glm_moe_dsa", "fp8")
    out = tmp_path / "out"
    out.write_text("precious")
    for extra in ([], ["--force"]):
        code, _, err = cli("convert", str(src), str(out), "--quiet", *extra)
        assert code == 2 and "exists and is not a directory" in err and str(out) in err
    assert out.read_text() == "precious"


def test_out_inside_src_through_a_symlink(ckpt_factory, tmp_path, cli):
    src = copy_source(ckpt_factory, tmp_path, "fp8")
    link = tmp_path / "link"
    link.symlink_to(src)
    code, _, err = cli("convert", str(src), str(link / "out"), "--quiet")
    assert code == 2 and "inside the source directory" in err
    assert not (src / "out").exists() and not (src / "out.partial").exists()


def test_corpus_size_is_documented():
    doc = (REPO / "docs" / "reliability.md").read_text()
    assert f"{len(ALL_CASES)} mutations" in doc
