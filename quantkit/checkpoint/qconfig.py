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

__all__ = ["build_quantization_config", "FP8_KV_CACHE_SCHEME"]

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
