"""The `quantization_config` block of config.json, built with compressed-tensors' own models.

SGLang and vLLM read exactly this: one config group targeting `Linear` (SGLang's MoE path looks the
scheme up under that target), symmetric INT4 group-wise weights, an ignore list covering every Linear
module the recipe keeps, and optionally the static FP8 KV-cache scheme.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_quantization_config", "FP8_KV_CACHE_SCHEME"]

FP8_KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def build_quantization_config(group_size: int, ignore: list[str], kv_cache: bool = False) -> dict[str, Any]:
    """A W4A16 pack-quantized config (plus the FP8 KV scheme when KV scales are written)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    weights = QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size,
        dynamic=False, actorder=None, observer="minmax",
    )
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
        quant_method="compressed-tensors",
        format="pack-quantized",
        quantization_status="compressed",
        ignore=list(ignore),
        kv_cache_scheme=QuantizationArgs(**FP8_KV_CACHE_SCHEME) if kv_cache else None,
    )
    return config.model_dump(mode="json")
