"""Where GPTQ's peak RSS comes from, phase by phase (issue 13, target 3).

    .venv/bin/python bench/gptq_memory_phases.py SRC [--samples 8 --seq-len 256 --threads 1]

SRC is the checkpoint `bench/gptq_vs_llmcompressor.py speed --keep DIR` generates (`DIR/src`). Runs
`calibrate.runner.run` on pre-tokenized windows, like that benchmark's "quantkit gptq only", with the
calibration phases wrapped: at every phase boundary the kernel's high-water mark is read (the exact peak
RSS of the phase that just ended: `VmHWM`, reset with `/proc/self/clear_refs` 5 when the next begins),
plus glibc's allocator counters (`mallinfo2`: bytes in use, free bytes retained in its arenas, mmapped
bytes) and the bytes of the torch CPU tensors alive (storages found by the garbage collector, counted
once each). Prints one line per phase, all in MiB above the baseline taken after the imports.
The wrappers only observe: the results are the same files the benchmark writes.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        return libc
    except (OSError, AttributeError):
        return None


LIBC = _libc()


def _status(key: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(ln.split()[1]) * 1024 for ln in fh if ln.startswith(key))


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def _tensor_bytes() -> int:
    """Bytes of the distinct CPU storages of the torch tensors the garbage collector can see."""
    import torch

    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
                st = obj.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        except Exception:  # noqa: BLE001 - some objects refuse isinstance / storage access
            continue
    return sum(seen.values())


class Phases:
    """Attribute the peak RSS of each stretch of the run to the phase running then."""

    def __init__(self, base: int, trim: bool = False) -> None:
        self.base, self.trim = base, trim
        self.label = "start"
        self.stack: list[str] = []
        self.rows: list[dict[str, Any]] = []
        self.t = time.perf_counter()

    def switch(self, label: str, count_tensors: bool = False) -> None:
        hwm, rss = _status("VmHWM:"), _status("VmRSS:")
        row: dict[str, Any] = {"phase": self.label, "peak_mib": (hwm - self.base) / MIB,
                               "end_rss_mib": (rss - self.base) / MIB, "s": time.perf_counter() - self.t}
        if LIBC is not None:
            m = LIBC.mallinfo2()
            row.update(heap_used_mib=m.uordblks / MIB, heap_free_mib=m.fordblks / MIB, mmapped_mib=m.hblkhd / MIB)
        if count_tensors:
            row["tensors_mib"] = _tensor_bytes() / MIB
        self.rows.append(row)
        self.label, self.t = label, time.perf_counter()
        if self.trim and LIBC is not None:
            LIBC.malloc_trim(0)
        _reset_hwm()

    def wrap(self, owner: Any, name: str, label: str | Callable[..., str], count: bool = False) -> None:
        fn = getattr(owner, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            outer = self.stack[-1] if self.stack else "runner"
            inner = label(*args, **kwargs) if callable(label) else label
            self.stack.append(inner)
            self.switch(inner, count)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stack.pop()
                self.switch(f"{outer} (between)" if not outer.endswith("(between)") else outer, count)

        setattr(owner, name, wrapped)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", type=Path)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--tensors", action="store_true", help="also count live tensor bytes (slow: scans the heap)")
    ap.add_argument("--trim", action="store_true", help="glibc malloc_trim(0) at every phase boundary")
    ap.add_argument("--no-chunk-trim", action="store_true",
                    help="no malloc_trim between GPTQ chunks (what those trims buy, and cost)")
    a = ap.parse_args()

    import shutil
    import tempfile

    import numba  # noqa: F401 - part of the runtime baseline, as in the benchmark
    import torch
    import transformers.models.deepseek_v3.modeling_deepseek_v3  # noqa: F401
    from transformers import AutoTokenizer

    from quantkit.calibrate import experts, layer_pass, runner
    from quantkit.calibrate import layers as L
    from quantkit.calibrate.data import calibration_tokens
    from quantkit.checkpoint.source import open_source
    from quantkit.quant.recipe import Recipe

    torch.set_num_threads(a.threads)
    if a.no_chunk_trim:
        experts.release_free_memory = lambda: False
    tok = AutoTokenizer.from_pretrained(a.src)
    tokens = calibration_tokens(REPO / "calibration_data/default.jsonl", tok, a.samples, a.seq_len, 0)
    recipe = Recipe(method="gptq", calibration={"samples": a.samples, "seq_len": a.seq_len, "seed": 0})
    work = a.work or Path(tempfile.mkdtemp(prefix="qk-memphase-"))
    shutil.rmtree(work, ignore_errors=True)
    source = open_source(a.src)
    gc.collect()
    _reset_hwm()
    base = _status("VmRSS:")
    ph = Phases(base, a.trim)
    ph.switch("runner", a.tensors)
    layer_of = lambda *args, **_k: f"build_layer {args[2]}"  # noqa: E731
    ph.wrap(L, "build_layer", layer_of, a.tensors)
    build = L.build_layer

    def build_with_hooks(*args: Any, **kwargs: Any) -> Any:  # the forward's parts as phases of their own
        module = build(*args, **kwargs)
        for name in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp", "mlp.shared_experts"):
            sub = module.get_submodule(name)
            sub.register_forward_pre_hook(lambda _m, _a, n=name: ph.switch(f"{ph.stack[-1]}: {n}"))
            sub.register_forward_hook(lambda _m, _a, _o, n=name: ph.switch(f"{ph.stack[-1]}: after {n}"))
        return module

    L.build_layer = build_with_hooks
    ph.wrap(runner.Acts, "open", "acts open", a.tensors)
    ph.wrap(layer_pass, "forward_all", lambda *args, **_k: "pass 2" if args[5] is not None or args[6] is not None
            else "pass 1", a.tensors)
    ph.wrap(layer_pass, "quantize_experts", "quantize_experts", a.tensors)
    ph.wrap(experts, "quantize_many", lambda ws, *r, **k: f"quantize_many x{len(ws)} {list(ws[0].shape)}")
    ph.wrap(experts, "quantize_rows", lambda w, *r, **k: f"quantize_rows {list(w.shape)}")
    ph.wrap(layer_pass, "save_layer", "save_layer", a.tensors)
    t, cpu = time.perf_counter(), time.process_time()
    runner.run(source, recipe, work, None, runner.RunOptions(tokens=tokens, threads=a.threads))
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    ph.switch("end", a.tensors)
    rows = ph.rows[1:]
    merged: list[dict[str, Any]] = []
    for r in rows:  # consecutive stretches of the same phase (GPTQ chunks) become one line: largest peak
        if merged and (merged[-1]["phase"] == r["phase"] or r["phase"] == "quantize_experts (between)"):
            m = merged[-1]
            m["n"] += 1
            m["s"] += r["s"]
            if r["peak_mib"] > m["peak_mib"]:
                m.update({k: v for k, v in r.items() if k not in ("s", "phase")})
        else:
            merged.append({**r, "n": 1})
    print(f"baseline RSS {base / MIB:.0f} MiB; run {wall:.1f} s wall, {cpu:.1f} s CPU; peak above baseline "
          f"{max(r['peak_mib'] for r in rows):.1f} MiB")
    cols = ["peak_mib", "end_rss_mib", "heap_used_mib", "heap_free_mib", "mmapped_mib", "tensors_mib"]
    print(f"{'phase':<40}{'n':>4}{'s':>7}" + "".join(f"{c.replace('_mib', ''):>11}" for c in cols))
    for m in merged:
        vals = "".join(f"{m[c]:>11.1f}" if c in m else f"{'-':>11}" for c in cols)
        print(f"{m['phase'][:40]:<40}{m['n']:>4}{m['s']:>7.1f}{vals}")
    (REPO / "bench" / "results").mkdir(parents=True, exist_ok=True)
    (REPO / "bench" / "results" / "gptq_memory_phases.json").write_text(
        json.dumps({"baseline_rss_mib": base / MIB, "wall_s": wall, "cpu_s": cpu, "rows": rows}, indent=1) + "\n")
    if a.work is None:
        shutil.rmtree(work, ignore_errors=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
