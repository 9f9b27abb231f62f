"""Execute SGLang 0.5.23's MLA attention backends' Python decode path on the CPU with a calibrated FP8 KV scale,
the attention kernel stubbed to record what it is handed; write what each backend did as JSON.

    python tests/engines/run_sglang_attn.py OUT.json CKPT [SCALE] [BACKEND...]

Per backend (triton, flashmla, trtllm_mla, cutedsl_mla, flashinfer, fa3): a backend object is made without its
constructor (`object.__new__`; the constructor sizes CUDA workspaces and JIT-compiles) and given the attributes
its `forward_decode` reads; the KV pool is SGLang's real `MLATokenToKVPool` on the CPU (DeepSeek geometry
512 + 64, FP8, page 64); the layer is a namespace with `RadixAttention`'s fields and the scales as
`BaseKVCacheMethod.process_weights_after_loading` leaves them (`k_scale` tensor, `k_scale_float`, v alike).
Then `forward_decode` runs for real until it calls the attention kernel: the module-level kernel function (or
the wrapper's `run`) is replaced by a recorder that raises `KernelReached` after recording its arguments. The
report per backend: the bytes the pool holds for the written token (compared with a plain FP8 cast of the latent
and with a cast of latent / scale), the scales handed to the kernel, and what was stubbed.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run_sglang  # noqa: E402  (tests/engines: SGLang's paths and stubs)

LATENT, ROPE, HEADS, PAGE = 512, 64, 16, 64


class KernelReached(Exception):
    """Raised by a kernel recorder: the backend's Python path ran up to the kernel call."""


