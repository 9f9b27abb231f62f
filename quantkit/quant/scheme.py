"""The weight formats a quantization unit can be stored in, as data every stage reads.

A `WeightFormat` is one closed-set entry: its bits, group, compressed-tensors format, the exact tensors (names,
dtypes, shapes) the writer stores for one weight matrix — hence its exact bytes — and a fake-quantize function
(quantize, then dequantize, in fp32) for measuring the error a format costs. The math itself lives in
`quant/int4.py` (INT4 / INT8) and `quant/fp4.py` (NVFP4 / MXFP4). A `UnitScheme` adds how it is computed
(RTN or GPTQ, the scale search): the plan, the workers, the calibration and the writer all read one.

Candidates and why (docs/mixed-precision.md; what the engines load was executed in tests/engines):
- `int4-g32` / `int4-g64` / `int4-g128`: W4A16 pack-quantized (4.5 / 4.25 / 4.125 bits with bf16 scales).
- `int8-g128`: W8A16 pack-quantized, group strategy, 8.125 bits. Group, not channel: vLLM's non-Marlin WNA16 MoE
  asserts `strategy == "group"` (channel-wise INT8 fails under `--moe-backend triton`); Marlin loads both in
  SGLang and vLLM; g128 is the cheapest group. (SGLang's Triton WNA16 MoE refuses every INT8 layer.)
- `bf16`: the unit kept in the model dtype (FP8 sources dequantized, as a kept role always was): in `ignore`.
- `fp8-block`: the unit kept as the source's FP8 blocks (only for FP8-block sources): a `float-quantized` group.
- `nvfp4a16`: FP4 weights for Blackwell targets. `mxfp4a16` and `nvfp4` (W4A4) are uniform-recipe formats only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

from quantkit.core.errors import QuantkitError

if TYPE_CHECKING:  # torch is imported where a tensor is made: `plan` and `--help` never load it
    import torch

__all__ = [
    "FORMATS",
    "FormatKind",
    "FormatName",
    "MIXABLE_FORMATS",
    "Method",
    "StoredTensor",
    "UnitScheme",
    "WeightFormat",
    "get_format",
]

FormatName = Literal["int4-g32", "int4-g64", "int4-g128", "int8-g128", "bf16", "fp8-block", "nvfp4a16",
                     "mxfp4a16", "nvfp4"]
FormatKind = Literal["int", "fp4", "bf16", "fp8"]
CTFormat = Literal["pack-quantized", "float-quantized", "nvfp4-pack-quantized", "mxfp4-pack-quantized"]
Method = Literal["rtn", "gptq"]
ScaleSearch = Literal["minmax", "mse"]
# (name suffix, dtype, shape) of one stored tensor; the dtype None means "the model dtype"
StoredTensor = tuple[str, "torch.dtype", tuple[int, ...]]

FP8_BLOCK = (128, 128)  # the block of DeepSeek-style FP8 sources (a source with another block passes its own)


@dataclass(frozen=True)
class WeightFormat:
    """One candidate weight format of a unit."""

    name: FormatName
    kind: FormatKind
    bits: int  # bits per stored weight value (bf16: 16, fp8: 8)
    group: int | None  # input columns per scale (fp8-block: the block's width; bf16: None)
    ct_format: CTFormat | None  # compressed-tensors format of its config group; None = kept in `ignore`
    mixable: bool  # may be one unit's format in a per-unit plan (False: uniform recipes only)
    label: str  # how reports and the card name it

    @property
    def quantized(self) -> bool:
        """Whether the unit gets a config group (False: the unit is in the `ignore` list)."""
        return self.ct_format is not None

    @property
    def computed(self) -> bool:
        """Whether writing it computes new values (INT / FP4) rather than copying or dequantizing the source."""
        return self.kind in ("int", "fp4")

    def check_shape(self, shape: tuple[int, ...], name: str) -> None:
        """A one-line error unless `name` is a 2-D weight this format can store."""
        if not self.computed:
            return
        if len(shape) != 2:
            raise QuantkitError(f"{name}: expected a 2-D Linear weight, got shape {list(shape)}")
        per_word = 32 // self.bits if self.kind == "int" else 2
        assert self.group is not None
        if shape[1] % self.group or shape[1] % per_word:
            raise QuantkitError(f"{name}: in_features {shape[1]} is not a multiple of group size {self.group} "
                                f"(and of {per_word}) for {self.label}")

    def stored(self, shape: tuple[int, ...], model_dtype: torch.dtype | None = None,
               fp8_block: tuple[int, int] = FP8_BLOCK, fp8_scale_dtype: torch.dtype | None = None
               ) -> list[StoredTensor]:
        """The tensors the writer stores for one weight matrix `[out, in]`, suffixes after the module name
        (`model_dtype` default bfloat16, `fp8_scale_dtype` default float32)."""
        import torch

        model_dtype = torch.bfloat16 if model_dtype is None else model_dtype
        fp8_scale_dtype = torch.float32 if fp8_scale_dtype is None else fp8_scale_dtype
        out, inp = shape[0], shape[-1]
        if self.kind == "int":
            assert self.group is not None
            return [("weight_packed", torch.int32, (out, inp * self.bits // 32)),
                    ("weight_scale", model_dtype, (out, inp // self.group)),
                    ("weight_shape", torch.int64, (2,))]
        if self.kind == "fp4":
            assert self.group is not None
            scale = torch.float8_e4m3fn if self.group == 16 else torch.uint8
            tensors: list[StoredTensor] = [("weight_packed", torch.uint8, (out, inp // 2)),
                                           ("weight_scale", scale, (out, inp // self.group))]
            if self.group == 16:
                tensors.append(("weight_global_scale", torch.float32, (1,)))
            if self.name == "nvfp4":
                tensors.append(("input_global_scale", torch.float32, (1,)))
            return tensors
        if self.kind == "fp8":
            bh, bw = fp8_block
            return [("weight", torch.float8_e4m3fn, tuple(shape)),
                    ("weight_scale", fp8_scale_dtype, (math.ceil(out / bh), math.ceil(inp / bw)))]
        return [("weight", model_dtype, tuple(shape))]

    def matrix_bytes(self, shape: tuple[int, ...], model_dtype: torch.dtype | None = None,
                     fp8_block: tuple[int, int] = FP8_BLOCK) -> int:
        """Exact bytes of one weight matrix as the writer stores it (tensor data, safetensors header aside)."""
        return sum(math.prod(s) * d.itemsize for _, d, s in self.stored(shape, model_dtype, fp8_block))

    def bits_per_weight(self, shape: tuple[int, int] = (4096, 4096)) -> float:
        """Stored bits per weight, scales included, for a matrix of `shape` (bf16 scales)."""
        return 8 * self.matrix_bytes(shape) / math.prod(shape)

    def fake_quantize(self, w: torch.Tensor, scale_dtype: torch.dtype | None = None,
                      global_amax: float | None = None) -> torch.Tensor:
        """`w` quantized and dequantized again, fp32 (RTN, minmax scales: exactly the values written).

        Kept formats return `w` itself: they add no error against the source (`bf16` of an FP8 source is its
        exact dequantization; `fp8-block` copies it). NVFP4's global scale comes from `global_amax` when the
        engines fuse this matrix with others (gate/up), else from `w` itself. Scales default to bfloat16.
        """
        import torch

        scale_dtype = torch.bfloat16 if scale_dtype is None else scale_dtype
        if self.kind == "int":
            from quantkit.quant.int4 import dequantize_group, quantize_rtn

            assert self.group is not None
            q, s = quantize_rtn(w, self.group, scale_dtype, self.bits)
            return dequantize_group(q, s, self.group)
        if self.kind == "fp4":
            from quantkit.quant import fp4

            v = w.to(scale_dtype)
            if self.group == 16:
                amax = torch.tensor(global_amax) if global_amax is not None else fp4.tensor_amax(v)
                return fp4.dequantize_nvfp4(fp4.nvfp4_quantize(v, fp4.nvfp4_global_scale(amax, v.dtype)))
            return fp4.dequantize_mxfp4(fp4.mxfp4_quantize(v))
        return w.float()


FORMATS: dict[FormatName, WeightFormat] = {f.name: f for f in (
    WeightFormat("int4-g32", "int", 4, 32, "pack-quantized", True, "INT4 g32"),
    WeightFormat("int4-g64", "int", 4, 64, "pack-quantized", True, "INT4 g64"),
    WeightFormat("int4-g128", "int", 4, 128, "pack-quantized", True, "INT4 g128"),
    WeightFormat("int8-g128", "int", 8, 128, "pack-quantized", True, "INT8 g128"),
    WeightFormat("bf16", "bf16", 16, None, None, True, "kept (BF16)"),
    WeightFormat("fp8-block", "fp8", 8, 128, "float-quantized", True, "kept (FP8-block)"),
    WeightFormat("nvfp4a16", "fp4", 4, 16, "nvfp4-pack-quantized", True, "NVFP4A16"),
    WeightFormat("mxfp4a16", "fp4", 4, 32, "mxfp4-pack-quantized", False, "MXFP4A16"),
    WeightFormat("nvfp4", "fp4", 4, 16, "nvfp4-pack-quantized", False, "NVFP4 (W4A4)"),
)}
MIXABLE_FORMATS: tuple[FormatName, ...] = tuple(n for n, f in FORMATS.items() if f.mixable)
assert set(FORMATS) == set(get_args(FormatName))


def get_format(name: str) -> WeightFormat:
    """The format called `name`; a one-line error naming the known ones otherwise."""
    if name not in FORMATS:
        raise QuantkitError(f"unknown weight format {name!r} (known: {', '.join(FORMATS)})")
    return FORMATS[name]  # type: ignore[index]


@dataclass(frozen=True)
class UnitScheme:
    """How one unit is written: its format and how the values are found."""

    format: WeightFormat
    method: Method = "rtn"
    scale_search: ScaleSearch = "minmax"

    @property
    def bits(self) -> int:
        return self.format.bits

    @property
    def group_size(self) -> int:
        """Input columns per scale of a computed format (a one-line error for a kept one)."""
        if self.format.group is None or not self.format.computed:
            raise QuantkitError(f"format {self.format.name} is kept as in the source: it has no quantization group")
        return self.format.group
