"""How `convert` runs on several ranks (torchrun): who decides, who waits, who does which shard.

Each step of a run is one of two kinds, so every rank takes the same collectives in the same order:

    every_rank(world, fn)   every rank runs fn (validating the source, checking paths); the ranks then
                            exchange their outcome, so a bad input fails on every rank with the same line
    on_main(world, fn)      rank 0 alone runs fn (lock, discard/resume, finalize, publish); the others wait
                            in the collective and receive its small result (which shards are done) or its
                            error: they never learn rank 0's decisions by racing on files

The not-yet-done shard jobs are partitioned by `World.balanced` over their source bytes: every rank
computes the same partition and runs its share.

For one process (`SINGLE`) the collectives are no-ops and every helper is a plain call.

A shared file system is required (the part files of every rank end up in one `OUT.partial`):
`check_shared_dir` has rank 0 write a nonce that every other rank must read back.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from quantkit.core.distributed import RankFailed, World
from quantkit.core.durable import write_text_atomic
from quantkit.core.errors import QuantkitError
from quantkit.core.paths import safe_mkdir

__all__ = ["DIST_DIR", "check_same_run", "check_shared_dir", "every_rank", "join", "on_main", "write_nonce"]

T = TypeVar("T")
DIST_DIR = "dist"  # OUT.partial/dist/: failure records of the ranks and the shared-filesystem nonce
_NONCE_FILE = "nonce"


def every_rank(world: World, fn: Callable[[], T]) -> T:
    """Run `fn` on every rank; when it raises a QuantkitError on any rank, every rank raises.

    The failing rank raises its own error; the others raise `RankFailed` with the lowest failing rank's
    message. Errors other than QuantkitError are bugs: they propagate on their rank (the others then
    learn about it from `World.guard`).
    """
    value: T | None = None
    own: QuantkitError | None = None
    try:
        value = fn()
    except QuantkitError as exc:
        if world.size == 1:
            raise
        own = exc
    errors = world.all_gather_object(None if own is None else str(own))
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        world.stop()  # every rank knows the run fails here: leave the group together (see World.stop)
    if own is not None:
        raise own
    if failed:
        rank, message = failed[0]
        raise RankFailed(f"rank {rank} of {world.size} failed: {message}")
    return value  # type: ignore[return-value]  # fn returned on this rank


def on_main(world: World, fn: Callable[[], T]) -> T:
    """Run `fn` on rank 0 only; every rank returns its result (small, JSON-like) or raises its error.

    Rank 0's QuantkitError reaches the others as `RankFailed` with the same message.
    """
    if world.size == 1:
        return fn()
    value: object = None
    error: str | None = None
    if world.is_main:
        try:
            value = fn()
        except QuantkitError as exc:
            world.all_gather_object((None, str(exc)))
            world.stop()  # every rank knows the run fails here: leave the group together (see World.stop)
            raise
    value, error = world.all_gather_object((value, error))[0]  # type: ignore[misc]
    if error is not None:
        world.stop()
        raise RankFailed(f"rank 0 of {world.size} failed: {error}")
    return value  # type: ignore[return-value]


def check_same_run(world: World, identity: dict[str, object], src: Path) -> None:
    """Every rank must see the same source, recipe and tool versions as rank 0 (e.g. nodes with another
    copy of SRC or another quantkit install would otherwise write parts of two different runs)."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    main = world.all_gather_object(digest)[0]

    def check() -> None:
        if digest != main:
            raise QuantkitError(f"{src}: rank {world.rank} on {socket.gethostname()} sees another source, recipe or "
                                "tool version than rank 0 (every node needs the same SRC and quantkit install)")

    every_rank(world, check)


def join(world: World) -> None:
    """Join the process group (a one-line error when that fails), and share the node's cores among its
    ranks: torch threads = cpus / ranks on this node, at least 1. A no-op for one process."""
    if world.size == 1:
        return
    try:
        world.start()
    except (RuntimeError, OSError, ValueError) as exc:
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        message = " ".join(str(exc).split())[:300]
        raise QuantkitError(f"rank {world.rank} of {world.size} could not join the {world.backend} process group "
                            f"at {where}: {message}") from None
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


def write_nonce(dist_dir: Path) -> str:
    """Rank 0: a fresh nonce in `dist_dir` (returned, to be sent to the other ranks)."""
    nonce = f"{secrets.token_hex(16)} {socket.gethostname()}"
    safe_mkdir(dist_dir)
    write_text_atomic(dist_dir / _NONCE_FILE, nonce + "\n")
    return nonce


def check_shared_dir(world: World, dist_dir: Path, nonce: str, wait_s: float = 5.0) -> None:
    """Every rank other than 0 must read back the nonce rank 0 wrote: OUT is on a file system they share.

    A collective (`every_rank`): a rank that cannot see the file makes every rank fail with its message.
    """
    def check() -> None:
        if world.is_main:
            return
        path = dist_dir / _NONCE_FILE
        deadline = time.monotonic() + wait_s  # network file systems may show a new file a moment late
        while True:
            try:
                if path.read_text(encoding="utf-8").strip() == nonce:
                    return
            except OSError:
                pass
            if time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        host0 = nonce.split(" ", 1)[-1]
        raise QuantkitError(
            f"{path}: rank {world.rank} on {socket.gethostname()} cannot read the file rank 0 on {host0} just "
            "wrote; the output directory must be on a file system every node shares (NFS, Lustre, ...)")

    every_rank(world, check)