class Anything(SimpleNamespace):
    """Per-forward metadata: the fields a test sets, None for every other one the path reads."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def _recorder(calls: list[dict[str, Any]], name: str) -> Callable[..., Any]:
    def record(*args: Any, **kwargs: Any) -> Any:
        calls.append({"kernel": name, "args": [_plain(a) for a in args],
                      "kwargs": {k: _plain(v) for k, v in kwargs.items()}})
        raise KernelReached(name)

    return record


def _plain(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return {"tensor": list(value.shape), "dtype": str(value.dtype),
                "value": value.float().flatten()[:1].tolist() if value.numel() <= 8 else None}
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return type(value).__name__


def _layer(scale: float) -> SimpleNamespace:
    import torch

    return SimpleNamespace(layer_id=0, tp_q_head_num=HEADS, tp_k_head_num=1, tp_v_head_num=1,
                           qk_head_dim=LATENT + ROPE, head_dim=LATENT + ROPE, v_head_dim=LATENT,
                           scaling=0.1, logit_cap=0.0, logit_capping_method="tanh", sliding_window_size=None,
                           xai_temperature_len=-1, is_cross_attention=False,
                           k_scale=torch.tensor(scale), v_scale=torch.tensor(scale), k_scale_float=scale,
                           v_scale_float=scale)


def _pool() -> Any:
    import torch
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return MLATokenToKVPool(size=4 * PAGE, page_size=PAGE, dtype=torch.float8_e4m3fn, kv_lora_rank=LATENT,
                            qk_rope_head_dim=ROPE, layer_num=1, device="cpu", enable_memory_saver=False)


def _batch(loc: int) -> SimpleNamespace:
    import torch

    return Anything(batch_size=1, out_cache_loc=torch.tensor([loc]), seq_lens=torch.tensor([loc + 1]),
                    seq_lens_sum=loc + 1, seq_lens_cpu=torch.tensor([loc + 1]), spec_info=None,
                    forward_mode=None, req_pool_indices=torch.tensor([0]))


def _backend(cls: type, pool: Any, attrs: dict[str, Any]) -> Any:
    import torch

    obj = object.__new__(cls)
    obj.__dict__.update(token_to_kv_pool=pool, use_mla=True, kv_lora_rank=LATENT, qk_rope_head_dim=ROPE,
                        kv_cache_dtype=torch.float8_e4m3fn, data_type=torch.float8_e4m3fn, page_size=PAGE,
                        num_q_heads=HEADS, q_data_type=torch.bfloat16, dcp_size=1, dcp_world_size=1,
                        is_draft_runner=False, forward_metadata=Anything())
    obj.__dict__.update(attrs)
    return obj


def _raising(calls: list[dict[str, Any]], name: str) -> Callable[..., Any]:
    return _recorder(calls, name)


def _quantize_fake(calls: list[dict[str, Any]], name: str) -> Callable[..., Any]:
    """Stand-in for a fused FP8 quantize kernel: records its arguments (which scale, if any, it is handed) and
    returns plain FP8 casts in the shapes the caller expects (q merged with q_rope, k, k_rope)."""
    import torch

    def quantize(q: Any, q_rope: Any, k: Any, k_rope: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append({"kernel": name, "args": [_plain(a) for a in (q, q_rope, k, k_rope, *args)],
                      "kwargs": {key: _plain(v) for key, v in kwargs.items()}})
        fp8 = torch.float8_e4m3fn
        return torch.cat([q, q_rope], -1).to(fp8), k.to(fp8), k_rope.to(fp8)

    return quantize


def _scaled_quant_fake(calls: list[dict[str, Any]], name: str) -> Callable[..., Any]:
    """Stand-in for `scaled_fp8_quant(x, scale)` (quantizes the query): records the scale, returns x / scale."""
    import torch

    def quant(x: Any, scale: Any = None, *args: Any, **kwargs: Any) -> Any:
        calls.append({"kernel": name, "args": [_plain(x), _plain(scale)], "kwargs": {}})
        return (x.float() / (scale if scale is not None else 1.0)).to(torch.float8_e4m3fn), scale

    return quant


def _row_scatter(calls: list[dict[str, Any]], name: str) -> Callable[..., Any]:
    """Stand-in for the pool's Triton row-copy kernel (`set_mla_kv_buffer_triton`, which the Triton interpreter
    cannot run): the same copy in torch, dst[loc] = [nope | rope], of the values SGLang's Python already cast."""
    import torch

    def scatter(dst: Any, loc: Any, nope: Any, rope: Any) -> None:
        calls.append({"kernel": name, "args": [_plain(nope), _plain(rope)], "kwargs": {}})
        row = torch.cat([nope.reshape(nope.shape[0], -1), rope.reshape(rope.shape[0], -1)], -1)
        dst.view(dst.shape[0], -1)[loc.long()] = row.view(dst.dtype)

    return scatter


POOL_MODULE = "sglang.srt.mem_cache.memory_pool"
POOL_PATCH = {"set_mla_kv_buffer_triton": _row_scatter, "set_mla_kv_buffer_dcp_sharded_triton": _row_scatter}


