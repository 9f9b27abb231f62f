"""One attention layer of the KL harness (`run_sglang_kv_kl.py`): the transformers side of the hand-off to SGLang.

MLA: the query is absorbed through `kv_b_proj` (q_nope @ W_UK, as SGLang's MLA decode does) and, with the rope
part, rounded to BF16 (SGLang's activations); the cached row is [latent | rotated rope] in BF16, zero-padded to
the 256 + 32 geometry SGLang's Triton MLA decode takes (zeros stay zeros through every cast and dot: exact). The
latent output goes back through W_UV. GQA: per-head query / K / V after qk-norm and rope, rounded to BF16.
Prompt positions attend exactly (fp32 math over BF16 inputs; see `kv_kl_sessions`), decode positions through
the session. DSA: the latent and the rope key as the configuration's pool stores and FlashMLA reads them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from kv_kl_sessions import MLA_PAD, Session

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def _exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention in fp32: q [P, H, D], k [P, KVH, D], v [P, KVH, Dv] -> [P, H, Dv]."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def _pad(x: torch.Tensor, lora: int) -> torch.Tensor:
    """[..., lora + rope] -> [..., 256 + 32]: latent first, rope at 256, zeros elsewhere."""
    out = x.new_zeros(*x.shape[:-1], sum(MLA_PAD))
    out[..., :lora] = x[..., :lora]
    out[..., MLA_PAD[0]:MLA_PAD[0] + x.shape[-1] - lora] = x[..., lora:]
    return out


def mla(session: Session, module: Any, query: torch.Tensor, kv_nope: torch.Tensor, k_rot: torch.Tensor,
        prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """query [1, H, s, nope + rope]; kv_nope [1, 1, s, lora]; k_rot [1, 1, s, rope] -> ([1, s, H, v], rows)."""
    q = query[0].float()
    heads, s = q.shape[0], q.shape[1]
    nope, vdim, lora = module.qk_nope_head_dim, module.v_head_dim, module.kv_lora_rank
    w = module.kv_b_proj.weight.float().view(heads, nope + vdim, lora)
    q_abs = torch.einsum("hsn,hnl->shl", q[..., :nope], w[:, :nope])
    qb = torch.cat([q_abs, q[..., nope:].transpose(0, 1)], dim=-1).to(BF16)  # [s, H, lora + rope]
    rows = torch.cat([kv_nope[0, 0], k_rot[0, 0]], dim=-1).to(BF16)  # [s, lora + rope]
    latent = torch.empty(s, heads, lora)
    latent[:prompt] = _exact(qb[:prompt].float(), rows[:prompt, None].float(), rows[:prompt, None, :lora].float(),
                             module.scaling)
    layer = session.layer_ns(module.layer_idx, module.scaling)
    k = _pad(rows, lora)[:, None]  # [s, 1, 288]
    session.write_prompt(layer, k[:prompt], k[:prompt, :, :MLA_PAD[0]])
    out = session.decode(layer, _pad(qb, lora)[prompt:], k[prompt:], k[prompt:, :, :MLA_PAD[0]], prompt)
    latent[prompt:] = out[..., :lora].float()
    return torch.einsum("shl,hvl->shv", latent, w[:, nope:])[None], rows.float()


def gqa(session: Session, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        prompt: int) -> torch.Tensor:
    """query [1, H, s, D], key / value [1, KVH, s, D] -> [1, s, H, D]."""
    q, k, v = (x[0].transpose(0, 1).to(BF16) for x in (query, key, value))
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1])
    out[:prompt] = _exact(q[:prompt].float(), k[:prompt].float(), v[:prompt].float(), module.scaling)
    layer = session.layer_ns(module.layer_idx, module.scaling)
    session.write_prompt(layer, k[:prompt], v[:prompt])
    out[prompt:] = session.decode(layer, q[prompt:], k[prompt:], v[prompt:], prompt).float()
    return out[None]


def dsa_round_trip(latent: torch.Tensor, config: str) -> torch.Tensor:
    """The DSA latent (kv_a_layernorm's output) as stored and read back: BF16 (the twin), a plain FP8 cast (raw
    576 B rows, trtllm), or SGLang's per-tile quantizer and dequantizer (656 B rows, flashmla_kv); the tiny
    latent's 64 values zero-padded to SGLang's 128-value tile (the tile's amax is unchanged)."""
    x = latent.to(BF16)
    if config == "bf16":
        return x.float()
    if config == "a":
        return x.to(FP8).float()
    from sglang.kernels.ops.attention.dsa.dequant_k_cache import dequantize_k_cache
    from sglang.kernels.ops.quantization.dsa_quant_k_cache import quantize_k_cache_separate

    lora = x.shape[-1]
    tile = 128 * -(-lora // 128)
    flat = x.reshape(-1, lora)
    padded = flat.new_zeros(flat.shape[0], tile)
    padded[:, :lora] = flat
    nope_bytes, _ = quantize_k_cache_separate(padded, None)
    back = dequantize_k_cache(nope_bytes.view(FP8))
    return back.reshape(flat.shape[0], -1)[:, :lora].float().reshape(latent.shape)


def dsa_rope(rope: torch.Tensor, config: str) -> torch.Tensor:
    """The rotated rope key as stored: BF16 (the twin; 656 B rows keep it BF16) or plain-cast (raw 576 B rows)."""
    x = rope.to(BF16)
    return x.to(FP8).float() if config == "a" else x.float()
