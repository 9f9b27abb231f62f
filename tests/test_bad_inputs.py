"""Bad input: one-line error naming the file (and tensor), exit 2, no OUT created — through the real CLI."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantkit", *args], capture_output=True, text=True, timeout=300)


def copy_source(ckpt_factory, tmp_path: Path, fmt: str = "fp8") -> Path:
    src = tmp_path / "src"
    shutil.copytree(ckpt_factory("glm_moe_dsa", fmt), src)
    return src


def first_shard(src: Path) -> Path:
    return sorted(src.glob("*.safetensors"))[0]


def truncate(src: Path) -> str:
    shard = first_shard(src)
    shard.write_bytes(shard.read_bytes()[:-100])
    return shard.name


def corrupt_header(src: Path) -> str:
    shard = first_shard(src)
    data = bytearray(shard.read_bytes())
    data[8:20] = b"not json!!!!"
    shard.write_bytes(bytes(data))
    return shard.name


def huge_header_length(src: Path) -> str:
    shard = first_shard(src)
    data = bytearray(shard.read_bytes())
    data[:8] = struct.pack("<Q", 10**12)
    shard.write_bytes(bytes(data))
    return shard.name


def _edit_index(src: Path, edit) -> dict:
    path = src / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    edit(index["weight_map"])
    path.write_text(json.dumps(index))
    return index


def index_missing_file(src: Path) -> str:
    _edit_index(src, lambda wm: wm.__setitem__(next(iter(wm)), "model-09999-of-09999.safetensors"))
    return "model-09999-of-09999.safetensors"


def index_missing_tensor(src: Path) -> str:
    _edit_index(src, lambda wm: wm.__setitem__("model.layers.0.self_attn.bogus.weight", next(iter(wm.values()))))
    return "model.layers.0.self_attn.bogus.weight"


def index_escapes(src: Path) -> str:
    (src.parent / "outside.safetensors").write_bytes(first_shard(src).read_bytes())
    _edit_index(src, lambda wm: wm.__setitem__(next(iter(wm)), "../outside.safetensors"))
    return "outside the checkpoint directory"


def pickle_shards(src: Path) -> str:
    for f in src.glob("*.safetensors"):
        f.rename(f.with_suffix(".bin"))
    _edit_index(src, lambda wm: wm.update({k: v.replace(".safetensors", ".bin") for k, v in wm.items()}))
    return "pickle checkpoints are refused"


def nan_weight(src: Path) -> str:
    from safetensors.torch import load_file

    shard = sorted(src.glob("*.safetensors"))[-1]
    tensors = load_file(shard)
    name = next(n for n, t in tensors.items() if "experts" in n and t.dtype == torch.bfloat16 or
                (t.is_floating_point() and t.dtype != torch.float8_e4m3fn and t.dim() == 2))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    return name


def missing_tensor(src: Path) -> str:
    from safetensors.torch import load_file

    shard = first_shard(src)
    tensors = load_file(shard)
    victim = next(n for n in tensors if n.endswith("mlp.gate.weight") or n.endswith("input_layernorm.weight"))
    del tensors[victim]
    save_file(tensors, shard, metadata={"format": "pt"})
    _edit_index(src, lambda wm: wm.pop(victim))
    return victim


def shape_mismatch(src: Path) -> str:
    config = json.loads((src / "config.json").read_text())
    config["moe_intermediate_size"] = config["moe_intermediate_size"] * 2
    (src / "config.json").write_text(json.dumps(config))
    return "config.json implies"


CASES = {
    "truncated shard": truncate,
    "corrupt header": corrupt_header,
    "absurd header length": huge_header_length,
    "index names a missing file": index_missing_file,
    "index names a missing tensor": index_missing_tensor,
    "path escaping SRC": index_escapes,
    "pickle .bin shards": pickle_shards,
    "NaN in a weight": nan_weight,
    "missing tensor": missing_tensor,
    "shape mismatch": shape_mismatch,
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_exit_2_and_no_output(ckpt_factory, tmp_path, case, cli):
    fmt = "bf16" if case == "NaN in a weight" else "fp8"
    src = copy_source(ckpt_factory, tmp_path, fmt)
    needle = CASES[case](src)
    out = tmp_path / "out"
    code, _, err = cli("convert", str(src), str(out), "--quiet")
    assert code == 2, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    assert needle in lines[0]
    assert not out.exists()


def test_group_size_not_dividing_in_features(ckpt_factory, tmp_path, cli):
    src = ckpt_factory("glm_moe_dsa", "bf16")  # hidden 64: group 128 cannot divide it
    code, _, err = cli("convert", str(src), str(tmp_path / "out"), "--group-size", "128", "--quiet")
    assert code == 2 and "not a multiple of group size 128" in err
    assert "mlp.experts." in err and ".safetensors" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_refuses_to_write_inside_source_or_overwrite(ckpt_factory, tmp_path, cli):
    src = copy_source(ckpt_factory, tmp_path)
    code, _, err = cli("convert", str(src), str(src / "out"), "--quiet")
    assert code == 2 and "inside the source directory" in err
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("precious")
    code, _, err = cli("convert", str(src), str(existing), "--quiet")
    assert code == 2 and "--force" in err
    assert (existing / "keep.txt").read_text() == "precious"


def test_usage_errors_exit_2_in_a_real_process(tmp_path):
    """One real subprocess: the console entry point's exit codes, not just the in-process runner's."""
    proc = run_cli("convert", str(tmp_path / "nope"), str(tmp_path / "out"), "--quiet")
    assert proc.returncode == 2 and "config.json" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
