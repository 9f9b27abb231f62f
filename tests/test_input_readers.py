"""Inputs every reader must survive, and bad data found after work started.

- A header nested 100,000 deep is exit 2 naming the file for every command that reads headers (inspect, plan,
  convert, validate of an output, validate --source).
- Bad FP8 scales found mid-run: OUT.partial keeps only the shards converted before, each journaled with the
  size and mtime of the source files it was made from; a rerun on the fixed source writes the same bytes as a
  clean run of it, also when the "fix" changed a shard that was already converted (it is redone).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import torch
from hostile_cases import INDEX, read_raw_header, shards
from hostile_cases_more import deep_nested_header
from safetensors.torch import load_file


def _digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def _one_error_line(code: int, err: str, needle: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert needle in lines[0], lines[0]
    return lines[0]


def test_deep_nesting_is_exit_2_naming_the_file_in_every_reader(ckpt_factory, tmp_path, cli):
    src = tmp_path / "src"
    shutil.copytree(ckpt_factory("glm_moe_dsa", "fp8"), src)
    deep_nested_header(src)
    shard = shards(src)[0]
    needle = f"{shard}: corrupt safetensors header (JSON nested too deeply)"
    for args in (["inspect", str(src)], ["plan", str(src)], ["convert", str(src), str(tmp_path / "o"), "--quiet"]):
        code, _, err = cli(*args)
        _one_error_line(code, err, needle)
    out = tmp_path / "out"
    assert cli("convert", str(ckpt_factory("glm_moe_dsa", "fp8")), str(out), "--quiet")[0] == 0
    code, _, err = cli("validate", str(out), "--source", str(src))
    _one_error_line(code, err, needle)
    target = shards(out)[0]
    shutil.copyfile(shard, target)  # the output's own shard, now nested 100,000 deep
    code, stdout, err = cli("validate", str(out), "--json")
    assert code == 2 and "Traceback" not in err, err
    failed = [c for c in json.loads(stdout)["checks"] if c["status"] == "fail"]
    assert any(f"{target}: corrupt safetensors header (JSON nested too deeply)" in c["detail"] for c in failed)


def _bad_scale_in_last_shard(src: Path, value: float) -> tuple[Path, str]:
    wm = json.loads((src / INDEX).read_text())["weight_map"]
    last = shards(src)[-1]
    name = next(n for n in sorted(wm) if n.endswith("_scale_inv") and wm[n] == last.name)
    _write_in_place(last, name, load_file(last)[name].clone().fill_(value))
    return last, name


def _write_in_place(shard: Path, name: str, value: torch.Tensor) -> None:
    """New values for one tensor, header bytes unchanged: the run fingerprint (header bytes, sizes) stays the same,
    as it does when a real fix rewrites a few bad scales."""
    header, _ = read_raw_header(shard)
    (header_len,) = struct.unpack("<Q", shard.read_bytes()[:8])
    with open(shard, "r+b") as fh:
        fh.seek(8 + header_len + header[name]["data_offsets"][0])
        fh.write(value.contiguous().view(torch.uint8).numpy().tobytes())


def _journaled(partial: Path) -> list[str]:
    return sorted(p.name for p in (partial / "journal").glob("shard-*.json"))


def test_bad_scale_mid_run_then_a_fixed_source_gives_the_clean_bytes(ckpt_factory, tmp_path, cli):
    pristine = ckpt_factory("glm_moe_dsa", "fp8")
    clean = tmp_path / "clean"
    shutil.copytree(pristine, tmp_path / "ref" / "src")  # quantkit.json names the source folder: same name
    assert cli("convert", str(tmp_path / "ref" / "src"), str(clean), "--quiet")[0] == 0
    for value in (float("nan"), float("inf"), 0.0):
        src, out = tmp_path / "src", tmp_path / "out"
        shutil.rmtree(src, ignore_errors=True)
        shutil.copytree(pristine, src)
        bad, name = _bad_scale_in_last_shard(src, value)
        code, _, err = cli("convert", str(src), str(out), "--quiet")
        line = _one_error_line(code, err, f"{bad}: tensor {name} holds a zero, negative, NaN or Inf block scale")
        partial = out.with_name("out.partial")
        kept = _journaled(partial)
        assert f"{partial} keeps the {len(kept)} of 3 shards converted before it" in line and kept
        assert not out.exists()
        shutil.copyfile(pristine / bad.name, bad)  # the fix: a good copy of the broken shard
        code, _, err = cli("convert", str(src), str(out), "--quiet")
        assert code == 0, err
        assert _digest(out) == _digest(clean), f"rerun after a {value} scale differs from a clean run"
        shutil.rmtree(out)


def test_a_fix_that_touches_a_converted_shard_redoes_it(ckpt_factory, tmp_path, cli):
    """Same header bytes (so the same run fingerprint), other data: only the recorded size/mtime tell them apart."""
    pristine = ckpt_factory("glm_moe_dsa", "fp8")
    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(pristine, src)
    bad, _ = _bad_scale_in_last_shard(src, float("nan"))
    assert cli("convert", str(src), str(out), "--quiet")[0] == 2
    kept = _journaled(out.with_name("out.partial"))
    assert "shard-00000.json" in kept
    first = shards(src)[0]
    norm = next(n for n in sorted(read_raw_header(first)[0]) if n.endswith("layernorm.weight"))
    value = (load_file(first)[norm].float() * 2 + 1).to(torch.bfloat16)  # other values, same dtype and shape
    _write_in_place(first, norm, value)
    shutil.copyfile(pristine / bad.name, bad)
    code, _, err = cli("convert", str(src), str(out), "--quiet")
    assert code == 0, err
    reference = tmp_path / "reference"
    assert cli("convert", str(src), str(reference), "--quiet")[0] == 0  # a clean run of the fixed source
    assert _digest(out) == _digest(reference)
    got = load_file(next(p for p in shards(out) if norm in load_file(p)))[norm]
    assert torch.equal(got, value), "the converted shard was reused although its source changed"
