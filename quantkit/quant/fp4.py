"""FP4 (E2M1) weight math: NVFP4 and MXFP4 group quantization, byte-identical to compressed-tensors.

compressed-tensors (CT) 0.17-0.20 and llm-compressor compute, for a weight `w` in its own dtype D
(bf16 for BF16 and FP8-block sources, which are dequantized to bf16 first):

NVFP4 (group 16, `nvfp4-pack-quantized`)
    global    = 2688 / amax(|w| over the fused group)          evaluated in D, then fp32; NaN/Inf -> 1.0
    s_g       = (amax_g / 6 in D) * global  (fp32), clamped to +-448, cast to float8_e4m3fn; 0 -> 0.125
    q         = E2M1(clamp(w / (s_g / global), -6, 6))          all in fp32
    stored    weight_packed uint8 [out, in/2], weight_scale e4m3 [out, in/16], weight_global_scale fp32 [1]
    dequant   w = E2M1 * weight_scale / weight_global_scale
MXFP4 (group 32, `mxfp4-pack-quantized`)
    p2        = amax_g rounded to a power of two (up when its mantissa is >= .75: CT's bit trick, in D)
    e         = 127 + floor(log2 p2) - 2, clamped to [0, 255]; scale = 2^(e-127) in D (an fp16 underflow -> 1)
    q         = E2M1(clamp(w / scale, -6, 6))                    in D; stored e = 127 + log2(scale)
    stored    weight_packed uint8 [out, in/2], weight_scale uint8 (biased E8M0) [out, in/32]

E2M1 rounding is nearest with ties to even (thresholds .25/.75/1.25/1.75/2.5/3.5/5 as CT's `cast_to_fp4`),
codes {0,.5,1,1.5,2,3,4,6} -> 0..7, sign in bit 3 iff the scaled value is < 0 (so -0.0 encodes 0x0 and a
tiny negative that rounds to zero 0x8), low nibble = even column. Computing in fp32 and rounding to D only
where CT's ops store D values gives the same bytes as CT's D arithmetic, faster on CPUs (tests compare with
CT's compressor and llm-compressor's path on bf16/fp16/fp32 inputs and the edge cases).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

from quantkit.core.errors import QuantkitError
from quantkit.quant import fused_fp4

__all__ = [
    "FP4Scheme",
    "fused_group",
    "fused_groups",
    "NVFP4_GROUP",
    "MXFP4_GROUP",
    "PackedFP4",
    "check_fp4_shape",
    "dequantize_mxfp4",
    "dequantize_nvfp4",
    "e2m1_codes",
    "fp4_group_size",
    "mxfp4_quantize",
    "nvfp4_global_scale",
    "nvfp4_quantize",
    "tensor_amax",
    "unpack_e2m1",
]

FP4Scheme = Literal["nvfp4", "mxfp4"]
NVFP4_GROUP, MXFP4_GROUP = 16, 32
_FP8_MAX, _FP4_MAX = 448.0, 6.0
_NVFP4_ZERO_SCALE = 0.125  # CT's eps for a float8_e4m3fn scale
use_fused = True  # tests switch the numba pass off to compare it with the torch ops
_E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# magnitude thresholds: value > t (strict) or >= t (ties rounding up to an even code)
_STRICT = (0.25, 1.25, 2.5, 5.0)
_INCLUSIVE = (0.75, 1.75, 3.5)


@dataclass
class PackedFP4:
    """The on-disk tensors of one FP4 Linear (compressed-tensors `*fp4-pack-quantized`)."""

    weight_packed: torch.Tensor  # uint8 [out, in/2]
    weight_scale: torch.Tensor  # float8_e4m3fn [out, in/16] (NVFP4) or uint8 E8M0 [out, in/32] (MXFP4)
    weight_global_scale: torch.Tensor | None  # float32 [1] (NVFP4 only)
    input_global_scale: torch.Tensor | None = None  # float32 [1] (NVFP4 W4A4 only: from calibration)

    def tensors(self, module: str) -> dict[str, torch.Tensor]:
        out = {f"{module}.weight_packed": self.weight_packed, f"{module}.weight_scale": self.weight_scale}
        if self.weight_global_scale is not None:
            out[f"{module}.weight_global_scale"] = self.weight_global_scale
        if self.input_global_scale is not None:
            out[f"{module}.input_global_scale"] = self.input_global_scale
        return out


def fp4_group_size(scheme: FP4Scheme) -> int:
    return NVFP4_GROUP if scheme == "nvfp4" else MXFP4_GROUP


def check_fp4_shape(shape: tuple[int, ...], scheme: FP4Scheme, name: str) -> None:
    """Raise a one-line error unless `name` is a 2-D weight whose input dim splits into whole FP4 groups."""
    group = fp4_group_size(scheme)
    if len(shape) != 2:
        raise QuantkitError(f"{name}: expected a 2-D Linear weight, got shape {list(shape)}")
    if shape[1] % group:
        raise QuantkitError(f"{name}: in_features {shape[1]} is not a multiple of the {scheme} group size {group}")


def _round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 values rounded to `dtype` and back: what an op in `dtype` would have stored."""
    return x if dtype == torch.float32 else x.to(dtype).to(torch.float32)


