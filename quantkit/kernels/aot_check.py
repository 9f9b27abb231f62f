"""Compile every Triton kernel for a GPU architecture ahead of time, on a machine without a GPU.

The interpreter checks what a kernel computes, not whether it lowers: layouts, `tl.dot` shape limits,
reshapes and register pressure only show up when Triton compiles to PTX and ptxas builds the cubin.
This module compiles the launch shapes the dispatcher really picks for the Kimi / GLM-5 shapes (the
`gpu_config` heuristics with an H200's 132 SMs) for sm_90 and reports registers and spills, so a
CPU-only session still catches a kernel that would not build on the GPU.

    TRITON_INTERPRET=0 python -m quantkit.kernels.aot_check [--level smoke|quick|full] [--arch 90]

It must run with the interpreter off (in its own process: Triton fixes the mode at import).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from triton.runtime.jit import JITFunction

H200_SMS = 132
QUICK_M = (1, 16, 64)
FULL_M = (1, 2, 16, 32, 64, 128)


@dataclass
class CompileResult:
    """Outcome of one ahead-of-time compile."""

    kernel: str
    config: str
    ok: bool
    seconds: float
    registers: int | None = None
    spill_bytes: int | None = None
    error: str | None = None


def _resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    """Registers and spill stores from the cubin, via the cuobjdump Triton ships (None if unavailable)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    return (int(regs.group(1)) if regs else None), (int(stack.group(1)) if stack else None)


# one compile: kernel, argument signature, constexpr values, launch options (num_warps, ...)
Job = tuple["JITFunction", dict[str, str], dict[str, int | float | bool], dict[str, int]]

def _compile(fn: JITFunction, signature: dict[str, str], constexprs: dict[str, int | float | bool],
             options: dict[str, int], arch: int) -> CompileResult:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature, **{name: "constexpr" for name in constexprs})
    label = ", ".join(f"{k}={getattr(v, 'name', v)}" for k, v in constexprs.items()) + f", {options}"
    start = time.perf_counter()
    try:
        kernel = triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as exc:  # any lowering failure is the finding
        return CompileResult(fn.__name__, label, False, time.perf_counter() - start, error=str(exc)[-500:])
    regs, stack = _resource_usage(kernel.asm["cubin"])
    return CompileResult(fn.__name__, label, True, time.perf_counter() - start, regs, stack)


def _linear_jobs(m_values: tuple[int, ...], groups: tuple[int, ...]) -> list[Job]:
    import triton.language as tl

    from quantkit.kernels.bench import MODELS, linear_shapes
    from quantkit.kernels.triton_w4a16 import _w4a16_kernel, gpu_config, sub_block

    seen, jobs = set(), []
    for model in MODELS:
        for _, n, k in linear_shapes(model):
            for m in m_values:
                for g in groups:
                    cfg = gpu_config(m, n, k, g, H200_SMS)
                    const = {"GROUP": g, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
                             "SUB": sub_block(cfg.block_k, g), "SPLIT_K": cfg.split_k, "DOT_DTYPE": tl.bfloat16,
                             "PRECISION": "tf32"}
                    key = (tuple(const.values())[:5], cfg.split_k > 1, cfg.num_warps, cfg.num_stages)
                    if key in seen:
                        continue
                    seen.add(key)
                    out = "*fp32" if cfg.split_k > 1 else "*bf16"
                    sig = {"x_ptr": "*bf16", "wp_ptr": "*i32", "ws_ptr": "*bf16", "out_ptr": out, "M": "i32",
                           "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32",
                           "stride_om": "i32"}
                    opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
                    jobs.append((_w4a16_kernel, sig, const, opts))
    return jobs


