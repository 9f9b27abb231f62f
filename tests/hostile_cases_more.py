"""The hostile-input corpus, part 2: deep nesting, more header, index, config and tensor-data breakage.

Same shape as hostile_cases.py: each case mutates a fresh copy of a generated checkpoint and returns the text
the one error line must contain. Cases whose bad data is found only while converting (NaN / Inf / zero values
in a later shard) also exercise "nothing left that looks like progress": the line says what OUT.partial keeps.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import torch
from hostile_cases import (
    INDEX,
    edit_header,
    edit_json,
    read_raw_header,
    rewrite_tensor,
    shards,
    tensors_by_offset,
    write_raw,
)
from safetensors.torch import load_file, save_file

DEEP = 100_000


def deep_json(depth: int = DEEP) -> str:
    return "[" * depth + "]" * depth


def _weight_map(src: Path) -> dict[str, str]:
    return json.loads((src / INDEX).read_text())["weight_map"]


def _last_shard_tensor(src: Path, pick: Callable[[str, dict], bool]) -> tuple[Path, str]:
    """A tensor of the LAST shard (converted after the others: found mid-run) satisfying `pick(name, entry)`."""
    shard = shards(src)[-1]
    header = read_raw_header(shard)[0]
    name = next(n for n in tensors_by_offset(header) if pick(n, header[n]))
    return shard, name


# ---- headers --------------------------------------------------------------------------------------
def deep_nested_header(src: Path) -> str:
    shard = shards(src)[0]
    header, body = read_raw_header(shard)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw = raw[:-1] + b',"deep":' + deep_json().encode() + b"}"
    write_raw(shard, raw, body)
    return "JSON nested too deeply"


def header_is_an_array(src: Path) -> str:
    shard = shards(src)[0]
    write_raw(shard, b"[]", read_raw_header(shard)[1])
    return "not a JSON object"


def header_is_null(src: Path) -> str:
    shard = shards(src)[0]
    write_raw(shard, b"null", read_raw_header(shard)[1])
    return "not a JSON object"


def header_entry_not_an_object(src: Path) -> str:
    shard = shards(src)[0]
    name = tensors_by_offset(read_raw_header(shard)[0])[0]
    edit_header(shard, lambda h: h.__setitem__(name, 5))
    return f"corrupt header entry for tensor {name}"


def three_data_offsets(src: Path) -> str:
    shard = shards(src)[0]
    name = tensors_by_offset(read_raw_header(shard)[0])[0]
    edit_header(shard, lambda h: h[name].__setitem__("data_offsets", [*h[name]["data_offsets"], 0]))
    return f"corrupt header entry for tensor {name}"


def reversed_data_offsets(src: Path) -> str:
    shard = shards(src)[0]
    name = tensors_by_offset(read_raw_header(shard)[0])[1]
    edit_header(shard, lambda h: h[name].__setitem__("data_offsets", h[name]["data_offsets"][::-1]))
    return f"tensor {name}: data offsets do not match"


def float_data_offsets(src: Path) -> str:
    shard = shards(src)[0]
    name = tensors_by_offset(read_raw_header(shard)[0])[0]
    edit_header(shard, lambda h: h[name].__setitem__("data_offsets", [float(o) for o in h[name]["data_offsets"]]))
    return f"tensor {name}: data offsets do not match"


def lowercase_dtype(src: Path) -> str:
    shard = shards(src)[0]
    name = tensors_by_offset(read_raw_header(shard)[0])[0]
    edit_header(shard, lambda h: h[name].__setitem__("dtype", h[name]["dtype"].lower()))
    return f"tensor {name} has unsupported dtype"


def e8m0_dtype(src: Path) -> str:
    shard = shards(src)[0]
    header = read_raw_header(shard)[0]
    name = next(n for n in tensors_by_offset(header) if header[n]["dtype"] in ("F8_E4M3", "U8", "I8"))
    edit_header(shard, lambda h: h[name].__setitem__("dtype", "F8_E8M0"))
    return f"tensor {name} has unsupported dtype 'F8_E8M0'"


def shape_is_a_string(src: Path) -> str:
    shard = shards(src)[0]
    name = tensors_by_offset(read_raw_header(shard)[0])[0]
    edit_header(shard, lambda h: h[name].__setitem__("shape", "64"))
    return f"tensor {name} has unsupported dtype"


def header_length_short_of_json(src: Path) -> str:
    shard = shards(src)[0]
    data = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    data[:8] = struct.pack("<Q", n - 16)
    shard.write_bytes(bytes(data))
    return "corrupt safetensors header (JSONDecodeError)"


def header_with_bom(src: Path) -> str:
    shard = shards(src)[0]
    header, body = read_raw_header(shard)
    write_raw(shard, b"\xef\xbb\xbf" + json.dumps(header, separators=(",", ":")).encode(), body)
    return "corrupt safetensors header"


def metadata_is_a_list(src: Path) -> str:
    edit_header(shards(src)[0], lambda h: h.__setitem__("__metadata__", ["format", "pt"]))
    return "__metadata__ must map strings to strings"


def truncated_data_section(src: Path) -> str:
    shard = shards(src)[-1]
    shard.write_bytes(shard.read_bytes()[:-64])
    return "truncated: tensor"


# ---- index ----------------------------------------------------------------------------------------
def index_deep_nested(src: Path) -> str:
    (src / INDEX).write_text('{"weight_map": ' + deep_json() + "}")
    return "not valid JSON (nested too deeply)"


def index_weight_map_a_list(src: Path) -> str:
    edit_json(src / INDEX, lambda i: i.__setitem__("weight_map", list(i["weight_map"])))
    return "no weight_map"


def index_file_name_a_number(src: Path) -> str:
    edit_json(src / INDEX, lambda i: i["weight_map"].__setitem__(next(iter(i["weight_map"])), 7))
    return "weight_map values must be file names"


def index_names_the_wrong_shard(src: Path) -> str:
    wm = _weight_map(src)
    name = next(n for n, f in wm.items() if f == shards(src)[0].name)
    other = shards(src)[1].name
    edit_json(src / INDEX, lambda i: i["weight_map"].__setitem__(name, other))
    return f"names tensor {name} in {other}, which does not contain it"


def index_omits_a_tensor(src: Path) -> str:
    name = sorted(_weight_map(src))[0]
    edit_json(src / INDEX, lambda i: i["weight_map"].pop(name))
    return f"holds tensor {name}, which the index does not list"


# ---- config.json ----------------------------------------------------------------------------------
def config_deep_nested(src: Path) -> str:
    (src / "config.json").write_text('{"model_type": "glm_moe_dsa", "x": ' + deep_json() + "}")
    return "config.json: not valid JSON (nested too deeply)"


def config_is_an_array(src: Path) -> str:
    (src / "config.json").write_text("[1, 2]")
    return "config.json: expected a JSON object"


def config_negative_layers(src: Path) -> str:
    edit_json(src / "config.json", lambda c: c.__setitem__("num_hidden_layers", -3))
    return "num_hidden_layers must be a whole number"


def config_float_hidden_size(src: Path) -> str:
    edit_json(src / "config.json", lambda c: c.__setitem__("hidden_size", float(c["hidden_size"])))
    return "hidden_size must be a whole number"


def config_bool_layers(src: Path) -> str:
    edit_json(src / "config.json", lambda c: c.__setitem__("num_hidden_layers", True))
    return "num_hidden_layers must be a whole number"


def int4_group_size_zero(src: Path) -> str:
    def zero(c: dict) -> None:
        c["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 0

    edit_json(src / "config.json", zero)
    return "group_size must be a positive integer, got 0"


# ---- tensors: missing, misplaced, wrong shape -----------------------------------------------------
def missing_layernorm(src: Path) -> str:
    wm = _weight_map(src)
    name = next(n for n in sorted(wm) if n.endswith("input_layernorm.weight"))
    tensors = load_file(src / wm[name])
    del tensors[name]
    save_file(tensors, src / wm[name], metadata={"format": "pt"})
    edit_json(src / INDEX, lambda i: i["weight_map"].pop(name))
    return f"missing tensor {name} (config.json implies it)"


def layernorm_wrong_shape(src: Path) -> str:
    name = next(n for n in sorted(_weight_map(src)) if n.endswith("post_attention_layernorm.weight"))
    rewrite_tensor(src, name, lambda t: torch.ones(t.shape[0] + 2, dtype=t.dtype))
    return f"tensor {name} has shape"


def fp8_weight_without_scale(src: Path) -> str:
    wm = _weight_map(src)
    scale = next(n for n in sorted(wm) if n.endswith("_scale_inv"))
    tensors = load_file(src / wm[scale])
    del tensors[scale]
    save_file(tensors, src / wm[scale], metadata={"format": "pt"})
    edit_json(src / INDEX, lambda i: i["weight_map"].pop(scale))
    return f"FP8 tensor {scale.removesuffix('_scale_inv')} has no {scale}"


def orphan_scale_inv(src: Path) -> str:
    shard = shards(src)[0]
    tensors = load_file(shard)
    tensors["model.layers.0.self_attn.ghost.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, shard, metadata={"format": "pt"})
    edit_json(src / INDEX, lambda i: i["weight_map"].__setitem__("model.layers.0.self_attn.ghost.weight_scale_inv",
                                                                 shard.name))
    return "model.layers.0.self_attn.ghost.weight_scale_inv has no FP8 weight it belongs to"


def int4_weight_shape_int32(src: Path) -> str:
    name = next(n for n in sorted(_weight_map(src)) if n.endswith(".weight_shape"))
    rewrite_tensor(src, name, lambda t: t.to(torch.int32))
    return f"{name} must be int64 [2]"


# ---- tensor data found bad mid-run (the last shard is converted after the others) -------------------
def _fill(value: float, pick: Callable[[str, dict], bool]) -> Callable[[Path], str]:
    def case(src: Path) -> str:
        shard, name = _last_shard_tensor(src, pick)
        tensors = load_file(shard)
        t = tensors[name].clone()
        t.view(-1)[0] = value
        tensors[name] = t
        save_file(tensors, shard, metadata={"format": "pt"})
        return f"tensor {name} "

    return case


def _is_bf16_norm(name: str, entry: dict) -> bool:
    return entry["dtype"] == "BF16" and name.endswith("layernorm.weight")


def _is_bf16_matrix(name: str, entry: dict) -> bool:
    return entry["dtype"] == "BF16" and len(entry["shape"]) == 2 and "proj" in name


def _is_scale_inv(name: str, entry: dict) -> bool:
    return name.endswith("_scale_inv")


def fp8_nan_byte(src: Path) -> str:
    shard, name = _last_shard_tensor(src, lambda n, e: e["dtype"] == "F8_E4M3" and ".experts." in n)
    tensors = load_file(shard)
    raw = tensors[name].view(torch.uint8).clone()
    raw[0, 0] = 0x7F  # NaN in float8_e4m3fn
    tensors[name] = raw.view(torch.float8_e4m3fn)
    save_file(tensors, shard, metadata={"format": "pt"})
    return f"tensor {name} contains NaN or Inf values"


MORE_CASES: dict[str, tuple[str, Callable[[Path], str]]] = {
    "header nested 100,000 deep": ("fp8", deep_nested_header),
    "header is a JSON array": ("fp8", header_is_an_array),
    "header is JSON null": ("fp8", header_is_null),
    "header entry not an object": ("fp8", header_entry_not_an_object),
    "three data offsets": ("fp8", three_data_offsets),
    "reversed data offsets": ("fp8", reversed_data_offsets),
    "float data offsets": ("fp8", float_data_offsets),
    "lowercase dtype": ("fp8", lowercase_dtype),
    "F8_E8M0 dtype": ("fp8", e8m0_dtype),
    "shape is a string": ("fp8", shape_is_a_string),
    "header length cuts the JSON short": ("fp8", header_length_short_of_json),
    "header starts with a UTF-8 BOM": ("fp8", header_with_bom),
    "__metadata__ is a list": ("fp8", metadata_is_a_list),
    "data section truncated": ("fp8", truncated_data_section),
    "index nested 100,000 deep": ("fp8", index_deep_nested),
    "index weight_map is a list": ("fp8", index_weight_map_a_list),
    "index file name is a number": ("fp8", index_file_name_a_number),
    "index names the wrong shard": ("fp8", index_names_the_wrong_shard),
    "index omits a tensor": ("fp8", index_omits_a_tensor),
    "config.json nested 100,000 deep": ("fp8", config_deep_nested),
    "config.json is an array": ("fp8", config_is_an_array),
    "config.json negative layers": ("fp8", config_negative_layers),
    "config.json float hidden_size": ("fp8", config_float_hidden_size),
    "config.json boolean layers": ("fp8", config_bool_layers),
    "INT4 group_size 0": ("int4", int4_group_size_zero),
    "missing layernorm": ("fp8", missing_layernorm),
    "layernorm of the wrong shape": ("fp8", layernorm_wrong_shape),
    "FP8 weight without its scale_inv": ("fp8", fp8_weight_without_scale),
    "scale_inv without an FP8 weight": ("fp8", orphan_scale_inv),
    "INT4 weight_shape int32": ("int4", int4_weight_shape_int32),
    "NaN in a BF16 norm, last shard": ("fp8", _fill(float("nan"), _is_bf16_norm)),
    "Inf in a BF16 matrix, last shard": ("fp8", _fill(float("inf"), _is_bf16_matrix)),
    "negative FP8 scale_inv, last shard": ("fp8", _fill(-1.0, _is_scale_inv)),
    "NaN byte in an FP8 expert, last shard": ("fp8", fp8_nan_byte),
}
