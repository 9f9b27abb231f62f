"""Execute SGLang 0.5.23's own prefill/decode checks on a PD pair, on the CPU, and write what they decided as JSON.

    python tests/engines/run_sglang_pd.py JOBS.json OUT.json
    JOBS: [{"name", "prefill": {"ckpt", "args"}, "decode": {"ckpt", "args"}}]   (args: the server argv, without
    `python -m sglang.launch_server`)

SGLang is imported once (stubs of tests/engines/stubs.py, as run_sglang.py). Per side, in a forked child (so
each side publishes its own runtime context): `prepare_server_args` + `publish` (SGLang's argparse and resolution,
hence the attention / DSA backends it picks for this role on an H200), `ModelConfig.from_server_args`,
`_get_quantization_config` (the checkpoint's quantization config as SGLang parses it, `kv_cache_quant_algo`),
`configure_kv_cache_dtype` on that quant config, and `calculate_mla_kv_cache_dim` (the KV row this role's
backend stores). `kv_cache_dtype_str` is then what `ModelRunner` sets (`resolved if resolved is not None else
get_model().kv_cache_dtype`, model_runner.py). The model itself is not built (only its quant config is read).
`--tp-size` runs as 1 (one CPU rank; both sides alike, the checks compared here do not depend on it).

Then, in the parent, the decode side's handshake: `CommonKVManager.try_ensure_parallel_info` of
`disaggregation/common/conn.py` runs on a manager holding the decode's values, with `requests.get` answering the
prefill bootstrap server's `/route` reply built from the prefill's values (the fields the prefill's
`_register_to_bootstrap` payload carries); its return value or the error it raises is reported.
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

import run_sglang  # noqa: E402  (tests/engines: SGLang's paths and stubs)


def _server_argv(ckpt: str, args: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(args):
        if args[i] in ("--model-path", "--tp-size"):
            i += 2
            continue
        out.append(args[i])
        i += 1
    return ["--model-path", ckpt, "--tp-size", "1", *out]


def side(ckpt: str, args: list[str]) -> dict[str, Any]:
    """What one server resolves for its args: backends, page size, dtype, KV dtype string and row."""
    import torch
    from sglang.srt.mem_cache.kv_cache_configurator import calculate_mla_kv_cache_dim
    from sglang.srt.runtime_context import attention_backends, get_exec, get_model

    server_args = run_sglang._publish(Path(ckpt), _server_argv(ckpt, args)[2:])
    model_config, quant_config, dtype_str, dtype = run_sglang.kv_cache_of(server_args)
    kernel = get_exec().kernel
    dim = calculate_mla_kv_cache_dim(model_config=model_config, kv_cache_dtype=dtype)
    return {
        "kv_cache_dtype_cli": get_model().kv_cache_dtype,
        "kv_cache_quant_algo": getattr(quant_config, "kv_cache_quant_algo", None),
        "kv_cache_dtype_str": dtype_str,
        "kv_dtype": str(dtype).removeprefix("torch."),
        "page_size": server_args.page_size,
        "dtype": str(model_config.dtype).removeprefix("torch."),
        "attention_backend": get_exec().kernel.attention_backend,
        "attention_backends": list(attention_backends()),  # (prefill, decode) as the model runner resolves them
        "dsa_prefill_backend": getattr(kernel, "dsa_prefill_backend", None),
        "dsa_decode_backend": getattr(kernel, "dsa_decode_backend", None),
        "kv_row_bytes": dim * torch.empty((), dtype=dtype).element_size(),  # FP8 rows: one byte per entry
    }


def handshake(prefill: dict[str, Any], decode: dict[str, Any]) -> dict[str, Any]:
    """The decode's first-request check against the prefill's bootstrap reply (SGLang's own method)."""
    from sglang.srt.disaggregation.common import conn

    reply = {"attn_tp_size": 1, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": prefill["page_size"],
             "kv_cache_dtype": prefill["kv_cache_dtype_str"], "follow_bootstrap_room": True}

    class Reply:
        status_code = 200
        text = json.dumps(reply)

        def json(self) -> dict[str, Any]:
            return dict(reply)

    manager = object.__new__(conn.CommonKVManager)
    manager.__dict__.update(
        prefill_info_table={}, kv_cache_dtype_str=decode["kv_cache_dtype_str"], kv_layout=None,
        dsv41_spec_layout=None, is_mla_backend=True, is_hybrid_mla_backend=False, dcp_size=1,
        attn_tp_size=1, attn_tp_rank=0, attn_cp_size=1, attn_cp_rank=0, pp_size=1, pp_rank=0,
        kv_args=SimpleNamespace(page_size=decode["page_size"], state_types=(), engine_rank=0))
    real_get = conn.requests.get
    conn.requests.get = lambda url, timeout=None: Reply()
    try:
        return {"accepted": manager.try_ensure_parallel_info("prefill-host:8998"), "error": None}
    except Exception as exc:  # the refusal SGLang raises (RuntimeError) or a missing attribute (reported)
        return {"accepted": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        conn.requests.get = real_get


def _child(job: dict[str, Any], role: str, out: Path) -> dict[str, Any]:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            result = side(job[role]["ckpt"], job[role]["args"])
            out.write_text(json.dumps(result))
            code = 0
        except Exception:
            out.write_text(json.dumps({"error": traceback.format_exc()}))
            code = 0
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.waitpid(pid, 0)
    return json.loads(out.read_text())


def main(argv: list[str]) -> int:
    jobs = json.loads(Path(argv[0]).read_text())
    archs = {json.loads((Path(j[r]["ckpt"]) / "config.json").read_text())["architectures"][0]
             for j in jobs for r in ("prefill", "decode")}
    run_sglang.prepare(sorted(archs), preload=True)
    import sglang.srt.disaggregation.common.conn  # noqa: F401  (imported once, before the children fork)
    import sglang.srt.mem_cache.kv_cache_configurator  # noqa: F401
    import sglang.srt.model_loader.loader  # noqa: F401

    results = []
    for i, job in enumerate(jobs):
        report: dict[str, Any] = {"name": job.get("name", str(i))}
        for role in ("prefill", "decode"):
            report[role] = _child(job, role, Path(argv[1] + f".{i}.{role}"))
        if "error" not in report["prefill"] and "error" not in report["decode"]:
            report["handshake"] = handshake(report["prefill"], report["decode"])
        results.append(report)
    Path(argv[1]).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
