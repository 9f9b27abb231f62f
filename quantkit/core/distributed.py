"""Running quantkit on several processes with torch.distributed: one process per GPU (or per CPU share).

`quantkit convert` started by `torchrun` (or any launcher that sets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
`MASTER_ADDR`, `MASTER_PORT`) finds itself in a world of N ranks: `World.from_env()` reads those variables
and `World.start()` joins the process group — NCCL when the ranks compute on CUDA devices (one device per
rank, `cuda:LOCAL_RANK`), gloo on CPUs. A single process is the world of one (`SINGLE`): every collective
below is then a no-op, so callers never branch on the world size.

Failures. A rank that fails records its one-line message in `failure_dir` (`OUT.partial/dist/`, on the
filesystem all ranks share) before it exits; the other ranks notice at their next collective (gloo: the
peer's sockets close; torchrun: the agent stops them) and exit non-zero with that message
(`World.guard`). A rank killed outright (kill -9, OOM) leaves no message: the others say which rank
stopped answering. The work already published by any rank is kept; the rerun resumes it.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal, TypeVar

import torch

from quantkit.core.errors import QuantkitError

__all__ = ["Backend", "SINGLE", "World", "RankFailed"]

Backend = Literal["gloo", "nccl"]
T = TypeVar("T")

_TIMEOUT_ENV = "QUANTKIT_DIST_TIMEOUT"  # seconds a collective may wait for the other ranks (default 1800)


class RankFailed(QuantkitError):
    """Another rank failed; the message is that rank's (or says it stopped answering)."""


