"""KV pages moved between two processes by SGLang 0.5.23's own PD transfer code over Mooncake (TCP), on the CPU.

    python tests/engines/run_sglang_pd_transfer.py OUT.json CKPT [--source SRC] [CASE...]
    cases: fp8, bf16-fp8, bf16-fp8-forced, plugin (default: all). CKPT: a converted checkpoint with calibrated FP8
    KV scales (the decode's, and the prefill's except in `plugin`); SRC: its BF16-KV source, the `plugin` prefill
    (`--kv-cache-dtype auto`, as quantkit's pd_split record launches it; without SRC: CKPT with `bf16`).

SGLang is imported once (run_sglang.prepare: the stubs of tests/engines/stubs.py, minus zmq and aiohttp, which are
real here, from .cache/engines/mooncake); per case and page size (1, 64) two forked children play the prefill and
the decode server, talking over 127.0.0.1 only. In each child, for real: `prepare_server_args` + `publish` of
`--disaggregation-mode prefill|decode --disaggregation-transfer-backend mooncake --kv-cache-dtype X --page-size P`,
`ModelConfig` + the checkpoint's quant config + `configure_kv_cache_dtype` (the `kv_cache_dtype_str` ModelRunner
sets), `maybe_init_shared_mooncake_transfer_engine` (Mooncake's TransferEngine, protocol tcp), a real
`MLATokenToKVPool` on the CPU and real `MetadataBuffers`, and the KV manager built by
`PrefillBootstrapQueue._init_kv_manager` / `DecodePreallocQueue._init_kv_manager` (run on an instance carrying
only the attributes they read). Prefill: `load_plugins()` first (SGLANG_PLUGINS=quantkit_pd_kv: the plugin is on
iff QUANTKIT_PD_KV is set), `start_disagg_service()` (the bootstrap server), a `MooncakeKVSender` polled to
WaitingForInput, `init` + `send` of its page indices, polled to Success/Failed. Decode: a `MooncakeKVReceiver`,
`try_ensure_parallel_info` retried as `DecodePreallocQueue` does, `init`, `send_metadata` of its destination
pages, polled to Success/Failed. Both dump their pools; the parent compares the bytes.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run_sglang  # noqa: E402

MOONCAKE = run_sglang.ENGINES / "mooncake"
PAGES = (1, 64)
POOL_PAGES = 8  # usable pages per pool (page 0 of the buffer is SGLang's padding page)
SRC_PAGES = (1, 3, 4)  # what the prefill sends
CANARY = 0xA5  # every decode byte before the transfer
ROOM = 4242
AUX_TOKEN = 31337  # first output token in the prefill's metadata row
# case -> prefill / decode --kv-cache-dtype, prefill env, decode destination pages, and (control only) the
# dtype string the decode manager claims, so that SGLang's dtype check passes and the raw copy runs.
CASES: dict[str, dict[str, Any]] = {
    "fp8": {"prefill": "fp8_e4m3", "decode": "fp8_e4m3", "env": {}, "dst": (5, 2, 6)},
    # the prefill's sender would wait for the decode until SGLang's bootstrap timeout: shortened to see its end
    "bf16-fp8": {"prefill": "bf16", "decode": "fp8_e4m3", "env": {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "1"},
                 "dst": (5, 2, 6)},
    # dst pages in the first half: the BF16 item length doubles every decode offset (more would write past the pool)
    "bf16-fp8-forced": {"prefill": "bf16", "decode": "fp8_e4m3", "env": {}, "dst": (1, 2, 3), "claim": "bf16"},
    "plugin": {"prefill": "auto", "decode": "fp8_e4m3", "dst": (5, 2, 6), "prefill_ckpt": "source",
               "env": {"QUANTKIT_PD_KV": "bf16-to-fp8", "QUANTKIT_PD_KV_DECODE": "{ckpt}"}},
}
DEFAULT_CASES = ("fp8", "bf16-fp8", "bf16-fp8-forced", "plugin")
STATUS = {0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput", 3: "Transferring", 4: "Success"}


def prepare() -> None:
    """run_sglang.prepare, with the real zmq / aiohttp / mooncake of .cache/engines/mooncake."""
    run_sglang.prepare(["DeepseekV3ForCausalLM"])
    sys.path.insert(0, str(MOONCAKE))
    real = {"zmq", "aiohttp"}
    for finder in sys.meta_path:
        if type(finder).__name__ == "_AbsentFinder":
            finder.names = frozenset(n for n in finder.names if n not in real)
    stubs = {name: sys.modules.pop(name) for name in [m for m in sys.modules if m.split(".")[0] in real]}
    import importlib

    for module in list(sys.modules.values()):  # modules imported during the stubs' setup hold the placeholders
        for attr, value in list(getattr(module, "__dict__", {}).items()):
            if any(value is stub for stub in stubs.values()):
                setattr(module, attr, importlib.import_module(value.__name__))

    for name in run_sglang._PRELOAD:  # not disaggregation.common.conn: it opens a zmq context at import (no fork)
        importlib.import_module(name)
    import sglang.srt.mem_cache.memory_pool  # noqa: F401


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        self.seen: set[int] = set()

    def emit(self, record: logging.LogRecord) -> None:
        if id(record) in self.seen:
            return
        self.seen.add(id(record))
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}"[:400])


def _resolve(ckpt: str, args: list[str]) -> tuple[Any, Any, str, Any]:
    """Publish the server args; (server_args, model_config, kv_cache_dtype_str, kv torch dtype) as ModelRunner."""
    from types import SimpleNamespace

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache.kv_cache_dtype import configure_kv_cache_dtype
    from sglang.srt.model_executor.model_runner_components.load_model_utils import build_load_config
    from sglang.srt.model_loader.loader import _get_quantization_config
    from sglang.srt.runtime_context import get_model

    server_args = run_sglang._publish(Path(ckpt), args)
    run_sglang._init_single_rank()  # gloo, one rank: the parallel groups the KV manager reads (pp_group)
    model_config = ModelConfig.from_server_args(server_args)
    load_config = build_load_config(server_args=server_args, tp_rank=0,
                                    remote_instance_weight_transporter_engine=None,
                                    remote_instance_weight_transporter_session_id="", draft_model_idx=None,
                                    weight_cache_mode=get_model().weight_cache_mode, weight_cache_socket=None)
    quant = _get_quantization_config(model_config, load_config)
    resolved, dtype = configure_kv_cache_dtype(
        server_args_kv_cache_dtype=get_model().kv_cache_dtype, model=SimpleNamespace(quant_config=quant),
        model_dtype=model_config.dtype, is_draft_worker=False, is_dflash=False,
        speculative_draft_attention_backend=None)
    return server_args, model_config, resolved if resolved is not None else get_model().kv_cache_dtype, dtype


def _manager(role: str, ckpt: str, args: list[str], page: int) -> tuple[Any, Any, Any, str]:
    """(kv manager, pool, metadata buffers, kv_cache_dtype_str), the manager built by SGLang's queue method."""
    from types import SimpleNamespace

    import torch
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.utils import MetadataBuffers, TransferBackend, is_mla_backend
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        maybe_init_shared_mooncake_transfer_engine,
    )
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    server_args, model_config, dtype_str, dtype = _resolve(ckpt, args)
    if role == "prefill":  # the bootstrap server (SGLang starts it in the tokenizer manager's process)
        from sglang.srt.managers.disagg_service import start_disagg_service

        start_disagg_service()
    maybe_init_shared_mooncake_transfer_engine(gpu_id=0)
    hf = model_config.hf_text_config
    pool = MLATokenToKVPool(size=POOL_PAGES * page, page_size=page, dtype=dtype, kv_lora_rank=hf.kv_lora_rank,
                            qk_rope_head_dim=hf.qk_rope_head_dim, layer_num=model_config.num_hidden_layers,
                            device="cpu", enable_memory_saver=False)
    meta = MetadataBuffers(4, hidden_size=hf.hidden_size, hidden_states_dtype=torch.bfloat16,
                           max_sampling_mask_tokens=16)
    runner = SimpleNamespace(kv_cache_dtype_str=dtype_str)
    scheduler = SimpleNamespace(rust_server=None, tp_worker=SimpleNamespace(model_runner=runner),
                                model_config=model_config, server_args=server_args, enable_hisparse=False)
    cls = PrefillBootstrapQueue if role == "prefill" else DecodePreallocQueue
    queue = object.__new__(cls)
    queue.__dict__.update(transfer_backend=TransferBackend.MOONCAKE, tp_rank=0, pp_rank=0, scheduler=scheduler,
                          token_to_kv_pool=pool, draft_token_to_kv_pool=None, is_mla_backend=is_mla_backend(pool),
                          metadata_buffers=meta, enable_staging=False)
    return queue._init_kv_manager(), pool, meta, dtype_str


