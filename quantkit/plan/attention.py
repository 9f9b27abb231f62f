"""Decode attention per SGLang backend and GPU, from the kernels' published figures (docs/planner.md cites each).

Per attention layer and decode step, on one GPU:

    t_attn = t0                                    fixed: kernel(s), split merge, metadata
           + batch x T_REQ                         per-request scheduling / combine
           + max(read_bytes / (BW x eta), tokens x tok_s x tiles)   memory, or a per-token floor (DSA dequant)
           + split partials / (BW x eta)           triton only: stage-1 partials written and read back
           + FP8 KV: write_s + tokens x c_fp8      FP8 write kernels (measured, or n_w x c_w fitted) and the
                                                   per-token FP8 read overhead (fitted, throughput.fit_decode)
           + FP8 MLA on fa3 / flashinfer: pool_tokens x C_POOL   the whole per-layer pool converted to BF16 on
                                                   every layer of every step (sglang#35291), then a BF16 read

`tokens` = batch x attended rows (DSA: min(context, index_topk)); `read_bytes` = tokens x KV row bytes (BF16 rows
after the pool conversion). Every constant names its source; `extrapolated` says what the source did not measure
(GPU, head count, dtype or context). The consistent backends per scale are `consistent_backends`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from quantkit.engines.kv_backends import GpuArch
from quantkit.plan.catalog import GPU

__all__ = ["C_POOL_S", "KERNELS", "SOURCES", "T_REQ_S", "Kernel", "ScaleMode", "consistent_backends",
           "kernel", "layer_seconds", "triton_splits"]

ScaleMode = Literal["unit", "calibrated"]
Layout = Literal["mla", "dsa", "gqa"]

SOURCES: dict[str, str] = {
    "A1": "FlashMLA README + docs/20250422-new-kernel-deep-dive.md: up to 3000 GB/s memory-bound on H800 "
          "(0.90 of 3.35 TB/s) https://github.com/deepseek-ai/FlashMLA",
    "A2": "FlashMLA docs/20250929-hopper-fp8-sparse-deep-dive.md: sparse FP8 decode 410 TFLOPS on H800 at b=128, "
          "h_q=128, topk 2048, dequantization-bound (~82 SM-cycles per KV token per 64-head tile, derived) "
          "https://github.com/deepseek-ai/FlashMLA",
    "A3": "FA3 qv MLA decode vs FlashMLA, H100, b=128, h_q=128: FA3 1.22-1.45x slower "
          "https://github.com/Dao-AILab/flash-attention/pull/1770",
    "A5": "FlashMLA 10-20% faster than FlashInfer MLA at h_q 16-64 (H800) "
          "https://github.com/flashinfer-ai/flashinfer/issues/892",
    "A7": "FlashInfer MLA decode, RTX 4090: 38 us at b16 x 1K ... 5.126 ms at b256 x 16K; fitted ~15 us fixed, "
          "0.2 us per request, 0.94 of bandwidth https://github.com/flashinfer-ai/flashinfer/pull/551",
    "A8": "trtllm-gen FP8 MLA decode on B200 (FLASHINFER_MLA column): b1 4K 14.4 us, b128 16K 222.1 us "
          "(5.4 TB/s = 0.68 of 8 TB/s), nh=64 b128 16K 204 us (0.74) https://github.com/vllm-project/vllm/pull/41778",
    "A10": "SGLang fa3 / flashinfer_mla with FP8 KV convert the whole per-layer pool to BF16: 225.79 us per layer "
           "at a 131,072-token pool, 13.77 ms of a 31.52 ms step (DeepSeek-R1, 8 x H200); flashmla page 64: "
           "17.68 ms, its unfused FP8 write +0.425 ms per step https://github.com/sgl-project/sglang/issues/35291",
    "prior": "no published figure: a prior, to be replaced by bench/gpu_sections/attention.py on a lent GPU",
}
T_REQ_S = 0.2e-6  # A7's per-request term (RTX 4090), extrapolated to every backend and GPU
C_POOL_S = 225.79e-6 / 131072  # A10: seconds per pool token per layer for the BF16 conversion (H200, measured)
FP8_WRITE_FLASHMLA_S = 0.425e-3 / 61  # A10: flashmla's unfused FP8 write per layer (a hold-out for n_w x c_w)
SMS: dict[str, int] = {"h100": 132, "h200": 132, "h20": 78, "b200": 148, "b300": 160, "gb200": 152, "a100": 108,
                       "l40s": 142}  # datasheet SM counts (SGLang's device_core_count)


@dataclass(frozen=True)
class Kernel:
    """One backend's decode attention on one GPU generation."""

    backend: str
    eta: float  # achieved share of peak HBM bandwidth, memory-bound
    t0_s: float  # fixed seconds per layer
    sources: tuple[str, ...]
    extrapolated: str  # what the sources did not measure ("" = measured as used)
    n_w: int = 0  # extra elementwise FP8 kernels per layer vs BF16 (each costs the fitted c_w)
    fp8_write_s: float | None = None  # measured FP8 write cost per layer (replaces n_w x c_w)
    pool_upcast: bool = False  # FP8 MLA: the whole per-layer pool converted to BF16 every layer
    tok_s: float = 0.0  # per-KV-token floor per 64-head tile (DSA sparse FP8 dequant)
    splits: bool = False  # split-KV partials written to and read from memory (triton)


_FLASHMLA = Kernel("flashmla", 0.90, 6e-6, ("A1", "A10", "A7"), "t0 from A7's shape; eta at h_q=128 on H800 "
                   "applied to TP8 head counts and H200", n_w=2)
