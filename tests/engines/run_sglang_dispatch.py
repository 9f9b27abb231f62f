"""Which MLA forward method SGLang 0.5.23 takes for a fresh prompt under given server args, executed: JSON out.

    python tests/engines/run_sglang_dispatch.py OUT.json CKPT ARGS_JSON [ARGS_JSON...]

Per argument list (each in a forked child): SGLang's `prepare_server_args` + `publish` for CKPT, then what the
published config says about the prefill CUDA graph (`cuda_graph_config.prefill.backend`, SGLang's default on CUDA
is the breakable graph, "BCG"; the PD decode role disables it), and the method DeepSeek's attention dispatch picks
(`models/deepseek_common/attention_backend_handler.py`, the handler registered for the resolved attention backend,
`triton` falling back as SGLang does) for a fresh prompt (an extend with no cached prefix), an extend after a
cached prefix, and a decode -- once outside the breakable graph (an eager prefill) and once inside it
(`enable_breakable_cuda_graph()`, what a replayed prefill runs under). MHA means the prompt's latent rows are
written by `_set_mla_kv_buffer` (a plain cast); MLA means the backend's `forward_extend` writes them (triton:
divided by k_scale).
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


def _batch(kind: str) -> SimpleNamespace:
    """The forward-batch fields the handlers read: SGLang's own ForwardMode, prefix lengths, sequence lengths."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    extend = kind != "decode"
    return SimpleNamespace(forward_mode=ForwardMode.EXTEND if extend else ForwardMode.DECODE,
                           extend_prefix_lens_cpu=([16] if kind == "prefix" else [0]) if extend else None,
                           seq_lens_cpu=[64], attn_cp_metadata=None, get_max_chunk_capacity=lambda: 8192)


def dispatch(ckpt: Path, args: list[str]) -> dict[str, Any]:
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.context import (
        enable_breakable_cuda_graph,
    )
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
    from sglang.srt.runtime_context import get_exec

    run_sglang._publish(ckpt, args)
    exec_cfg = get_exec()
    graphs = exec_cfg.graph.cuda_graph_config
    backend = exec_cfg.kernel.attention_backend
    handler = AttentionBackendRegistry.get_handler(backend)
    attn = SimpleNamespace(kv_cache_dtype="fp8_e4m3", num_local_heads=16, qk_nope_head_dim=128,
                           qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512, flashinfer_mla_disable_ragged=False,
                           chunked_prefix_cache_threshold=8192, disable_chunked_prefix_cache=False)
    methods: dict[str, dict[str, str]] = {"eager": {}, "prefill_graph": {}}
    for kind in ("fresh_prompt", "prefix", "decode"):
        methods["eager"][kind] = handler(attn, _batch(kind)).name
        with enable_breakable_cuda_graph():
            methods["prefill_graph"][kind] = handler(attn, _batch(kind)).name
    return {"args": args, "attention_backend": backend, "handler": handler.__name__,
            "prefill_graph": graphs.prefill.backend, "decode_graph": graphs.decode.backend,
            "deterministic": bool(exec_cfg.deterministic.enable_deterministic_inference), "methods": methods}


def main(argv: list[str]) -> int:
    out, ckpt = Path(argv[0]), Path(argv[1])
    arg_lists = [json.loads(a) for a in argv[2:]]
    run_sglang.prepare(["DeepseekV3ForCausalLM"], preload=True)
    from stubs import install_sglang_attention_stubs

    install_sglang_attention_stubs()
    import sglang.srt.models.deepseek_common.attention_backend_handler  # noqa: F401

    results = []
    for i, args in enumerate(arg_lists):
        part = out.with_suffix(f".{i}.json")
        pid = os.fork()
        if pid == 0:
            try:
                result: dict[str, Any] = dispatch(ckpt, args)
            except Exception:
                result = {"args": args, "error": traceback.format_exc(limit=5)}
            part.write_text(json.dumps(result))
            sys.stdout.flush()
            os._exit(0)
        os.waitpid(pid, 0)
        results.append(json.loads(part.read_text()))
    out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