def _fill(pool: Any, fp8: bool) -> None:
    import torch

    gen = torch.Generator().manual_seed(7)
    for buf in pool.kv_buffer:
        if fp8:  # arbitrary FP8 bytes
            buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.shape, generator=gen, dtype=torch.uint8))
        else:  # latents of a realistic size
            buf.copy_((torch.randn(buf.shape, generator=gen) * 3).to(buf.dtype))


def _poll(obj: Any, done: set[int], deadline: float, stop: Path | None = None) -> int:
    status = obj.poll()
    while status not in done and time.time() < deadline and not (stop is not None and stop.exists()):
        time.sleep(0.005)
        status = obj.poll()
    return int(status)


def prefill(ckpt: str, args: list[str], page: int, work: Path) -> dict[str, Any]:
    import numpy as np
    import sglang.srt.plugins as plugins
    import torch

    out: dict[str, Any] = {"plugin_error": None}
    os.environ["SGLANG_PLUGINS"] = "quantkit_pd_kv"
    try:
        plugins.load_plugins()
    except Exception as exc:  # the plugin refusing to start is a result
        out["plugin_error"] = f"{type(exc).__name__}: {exc}"
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

    mgr, pool, meta, out["kv_cache_dtype_str"] = _manager("prefill", ckpt, args, page)
    out["kv_item_lens"], out["advertised_kv_cache_dtype"] = list(mgr.kv_args.kv_item_lens), mgr.kv_cache_dtype_str
    _fill(pool, pool.store_dtype != torch.bfloat16)
    meta.output_ids[0, 0] = AUX_TOKEN
    torch.save([b.clone() for b in pool.kv_buffer], work / "prefill.pt")
    sender = MooncakeKVSender(mgr, f"127.0.0.1:{mgr.bootstrap_port}", ROOM)
    (work / "prefill.ready").touch()
    stop = None if "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT" in os.environ else work / "decode.json"
    status = _poll(sender, {0, 2}, time.time() + 60, stop)
    out["status_before_send"] = STATUS[status]
    if status == 2:
        sender.init(len(SRC_PAGES), 0)
        start = time.perf_counter()
        sender.send(np.array(SRC_PAGES, dtype=np.int32))
        status = _poll(sender, {0, 4}, time.time() + 60)
        out["transfer_s"] = time.perf_counter() - start
    out["status"] = STATUS[status]
    out["failure"] = mgr.failure_records.get(ROOM)
    deadline = time.time() + 30  # stay up (engine, sockets) until the decode has its answer, as a server would
    while not (work / "decode.json").exists() and time.time() < deadline:
        time.sleep(0.01)
    return out


