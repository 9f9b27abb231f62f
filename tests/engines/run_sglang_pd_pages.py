"""quantkit's BF16 -> FP8 page conversion against the pages SGLang 0.5.23's decode server writes itself (CPU).

    python tests/engines/run_sglang_pd_pages.py OUT.json CKPT SCALE

For page sizes 1 and 64, in a forked child that published SGLang's server args for CKPT:
- MLA: a BF16 prefill pool and an FP8 decode pool, both SGLang's `MLATokenToKVPool`; the same latents (two full
  pages) are written into each by `TritonAttnBackend.forward_decode` (run_sglang_attn.py's harness; the decode
  layer holds the calibrated scale, the prefill layer none); the prefill's pages, converted by
  `quantkit.serving.pd.sglang.mla_pages_to_fp8`, are compared byte for byte with the decode's pages.
- DSA: `MLATokenToKVPool(use_dsa=True)` BF16 and FP8 with SGLang's 656 B rows (`override_kv_cache_dim` from
  `calculate_mla_kv_cache_dim`'s formula), written by the pool's `set_mla_kv_buffer` (the DSA write path:
  `quantize_k_cache_separate` per-tile quantization); converted by `dsa_pages_to_fp8`, compared the same way.
The pools' Triton row-copy kernel is run_sglang_attn's torch stand-in (the interpreter cannot run it). The DSA
per-tile quantizer is SGLang's Triton kernel (interpreted here) on both sides: the plugin calls it, so the DSA
comparison checks the row layout and page placement, not an independent quantizer. Cost per page: bench/pd_kv_pages.py.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run_sglang  # noqa: E402
import run_sglang_attn as attn  # noqa: E402

LATENT, ROPE = attn.LATENT, attn.ROPE
DSA_ROW = LATENT + LATENT // 128 * 4 + ROPE * 2  # 656


def _pool(page: int, dtype: Any, dsa: bool) -> Any:
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return MLATokenToKVPool(size=4 * page, page_size=page, dtype=dtype, kv_lora_rank=LATENT, qk_rope_head_dim=ROPE,
                            layer_num=1, device="cpu", enable_memory_saver=False, use_dsa=dsa,
                            override_kv_cache_dim=DSA_ROW if dsa and dtype != _bf16() else None)


def _bf16() -> Any:
    import torch

    return torch.bfloat16


def _triton_write(pool: Any, latent: Any, locs: Any, scale: float | None) -> None:
    """The decode step of SGLang's triton backend for these tokens, up to its (recorded) attention kernel."""
    import torch
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    spec = attn.BACKENDS["triton"]
    backend = attn._backend(TritonAttnBackend, pool, spec["attrs"])
    backend.decode_attention_fwd = attn._recorder([], "decode_attention_fwd")
    layer = attn._layer(scale if scale is not None else 1.0)
    if scale is None:
        layer.k_scale = layer.v_scale = layer.k_scale_float = layer.v_scale_float = None
    n = latent.shape[0]
    batch = attn.Anything(batch_size=n, out_cache_loc=locs, seq_lens=locs + 1, seq_lens_sum=int(locs.sum()) + n,
                          spec_info=None, forward_mode=SimpleNamespace(is_decode=lambda: True))
    q = torch.zeros(n, attn.HEADS * (LATENT + ROPE), dtype=torch.bfloat16)
    try:
        backend.forward_decode(q, latent.clone(), latent[..., :LATENT].clone(), layer, batch, save_kv_cache=True)
    except attn.KernelReached:
        pass


def _dsa_write(pool: Any, latent: Any, locs: Any) -> None:
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    batch = attn.Anything(out_cache_loc=locs)
    pool.set_mla_kv_buffer(attn._layer(1.0), KVWriteLoc.for_batch(batch), latent[..., :LATENT].contiguous(),
                           latent[..., LATENT:].contiguous())


def _pages(pool: Any, page: int, first: int, count: int) -> Any:
    import torch

    buf = pool.get_key_buffer(0)
    return buf[first * page:(first + count) * page].reshape(count, page, -1).view(torch.uint8) if buf.dtype != \
        torch.bfloat16 else buf[first * page:(first + count) * page].reshape(count, page, -1)


def compare(page: int, scale: float) -> dict[str, Any]:
    import torch

    from quantkit.serving.pd.sglang import dsa_pages_to_fp8, mla_pages_to_fp8

    pool_module = __import__("sglang.srt.mem_cache.memory_pool", fromlist=["x"])
    for name, factory in attn.POOL_PATCH.items():
        setattr(pool_module, name, factory([], name))
    torch.manual_seed(page)
    latent = (torch.randn(2 * page, 1, LATENT + ROPE) * 3).to(torch.bfloat16)
    locs = torch.arange(page, 3 * page)  # pages 1 and 2
    out: dict[str, Any] = {"page_size": page}
    prefill, decode = _pool(page, torch.bfloat16, False), _pool(page, torch.float8_e4m3fn, False)
    _triton_write(prefill, latent, locs, None)
    _triton_write(decode, latent, locs, scale)
    got, want = mla_pages_to_fp8(_pages(prefill, page, 1, 2), scale), _pages(decode, page, 1, 2)
    out["mla"] = {"equal": bool(torch.equal(got, want)), "bytes_per_page": int(want[0].numel()),
                  "decode_written": bool(want.any()), "differing_bytes": int((got != want).sum())}
    prefill, decode = _pool(page, torch.bfloat16, True), _pool(page, torch.float8_e4m3fn, True)
    _dsa_write(prefill, latent, locs)
    _dsa_write(decode, latent, locs)
    got, want = dsa_pages_to_fp8(_pages(prefill, page, 1, 2)), _pages(decode, page, 1, 2)
    out["dsa"] = {"equal": bool(torch.equal(got, want)), "bytes_per_page": int(want[0].numel()),
                  "decode_written": bool(want.any()), "differing_bytes": int((got != want).sum()) if
                  got.shape == want.shape else -1, "row_bytes": int(want.shape[-1])}
    return out


def main(argv: list[str]) -> int:
    out, ckpt, scale = Path(argv[0]), Path(argv[1]), float(argv[2])
    run_sglang.prepare(["DeepseekV3ForCausalLM"], preload=True)
    import sglang.srt.mem_cache.memory_pool  # noqa: F401

    report: dict[str, Any] = {"scale": scale, "pages": []}
    for page in (1, 64):
        part = out.with_suffix(f".{page}.json")
        pid = os.fork()
        if pid == 0:
            try:
                run_sglang._publish(ckpt, ["--kv-cache-dtype", "fp8_e4m3", "--page-size", str(page)])
                result = compare(page, scale)
            except Exception:
                result = {"page_size": page, "error": traceback.format_exc(limit=6)}
            part.write_text(json.dumps(result))
            os._exit(0)
        os.waitpid(pid, 0)
        report["pages"].append(json.loads(part.read_text()))
    out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