def _moe_jobs(slot_counts: tuple[int, ...], groups: tuple[int, ...]) -> list[Job]:
    import triton.language as tl

    from quantkit.kernels.bench import MODELS
    from quantkit.kernels.triton_moe import _w4a16_moe_kernel, gpu_moe_config
    from quantkit.kernels.triton_w4a16 import sub_block

    seen, jobs = set(), []
    for cfg_model in MODELS.values():
        for n, k in ((2 * cfg_model["moe_inter"], cfg_model["hidden"]), (cfg_model["hidden"], cfg_model["moe_inter"])):
            for slots in slot_counts:
                for g in groups:
                    cfg = gpu_moe_config(slots, n, k, g, H200_SMS)
                    const = {"GROUP": g, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
                             "SUB": sub_block(cfg.block_k, g), "SPLIT_K": cfg.split_k, "MUL_ROUTED_WEIGHT": True,
                             "DOT_DTYPE": tl.bfloat16, "PRECISION": "tf32"}
                    key = (tuple(const.values())[:5], cfg.split_k > 1)
                    if key in seen:
                        continue
                    seen.add(key)
                    sig = {"x_ptr": "*bf16", "wp_ptr": "*i32", "ws_ptr": "*bf16",
                           "out_ptr": "*fp32" if cfg.split_k > 1 else "*bf16", "topw_ptr": "*fp32",
                           "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32", "N": "i32",
                           "K": "i32", "num_slots": "i32", "rows_div": "i32", "stride_xm": "i32", "stride_we": "i32",
                           "stride_wn": "i32", "stride_se": "i32", "stride_sn": "i32", "stride_om": "i32"}
                    jobs.append((_w4a16_moe_kernel, sig, const, {"num_warps": cfg.num_warps,
                                                                 "num_stages": cfg.num_stages}))
    return jobs


def _fp8_jobs() -> list[Job]:
    from quantkit.kernels.reference import FP8_E4M3_MAX
    from quantkit.kernels.triton_fp8kv import _fp8_dequant_kernel, _fp8_quant_kernel

    quant_sig = {"x_ptr": "*bf16", "out_ptr": "*fp8e4nv", "inv_scale_ptr": "*fp32", "slot_ptr": "*i64",
                 "n_rows": "i32", "D": "i32", "stride_x": "i32", "stride_o": "i32"}
    deq_sig = {"q_ptr": "*fp8e4nv", "out_ptr": "*bf16", "scale_ptr": "*fp32", "n_rows": "i32", "D": "i32",
               "stride_q": "i32", "stride_o": "i32"}
    return [
        (_fp8_quant_kernel, quant_sig, {"FP8_MAX": FP8_E4M3_MAX, "HAS_SLOTS": True, "BLOCK_R": 4, "BLOCK_D": 1024},
         {"num_warps": 4}),
        (_fp8_quant_kernel, quant_sig, {"FP8_MAX": FP8_E4M3_MAX, "HAS_SLOTS": False, "BLOCK_R": 32, "BLOCK_D": 128},
         {"num_warps": 4}),
        (_fp8_dequant_kernel, deq_sig, {"BLOCK_R": 4, "BLOCK_D": 1024}, {"num_warps": 4}),
    ]


def run(level: str = "quick", arch: int = 90) -> list[CompileResult]:
    """Compile the dispatcher's launch shapes: "smoke" (one per kernel body, for tests), "quick", "full"."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("ahead-of-time compile needs TRITON_INTERPRET unset or 0 (run it in its own process)")
    groups = (32, 64, 128) if level == "full" else (32,)
    m_values = {"smoke": (1, 16), "quick": QUICK_M, "full": FULL_M}[level]
    jobs = _linear_jobs(m_values, groups)
    if level == "smoke":  # the GEMV and 16-row dot bodies, split-K on, nothing twice
        jobs = [job for job in jobs if job[2]["SPLIT_K"] > 1][:2]
    jobs += _moe_jobs((8,) if level != "full" else (8, 64, 256, 1024), groups)[:1 if level == "smoke" else None]
    jobs += _fp8_jobs()[:1 if level == "smoke" else None]
    return [_compile(fn, sig, const, opts, arch) for fn, sig, const, opts in jobs]


def main() -> None:
    """CLI: print one line per compile; exit 1 if any kernel failed to build."""
    parser = argparse.ArgumentParser(description="Compile the Triton kernels for a GPU arch without a GPU.")
    parser.add_argument("--level", choices=("smoke", "quick", "full"), default="quick",
                        help="smoke: one launch shape per kernel body; full: all group sizes and batch sizes")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (90 = Hopper)")
    args = parser.parse_args()
    results = run(args.level, args.arch)
    for r in results:
        status = "ok  " if r.ok else "FAIL"
        print(f"{status} {r.kernel:22s} regs={r.registers} stack={r.spill_bytes} {r.seconds:5.1f}s  {r.config}")
        if r.error:
            print(f"     {r.error}")
    failed = sum(not r.ok for r in results)
    print(f"{len(results) - failed}/{len(results)} kernels compiled for sm_{args.arch}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