def tensor_amax(w: torch.Tensor) -> torch.Tensor:
    """max |w| as an fp32 scalar tensor (exact: |w| and max are exact in any float dtype)."""
    return torch.maximum(w.amax(), w.amin().neg()).float()


def nvfp4_global_scale(amax: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """`2688 / amax` in `dtype` (CT's `generate_gparam`), as float32 [1]; NaN/Inf (amax 0 in fp16...) -> 1.0.

    `amax` is the max |w| over every tensor of a fused group, a value representable in `dtype`."""
    a = torch.as_tensor(amax, dtype=torch.float32).reshape(1).to(dtype)
    a = torch.clamp(a, min=torch.finfo(dtype).tiny)
    scale = (_FP8_MAX * _FP4_MAX / a).to(torch.float32)
    return torch.nan_to_num(scale, nan=1.0, posinf=1.0, neginf=1.0)


def e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes (sign in bit 3) of fp32 values already clamped to [-6, 6]."""
    mag = scaled.abs()
    code = torch.zeros(scaled.shape, dtype=torch.uint8)
    for t in _STRICT:
        code += mag > t
    for t in _INCLUSIVE:
        code += mag >= t
    return code | ((scaled < 0).to(torch.uint8) << 3)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte along the input dim, low nibble = even column."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """fp32 E2M1 values [out, in] from packed uint8 [out, in/2]."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
    values = _E2M1_VALUES[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -values, values)


def _group_amax(w: torch.Tensor, group: int) -> torch.Tensor:
    if _fused_ok(w):
        return fused_fp4.group_amax(w, group)
    grouped = w.unflatten(-1, (-1, group))
    return torch.maximum(grouped.amax(-1), grouped.amin(-1).neg()).float()


def nvfp4_quantize(w: torch.Tensor, global_scale: torch.Tensor) -> PackedFP4:
    """NVFP4 of a 2-D weight in its own dtype with the (fused group's) float32 [1] `global_scale`."""
    dtype = w.dtype
    gs = global_scale.to(torch.float32).reshape(1)
    local = _round_to(_group_amax(w, NVFP4_GROUP) / _FP4_MAX, dtype)
    scale8 = (local * gs).clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    scale8 = torch.where(scale8 == 0, torch.full_like(scale8, _NVFP4_ZERO_SCALE), scale8)
    effective = _round_to(scale8, dtype) / gs  # the scale parameter lives in the weight dtype (exact)
    if _fused_ok(w):
        packed = fused_fp4.e2m1_pack(w, effective, NVFP4_GROUP, round_bf16=False)
    else:
        scaled = (w.float().unflatten(-1, (-1, NVFP4_GROUP)) / effective.unsqueeze(-1)).clamp_(-_FP4_MAX, _FP4_MAX)
        packed = _pack(e2m1_codes(scaled.flatten(-2)))
    return PackedFP4(packed, scale8.to(torch.float8_e4m3fn), gs.clone())


def _fused_ok(w: torch.Tensor) -> bool:
    """The numba pass applies on the CPU (same bytes as the torch ops, ~5x faster); `use_fused` turns it off."""
    return use_fused and w.device.type == "cpu" and w.shape[-1] % 2 == 0


def _mx_exponents(amax_g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Biased E8M0 exponents (int32) of CT's MXFP4 scales from the group amax values in `dtype`."""
    if dtype == torch.float32:
        bits, mantissa = amax_g.view(torch.int32), 23
    else:
        bits, mantissa = amax_g.to(dtype).view(torch.int16).to(torch.int32) & 0xFFFF, 7 if dtype == torch.bfloat16 \
            else 10
    exponent_bits = 8 if dtype != torch.float16 else 5
    rounded = (bits + (1 << (mantissa - 2))) & (((1 << (exponent_bits + 1)) - 1) << mantissa)
    if dtype == torch.float32:
        p2 = rounded.view(torch.float32)
    else:
        p2 = rounded.to(torch.int16).view(dtype).float()
    exp = torch.floor(torch.log2(p2)) + (127 - 2)
    return exp.clamp_(0, 255).to(torch.int32)  # log2(0) = -inf -> 0; CT's uint8 cast saturates the same way


def mxfp4_quantize(w: torch.Tensor) -> PackedFP4:
    """MXFP4 of a 2-D weight in its own dtype (no global scale)."""
    dtype = w.dtype
    exp = _mx_exponents(_group_amax(w, MXFP4_GROUP), dtype)
    scale = _round_to(torch.exp2((exp - 127).float()), dtype)  # the scale parameter lives in the weight dtype
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # underflow (fp16): CT's uint8 "eps" is 1
    if _fused_ok(w) and dtype in (torch.bfloat16, torch.float32):
        packed = fused_fp4.e2m1_pack(w, scale, MXFP4_GROUP, round_bf16=dtype == torch.bfloat16)
    else:
        scaled = _round_to(w.float().unflatten(-1, (-1, MXFP4_GROUP)) / scale.unsqueeze(-1), dtype)
        packed = _pack(e2m1_codes(scaled.clamp_(-_FP4_MAX, _FP4_MAX).flatten(-2)))
    stored = torch.log2(scale).floor_().add_(127).to(torch.uint8)  # CT re-encodes the (possibly replaced) scale
    return PackedFP4(packed, stored, None)


def dequantize_nvfp4(packed: PackedFP4) -> torch.Tensor:
    """fp32 weight `E2M1 * weight_scale / weight_global_scale` (what the engines compute)."""
    assert packed.weight_global_scale is not None
    values = unpack_e2m1(packed.weight_packed).unflatten(-1, (-1, NVFP4_GROUP))
    scale = packed.weight_scale.float() / packed.weight_global_scale.float()
    return (values * scale.unsqueeze(-1)).flatten(-2)


def dequantize_mxfp4(packed: PackedFP4) -> torch.Tensor:
    """fp32 weight `E2M1 * 2^(e - 127)`."""
    values = unpack_e2m1(packed.weight_packed).unflatten(-1, (-1, MXFP4_GROUP))
    scale = torch.exp2(packed.weight_scale.float() - 127)
    return (values * scale.unsqueeze(-1)).flatten(-2)


# module-name endings the engines load into one fused parameter -> the group's tag
_FUSED = (
    (re.compile(r"^(.*\.)(gate_proj|up_proj)$"), "gate_up_proj"),
    (re.compile(r"^(.*\.)(q_a_proj|kv_a_proj_with_mqa)$"), "fused_qkv_a_proj"),
    (re.compile(r"^(.*\.)(q_proj|k_proj|v_proj)$"), "qkv_proj"),
    (re.compile(r"^(.*\.)(w1|w3)$"), "w13"),
)


def fused_group(module: str) -> str | None:
    """The fused parameter an engine loads `module` into (e.g. `...experts.3.gate_up_proj`), or None."""
    for pattern, tag in _FUSED:
        match = pattern.match(module)
        if match:
            return match.group(1) + tag
    return None


def fused_groups(modules: list[str]) -> dict[str, list[str]]:
    """Fused group -> its members among `modules`, for groups with at least two members."""
    groups: dict[str, list[str]] = {}
    for m in modules:
        g = fused_group(m)
        if g is not None:
            groups.setdefault(g, []).append(m)
    return {g: sorted(ms) for g, ms in groups.items() if len(ms) > 1}
