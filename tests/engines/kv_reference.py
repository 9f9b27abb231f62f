"""Torch reproductions of FP8-KV attention reads that cannot run on this CPU as kernels, for the KL harness
(`run_sglang_kv_kl.py`). Each reproduces the kernel's *arithmetic*, not just "dequantize, then exact attention":

- `decode_attention_fwd`: SGLang 0.5.23's Triton decode kernel (`sglang/kernels/ops/attention/decode_attention.py`,
  the grouped stage 1 + stage 2 that CUDA runs for MLA and GQA): the query's first `BLOCK_DMODEL` values cast to
  the KV dtype at scale 1 (`q.to(K_Buffer.dtype)`), the rope part kept in the query's dtype, `k_scale` folded into
  the softmax scale, an online softmax over 32-token blocks inside each KV split (split lengths as the kernel
  computes them from `num_kv_splits`), the numerator's probabilities cast to the V dtype (`p.to(v.dtype)`) while
  the denominator sums them unrounded, the splits merged by their log-sum-exp, times `v_scale`, stored in the
  output's dtype. Same signature as SGLang's function, so the backend's own `forward_decode` calls it.
  `test_kv_kl.py` runs SGLang's kernel under the Triton interpreter (with `triton_interp_fix`) on the same
  inputs and asserts agreement to the output's rounding: this is what licenses using the reproduction for the
  KL table (the interpreter needs about 45 ms per kernel program).
- `flash_mla_with_kvcache`: FlashMLA's FP8 decode as SGLang's flashmla backend calls it (sgl-kernel, Hopper;
  not runnable here). From FlashMLA's FP8 pull request (https://github.com/deepseek-ai/FlashMLA/pull/54): the
  query arrives already quantized by `scaled_fp8_quant(q, k_scale)` (the backend does that), logits are
  `q8 . k8 x descale_q x descale_k x softmax_scale` over all 576 values, P is cast to e4m3 ("Since the maximum
  value of P does not exceed 1, the f32tofp8_cast is directly used"), V is the latent (times `descale_k`).
  Assumptions (not stated by the source): 64-token blocks (FlashMLA's page), one KV split, the denominator
  sums unrounded P as the Triton kernel does. It shares `attend_one` with the Triton reproduction (which the
  executed kernel checks); its FlashMLA-specific parameters (q / k_scale over all 576 values, 64-token blocks,
  one split) cannot be checked here: no FlashMLA kernel runs on a CPU.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["attend_one", "decode_attention_fwd", "flash_mla_with_kvcache", "scaled_fp8_quant"]

FP8 = torch.float8_e4m3fn
MIN_BLOCK_KV = 32  # decode_attention.py: _MIN_BLOCK_KV
TRITON_BLOCK_N = 32  # _decode_grouped_att_m_fwd: BLOCK = 32 on CUDA
FLASHMLA_BLOCK_N = 64


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to `dtype` and back to fp32 (torch: round to nearest even; saturating to e4m3, as the GPU)."""
    return x.to(dtype).float() if dtype != torch.float32 else x.float()


def attend_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, nope: int, sm_scale: float,
               v_scale: float, splits: int, block: int, quantize_q_rope: bool = False) -> torch.Tensor:
    """One request's decode attention as the FP8 kernels compute it.

    q: [H, Lk] (values in the query's dtype); keys: [L, KVH, Lk] and values: [L, KVH, Lv] in the pool's storage
    dtype; `nope` = how many leading query values are cast to the KV dtype (the rest stays in q's dtype unless
    `quantize_q_rope`). Returns [H, Lv] fp32 (before the output's dtype rounding)."""
    heads, kv_heads = q.shape[0], keys.shape[1]
    group = heads // kv_heads
    length = keys.shape[0]
    kdt = keys.dtype
    k = keys.float().repeat_interleave(group, dim=1)  # [L, H, Lk]
    v = values.float().repeat_interleave(group, dim=1)  # [L, H, Lv]
    qf = q.float()
    q_nope = _cast(qf[:, :nope], kdt) if kdt != q.dtype else qf[:, :nope]
    q_rope = _cast(qf[:, nope:], kdt) if quantize_q_rope else qf[:, nope:]
    logits = torch.einsum("hd,lhd->hl", q_nope, k[..., :nope])
    if q_rope.shape[1]:
        logits = logits + torch.einsum("hd,lhd->hl", q_rope, k[..., nope:])
    logits = logits * sm_scale
    per = math.ceil(math.ceil(length / splits) / MIN_BLOCK_KV) * MIN_BLOCK_KV
    outs, lses = [], []
    for start in range(0, length, per):
        end = min(start + per, length)
        e_max = torch.full((heads,), -math.inf)
        e_sum = torch.zeros(heads)
        acc = torch.zeros(heads, v.shape[-1])
        for b in range(start, end, block):
            qk = logits[:, b:min(b + block, end)]
            n_max = torch.maximum(qk.max(dim=1).values, e_max)
            rescale = torch.exp(e_max - n_max)
            p = torch.exp(qk - n_max[:, None])
            acc = acc * rescale[:, None] + torch.einsum("hl,lhd->hd", _cast(p, values.dtype), v[b:b + p.shape[1]])
            e_sum = e_sum * rescale + p.sum(dim=1)
            e_max = n_max
        outs.append(acc / e_sum[:, None])
        lses.append(e_max + torch.log(e_sum))
    e_max = torch.full((heads,), -math.inf)
    e_sum = torch.zeros(heads)
    acc = torch.zeros(heads, v.shape[-1])
    for o, lse in zip(outs, lses, strict=True):  # stage 2: merge the splits by their log-sum-exp
        n_max = torch.maximum(lse, e_max)
        old = torch.exp(e_max - n_max)
        w = torch.exp(lse - n_max)
        acc = acc * old[:, None] + w[:, None] * o
        e_sum = e_sum * old + w
        e_max = n_max
    return acc / e_sum[:, None] * v_scale