@dataclass(frozen=True)
class World:
    """This process's place among the ranks of one run."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: Backend = "gloo"

    # ---- joining ---------------------------------------------------------------------------------
    @staticmethod
    def from_env(device: str = "cpu") -> World:
        """The world torchrun describes in the environment (`SINGLE` outside one, or with WORLD_SIZE 1).

        `device` is what the user asked for: a CUDA device makes the backend NCCL, one device per rank.
        """
        size = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if size <= 1:
            return SINGLE
        for var in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise QuantkitError(f"WORLD_SIZE={size} but {var} is not set: start quantkit with torchrun")
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        backend: Backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        return World(rank, size, local, backend)

    def start(self) -> None:
        """Join the process group (no-op for one process or when already joined)."""
        import torch.distributed as dist

        if self.size == 1 or dist.is_initialized():
            return
        if self.backend == "nccl":
            torch.cuda.set_device(self.local_rank)
        timeout = timedelta(seconds=float(os.environ.get(_TIMEOUT_ENV, "1800")))
        dist.init_process_group(self.backend, rank=self.rank, world_size=self.size, timeout=timeout)

    def stop(self) -> None:
        """Leave the process group (after the last collective).

        A barrier first: a rank that returns early from the last collective and tears its connections down
        while a peer's gloo threads are still completing it can abort that peer at exit (SIGABRT,
        "terminate called without an active exception", seen in CI under torchrun). Called after the last
        collective of a successful run, and by every rank at once when a collective decided the run fails."""
        import torch.distributed as dist

        if self.size > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def device(self, requested: str) -> str:
        """The device this rank computes on: `cuda:LOCAL_RANK` when the run is on CUDA, else `requested`."""
        if self.size > 1 and torch.device(requested).type == "cuda":
            return f"cuda:{self.local_rank}"
        return requested

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ---- work partitioning -----------------------------------------------------------------------
    def owner(self, index: int) -> int:
        """The rank that owns item `index` of a list partitioned round-robin."""
        return index % self.size

    def mine(self, items: list[T]) -> list[T]:
        """This rank's items of `items`, round-robin (every rank computes the same partition)."""
        return items[self.rank :: self.size]

    def balanced(self, sizes: list[int]) -> list[int]:
        """Indices of `sizes` assigned to this rank: largest first, each to the least-loaded rank (ties to
        the lowest rank) — deterministic for a given world size."""
        load = [0] * self.size
        owner = [0] * len(sizes)
        for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
            r = min(range(self.size), key=lambda r: (load[r], r))
            owner[i] = r
            load[r] += sizes[i]
        return [i for i in range(len(sizes)) if owner[i] == self.rank]

    # ---- collectives (no-ops for one process) ----------------------------------------------------
    def _comm(self, t: torch.Tensor) -> torch.Tensor:
        """Where a tensor must live for this backend's collectives."""
        if self.backend == "nccl":
            return t.to(f"cuda:{self.local_rank}")
        return t.cpu()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of `t` over the ranks (a new tensor on `t`'s device; `t` itself for one process)."""
        if self.size == 1:
            return t
        import torch.distributed as dist

        buf = self._comm(t).clone()
        dist.all_reduce(buf)
        return buf.to(t.device)

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """`src`'s `t` on every rank (other ranks pass a tensor of the same shape and dtype)."""
        if self.size == 1:
            return t
        import torch.distributed as dist

        buf = self._comm(t).contiguous().clone()
        dist.broadcast(buf, src)
        return buf.to(t.device)

    def all_gather_object(self, value: object) -> list[object]:
        """Every rank's `value` (small, JSON-like values only: they travel pickled between our own ranks)."""
        if self.size == 1:
            return [value]
        import torch.distributed as dist

        out: list[object] = [None] * self.size
        dist.all_gather_object(out, value)
        return out

    def barrier(self) -> None:
        if self.size == 1:
            return
        import torch.distributed as dist

        dist.barrier()

    def agree(self, ok: bool) -> bool:
        """True on every rank when every rank passed True (a collective: all ranks must call it)."""
        if self.size == 1:
            return ok
        flag = self.all_reduce(torch.tensor([0 if ok else 1], dtype=torch.int64))
        return int(flag.item()) == 0

    def all_gather_rows(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
        """Every rank's tensors concatenated along dim 0 in rank order, and each rank's row count.

        All `tensors` of one rank have the same number of rows (which may differ between ranks, zero
        included); each rank passes the same dtypes and trailing shapes. Returns `tensors` unchanged for
        one process.
        """
        if self.size == 1:
            return tensors, [tensors[0].shape[0]]
        import torch.distributed as dist

        n = self._comm(torch.tensor([tensors[0].shape[0]], dtype=torch.int64))
        counts = [torch.zeros_like(n) for _ in range(self.size)]
        dist.all_gather(counts, n)
        rows = [int(c.item()) for c in counts]
        top = max(rows)
        out = []
        for t in tensors:
            buf = self._comm(t).contiguous()
            if buf.shape[0] < top:
                buf = torch.cat([buf, buf.new_zeros((top - buf.shape[0], *buf.shape[1:]))])
            parts = [torch.empty_like(buf) for _ in range(self.size)]
            dist.all_gather(parts, buf)
            out.append(torch.cat([p[:r] for p, r in zip(parts, rows, strict=True)]).to(t.device))
        return out, rows

    def broadcast_exact(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """`broadcast` of the raw bytes (any dtype, bf16 included, whatever the backend supports)."""
        if self.size == 1:
            return t
        raw = t.contiguous().view(torch.uint8)
        return self.broadcast(raw, src).view(t.dtype)

    # ---- failures --------------------------------------------------------------------------------
    @contextmanager
    def guard(self, failure_dir: Callable[[], Path | None]) -> Iterator[None]:
        """Run a rank's work; turn a failure anywhere in the world into the same one-line error on every rank.

        `failure_dir` is asked only when something failed (the directory may not exist at the start).
        This rank's own QuantkitError is recorded there and re-raised; an error from a collective (another
        rank is gone) or torchrun's SIGTERM becomes `RankFailed` with the failing rank's recorded message.
        """
        if self.size == 1:
            yield
            return
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
        try:
            yield
        except BaseException as exc:
            # This rank is failing. The launcher sends SIGTERM to every rank once one has exited: it must not
            # cut this rank's message short, so it stays ignored until the process exits.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            failure = self._explain(exc, failure_dir)
            if failure is None:
                raise
            raise failure from None
        signal.signal(signal.SIGTERM, previous)

    def _explain(self, exc: BaseException, failure_dir: Callable[[], Path | None]) -> RankFailed | None:
        """The error to raise instead of `exc` (None: re-raise `exc`, after recording it for the others)."""
        if isinstance(exc, RankFailed):
            return None
        if isinstance(exc, QuantkitError):
            _record(failure_dir(), self.rank, str(exc))
            return None
        if isinstance(exc, (RuntimeError, _Terminated, ConnectionError)):
            other = _read_failure(failure_dir(), self.rank)
            if other is not None:
                return RankFailed(f"rank {other[0]} of {self.size} failed: {other[1]}")
            if isinstance(exc, _Terminated):
                return RankFailed(f"another rank of {self.size} exited without a message (killed?), so the launcher "
                                  f"stopped rank {self.rank}; rerun the same command to resume")
            message = _clean(str(exc))
            if _is_peer_loss(message):
                return RankFailed(f"another rank of {self.size} stopped answering (killed?): {message}; "
                                  "rerun the same command to resume")
            _record(failure_dir(), self.rank, f"internal error: {type(exc).__name__}: {message}")
            return None
        if not isinstance(exc, KeyboardInterrupt):
            _record(failure_dir(), self.rank, f"internal error: {type(exc).__name__}: {exc}")
        return None


SINGLE = World()


class _Terminated(BaseException):
    pass


def _raise_terminated(_signum: int, _frame: object) -> None:
    if sys.exc_info()[0] is None:  # while an error is being handled, that error is the one to report
        raise _Terminated()


def _clean(message: str) -> str:
    """A collective's error on one short line: without gloo's source location and advice."""
    message = re.sub(r"\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", " ".join(message.split()))
    return message.split(" This is typically caused by")[0].strip()[:300]


def _is_peer_loss(message: str) -> bool:
    m = message.lower()
    return any(s in m for s in ("connection closed", "connection reset", "broken pipe", "timed out", "timeout",
                                "peer", "nccl"))


def _record(path: Path | None, rank: int, message: str) -> None:
    """Write this rank's failure where the other ranks look (best effort: the run is failing anyway)."""
    if path is None:
        return
    try:
        from quantkit.core.paths import open_write, replace, safe_mkdir

        safe_mkdir(path, parents=True)
        tmp = path / f".rank{rank}.tmp"
        with open_write(tmp, text=True) as fh:
            fh.write(" ".join(message.split()) + "\n")
        replace(tmp, path / f"rank{rank}.failed")
    except (OSError, QuantkitError):  # a link planted there is left alone; the run is failing anyway
        pass


def _read_failure(path: Path | None, me: int, wait_s: float = 3.0) -> tuple[int, str] | None:
    """The lowest other rank's recorded failure, waiting briefly for it to be written."""
    if path is None:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        if path.is_dir():
            for f in path.glob("rank*.failed"):
                rank = int(f.name[4:-7])
                if rank != me:
                    found.append((rank, f.read_text(encoding="utf-8").strip()))
        if found or time.monotonic() >= deadline:
            return min(found) if found else None
        time.sleep(0.1)


def clear_failures(path: Path) -> None:
    """Remove the failure records of a previous run (rank 0, before the ranks start working)."""
    if path.is_dir():
        for f in path.glob("rank*.failed"):
            f.unlink(missing_ok=True)
