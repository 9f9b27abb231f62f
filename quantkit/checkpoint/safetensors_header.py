"""Reading and checking safetensors headers without loading any tensor data.

A safetensors file is `u64 header length | JSON header | data`. Parsing the JSON ourselves lets us
reject truncated or corrupt shards with a precise one-line message before any conversion work starts,
and lets the planner and the validator account for bytes exactly.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from quantkit.core.errors import QuantkitError

if TYPE_CHECKING:  # torch is imported on first use of ST_TO_TORCH: `plan`, `inspect` and `--help` never need it
    import torch

__all__ = ["DTYPE_BYTES", "HeaderEntry", "ShardHeader", "ST_TO_TORCH", "read_header"]

DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1, "F8_E8M0": 1,
}
_ST_TO_TORCH = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
ST_TO_TORCH: dict[str, torch.dtype]  # bound on first use by __getattr__ below
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit: the only bound on a header (and its __metadata__)


def __getattr__(name: str) -> dict[str, torch.dtype]:
    """`ST_TO_TORCH` (safetensors dtype name -> torch dtype), built on first use so importing this module
    does not import torch."""
    if name != "ST_TO_TORCH":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch

    table = {st: getattr(torch, attr) for st, attr in _ST_TO_TORCH.items()}
    globals()["ST_TO_TORCH"] = table
    return table


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor as the header describes it."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ShardHeader:
    """A parsed, bounds-checked shard header."""

    path: Path
    header_len: int
    tensors: dict[str, HeaderEntry]
    metadata: dict[str, str]
    file_size: int

    @property
    def data_bytes(self) -> int:
        return self.file_size - 8 - self.header_len


def read_header(path: Path) -> ShardHeader:
    """Parse and check one shard header; raise QuantkitError naming the file (and tensor) when bad."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            raw_len = fh.read(8)
            if len(raw_len) < 8:
                raise QuantkitError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > _MAX_HEADER or 8 + header_len > size:
                raise QuantkitError(f"{path}: corrupt or truncated safetensors header (length {header_len})")
            header = json.loads(fh.read(header_len).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise QuantkitError(f"{path}: corrupt safetensors header ({exc.__class__.__name__})") from None
    except RecursionError:  # `[[[[...]]]]` 100,000 deep: json's parser gives up; no header nests like that
        raise QuantkitError(f"{path}: corrupt safetensors header (JSON nested too deeply)") from None
    except OSError as exc:
        raise QuantkitError(f"{path}: cannot read ({exc.strerror})") from None
    if not isinstance(header, dict):
        raise QuantkitError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = _metadata(path, header.pop("__metadata__", None))
    tensors = {name: _entry(path, name, info) for name, info in header.items()}
    _check_layout(path, tensors, size - 8 - header_len)
    return ShardHeader(path, header_len, tensors, metadata, size)


def _metadata(path: Path, value: object) -> dict[str, str]:
    """`__metadata__` is a string-to-string map (safetensors' own rule). Its size is bounded only by the header
    cap (100 MB, checked before the header is read): a legal file with 50 MB of metadata converts."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise QuantkitError(f"{path}: __metadata__ must map strings to strings")
    return value


def _check_layout(path: Path, tensors: dict[str, HeaderEntry], data_len: int) -> None:
    """Tensors tile the data section exactly: no overlap, no gap, nothing past the end (as safetensors checks)."""
    offset = 0
    for name, entry in sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if entry.start != offset:
            what = "overlaps the tensor before it" if entry.start < offset else f"leaves a gap at byte {offset}"
            raise QuantkitError(f"{path}: tensor {name} starts at byte {entry.start} and {what} (data offsets must "
                                "tile the file)")
        offset = entry.end
    if offset > data_len:
        worst = max(tensors, key=lambda n: tensors[n].end)
        raise QuantkitError(
            f"{path}: truncated: tensor {worst} ends at byte {offset} of the data section but the file holds "
            f"{data_len}"
        )
    if offset < data_len:
        raise QuantkitError(f"{path}: {data_len - offset} bytes after the last tensor are not described by the "
                            "header (corrupt or stale data)")


def _entry(path: Path, name: str, info: object) -> HeaderEntry:
    try:
        dtype, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]  # type: ignore[index]
    except (TypeError, KeyError, ValueError):
        raise QuantkitError(f"{path}: corrupt header entry for tensor {name}") from None
    if not isinstance(dtype, str) or dtype not in _ST_TO_TORCH or not all(type(d) is int and d >= 0 for d in shape):
        raise QuantkitError(f"{path}: tensor {name} has unsupported dtype {dtype!r} or bad shape {shape}")
    numel = 1
    for d in shape:
        numel *= d
    if not (type(start) is int and type(end) is int and 0 <= start <= end) or end - start != numel * DTYPE_BYTES[dtype]:
        raise QuantkitError(f"{path}: tensor {name}: data offsets do not match dtype {dtype} and shape {shape}")
    return HeaderEntry(dtype, shape, start, end)