def run_backend(name: str, scale: float) -> dict[str, Any]:
    """One backend's decode step for one token: what the pool stores and what the kernel is handed."""
    import importlib

    import torch

    spec = BACKENDS[name]
    cls = getattr(importlib.import_module(spec["module"]), spec["class"])
    module = importlib.import_module(spec.get("patch_module", spec["module"]))  # where forward_decode's globals are
    pool_module = importlib.import_module(POOL_MODULE)
    for attr, factory in POOL_PATCH.items():
        setattr(pool_module, attr, factory([], attr))
    pool, layer, loc = _pool(), _layer(scale), 5
    torch.manual_seed(0)
    latent = torch.randn(1, 1, LATENT + ROPE, dtype=torch.bfloat16) * 4
    q = torch.randn(1, HEADS, LATENT + ROPE, dtype=torch.bfloat16)
    calls: list[dict[str, Any]] = []
    saved = {attr: getattr(module, attr, None) for attr in spec.get("patch", {})}
    for attr, factory in spec.get("patch", {}).items():
        setattr(module, attr, factory(calls, attr))
    backend = _backend(cls, pool, spec.get("attrs", {}))
    for attr, factory in spec.get("self_patch", {}).items():
        setattr(backend, attr, factory(calls, attr))
    if "metadata" in spec:
        backend.forward_metadata = spec["metadata"](calls)
        backend.forward_decode_metadata = backend.forward_metadata
    batch = _batch(loc)
    batch.forward_mode = SimpleNamespace(is_decode=lambda: True)
    error = None
    try:
        if spec.get("method"):
            result = getattr(backend, spec["method"])(*spec["method_args"](q, layer), **spec.get("method_kwargs", {}))
            calls.append({"kernel": spec["method"], "args": [_plain(r) for r in (
                result if isinstance(result, tuple) else (result,))], "kwargs": {}})
        elif spec.get("split"):  # q_nope / q_rope and k_nope / k_rope passed apart (trtllm_mla, flashinfer)
            k = latent[..., :LATENT].clone()
            backend.forward_decode(q[..., :LATENT].clone(), k, k, layer, batch, save_kv_cache=True,
                                   q_rope=q[..., LATENT:].clone(), k_rope=latent[..., LATENT:].clone())
        else:
            backend.forward_decode(q.reshape(1, -1), latent.clone(), latent[..., :LATENT].clone(), layer, batch,
                                   save_kv_cache=True)
    except KernelReached:
        pass
    except Exception:  # reported: the path needs something this runner did not give it
        error = traceback.format_exc(limit=4)
    finally:
        for attr, fn in saved.items():
            setattr(module, attr, fn)
    stored = pool.get_key_buffer(0)[loc].view(torch.uint8).flatten()
    cast = latent.reshape(-1).to(torch.float8_e4m3fn).view(torch.uint8)
    # latent / scale computed in the latent's dtype (BF16), as a write that divides before the cast does
    divided = latent.reshape(-1).clone().div_(torch.tensor(scale)).to(torch.float8_e4m3fn).view(torch.uint8)
    written = bool(stored.any())
    return {"backend": name, "error": error, "calls": calls, "written": written,
            "write_is_plain_cast": written and torch.equal(stored, cast),
            "write_divides_by_scale": written and torch.equal(stored, divided),
            "stubbed": sorted(spec.get("patch", {})) + sorted(spec.get("self_patch", {})) + sorted(POOL_PATCH)}


def _flashmla_metadata(calls: list[dict[str, Any]]) -> Anything:
    import torch

    return Anything(block_kv_indices=torch.zeros(1, 4, dtype=torch.int32))


def _trtllm_metadata(calls: list[dict[str, Any]]) -> Anything:
    import torch

    return Anything(block_kv_indices=torch.zeros(1, 4, dtype=torch.int32), max_seq_len_k=PAGE)


def _flashinfer_metadata(calls: list[dict[str, Any]]) -> Anything:
    return Anything(decode_wrapper=SimpleNamespace(run=_recorder(calls, "decode_wrapper.run")))


def _flashinfer_module(calls: list[dict[str, Any]], name: str) -> SimpleNamespace:
    """The `flashinfer` package as trtllm_mla_backend uses it (absent here): its decode kernel, recorded."""
    kernel = "flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla"
    return SimpleNamespace(decode=SimpleNamespace(trtllm_batch_decode_with_kv_cache_mla=_recorder(calls, kernel)))


_TRTLLM_ATTRS = {"_fused_set_kv_concat_q_fp8": False, "_fused_set_kv_concat_q": False, "qk_nope_head_dim": 128,
                 "workspace_buffer": None, "_multi_ctas_kv_counter_buffer": None}
_TRTLLM = {"module": "sglang.srt.layers.attention.trtllm_mla_backend", "class": "TRTLLMMLABackend", "split": True,
           "blackwell": True,
           "patch": {"mla_quantize_without_rope_for_fp8": _quantize_fake, "flashinfer": _flashinfer_module},
           "metadata": _trtllm_metadata}
