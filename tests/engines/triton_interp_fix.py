"""Two fixes of Triton 3.9's CPU *interpreter* (`TRITON_INTERPRET=1`), so that SGLang's Triton attention kernels
compute on the CPU what they compute on a GPU. These are fixes of the tool that runs the kernels here, not of
SGLang: no engine code is changed, and nothing here is imported by quantkit.

1. Float conversions (`triton/runtime/interpreter.py: _convert_float`): the interpreter rounds the mantissa to
   nearest but never carries into the exponent (7.81 -> 4.0 instead of 8.0, 1.996 -> 1.0), does not saturate
   fp32 -> e4m3 (1000 -> 256 instead of 448), flushes e4m3 subnormals (0.0013 -> 0) and truncates fp32 -> bf16.
   A GPU converts with `cvt.rn.satfinite.e4m3x2.f32` (round to nearest even, saturating) and `cvt.rn.bf16.f32`.
   The fix converts every float <-> float pair among fp32 / fp16 / bf16 / e4m3 / e5m2 with torch's cast, which is
   round-to-nearest-even and, to e4m3, saturating (torch 2.13's CPU cast, executed by
   `tests/engines/test_kv_kl.py::test_interpreter_fix`).
2. `tl.dot` on bf16 operands (`InterpreterBuilder.create_dot`): the interpreter multiplies the uint16 storage as
   integers (errors ~1e10). The fix upcasts 16- and 8-bit float operands to fp32 (exact) and accumulates in fp32,
   as the tensor cores do (summation order aside).

`test_kv_kl.py` asserts that the *unpatched* interpreter still mis-rounds (so this file is dropped when Triton
fixes it) and that, patched, SGLang's decode kernel agrees with a torch reproduction of its arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["install", "installed", "uninstall"]

_SAVED: dict[str, Callable[..., Any]] = {}


def _tables() -> tuple[dict[Any, Any], dict[int, Any], dict[int, Any]]:
    import numpy as np
    import torch
    import triton.language as tl

    torch_of = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16,
                tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}
    np_bits = {8: np.uint8, 16: np.uint16, 32: np.uint32}
    torch_bits = {8: torch.uint8, 16: torch.int16, 32: torch.int32}
    return torch_of, np_bits, torch_bits


def _convert_float(data: Any, input_dtype: Any, output_dtype: Any, rounding_mode: Any) -> Any:
    """The interpreter's float conversion, done by torch for the pairs it gets wrong (storage bits in and out)."""
    import numpy as np
    import torch

    torch_of, np_bits, torch_bits = _tables()
    if input_dtype not in torch_of or output_dtype not in torch_of:
        return _SAVED["_convert_float"](data, input_dtype, output_dtype, rounding_mode)
    raw = np.ascontiguousarray(data).view(np_bits[input_dtype.primitive_bitwidth])
    if input_dtype.primitive_bitwidth == 8:
        bits = torch.from_numpy(raw.copy())
    else:  # torch has no uint16 / uint32 views: reinterpret as the signed type of the same width
        signed = {16: np.int16, 32: np.int32}[input_dtype.primitive_bitwidth]
        bits = torch.from_numpy(raw.view(signed).copy())
    out = bits.view(torch_of[input_dtype]).to(torch_of[output_dtype])
    width = output_dtype.primitive_bitwidth
    return out.view(torch_bits[width]).numpy().view(np_bits[width]).reshape(np.shape(data))


def _create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
    """`tl.dot` with 8/16-bit float operands upcast to fp32 (exact) and an fp32 accumulator."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    def fp32(handle: Any) -> Any:
        if handle.dtype.is_floating() and handle.dtype.primitive_bitwidth < 32:
            return _convert_float(handle.data, handle.dtype, tl.float32, None).view(np.float32)
        return handle.data

    out = np.matmul(fp32(a), fp32(b), dtype=np.float32).astype(d.data.dtype) + d.data
    return interpreter.TensorHandle(out, d.dtype.scalar)


def install() -> None:
    """Patch the interpreter (idempotent). Call after `triton` is importable, before any kernel runs."""
    from triton.runtime import interpreter

    if _SAVED:
        return
    _SAVED["_convert_float"] = interpreter._convert_float
    _SAVED["create_dot"] = interpreter.InterpreterBuilder.create_dot
    interpreter._convert_float = _convert_float
    interpreter.InterpreterBuilder.create_dot = _create_dot  # type: ignore[method-assign]


def uninstall() -> None:
    from triton.runtime import interpreter

    if not _SAVED:
        return
    interpreter._convert_float = _SAVED.pop("_convert_float")
    interpreter.InterpreterBuilder.create_dot = _SAVED.pop("create_dot")  # type: ignore[method-assign]


def installed() -> bool:
    return bool(_SAVED)
