"""The `quantization_config` block of config.json, in compressed-tensors' own serialized form.

SGLang and vLLM read exactly this: one config group targeting `Linear` (SGLang's MoE path looks the
scheme up under that target), symmetric INT4 group-wise weights, an ignore list covering every Linear
module the recipe keeps, and optionally the static FP8 KV-cache scheme.

The dict is what compressed-tensors' `QuantizationConfig(...).model_dump(mode="json")` produces for this
scheme, written out literally: importing compressed-tensors (and the transformers it pulls in) costs ~3
CPU-seconds, a sixth of a whole RTN conversion of a 2 GB checkpoint. A test builds the same block with
compressed-tensors' models and compares, and `quantkit validate` parses every written config with them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_fp4_quantization_config", "build_quantization_config", "FP8_KV_CACHE_SCHEME"]

FP8_KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def _args(num_bits: int, kind: str, strategy: str, group_size: int | None, observer: str | None) -> dict[str, Any]:
    """One serialized `QuantizationArgs` (compressed-tensors' field order and defaults)."""
    return {"num_bits": num_bits, "type": kind, "symmetric": True, "group_size": group_size, "strategy": strategy,
            "block_structure": None, "dynamic": False, "actorder": None, "scale_dtype": None, "zp_dtype": None,
            "observer": observer, "observer_kwargs": {}}


def build_quantization_config(group_size: int, ignore: list[str], kv_cache: bool = False) -> dict[str, Any]:
    """A W4A16 pack-quantized config (plus the FP8 KV scheme when KV scales are written)."""
    weights = _args(4, "int", "group", group_size, "minmax")
    group = {"targets": ["Linear"], "weights": weights, "input_activations": None, "output_activations": None,
             "format": None}
    kv = _args(8, "float", "tensor", None, None) if kv_cache else None
    return {"config_groups": {"group_0": group}, "quant_method": "compressed-tensors", "kv_cache_scheme": kv,
            "format": "pack-quantized", "quantization_status": "compressed", "global_compression_ratio": None,
            "ignore": list(ignore)}


_FP4_FORMATS = {"nvfp4a16": "nvfp4-pack-quantized", "mxfp4a16": "mxfp4-pack-quantized", "nvfp4": "nvfp4-pack-quantized"}


def _fp4_args(group_size: int, dynamic: bool | str, observer: str | None) -> dict[str, Any]:
    """compressed-tensors' FP4 `QuantizationArgs` as its presets serialize them (NVFP4: tensor_group + e4m3 scales,
    MXFP4: group + uint8 E8M0 scales)."""
    nv = group_size == 16
    args = _args(4, "float", "tensor_group" if nv else "group", group_size, observer)
    args.update(dynamic=dynamic, scale_dtype="torch.float8_e4m3fn" if nv else "torch.uint8")
    return args


def build_fp4_quantization_config(scheme: str, ignore: list[str], kv_cache: bool = False) -> dict[str, Any]:
    """An FP4 config: compressed-tensors' preset scheme (NVFP4A16, MXFP4A16, NVFP4) targeting `Linear`, format
    `nvfp4-pack-quantized` / `mxfp4-pack-quantized`, the ignore list and optionally the static FP8 KV scheme.

    Written literally, like the INT4 block (importing compressed-tensors costs ~3-4 CPU-s per run); a test
    compares it with `QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(...)}, ...)` for
    every scheme, and `quantkit validate` parses it with compressed-tensors."""
    weights = _fp4_args(32 if scheme == "mxfp4a16" else 16, False, None)
    acts = _fp4_args(16, "local", "static_minmax") if scheme == "nvfp4" else None
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts, "output_activations": None,
             "format": None}
    kv = _args(8, "float", "tensor", None, None) if kv_cache else None
    return {"config_groups": {"group_0": group}, "quant_method": "compressed-tensors", "kv_cache_scheme": kv,
            "format": _FP4_FORMATS[scheme], "quantization_status": "compressed", "global_compression_ratio": None,
            "ignore": list(ignore)}