BACKENDS: dict[str, dict[str, Any]] = {
    "triton": {"module": "sglang.srt.layers.attention.triton_backend", "class": "TritonAttnBackend",
               "self_patch": {"decode_attention_fwd": _raising},
               "attrs": {"enable_deterministic": False, "enable_lean_attention": False, "max_kv_splits": 8,
                         "swa_v_head_dim": None, "use_pdl": False}},
    "flashmla": {"module": "sglang.srt.layers.attention.flashmla_backend", "class": "FlashMLABackend",
                 "patch": {"flash_mla_with_kvcache": _raising, "scaled_fp8_quant": _scaled_quant_fake},
                 "attrs": {"is_fp8_kvcache": True}, "metadata": _flashmla_metadata},
    "trtllm_mla": {**_TRTLLM, "attrs": {**_TRTLLM_ATTRS, "backend": "trtllm-gen"}},
    "cutedsl_mla": {**_TRTLLM, "module": "sglang.srt.layers.attention.cutedsl_mla_backend",
                    "class": "CuteDslMLABackend", "patch_module": _TRTLLM["module"],
                    "attrs": {**_TRTLLM_ATTRS, "backend": "cute-dsl"}},
    "flashinfer": {"module": "sglang.srt.layers.attention.flashinfer_mla_backend",
                   "class": "FlashInferMLAAttnBackend", "split": True, "metadata": _flashinfer_metadata},
    "fa3": {"module": "sglang.srt.layers.attention.flashattention_backend", "class": "FlashAttentionBackend",
            "method": "prepare_paged_mha_query", "attrs": {"kv_cache_dtype_str": "fp8_e4m3",
                                                           "kv_cache_is_mxfp8": False, "fa_impl_ver": 3},
            "method_args": lambda q, layer: (q, None, None, layer),
            "method_kwargs": {"logical_batch_size": 1, "kv_head_num": 1, "is_prefill": False}},
}


def main(argv: list[str]) -> int:
    """OUT CKPT [SCALE] [BACKEND...]: each backend in a forked child that publishes SGLang's server args for
    CKPT with `--attention-backend BACKEND --kv-cache-dtype fp8_e4m3` first (the runtime context the pool reads)."""
    import os

    record_args: list[str] | None = None
    if "--record-args" in argv:  # also: which backend SGLang resolves for these server args (the serving record's)
        i = argv.index("--record-args")
        record_args = json.loads(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    out, ckpt = Path(argv[0]), Path(argv[1])
    scale = float(argv[2]) if len(argv) > 2 else 0.5
    run_sglang.prepare(["DeepseekV3ForCausalLM"], preload=True)
    from stubs import install_sglang_attention_stubs

    install_sglang_attention_stubs()
    import sglang.srt.mem_cache.memory_pool  # noqa: F401

    report: dict[str, Any] = {"scale": scale, "backends": {}, "record_backend": None}
    if record_args is not None:
        part = out.with_suffix(".record.json")
        pid = os.fork()
        if pid == 0:
            from sglang.srt.runtime_context import get_exec

            try:
                run_sglang._publish(ckpt, record_args)
                part.write_text(json.dumps(get_exec().kernel.attention_backend))
            except Exception:
                part.write_text(json.dumps("error: " + traceback.format_exc(limit=3)))
            os._exit(0)
        os.waitpid(pid, 0)
        report["record_backend"] = json.loads(part.read_text())
    for name in argv[3:] or list(BACKENDS):
        part = out.with_suffix(f".{name}.json")
        pid = os.fork()
        if pid == 0:
            try:
                # the runtime context the pool reads; SGLang refuses the Blackwell-only backends on the
                # H200 the stubs describe, so those publish SGLang's own default instead
                server = [] if BACKENDS[name].get("blackwell") else ["--attention-backend", name]
                run_sglang._publish(ckpt, [*server, "--kv-cache-dtype", "fp8_e4m3", "--page-size", str(PAGE)])
                result = run_backend(name, scale)
            except Exception:
                result = {"backend": name, "error": traceback.format_exc(limit=6)}
            part.write_text(json.dumps(result, default=str))
            sys.stdout.flush()
            os._exit(0)
        os.waitpid(pid, 0)
        report["backends"][name] = json.loads(part.read_text())
    out.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
