"""KV pages moved between two processes by SGLang 0.5.23's own PD transfer code over Mooncake (TCP), on the CPU.

    python tests/engines/run_sglang_pd_transfer.py OUT.json CKPT [--source SRC] [--dsa DSA --dsa-source DSA_SRC]
        [CASE...]
    cases (pd_transfer_cases.CASES): fp8, bf16-fp8, bf16-fp8-forced, plugin, plugin-rounds, and plugin-dsa with
    --dsa (default: all). CKPT: a converted checkpoint with calibrated FP8 KV scales (the decode's, and the
    prefill's except in the plugin cases); SRC: its BF16-KV source, the plugin prefill (`--kv-cache-dtype auto`,
    as quantkit's pd_split record launches it; without SRC: CKPT with `bf16`). DSA / DSA_SRC: the same for GLM-5.

SGLang is imported once (run_sglang.prepare: the stubs of tests/engines/stubs.py, minus zmq and aiohttp, which are
real here, from .cache/engines/mooncake); per case and page size (1, 64) two forked children play the prefill and
the decode server, talking over 127.0.0.1 only. In each child, for real: `prepare_server_args` + `publish` of
`--disaggregation-mode prefill|decode --disaggregation-transfer-backend mooncake --kv-cache-dtype X --page-size P`,
`ModelConfig` + the checkpoint's quant config + `configure_kv_cache_dtype` (the `kv_cache_dtype_str` ModelRunner
sets), `maybe_init_shared_mooncake_transfer_engine` (Mooncake's TransferEngine, protocol tcp), a real
`MLATokenToKVPool` (DSA: `DSATokenToKVPool`, see pd_transfer_cases) on the CPU at the page size SGLang resolved,
real `MetadataBuffers`, and the KV manager built by `PrefillBootstrapQueue._init_kv_manager` /
`DecodePreallocQueue._init_kv_manager` (run on an instance carrying only the attributes they read). Prefill:
`load_plugins()` first (SGLANG_PLUGINS=quantkit_pd_kv: the plugin is on iff QUANTKIT_PD_KV is set),
`start_disagg_service()` (the bootstrap server), a `MooncakeKVSender` polled to WaitingForInput, `init` + `send`
of its page indices, polled to Success/Failed. Decode: a `MooncakeKVReceiver`,
`try_ensure_parallel_info` retried as `DecodePreallocQueue` does, `init`, `send_metadata` of its destination
pages (and, for DSA, of its indexer state), polled to Success/Failed. Both dump their pools (DSA: the decode also
writes its own reference pool); the parent compares the bytes.
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

import pd_transfer_cases as cases  # noqa: E402
import run_sglang  # noqa: E402
from pd_transfer_cases import CASES, DEFAULT_CASES, PAGES, SRC_PAGES  # noqa: E402

MOONCAKE = run_sglang.ENGINES / "mooncake"
ROOM = 4242
AUX_TOKEN = 31337  # first output token in the prefill's metadata row
STATUS = {0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput", 3: "Transferring", 4: "Success"}


def prepare() -> None:
    """run_sglang.prepare, with the real zmq / aiohttp / mooncake of .cache/engines/mooncake."""
    run_sglang.prepare(["DeepseekV3ForCausalLM", "GlmMoeDsaForCausalLM"])
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


class PageSizeResolved(Exception):
    def __init__(self, requested: int, resolved: int, pool_error: str | None) -> None:
        super().__init__(f"SGLang resolved --page-size {requested} to {resolved}")
        self.resolved, self.pool_error = resolved, pool_error


def _resolve(ckpt: str, args: list[str]) -> tuple[Any, Any, str, Any]:
    """Publish the server args; (server_args, model_config, kv_cache_dtype_str, kv torch dtype) as ModelRunner."""
    server_args = run_sglang._publish(Path(ckpt), args)
    run_sglang._init_single_rank()  # gloo, one rank: the parallel groups the KV manager reads (pp_group)
    model_config, _, dtype_str, dtype = run_sglang.kv_cache_of(server_args)
    return server_args, model_config, dtype_str, dtype


def _manager(role: str, ckpt: str, args: list[str], page: int) -> tuple[Any, Any, Any, dict[str, Any], Any]:
    """(kv manager, pool, metadata buffers, notes, a builder of another such pool), the manager built by SGLang's
    queue method."""
    from types import SimpleNamespace

    import torch
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.utils import MetadataBuffers, TransferBackend, is_mla_backend
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        maybe_init_shared_mooncake_transfer_engine,
    )
    from sglang.srt.runtime_context import get_schedule

    server_args, model_config, dtype_str, dtype = _resolve(ckpt, args)
    if role == "prefill":  # the bootstrap server (SGLang starts it in the tokenizer manager's process)
        from sglang.srt.managers.disagg_service import start_disagg_service

        start_disagg_service()
    resolved = get_schedule().page_size  # what ModelRunner builds its pool with
    if resolved != page:  # GLM-5 on CUDA: SGLang resolves every --page-size to 64
        raise PageSizeResolved(page, resolved, cases.pool_error(model_config, dtype, page))
    maybe_init_shared_mooncake_transfer_engine(gpu_id=0)
    pool, notes = cases.build_pool(model_config, dtype, page)
    notes.update(kv_cache_dtype_str=dtype_str, page_size_resolved=resolved)
    hf = model_config.hf_text_config
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
    return queue._init_kv_manager(), pool, meta, notes, lambda: cases.build_pool(model_config, dtype, page)[0]


def _describe(mgr: Any, pool: Any, notes: dict[str, Any]) -> dict[str, Any]:
    args = mgr.kv_args
    return {**notes, "kv_item_lens": list(args.kv_item_lens), "advertised_kv_cache_dtype": mgr.kv_cache_dtype_str,
            "state_types": [str(getattr(t, "value", t)) for t in getattr(args, "state_types", [])],
            "state_item_lens": [list(x) for x in getattr(args, "state_item_lens", [])],
            "pool_class": type(pool).__name__, "store_dtype": str(pool.store_dtype)}


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

    mgr, pool, meta, notes, _ = _manager("prefill", ckpt, args, page)
    out.update(_describe(mgr, pool, notes))
    staging = getattr(mgr, "_quantkit_pd_staging", None)
    out["staging_slots"] = staging.slots if staging is not None else None
    if staging is not None:  # record SGLang's send of each round: (staging slots, decode pages, its status)
        rounds, send = [], staging.send

        def counted(pages: Any, dst: Any, sglang_send: Any) -> int:
            def one(slots: Any, to: Any) -> int:
                ret = sglang_send(slots, to)
                rounds.append({"slots": [int(x) for x in slots], "dst": [int(x) for x in to], "ret": int(ret)})
                return ret

            return send(pages, dst, one)

        staging.send, out["rounds"] = counted, rounds
    cases.fill(pool, pool.store_dtype != torch.bfloat16)
    meta.output_ids[0, 0] = AUX_TOKEN
    cases.dump(pool, work / "prefill.pt")
    sender = MooncakeKVSender(mgr, f"127.0.0.1:{mgr.bootstrap_port}", ROOM)
    (work / "prefill.ready").touch()
    stop = None if "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT" in os.environ else work / "decode.json"
    status = _poll(sender, {0, 2}, time.time() + 60, stop)
    out["status_before_send"] = STATUS[status]
    if status == 2:
        sender.init(len(SRC_PAGES), 0)
        start = time.perf_counter()
        sender.send(np.array(SRC_PAGES, dtype=np.int32), cases.state_indices(mgr.kv_args, SRC_PAGES))
        status = _poll(sender, {0, 4}, time.time() + 120)
        out["transfer_s"] = time.perf_counter() - start
    out["status"] = STATUS[status]
    out["failure"] = mgr.failure_records.get(ROOM)
    deadline = time.time() + 120  # stay up (engine, sockets) until the decode has its answer, as a server would
    while not (work / "decode.json").exists() and time.time() < deadline:
        time.sleep(0.01)
    return out


def decode(ckpt: str, args: list[str], page: int, work: Path, case: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import torch
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVReceiver

    out: dict[str, Any] = {"error": None}
    mgr, pool, meta, notes, another = _manager("decode", ckpt, args, page)
    out.update(_describe(mgr, pool, notes))
    if case.get("claim"):  # control only: pass the dtype-string check, nothing else changed
        mgr.kv_cache_dtype_str = case["claim"]
    cases.canary(pool)
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
        receiver.send_metadata(np.array(case["dst"], dtype=np.int32), aux_index=0,
                               state_indices=cases.state_indices(mgr.kv_args, case["dst"]))
        out["status"] = STATUS[_poll(receiver, {0, 4}, time.time() + 120, gone)]
        out["transfer_s"] = time.perf_counter() - start
    except Exception as exc:  # SGLang's refusal (nothing in the scheduler catches it: the server exits)
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["status"] = STATUS[int(mgr.check_status(ROOM))]
    out["failure"] = mgr.failure_records.get(ROOM)
    out["aux_token"] = int(meta.output_ids[0, 0])
    cases.dump(pool, work / "decode.pt")
    if cases.state_buffers(pool) and out["status"] == "Success":  # DSA: the decode's own write, for reference
        start = time.perf_counter()
        src = torch.load(work / "prefill.pt")["kv"]
        torch.save(cases.dsa_reference(another(), src, page, case["dst"]), work / "reference.pt")
        out["reference_s"] = time.perf_counter() - start
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
        decode_ckpt, source = cases.checkpoints(case, ckpts)
        ckpt, kv = decode_ckpt, spec[role]
        if role == "prefill" and spec.get("prefill_ckpt") == "source":
            ckpt, kv = (source, kv) if source else (ckpt, "bf16")
        os.environ.update(MC_FORCE_TCP="1", MOONCAKE_PROTOCOL="tcp", SGLANG_HOST_IP="127.0.0.1")
        if role == "prefill":
            os.environ.update({k: v.format(ckpt=decode_ckpt, page=page) for k, v in spec["env"].items()})
        args = ["--tp-size", "1", "--host", "127.0.0.1", "--disaggregation-mode", role,
                "--disaggregation-transfer-backend", "mooncake", "--disaggregation-bootstrap-port", str(port),
                "--kv-cache-dtype", kv, "--page-size", str(page), *spec.get(f"{role}_args", [])]
        result = prefill(ckpt, args, page, work) if role == "prefill" else decode(ckpt, args, page, work, spec)
    except PageSizeResolved as exc:  # no server of this case runs at this page size
        result = {"error": None, "status": None, "page_size_resolved": exc.resolved, "pool_error": exc.pool_error}
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
        out["pages"] = cases.compare(case, cases.checkpoints(case, ckpts)[0], page, work)
    return out


def main(argv: list[str]) -> int:
    out, ckpts, rest = Path(argv[0]), {"ckpt": str(Path(argv[1]).resolve())}, argv[2:]
    while rest[:1] in (["--source"], ["--dsa"], ["--dsa-source"]):
        ckpts[rest[0][2:].replace("-", "_")], rest = str(Path(rest[1]).resolve()), rest[2:]
    names = rest or [*DEFAULT_CASES, *(["plugin-dsa"] if "dsa" in ckpts else [])]
    prepare()
    root = out.parent / (out.stem + "-work")
    report = {"ckpts": ckpts, "cases": [run_case(c, ckpts, p, root) for c in names
                                        for p in CASES[c].get("pages", PAGES)]}
    out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
