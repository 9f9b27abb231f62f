"""The hostile-input corpus, part 1 (headers, layout, FP8, INT4, config): mutations of a generated checkpoint.

Each case takes a fresh copy of a generated checkpoint, breaks one thing the way a bad download, a buggy
exporter or an attacker would, and returns the text the error line must contain. The tests that run them
through the CLI are in test_hostile_inputs.py; part 2 is hostile_cases_more.py.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

INDEX = "model.safetensors.index.json"


# ---- helpers that break files ---------------------------------------------------------------------
def shards(src: Path) -> list[Path]:
    return sorted(src.glob("model-*.safetensors"))


def read_raw_header(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def write_raw(path: Path, header: dict | bytes, body: bytes) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def edit_header(path: Path, edit: Callable[[dict], object]) -> dict:
    header, body = read_raw_header(path)
    edit(header)
    write_raw(path, header, body)
    return header


def tensors_by_offset(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def edit_json(path: Path, edit: Callable[[dict], object]) -> None:
    value = json.loads(path.read_text())
    edit(value)
    path.write_text(json.dumps(value))


def rewrite_tensor(src: Path, name: str, change: Callable[[torch.Tensor], torch.Tensor]) -> Path:
    shard = src / json.loads((src / INDEX).read_text())["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = change(tensors[name]).contiguous()
    save_file(tensors, shard, metadata={"format": "pt"})
    return shard


def first_scale_inv(src: Path) -> str:
    return next(n for n in sorted(json.loads((src / INDEX).read_text())["weight_map"]) if n.endswith("_scale_inv"))


# ---- the cases ------------------------------------------------------------------------------------
def overlapping_offsets(src: Path) -> str:
    shard = shards(src)[0]
    header = edit_header(shard, lambda h: None)
    a, b = tensors_by_offset(header)[:2]

    def overlap(h: dict) -> None:
        size = h[b]["data_offsets"][1] - h[b]["data_offsets"][0]
        h[b]["data_offsets"] = [h[a]["data_offsets"][0], h[a]["data_offsets"][0] + size]

    edit_header(shard, overlap)
    return "overlaps the tensor before it"


def gapped_offsets(src: Path) -> str:
    shard = shards(src)[0]
    header, body = read_raw_header(shard)
    last = tensors_by_offset(header)[-1]
    header[last]["data_offsets"] = [o + 8 for o in header[last]["data_offsets"]]
    start = header[last]["data_offsets"][0] - 8
    write_raw(shard, header, body[:start] + b"\0" * 8 + body[start:])
    return "leaves a gap"


def trailing_garbage(src: Path) -> str:
    shard = shards(src)[0]
    shard.write_bytes(shard.read_bytes() + b"\0" * 64)
    return "64 bytes after the last tensor"


def header_length_past_eof(src: Path) -> str:
    shard = shards(src)[0]
    data = bytearray(shard.read_bytes())
    data[:8] = struct.pack("<Q", len(data))
    shard.write_bytes(bytes(data))
    return "corrupt or truncated safetensors header"


def header_length_2_63(src: Path) -> str:
    shard = shards(src)[0]
    data = bytearray(shard.read_bytes())
    data[:8] = struct.pack("<Q", 2**63)
    shard.write_bytes(bytes(data))
    return f"(length {2**63})"


def non_utf8_header(src: Path) -> str:
    shard = shards(src)[0]
    data = bytearray(shard.read_bytes())
    at = data.index(b"model.")
    data[at] = 0xFF
    shard.write_bytes(bytes(data))
    return "UnicodeDecodeError"


def negative_dim(src: Path) -> str:
    shard = shards(src)[0]
    name = tensors_by_offset(read_raw_header(shard)[0])[0]
    edit_header(shard, lambda h: h[name].__setitem__("shape", [-1, *h[name]["shape"][1:]]))
    return f"tensor {name} has unsupported dtype"


def absurd_dims(src: Path) -> str:
    shard = shards(src)[0]
    name = tensors_by_offset(read_raw_header(shard)[0])[0]
    edit_header(shard, lambda h: h[name].__setitem__("shape", [2**40, 2**40]))
    return f"tensor {name}: data offsets do not match"


def float_dim(src: Path) -> str:
    shard = shards(src)[0]
    name = tensors_by_offset(read_raw_header(shard)[0])[0]
    edit_header(shard, lambda h: h[name].__setitem__("shape", [float(d) for d in h[name]["shape"]]))
    return f"tensor {name} has unsupported dtype"


def dtype_size_mismatch(src: Path) -> str:
    shard = shards(src)[0]
    header = read_raw_header(shard)[0]
    name = next(n for n in tensors_by_offset(header) if header[n]["dtype"] == "BF16")
    edit_header(shard, lambda h: h[name].__setitem__("dtype", "F32"))
    return f"tensor {name}: data offsets do not match dtype F32"


def unknown_dtype(src: Path) -> str:
    shard = shards(src)[0]
    name = tensors_by_offset(read_raw_header(shard)[0])[0]
    edit_header(shard, lambda h: h[name].__setitem__("dtype", "Q4_K"))
    return "unsupported dtype 'Q4_K'"


def tensor_in_two_shards(src: Path) -> str:
    a, b = shards(src)[:2]
    name = next(n for n in load_file(a) if n.endswith("layernorm.weight"))
    tb = load_file(b)
    tb[name] = load_file(a)[name]
    save_file(tb, b, metadata={"format": "pt"})
    return f"tensor {name} is also stored in"


def absolute_path_in_index(src: Path) -> str:
    target = str(shards(src)[0].resolve())
    edit_json(src / INDEX, lambda i: i["weight_map"].__setitem__(next(iter(i["weight_map"])), target))
    return "points outside the checkpoint directory"


def dotdot_path_in_index(src: Path) -> str:
    rel = f"sub/../{shards(src)[0].name}"
    edit_json(src / INDEX, lambda i: i["weight_map"].update({k: rel for k, v in i["weight_map"].items()
                                                             if v == shards(src)[0].name}))
    return "points outside the checkpoint directory"


def symlink_outside_src(src: Path) -> str:
    shard = shards(src)[0]
    outside = src.parent / "elsewhere.safetensors"
    shutil.move(shard, outside)
    shard.symlink_to(outside)
    return "outside the checkpoint directory"


def empty_shard(src: Path) -> str:
    shards(src)[0].write_bytes(b"")
    return "truncated safetensors file (0 bytes"


def fp8_scale_wrong_shape(src: Path) -> str:
    name = first_scale_inv(src)
    rewrite_tensor(src, name, lambda t: torch.ones(t.shape[0] + 1, t.shape[1]))
    return f"tensor {name} has shape"


def _bad_scale(value: float) -> Callable[[Path], str]:
    def case(src: Path) -> str:
        name = first_scale_inv(src)
        rewrite_tensor(src, name, lambda t: t.clone().fill_(value))
        return f"tensor {name} holds a zero, negative, NaN or Inf block scale"

    return case


def int4_packed_shape_mismatch(src: Path) -> str:
    name = next(n for n in json.loads((src / INDEX).read_text())["weight_map"] if n.endswith(".weight_shape"))
    rewrite_tensor(src, name, lambda t: t * 2)
    return "does not match weight_packed"


def int4_missing_scale(src: Path) -> str:
    index = json.loads((src / INDEX).read_text())["weight_map"]
    name = next(n for n in index if n.endswith(".weight_scale"))
    tensors = load_file(src / index[name])
    del tensors[name]
    save_file(tensors, src / index[name], metadata={"format": "pt"})
    edit_json(src / INDEX, lambda i: i["weight_map"].pop(name))
    return f"tensor {name.removesuffix('_scale')}_packed has no matching weight_scale"


def int4_scale_contradicts_group(src: Path) -> str:
    def to_64(c: dict) -> None:
        c["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 64

    edit_json(src / "config.json", to_64)
    return "with group size 64"


def config_not_json(src: Path) -> str:
    (src / "config.json").write_text("{ not json")
    return "config.json: not valid JSON"


def config_string_for_number(src: Path) -> str:
    edit_json(src / "config.json", lambda c: c.__setitem__("num_hidden_layers", "3"))
    return "num_hidden_layers must be a whole number"


def config_without_layers(src: Path) -> str:
    edit_json(src / "config.json", lambda c: c.pop("num_hidden_layers"))
    return "num_hidden_layers must be a positive whole number, got None"


def config_billion_layers(src: Path) -> str:
    edit_json(src / "config.json", lambda c: c.__setitem__("num_hidden_layers", 10**9))
    return "imply at least 2000000"


def config_billion_experts(src: Path) -> str:
    edit_json(src / "config.json", lambda c: c.__setitem__("n_routed_experts", 10**9))
    return "n_routed_experts 1000000000 imply"


def config_huge_file(src: Path) -> str:
    (src / "config.json").write_text(json.dumps({"model_type": "glm_moe_dsa", "pad": "x" * (20 << 20)}))
    return "refusing to parse it"


def unknown_model_type(src: Path) -> str:
    edit_json(src / "config.json", lambda c: c.__setitem__("model_type", "llama4_moe"))
    return "unsupported model_type 'llama4_moe'"


def non_string_metadata(src: Path) -> str:
    edit_header(shards(src)[0], lambda h: h.__setitem__("__metadata__", {"format": ["pt"]}))
    return "__metadata__ must map strings to strings"


class _Boom:
    """Unpickling this would create MARKER: the test proves it never happens."""

    def __reduce__(self):
        return (os.system, (f"touch {os.environ.get('QK_PICKLE_MARKER', '/tmp/qk-pickle-marker')}",))


def _write_pickle(path: Path) -> None:
    import pickle

    path.write_bytes(pickle.dumps(_Boom()))


def pickle_only_checkpoint(src: Path) -> str:
    for f in shards(src):
        f.unlink()
    (src / INDEX).unlink()
    _write_pickle(src / "pytorch_model.bin")
    return "pickle checkpoints are refused"


def pickle_in_index(src: Path) -> str:
    _write_pickle(src / "pytorch_model-00001.bin")
    edit_json(src / INDEX, lambda i: i["weight_map"].__setitem__(next(iter(i["weight_map"])),
                                                                 "pytorch_model-00001.bin"))
    return "pickle checkpoints are refused"


def fp8_without_quant_method(src: Path) -> str:
    edit_json(src / "config.json", lambda c: c.pop("quantization_config"))
    return "is FP8 but quantization_config.quant_method is None"


def claims_fp8_but_bf16(src: Path) -> str:
    edit_json(src / "config.json", lambda c: c.__setitem__(
        "quantization_config", {"quant_method": "fp8", "weight_block_size": [128, 128]}))
    return "no tensor is stored as FP8"


def bad_block_size(src: Path) -> str:
    edit_json(src / "config.json", lambda c: c["quantization_config"].__setitem__("weight_block_size", [0, "x"]))
    return "weight_block_size must be two positive integers"


def malformed_quantization_config(src: Path) -> str:
    edit_json(src / "config.json", lambda c: c.__setitem__("quantization_config", ["fp8"]))
    return "quantization_config is malformed"


# case name -> (source format, mutation)
CASES: dict[str, tuple[str, Callable[[Path], str]]] = {
    "overlapping data offsets": ("fp8", overlapping_offsets),
    "gapped data offsets": ("fp8", gapped_offsets),
    "bytes after the last tensor": ("fp8", trailing_garbage),
    "header length past EOF": ("fp8", header_length_past_eof),
    "header length 2^63": ("fp8", header_length_2_63),
    "non-UTF-8 header": ("fp8", non_utf8_header),
    "negative dim": ("fp8", negative_dim),
    "absurd dims": ("fp8", absurd_dims),
    "float dims": ("fp8", float_dim),
    "dtype/size mismatch": ("fp8", dtype_size_mismatch),
    "unknown dtype": ("fp8", unknown_dtype),
    "tensor in two shards": ("fp8", tensor_in_two_shards),
    "absolute path in index": ("fp8", absolute_path_in_index),
    "'..' path in index": ("fp8", dotdot_path_in_index),
    "shard symlinked outside SRC": ("fp8", symlink_outside_src),
    "empty shard": ("fp8", empty_shard),
    "FP8 scale_inv wrong shape": ("fp8", fp8_scale_wrong_shape),
    "FP8 scale_inv NaN": ("fp8", _bad_scale(float("nan"))),
    "FP8 scale_inv Inf": ("fp8", _bad_scale(float("inf"))),
    "FP8 scale_inv zero": ("fp8", _bad_scale(0.0)),
    "INT4 packed shape mismatch": ("int4", int4_packed_shape_mismatch),
    "INT4 missing scale": ("int4", int4_missing_scale),
    "INT4 scales contradict the config's group size": ("int4", int4_scale_contradicts_group),
    "config.json not JSON": ("fp8", config_not_json),
    "config.json string for a number": ("fp8", config_string_for_number),
    "config.json without num_hidden_layers": ("fp8", config_without_layers),
    "config.json 10^9 layers": ("fp8", config_billion_layers),
    "config.json 10^9 experts": ("fp8", config_billion_experts),
    "config.json of 20 MB": ("fp8", config_huge_file),
    "unknown model_type": ("fp8", unknown_model_type),
    "non-string __metadata__": ("fp8", non_string_metadata),
    "pickle-only checkpoint": ("fp8", pickle_only_checkpoint),
    "pickle file in the index": ("fp8", pickle_in_index),
    "FP8 tensors, no quant_method": ("fp8", fp8_without_quant_method),
    "quantization_config says fp8, tensors are BF16": ("bf16", claims_fp8_but_bf16),
    "weight_block_size malformed": ("fp8", bad_block_size),
    "quantization_config not an object": ("fp8", malformed_quantization_config),
}
