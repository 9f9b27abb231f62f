"""KV-cache bytes per token per GPU, laid out the way SGLang allocates its pools.

- MLA (DeepSeek V3, Kimi K2.x): one latent row (kv_lora_rank + qk_rope_head_dim values) per token
  and layer, serving as K and V; replicated on every tensor-parallel rank (not divided by TP).
- DSA (GLM-5.x, DeepSeek V3.2): MLA plus an FP8 indexer-key cache. The FP8 layout stores 512 e4m3
  latent values + 4 fp32 tile scales + 64 bf16 rope values = 656 B per layer; the indexer cache is
  128 e4m3 + one fp32 scale = 132 B per layer.
- GQA (GLM-4.x): K and V for the KV heads of this rank (heads are replicated when TP > KV heads).
Draft (MTP) layers of speculative decoding get their own pool with the same token count, so their
bytes are added per token when speculative decoding is on.
"""

from __future__ import annotations

from typing import Any

from quantkit.core.errors import QuantkitError

__all__ = ["KV_DTYPES", "kv_bytes_per_token_per_gpu", "kv_layer_bytes"]

KV_DTYPES = ("bf16", "fp8")
DSA_TILE = 128  # DSA FP8 cache: one fp32 scale per 128 latent values
INDEXER_SCALE_BYTES = 4


def kv_layer_bytes(text: dict[str, Any], layout: str, kv: str, tp: int = 1) -> dict[str, int]:
    """Bytes per token of one attention layer on one GPU: `{"kv": ..., "indexer": ...}`."""
    if kv not in KV_DTYPES:
        raise QuantkitError(f"--kv {kv!r}: expected one of {', '.join(KV_DTYPES)}")
    width = 1 if kv == "fp8" else 2
    if layout == "gqa":
        kv_heads = int(text["num_key_value_heads"])
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // int(text["num_attention_heads"]))
        heads_per_gpu = max(1, kv_heads // tp) if kv_heads >= tp else 1
        return {"kv": 2 * heads_per_gpu * head_dim * width, "indexer": 0}
    latent = int(text["kv_lora_rank"]) + int(text["qk_rope_head_dim"])
    if layout == "mla":
        return {"kv": latent * width, "indexer": 0}
    if layout == "dsa":
        lora, rope = int(text["kv_lora_rank"]), int(text["qk_rope_head_dim"])
        fp8_layout = lora + 4 * -(-lora // DSA_TILE) + 2 * rope  # 512 + 16 + 128 = 656 B for GLM-5
        kv_bytes = fp8_layout if kv == "fp8" else latent * 2
        return {"kv": kv_bytes, "indexer": int(text["index_head_dim"]) + INDEXER_SCALE_BYTES}
    raise QuantkitError(f"unknown KV layout {layout!r}")


def _indexer_layers(text: dict[str, Any], layers: int, shared_indexer: bool) -> int:
    """Layers that keep an indexer cache: all, or only the `full` ones of IndexShare models."""
    types = text.get("indexer_types")
    if shared_indexer and isinstance(types, list) and types:
        return sum(1 for t in types[:layers] if t == "full")
    return layers


def kv_bytes_per_token_per_gpu(
    text: dict[str, Any],
    layout: str,
    kv: str,
    tp: int = 1,
    draft_layers: int = 0,
    shared_indexer: bool = False,
) -> int:
    """KV bytes one token occupies on one GPU (target layers + `draft_layers` MTP draft layers)."""
    per_layer = kv_layer_bytes(text, layout, kv, tp)
    layers = int(text["num_hidden_layers"])
    total = per_layer["kv"] * (layers + draft_layers)
    if per_layer["indexer"]:
        total += per_layer["indexer"] * (_indexer_layers(text, layers, shared_indexer) + draft_layers)
    return total
