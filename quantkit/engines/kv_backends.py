"""Which attention backends apply a calibrated FP8 KV scale consistently (MLA / DSA, SGLang 0.5.23, vLLM 0.33.0).

A calibrated scale s is consistent only when the write divides by s (or the pages were written by a side that
did) and the read multiplies by s; scale 1.0 is consistent on every backend. Which one a checkpoint ships is
measured (quantkit/engines/kv_choice.py). SGLang's MLA pool writes with a plain cast (`memory_pool.py:
MLATokenToKVPool.set_kv_buffer`), so a backend that multiplies by `k_scale` on read without dividing on write
scales every logit by s. `tests/test_kv_backends.py` executes each backend's Python write path and the descale
arguments it hands the (stubbed) kernel; the `executed` column says which part ran, the rest is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from quantkit.arch import KVLayout

__all__ = ["BACKENDS", "BackendKV", "GpuArch", "consistent_sglang_backend", "sglang_backend",
           "sglang_default_backend", "sglang_effective_scale"]

GpuArch = Literal["sm90", "sm100", "other"]
KVVerdict = Literal["consistent", "ignored", "inconsistent", "per-tile"]


@dataclass(frozen=True)
class BackendKV:
    engine: Literal["sglang", "vllm"]
    name: str  # the --attention-backend (DSA: --dsa-*-backend) value
    write: str
    read: str
    verdict: KVVerdict  # for a calibrated scale != 1: consistent | ignored (1.0 both ways) | inconsistent | per-tile
    source: str
    executed: str  # what tests/test_kv_backends.py runs of it


BACKENDS: tuple[BackendKV, ...] = (
    BackendKV("sglang", "triton", "k.div_(layer.k_scale), then cast (set_kv_buffer with k_scale/v_scale)",
              "decode kernel gets k_scale_float / v_scale_float", "consistent",
              "layers/attention/triton_backend.py: TritonAttnBackend.forward_decode",
              "forward_decode on a real MLATokenToKVPool, kernel stubbed (pool bytes and descales recorded)"),
    BackendKV("sglang", "flashmla", "plain cast (pool.set_kv_buffer, no scale)",
              "q quantized by k_scale, descale_q = descale_k = k_scale", "inconsistent",
              "layers/attention/flashmla_backend.py: FlashMLABackend.forward_decode",
              "forward_decode on a real MLATokenToKVPool, flash_mla_with_kvcache / scaled_fp8_quant stubbed"),
    BackendKV("sglang", "trtllm_mla", "unit-scale FP8 quantize (mla_quantize_and_rope_for_fp8, no k_scale)",
              "bmm1 scale = q_scale * k_scale_float * softmax scale; no V scale", "inconsistent",
              "layers/attention/trtllm_mla_backend.py: _calc_bmm1_scale / forward_decode",
              "the bmm1-scale helper executed; the write is read (fused CUDA kernel)"),
    BackendKV("sglang", "cutedsl_mla", "as trtllm_mla (subclass)", "as trtllm_mla", "inconsistent",
              "layers/attention/cutedsl_mla_backend.py (subclass of TRTLLMMLABackend)",
              "subclass relation and inherited bmm1-scale helper executed"),
    BackendKV("sglang", "flashinfer", "plain cast (pool.set_mla_kv_buffer, no scale)",
              "upcasts the buffer; never reads layer.k_scale", "ignored",
              "layers/attention/flashinfer_mla_backend.py", "read (no k_scale reference in the module, asserted)"),
    BackendKV("sglang", "fa3", "plain cast", "MLA head_dim 576 > 256: no k/v descale handed to the kernel", "ignored",
              "layers/attention/flashattention_backend.py: FlashAttentionBackend.prepare_paged_mha_query",
              "prepare_paged_mha_query executed at head_dim 576 (descales None)"),
    BackendKV("sglang", "flashmla_kv", "own per-tile FP8 scales in a 656 B row (DSA)", "per-tile scales from the row",
              "per-tile", "layers/attention/dsa_backend.py; mem_cache/kv_cache_configurator.py",
              "row size from calculate_mla_kv_cache_dim executed"),
    BackendKV("sglang", "trtllm", "raw 576 B FP8 row (DSA)", "unit scale", "per-tile",
              "layers/attention/dsa_backend.py; mem_cache/kv_cache_configurator.py",
              "row size from calculate_mla_kv_cache_dim executed"),
    BackendKV("vllm", "FLASHMLA / CUTLASS_MLA / FLASHINFER_MLA / TRITON_MLA / FLASH_ATTN_MLA",
              "concat_and_cache_mla(..., scale=layer._k_scale)", "descale by layer._k_scale", "ignored",
              "attention/layers/mla_attention.py; model_executor/model_loader/weight_utils.py",
              "the loader (test_vllm_loads.py: every MLAAttention keeps _k_scale = 1.0, the scales are skipped); "
              "the backends' kernels are read, not executed: whatever they do with _k_scale, it is 1.0"),
)


def sglang_default_backend(layout: KVLayout, arch: GpuArch) -> str:
    """What SGLang picks without --attention-backend for FP8 MLA KV (DeepSeek-V3: fa3 on SM90, trtllm_mla on SM100;
    DSA FP8: flashmla_kv on SM90, trtllm on SM100; `overrides.py`)."""
    if layout == KVLayout.DSA:
        return "trtllm" if arch == "sm100" else "flashmla_kv"
    return "trtllm_mla" if arch == "sm100" else ("fa3" if arch == "sm90" else "triton")


def sglang_backend(layout: KVLayout, arch: GpuArch) -> str:
    """A PD side's backend where the scale plays no role or must be ignored: DSA, SGLang's FP8 default of the GPU,
    pinned for both roles so both rows agree; MLA, a backend that ignores a checkpoint's calibrated scale (fa3 on
    Hopper, flashinfer elsewhere), for a decode reading an FP8 source's unscaled pages -- both convert the whole
    FP8 pool to BF16 on every layer (sglang#35291), so a unit-scale checkpoint pins the fastest backend instead
    (quantkit/engines/kv_choice.py); GQA, SGLang's Hopper default or flashinfer."""
    if layout == KVLayout.DSA:
        return sglang_default_backend(layout, arch)
    return "fa3" if arch == "sm90" else "flashinfer"


def _verdict(name: str) -> KVVerdict | None:
    for b in BACKENDS:
        if b.engine == "sglang" and b.name == name:
            return b.verdict
    return None


def sglang_effective_scale(layout: KVLayout, backend: str, scales_loaded: bool) -> str:
    """The KV scale a side really applies: `per-tile` (DSA), `1.0`, `calibrated`, or `inconsistent`."""
    if layout == KVLayout.DSA:
        return "per-tile"
    if not scales_loaded or layout != KVLayout.MLA:
        return "calibrated" if scales_loaded else "1.0"
    verdict = _verdict(backend)
    return {"consistent": "calibrated", "ignored": "1.0"}.get(verdict or "", "inconsistent")


def consistent_sglang_backend() -> str:
    """The MLA backend that divides by the calibrated scale on write and multiplies on read (on its MLA paths:
    a fresh prompt prefilled eagerly takes the MHA path, which writes a plain cast; docs/serving.md)."""
    return next(b.name for b in BACKENDS if b.engine == "sglang" and b.verdict == "consistent")
