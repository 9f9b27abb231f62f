"""A layer boundary's activations on disk: `work_dir/acts_NNNN/bNNNNNN.safetensors`, one file per global
calibration batch (hidden states, + DSA top-k indices), written by `ActsWriter` into a temporary directory and
published whole; read back by `Acts`, from RAM while they fit the budget, else file by file."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quantkit.core.distributed import SINGLE, World
from quantkit.core.errors import QuantkitError
from quantkit.core.paths import open_write, refuse_link, replace

__all__ = ["Acts", "ActsWriter", "batch_file", "write_acts"]


class Acts:
    """This rank's inputs of one layer: batches of hidden states (+ DSA top-k indices), from RAM or disk.

    `indices` are the global batch indices; `total` is the size of every rank's batches together.
    """

    def __init__(self, path: Path, indices: list[int], cached: list[dict[str, torch.Tensor]] | None,
                 total: int) -> None:
        self.path, self.indices, self.cached, self.total = path, indices, cached, total
        self.files = [batch_file(path, i) for i in indices]

    @classmethod
    def open(cls, path: Path, budget: int, indices: list[int]) -> Acts:
        missing = [i for i in indices if not batch_file(path, i).exists()]
        if missing:
            raise QuantkitError(f"{batch_file(path, missing[0])}: calibration batch missing (the work directory "
                                "was made with another batch size?); delete the directory to restart")
        size = sum(batch_file(path, i).stat().st_size for i in indices)
        total = sum(f.stat().st_size for f in path.glob("b*.safetensors"))
        cached = [_load(batch_file(path, i)) for i in indices] if size <= budget else None
        return cls(path, indices, cached, total)

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self.cached is not None:
            yield from self.cached
        else:
            for f in self.files:
                yield _load(f)


def batch_file(acts_dir: Path, index: int) -> Path:
    """The activations of global calibration batch `index` at one layer boundary."""
    return acts_dir / f"b{index:06d}.safetensors"


def _load(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


class ActsWriter:
    """Writes a layer's outputs batch by batch into a temporary directory, published by `close`.

    With several ranks each writes its own batches; rank 0 prepares the directory and publishes it, and
    both `__init__` and `close` are collectives."""

    def __init__(self, path: Path, world: World = SINGLE) -> None:
        self.path, self.world = path, world
        self.tmp = path.with_name(path.name + ".tmp")
        if world.is_main:
            refuse_link(self.tmp, path)
            shutil.rmtree(self.tmp, ignore_errors=True)
            shutil.rmtree(path, ignore_errors=True)
            self.tmp.mkdir(parents=True)
        world.barrier()

    def add(self, index: int, hidden: torch.Tensor, topk: torch.Tensor | None) -> None:
        """The outputs of global batch `index`."""
        t = {"hidden": hidden.detach().to("cpu", torch.float32).contiguous()}
        if topk is not None:
            t["topk"] = topk.detach().to("cpu", torch.int32).contiguous()
        save_file(t, str(batch_file(self.tmp, index)))

    def close(self) -> None:
        self.world.barrier()  # every rank's batches are written
        if self.world.is_main:
            with open_write(self.tmp / "done"):
                pass
            replace(self.tmp, self.path)


def write_acts(path: Path, batches: Iterator[tuple[int, torch.Tensor]], world: World) -> None:
    w = ActsWriter(path, world)
    for i, h in batches:
        w.add(i, h, None)
    w.close()
    world.barrier()  # published before any rank reads it
