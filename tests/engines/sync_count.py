"""Counting what would block the host on a GPU, on a CPU-only machine: a torch function mode with device provenance.

Under the engine stubs every "cuda" tensor lives on the CPU, so nothing ever really waits; this mode tells device
tensors from host ones by where they came from and counts each operation that, with the device tensors on a GPU,
would make the host wait for the device:

- a read of a device tensor's data on the host: ``item``, ``tolist``, ``bool()``/``int()``/``float()``/
  ``__index__``, ``numpy``, ``cpu()``, ``repr``, ``torch.equal``;
- an operation whose output shape depends on device data: ``nonzero``, ``unique``, ``masked_select``, ``bincount``,
  ``argwhere``, ``repeat_interleave``, boolean-mask indexing of a device tensor;
- a host tensor (more than one element) indexing a device tensor (an implicit blocking upload), a blocking
  ``copy_`` host->device, ``torch.tensor(data, device=...)``, ``.to(device)`` of a host tensor without
  ``non_blocking`` (pageable: may synchronise), and ``torch.cuda.synchronize()``.

Device tensors (tagged ``_qk_dev``): the roots a test names (:meth:`SyncCounter.tag`), every output of an operation
with a device input (except the host reads above), every tensor made with an explicit ``device=``, and
``.to(device, non_blocking=True)`` of a host tensor (an asynchronous upload). With the pool on the CPU, ``.to(cpu)``
of a device tensor cannot be told from a no-op move and keeps the tag (a later read of it still counts).

Attribution: the innermost frame outside torch, the hook registry, the stubs and this file decides the bucket:
``sglang`` (SGLang's source), ``harness`` (the campaign that stands in for the model and the clients) or
``plugin`` (everything else: quantkit's plugin, and code a test injects).
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["Bucket", "SyncCounter"]

Bucket = Literal["plugin", "sglang", "harness"]
T = torch.Tensor
_READS = {T.item, T.tolist, T.__bool__, T.__int__, T.__float__, T.__index__, T.numpy, T.cpu, T.__repr__,
          T.__format__, torch.equal, T.equal, torch.allclose, T.allclose, torch.is_nonzero, T.is_nonzero}
_DATA_SHAPED = {torch.nonzero, T.nonzero, torch.unique, T.unique, torch.unique_consecutive, T.unique_consecutive,
                torch.masked_select, T.masked_select, torch.argwhere, T.argwhere, torch.bincount, T.bincount,
                torch.repeat_interleave, T.repeat_interleave}
_INDEX_AT_1 = {T.__getitem__, T.__setitem__, T.index_put_, T.index_put, torch.index_put, torch.take, T.take}
_INDEX_AT_2 = {T.index_select, torch.index_select, T.index_add_, T.index_copy_, T.index_fill_, T.scatter_, T.gather,
               torch.gather}
_FROM_DATA = {torch.tensor, torch.as_tensor}
_SKIP = ("/torch/", "hook_registry.py", "stubs.py", str(Path(__file__).resolve()), "<frozen", "functools.py")
_HARNESS = ("campaign.py", "campaign_engine.py")


def _tensors(x: object) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, list | tuple):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _device_arg(value: object) -> bool:
    return isinstance(value, str | torch.device) and str(value) != "meta"


def is_device(t: torch.Tensor) -> bool:
    return bool(getattr(t, "_qk_dev", False))


class SyncCounter(TorchFunctionMode):
    """``events[(bucket, kind, where)]``: how often; ``active`` gates counting (tagging always runs)."""

    def __init__(self, sglang_root: str) -> None:
        super().__init__()
        self.events: collections.Counter[tuple[Bucket, str, str]] = collections.Counter()
        self.sglang_root = str(Path(sglang_root).resolve())
        self.active = False
        self._sync: Callable[..., None] | None = None

    # ---- setup -------------------------------------------------------------------------------------------------
    @staticmethod
    def tag(*tensors: object) -> None:
        """Mark ``tensors`` (and tensors inside lists / tuples / dicts) as device tensors."""
        for t in _tensors(tensors):
            t._qk_dev = True

    def __enter__(self) -> SyncCounter:
        self._sync = torch.cuda.synchronize
        torch.cuda.synchronize = self._counted_sync  # type: ignore[assignment]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize = self._sync  # type: ignore[assignment]
        super().__exit__(*exc)

    def _counted_sync(self, device: object = None) -> None:
        self._count("torch.cuda.synchronize")

    # ---- counting ----------------------------------------------------------------------------------------------
    def totals(self, bucket: Bucket) -> int:
        return sum(n for (b, _, _), n in self.events.items() if b == bucket)

    def lines(self, bucket: Bucket | None = None) -> list[str]:
        return [f"{b} {n} {kind} @ {where}" for (b, kind, where), n in sorted(self.events.items())
                if bucket is None or b == bucket]  # fmt: skip

    def _who(self) -> tuple[Bucket, str]:
        f = sys._getframe(2)
        while f is not None:
            name = f.f_code.co_filename
            if any(s in name for s in _SKIP):
                f = f.f_back
                continue
            where = f"{Path(name).name}:{f.f_lineno} {f.f_code.co_name}"
            if str(Path(name).resolve()).startswith(self.sglang_root):
                return "sglang", where
            if Path(name).name in _HARNESS:
                return "harness", where
            return "plugin", where
        return "plugin", "?"

    def _count(self, kind: str) -> None:
        if self.active:
            bucket, where = self._who()
            self.events[(bucket, kind, where)] += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        ins = list(_tensors(args)) + list(_tensors(kwargs))
        dev_in = any(is_device(t) for t in ins)
        target = kwargs.get("device")
        if func is T.to:
            target = next((a for a in args[1:] if isinstance(a, str | torch.device)), target)
        non_blocking = bool(kwargs.get("non_blocking", False)) or (func is T.to and len(args) > 2 and args[-1] is True)
        if func in _READS and dev_in:
            self._count(f"host read: {func.__name__}")
        elif func in _DATA_SHAPED and dev_in:
            self._count(f"data-dependent shape: {func.__name__}")
        elif (func in _INDEX_AT_1 or func in _INDEX_AT_2) and args and is_device(args[0]):
            at = 1 if func in _INDEX_AT_1 else 2
            index = list(_tensors(args[at : at + 1]))
            rest = list(_tensors(args[at + 1 :])) + list(_tensors(kwargs))
            if any(t.dtype == torch.bool for t in index):
                self._count("boolean-mask indexing (nonzero)")
            elif any(not is_device(t) and t.numel() > 1 for t in index):
                self._count("host tensor indexes a device tensor (blocking upload)")
            elif any(not is_device(t) and t.numel() > 1 for t in rest):
                self._count("host values written into a device tensor (blocking upload)")
        elif func is T.copy_ and args and is_device(args[0]) and not is_device(args[1]) and args[1].numel() > 1:
            if not non_blocking:
                self._count("blocking upload: copy_")
        elif func in _FROM_DATA and _device_arg(target):
            self._count("blocking upload: torch.tensor(data, device=...)")
        elif func is T.to and _device_arg(target) and ins and not dev_in and not non_blocking:
            self._count("possible blocking upload: .to(device) without non_blocking")
        out = func(*args, **kwargs)
        if func in _READS:
            if isinstance(out, torch.Tensor) and out is args[0]:
                out = out.clone()  # a real copy to the host is a new host tensor
            return out
        upload = func is T.to and _device_arg(target) and not dev_in and non_blocking
        if dev_in or upload or (_device_arg(target) and func is not T.to):
            outs = list(_tensors(out))
            if upload and isinstance(out, torch.Tensor) and ins and out is ins[0]:
                out = out.clone()  # an upload makes a new device tensor (on the CPU `.to` returned its input)
                outs = [out]
            for t in outs:
                t._qk_dev = True
        return out