_FA3 = Kernel("fa3", 0.90 / 1.3, 6e-6, ("A1", "A3", "A10"), "FA3/FlashMLA ratio at h_q=128 on H100 applied to "
              "TP8 head counts and H200", n_w=1, pool_upcast=True)
_FLASHINFER = Kernel("flashinfer", 0.90 / 1.15, 8e-6, ("A1", "A5", "A10"), "FlashMLA/FlashInfer ratio at h_q "
                     "16-64 (H800) applied to H200", n_w=1, pool_upcast=True)
_TRITON = Kernel("triton", 0.60, 8e-6, ("prior",), "no published timing of SGLang's Triton MLA decode", n_w=2,
                 splits=True)
_TRTLLM = Kernel("trtllm_mla", 0.70, 13e-6, ("A8",), "B200 kernel figures at nh 64-128 applied to TP8 head "
                 "counts")
_DSA_SM90 = Kernel("flashmla_kv", 0.90, 6e-6, ("A1", "A2"), "A2's per-token dequant cost (H800, 128 heads) "
                   "per 64-head tile at TP8", n_w=1, tok_s=82 / (132 * 1.83e9))
_DSA_SM100 = Kernel("trtllm", 0.70, 13e-6, ("A8",), "A8's dense MLA figures applied to DSA sparse decode")
KERNELS: dict[GpuArch, dict[str, Kernel]] = {
    "sm90": {k.backend: k for k in (_FLASHMLA, _FA3, _FLASHINFER, _TRITON, _DSA_SM90)},
    "sm100": {k.backend: k for k in (_TRTLLM, Kernel("cutedsl_mla", 0.70, 13e-6, ("A8",), "as trtllm_mla"),
                                     _FLASHINFER, _TRITON, _DSA_SM100,
                                     Kernel("flashmla_kv", 0.70, 13e-6, ("A2", "A8"), "Hopper kernel figures on "
                                            "B200", n_w=1, tok_s=82 / (148 * 1.9e9)))},
    "other": {k.backend: k for k in (_FLASHINFER, _TRITON)},
}
_GQA: dict[GpuArch, tuple[str, ...]] = {"sm90": ("fa3", "flashinfer", "triton"), "sm100": ("flashinfer", "triton"),
                                        "other": ("flashinfer", "triton")}


def kernel(arch: GpuArch, backend: str) -> Kernel:
    """The constants of `backend` on a GPU generation (GQA uses the MLA figures of the same backend)."""
    table = KERNELS[arch]
    if backend not in table:
        raise KeyError(f"attention backend {backend!r} is not modelled on {arch} (known: {', '.join(table)})")
    return table[backend]


def consistent_backends(layout: Layout, scale: ScaleMode, arch: GpuArch) -> tuple[str, ...]:
    """Backends that apply one scale on write and read for the layout: a calibrated MLA scale only on triton
    (quantkit/engines/kv_backends.py); scale 1.0 everywhere; DSA per-tile scales on its DSA backends; GQA
    (GLM-4.x) scales are not loaded by SGLang, so only scale 1.0 is servable there."""
    if layout == "dsa":
        return ("trtllm", "flashmla_kv") if arch == "sm100" else ("flashmla_kv",)
    if layout == "gqa":
        return _GQA[arch] if scale == "unit" else ()
    if scale == "calibrated":
        return ("triton",)
    return tuple(b for b in KERNELS[arch] if b not in ("flashmla_kv", "trtllm"))


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def triton_splits(batch: int, context: int, heads: int, sms: int, mla: bool = True) -> int:
    """SGLang's split count for `batch` requests of `context` tokens (kernels/ops/attention/metadata.py:
    get_num_kv_splits_triton with equal lengths; max_kv_splits 8, MLA: triton_backend.py: _mla_decode_kv_splits_cap
    at the served context)."""
    cap = max(8, min(_pow2(sms), _pow2(math.ceil(context / 32)))) if mla else 8
    ext = int(sms * max(math.log2(context / 64.0), 1.0))
    grid = batch * math.ceil(heads / min(16, heads))
    splits_2 = min(math.ceil(ext / grid), cap)
    return max(1, math.ceil(context / math.ceil(context / splits_2)))


def layer_seconds(k: Kernel, gpu: GPU, layout: Layout, kv: str, heads: int, latent: int, row_bytes: int,
                  batch: int, context: int, index_topk: int, pool_tokens: int, c_w: float, c_fp8: float) -> float:
    """Seconds of one attention layer's decode for `batch` requests of `context` tokens on one GPU."""
    attended = min(context, index_topk) if index_topk else context
    tokens = batch * attended
    bw = gpu.bandwidth_bytes_s * k.eta
    upcast = kv == "fp8" and k.pool_upcast and layout == "mla"
    read = tokens * row_bytes * (2 if upcast else 1)
    tiles = math.ceil(heads / 64)
    t = k.t0_s + batch * T_REQ_S + max(read / bw, tokens * k.tok_s * tiles)
    if k.splits:
        s = triton_splits(batch, context, heads, SMS.get(gpu.key, 132), layout != "gqa")
        t += batch * heads * s * (latent + 1) * 4 * 2 / bw
    if kv == "fp8":
        t += k.fp8_write_s if k.fp8_write_s is not None else k.n_w * c_w
        t += pool_tokens * C_POOL_S if upcast else tokens * c_fp8
    return t
