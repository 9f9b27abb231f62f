"""Streaming safetensors writer: the header is written first from the planned tensor list, then each
tensor's bytes as soon as it is produced, so a worker never holds more than one tensor.

The converter knows every output tensor's name, dtype and shape before computing any of them (the
plan), which is what makes this possible. The file is written under a temporary name, fsynced, and
renamed into place: a crash never leaves a file that looks complete. With `record_digest`, the sha256 of
the bytes is computed as they are written and left in a sidecar for the content manifest
(`quantkit.checkpoint.manifest`), so no shard is read again to hash it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.checkpoint.manifest import write_digest
from quantkit.core.durable import fsync_dir
from quantkit.core.paths import open_write, replace

__all__ = ["PlannedTensor", "StreamingShardWriter", "TORCH_TO_ST", "fsync_dir", "split_parts"]

TORCH_TO_ST = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


@dataclass(frozen=True)
class PlannedTensor:
    """An output tensor known before it is computed."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = torch.tensor([], dtype=self.dtype).element_size()
        for d in self.shape:
            n *= d
        return n


def split_parts(tensors: list[PlannedTensor], max_bytes: int) -> list[list[PlannedTensor]]:
    """Split a tensor list, in order, into parts of at most `max_bytes` (a bigger tensor gets its own)."""
    parts: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if parts[-1] and size + t.nbytes > max_bytes:
            parts.append([])
            size = 0
        parts[-1].append(t)
        size += t.nbytes
    return [p for p in parts if p]


class StreamingShardWriter:
    """Write one safetensors file whose tensors arrive one by one in the planned order."""

    def __init__(self, path: Path, planned: Iterable[PlannedTensor], metadata: dict[str, str] | None = None,
                 record_digest: bool = False):
        """`record_digest`: leave the sha256 of the written bytes in `<path>.sha256` (for the manifest)."""
        self.path = path
        self.record_digest = record_digest
        self.planned = list(planned)
        self._tmp = path.with_name(path.name + ".tmp")
        self._next = 0
        header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
        offset = 0
        for t in self.planned:
            span = [offset, offset + t.nbytes]
            header[t.name] = {"dtype": TORCH_TO_ST[t.dtype], "shape": list(t.shape), "data_offsets": span}
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8-byte alignment
        self._fh = open_write(self._tmp)  # never through a link (quantkit.core.paths); closed in finish()/abort()
        self._sha256 = hashlib.sha256()
        self._emit(len(raw).to_bytes(8, "little"))
        self._emit(raw)

    def _emit(self, data: bytes | memoryview) -> None:
        self._fh.write(data)
        self._sha256.update(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next planned tensor; name, dtype and shape must match the plan."""
        expected = self.planned[self._next]
        if name != expected.name or tensor.dtype != expected.dtype or tuple(tensor.shape) != expected.shape:
            raise RuntimeError(
                f"writer for {self.path.name}: got {name} {tensor.dtype} {tuple(tensor.shape)}, planned "
                f"{expected.name} {expected.dtype} {expected.shape}"
            )
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self._emit(memoryview(data.numpy()))
        self._next += 1

    def finish(self) -> Path:
        """Check everything planned was written, fsync, and rename into place."""
        if self._next != len(self.planned):
            missing = self.planned[self._next].name
            self.abort()
            raise RuntimeError(f"writer for {self.path.name}: tensor {missing} was never written")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        if self.record_digest:  # before the rename: a finished file always has its digest
            write_digest(self.path, self._sha256.hexdigest())
        replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        """Drop the unfinished file (also when closing it fails, as it does on a full disk)."""
        try:
            self._fh.close()
        except OSError:
            pass
        if not os.path.islink(self._tmp):  # a link planted there was refused at open: it stays as it is
            self._tmp.unlink(missing_ok=True)
