"""Build, load and call the CUDA C++ W4A16 GEMV (`cuda/w4a16_gemv.cu`).

The extension is compiled on first use with `torch.utils.cpp_extension.load` (needs a CUDA torch and
`nvcc`), cached by torch under `TORCH_EXTENSIONS_DIR`. `nvcc_compile_check` compiles the kernel alone,
without torch headers, so a CPU-only machine with `nvcc` can still prove the source builds.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["CUDA_DIR", "MAX_ROWS", "cuda_gemv_supported", "load_extension", "cuda_w4a16_linear", "nvcc_command",
           "nvcc_compile_check"]

CUDA_DIR = Path(__file__).parent / "cuda"
MAX_ROWS = 8  # kMaxRows in w4a16_gemv.h


def cuda_gemv_supported(x: torch.Tensor, k: int, group_size: int) -> bool:
    """Whether the CUDA GEMV can take this call (decode rows, bf16/fp16, K and group multiples of 32)."""
    return (
        x.is_cuda
        and 1 <= x.shape[0] <= MAX_ROWS
        and x.dtype in (torch.bfloat16, torch.float16)
        and k % 32 == 0
        and group_size % 32 == 0
        and k % group_size == 0
    )


@functools.lru_cache(maxsize=1)
def load_extension(verbose: bool = False) -> ModuleType:
    """Compile (once per machine) and import the extension module."""
    from torch.utils.cpp_extension import load

    return load(
        name="quantkit_w4a16_gemv",
        sources=[str(CUDA_DIR / "w4a16_gemv_binding.cpp"), str(CUDA_DIR / "w4a16_gemv.cu")],
        extra_include_paths=[str(CUDA_DIR)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "-lineinfo"],
        verbose=verbose,
    )


def cuda_w4a16_linear(
    x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor, group_size: int
) -> torch.Tensor:
    """`[M <= 8, K] -> [M, N]` with the CUDA GEMV."""
    if not cuda_gemv_supported(x, x.shape[1], group_size):
        raise ValueError(
            f"cuda backend needs a CUDA bf16/fp16 x with 1..{MAX_ROWS} rows, K % 32 == 0 and group % 32 == 0; "
            f"got {x.device} {x.dtype} {tuple(x.shape)}, group {group_size}"
        )
    return load_extension().w4a16_gemv(x, weight_packed, weight_scale, group_size)


def nvcc_command(out_dir: Path, arch: str = "sm_90") -> list[str]:
    """The nvcc call that compiles the kernel translation unit to `out_dir/w4a16_gemv.o` (no torch)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise FileNotFoundError("nvcc is not on PATH")
    return [nvcc, "-c", "-std=c++17", "-O3", f"-arch={arch}", "-I", str(CUDA_DIR),
            "-o", str(out_dir / "w4a16_gemv.o"), str(CUDA_DIR / "w4a16_gemv.cu")]


def nvcc_compile_check(out_dir: Path, arch: str = "sm_90") -> subprocess.CompletedProcess[str]:
    """Compile the kernel alone to an object file: proves the source builds; nothing is run."""
    return subprocess.run(nvcc_command(out_dir, arch), capture_output=True, text=True, check=False)