def decode(ckpt: str, args: list[str], page: int, work: Path, case: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import torch
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVReceiver

    out: dict[str, Any] = {"error": None}
    mgr, pool, meta, out["kv_cache_dtype_str"] = _manager("decode", ckpt, args, page)
    out["kv_item_lens"], out["advertised_kv_cache_dtype"] = list(mgr.kv_args.kv_item_lens), mgr.kv_cache_dtype_str
    if case.get("claim"):  # control only: pass the dtype-string check, nothing else changed
        mgr.kv_cache_dtype_str = case["claim"]
    for buf in pool.kv_buffer:
        buf.view(torch.uint8).fill_(CANARY)
    deadline, gone = time.time() + 60, work / "prefill.json"  # gone: the prefill child has ended
    while not (work / "prefill.ready").exists() and not gone.exists() and time.time() < deadline:
        time.sleep(0.01)
    addr = f"127.0.0.1:{mgr.bootstrap_port}"
    receiver = MooncakeKVReceiver(mgr, addr, ROOM)
    try:
        while not mgr.try_ensure_parallel_info(addr) and not gone.exists() and time.time() < deadline:
            time.sleep(0.05)  # DecodePreallocQueue retries the same way while the prefill registers
        if addr not in mgr.prefill_info_table:
            raise RuntimeError("the prefill's bootstrap server never answered /route")
        receiver.init(0)
        start = time.perf_counter()
        receiver.send_metadata(np.array(case["dst"], dtype=np.int32), aux_index=0)
        out["status"] = STATUS[_poll(receiver, {0, 4}, time.time() + 60, gone)]
        out["transfer_s"] = time.perf_counter() - start
    except Exception as exc:  # SGLang's refusal (nothing in the scheduler catches it: the server exits)
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["status"] = STATUS[int(mgr.check_status(ROOM))]
    out["failure"] = mgr.failure_records.get(ROOM)
    out["aux_token"] = int(meta.output_ids[0, 0])
    torch.save([b.clone() for b in pool.kv_buffer], work / "decode.pt")
    return out


def _child(role: str, case: str, ckpts: dict[str, str], page: int, port: int, work: Path) -> int:
    pid = os.fork()
    if pid:
        return pid
    code, result = 0, {}
    errors = _Errors()
    for name in ("", "sglang"):
        logging.getLogger(name).addHandler(errors)
    try:
        spec = CASES[case]
        ckpt, kv = ckpts["ckpt"], spec[role]
        if role == "prefill" and spec.get("prefill_ckpt") == "source":
            ckpt, kv = (ckpts["source"], kv) if ckpts.get("source") else (ckpt, "bf16")
        os.environ.update(MC_FORCE_TCP="1", MOONCAKE_PROTOCOL="tcp", SGLANG_HOST_IP="127.0.0.1")
        if role == "prefill":
            os.environ.update({k: v.format(ckpt=ckpts["ckpt"]) for k, v in spec["env"].items()})
        args = ["--tp-size", "1", "--host", "127.0.0.1", "--disaggregation-mode", role,
                "--disaggregation-transfer-backend", "mooncake", "--disaggregation-bootstrap-port", str(port),
                "--kv-cache-dtype", kv, "--page-size", str(page)]
        result = prefill(ckpt, args, page, work) if role == "prefill" else decode(ckpt, args, page, work, spec)
    except Exception:
        result = {"error": traceback.format_exc(limit=8), "status": None}
    result["log"] = errors.lines[-20:]
    (work / f"{role}.json.tmp").write_text(json.dumps(result))
    (work / f"{role}.json.tmp").rename(work / f"{role}.json")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _wait(pids: list[int], timeout: float) -> bool:
    deadline, left = time.time() + timeout, set(pids)
    while left and time.time() < deadline:
        for pid in list(left):
            if os.waitpid(pid, os.WNOHANG)[0]:
                left.discard(pid)
        time.sleep(0.02)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return not left


def _k_scales(ckpt: str, layers: int) -> list[float]:
    from safetensors import safe_open

    index = json.loads((Path(ckpt) / "model.safetensors.index.json").read_text())["weight_map"]
    scales = []
    for i in range(layers):
        name = f"model.layers.{i}.self_attn.k_proj.k_scale"
        with safe_open(Path(ckpt) / index[name], "pt") as f:
            scales.append(float(f.get_tensor(name)))
    return scales


def compare(case: str, ckpt: str, page: int, work: Path) -> dict[str, Any]:
    """Destination pages against what the decode should hold; every other decode byte still the canary."""
    import torch

    from quantkit.serving.sglang_pd import mla_pages_to_fp8

    src, dst = torch.load(work / "prefill.pt"), torch.load(work / "decode.pt")
    dst_pages = CASES[case]["dst"]
    scales = _k_scales(ckpt, len(src)) if case == "plugin" else [1.0] * len(src)
    differing, untouched_ok, intended_empty, stray, written = 0, True, 0, 0, []
    for layer, (s, d) in enumerate(zip(src, dst, strict=True)):
        s_pages = s.reshape(-1, page, s.shape[-1])
        d_pages = d.view(torch.uint8).reshape(-1, page, d.shape[-1] * d.element_size())
        idx = torch.tensor(SRC_PAGES)
        if case == "plugin":
            want = mla_pages_to_fp8(s_pages[idx], scales[layer])
        else:
            want = s_pages[idx].view(torch.uint8).reshape(len(SRC_PAGES), page, -1)
        got = d_pages[torch.tensor(dst_pages)]
        differing += int((got != want).sum()) if got.shape == want.shape else int(got.numel())
        intended_empty += int((got == CANARY).all(dim=(1, 2)).sum())
        others = torch.ones(d_pages.shape[0], dtype=torch.bool)
        others[list(dst_pages)] = False
        bad = int((d_pages[others] != CANARY).sum())
        if layer == 0:
            written = [i for i in range(d_pages.shape[0]) if bool((d_pages[i] != CANARY).any())]
        stray += bad
        untouched_ok &= bad == 0
    return {"equal": differing == 0, "differing_bytes": differing, "others_untouched": untouched_ok,
            "stray_bytes": stray, "intended_pages_still_canary": intended_empty, "dst_pages": list(dst_pages),
            "written_pages_layer0": written,
            "page_bytes_decode": int(dst[0][:page].numel() * dst[0].element_size()),
            "page_bytes_prefill": int(src[0][:page].numel() * src[0].element_size())}


def run_case(case: str, ckpts: dict[str, str], page: int, root: Path) -> dict[str, Any]:
    work = root / f"{case}-{page}"
    work.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.perf_counter()
    finished = _wait([_child("prefill", case, ckpts, page, port, work),
                      _child("decode", case, ckpts, page, port, work)], timeout=150)
    out: dict[str, Any] = {"case": case, "page_size": page, "finished": finished,
                           "wall_s": round(time.perf_counter() - started, 2)}
    for role in ("prefill", "decode"):
        path = work / f"{role}.json"
        out[role] = json.loads(path.read_text()) if path.exists() else {"error": "no result (killed)"}
    d = out["decode"]
    if d.get("transfer_s") is not None:
        d["transfer_ms_per_page"] = round(1000 * d["transfer_s"] / len(SRC_PAGES), 3)
    if (work / "decode.pt").exists() and (work / "prefill.pt").exists():
        out["pages"] = compare(case, ckpts["ckpt"], page, work)
    return out


def main(argv: list[str]) -> int:
    out, ckpts, rest = Path(argv[0]), {"ckpt": str(Path(argv[1]).resolve())}, argv[2:]
    if rest[:1] == ["--source"]:
        ckpts["source"], rest = str(Path(rest[1]).resolve()), rest[2:]
    cases = rest or list(DEFAULT_CASES)
    prepare()
    root = out.parent / (out.stem + "-work")
    report = {"ckpts": ckpts, "cases": [run_case(c, ckpts, p, root) for c in cases for p in PAGES]}
    out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