def _geometry(lk: int) -> int:
    """How many leading query values stage 1 casts to the KV dtype (BLOCK_DMODEL, masked to Lk)."""
    return {576: 512, 288: 256}.get(lk, lk)


def decode_attention_fwd(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, o: torch.Tensor,
                         kv_indptr: torch.Tensor, kv_indices: torch.Tensor, attn_logits: torch.Tensor,
                         attn_lse: torch.Tensor, num_kv_splits: torch.Tensor, max_kv_splits: int, sm_scale: float,
                         k_scale: float, v_scale: float, logit_cap: float = 0.0, sinks: Any = None,
                         xai_temperature_len: int = -1, has_mla: bool = False, use_pdl: bool = False,
                         page_size: int = 1, score_mod: Any = None, aux_tensors: Any = None, **lean: Any) -> None:
    """Drop-in for SGLang's `decode_attention_fwd` (CUDA path, no logit cap / sinks / score_mod): writes `o`."""
    assert logit_cap == 0.0 and sinks is None and score_mod is None and xai_temperature_len <= 0
    lk, lv = k_buffer.shape[-1], v_buffer.shape[-1]
    nope = _geometry(lk)
    for r in range(q.shape[0]):
        start, end = int(kv_indptr[r]), int(kv_indptr[r + 1])
        idx = kv_indices[start:end].long()
        keys = k_buffer.reshape(-1, k_buffer.shape[-2], lk)[idx]
        values = keys[..., :lv] if has_mla else v_buffer.reshape(-1, v_buffer.shape[-2], lv)[idx]
        out = attend_one(q[r], keys, values, nope, sm_scale * k_scale, v_scale, int(num_kv_splits[r]),
                         TRITON_BLOCK_N)
        o[r] = out.to(o.dtype)


def scaled_fp8_quant(x: torch.Tensor, scale: torch.Tensor | None = None, *args: Any,
                     **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stand-in for sgl-kernel's static per-tensor `scaled_fp8_quant`: clamp(x / scale) cast to e4m3."""
    s = float(scale.reshape(-1)[0]) if scale is not None else 1.0
    return (x.float() / s).clamp(-448.0, 448.0).to(FP8), scale


def flash_mla_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                           cache_seqlens: torch.Tensor, head_dim_v: int, tile_scheduler_metadata: Any = None,
                           num_splits: Any = None, softmax_scale: float | None = None, causal: bool = True,
                           descale_q: torch.Tensor | None = None,
                           descale_k: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
    """FlashMLA's FP8 decode (see the module docstring for what is assumed): q [B, 1, H, Lk] e4m3, k_cache
    [pages, page, 1, Lk] e4m3; returns ([B, 1, H, head_dim_v] bf16, None)."""
    batch, _, heads, lk = q.shape
    dq = float(descale_q.reshape(-1)[0]) if descale_q is not None else 1.0
    dk = float(descale_k.reshape(-1)[0]) if descale_k is not None else 1.0
    scale = (softmax_scale if softmax_scale is not None else lk ** -0.5) * dq * dk
    rows = k_cache.reshape(k_cache.shape[0], k_cache.shape[1], lk)
    out = torch.empty(batch, 1, heads, head_dim_v, dtype=torch.bfloat16)
    for b in range(batch):
        length = int(cache_seqlens[b])
        keys = rows[block_table[b].long()].reshape(-1, 1, lk)[:length]
        res = attend_one(q[b, 0], keys, keys[..., :head_dim_v], lk, scale, dk, 1, FLASHMLA_BLOCK_N)
        out[b, 0] = res.to(torch.bfloat16)
    return out, None
