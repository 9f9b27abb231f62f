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


_FP4_PRESETS = {"nvfp4a16": ("NVFP4A16", "nvfp4-pack-quantized"), "mxfp4a16": ("MXFP4A16", "mxfp4-pack-quantized"),
                "nvfp4": ("NVFP4", "nvfp4-pack-quantized")}


def build_fp4_quantization_config(scheme: str, ignore: list[str], kv_cache: bool = False) -> dict[str, Any]:
    """An FP4 config built with compressed-tensors' own models: its preset scheme (NVFP4A16, MXFP4A16, NVFP4)
    targeting `Linear`, format `nvfp4-pack-quantized` / `mxfp4-pack-quantized`, the ignore list and optionally
    the static FP8 KV scheme. FP4 conversions import compressed-tensors anyway, so no literal copy here."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, preset_name_to_scheme

    preset, fmt = _FP4_PRESETS[scheme]
    config = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}, format=fmt, ignore=list(ignore),
        quantization_status="compressed",
        kv_cache_scheme=QuantizationArgs(**FP8_KV_CACHE_SCHEME) if kv_cache else None)
    return config.model_dump(mode="json")
