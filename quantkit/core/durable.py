"""Durable file operations: the one atomic JSON writer, directory fsyncs, free-space accounting, run locks.

Every file quantkit publishes is written under a temporary name, fsynced, renamed into place and its
directory entry fsynced, so a kill -9 or power loss at any instant leaves either the old state or the new
one, never a torn file. Full disks are reported as a `QuantkitError` naming the path and the bytes still
needed (exit 2), and the work done so far is kept for a rerun.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from quantkit.core.errors import QuantkitError
from quantkit.core.jsontypes import JSONValue
from quantkit.core.paths import open_write, refuse_link, replace, safe_mkdir

__all__ = [
    "NO_SPACE_ERRNOS", "RunLock", "fsync_dir", "fsync_file", "fsync_tree", "is_no_space", "no_space_error",
    "tree_bytes", "write_json_atomic", "write_text_atomic",
]

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through `path.tmp`: fsync the file, rename, fsync the directory. Neither name may be
    a symbolic link (`quantkit.core.paths`)."""
    tmp = path.with_name(path.name + ".tmp")
    refuse_link(tmp, path)
    try:
        with open_write(tmp, text=True) as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        replace(tmp, path)
    except BaseException:
        if not os.path.islink(tmp):
            tmp.unlink(missing_ok=True)  # a full disk must not also leave a torn .tmp behind
        raise
    fsync_dir(path.parent)


def write_json_atomic(path: Path, value: JSONValue, indent: int | None = 2) -> None:
    """The one JSON writer for files other tools or a resumed run read back (see `write_text_atomic`)."""
    write_text_atomic(path, json.dumps(value, indent=indent) + "\n")


def fsync_file(path: Path) -> None:
    """fsync one file (its data; a no-op cost when it was fsynced when written) or one directory (its entries:
    renames and new files inside it become durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


fsync_dir = fsync_file  # the same call on a directory: makes renames and new entries inside it durable


def fsync_tree(root: Path) -> None:
    """fsync `root` (a file, or a directory with every file and directory under it)."""
    if not root.is_dir():
        fsync_file(root)
        return
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            fsync_file(path)
        elif path.is_dir():
            fsync_dir(path)
    fsync_dir(root)


def tree_bytes(root: Path) -> int:
    """Bytes of the regular files under `root` (0 when it does not exist)."""
    if not root.exists():
        return 0
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def is_no_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS


def no_space_error(exc: OSError, where: Path, still_needed: int) -> QuantkitError:
    """The one-line message for a disk that filled up mid-way."""
    path = exc.filename or where
    return QuantkitError(
        f"{path}: no space left on device; about {still_needed} more bytes are needed to finish "
        f"({_gb(still_needed)}). The work so far is kept: free space and rerun the same command to resume"
    )


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


class RunLock:
    """An exclusive lock on a work directory: `flock` on `DIR/.quantkit.lock`, which holds the owner's pid and host.

    The kernel drops a flock when its process dies, however it dies, so a lock left by a killed run is
    simply free: the next run takes it over (and says whose it was). A live holder makes `acquire`
    refuse with a message naming it. The lock file must not be unlinked while others may open it, except
    by its holder right before the directory is renamed away (see `quantkit.convert.publish`).
    """

    NAME = ".quantkit.lock"  # a dot name: carry-over never copies a source file over it

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / self.NAME
        self._fd: int | None = None
        self.previous_owner: str | None = None  # set when a stale lock was taken over

    def acquire(self) -> RunLock:
        for _ in range(5):  # the holder may rename the directory away between our open and flock
            safe_mkdir(self.directory, parents=True)
            refuse_link(self.path)
            fd = _open_lock(self.path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _read_owner(fd)
                os.close(fd)
                raise QuantkitError(
                    f"{self.directory}: another quantkit run ({owner or 'unknown process'}) is writing this output; "
                    "wait for it to finish or stop it, then rerun"
                ) from None
            if _same_file(fd, self.path):
                break
            os.close(fd)
        else:
            raise QuantkitError(f"{self.directory}: the work directory keeps changing under this run; is another "
                                "run publishing it?")
        self.previous_owner = _read_owner(fd) or None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def unlink_before_rename(self) -> None:
        """Remove the lock file (still holding the lock on its inode) so it does not travel with a rename."""
        self.path.unlink(missing_ok=True)

    @contextmanager
    def held(self) -> Iterator[RunLock]:
        self.acquire()
        try:
            yield self
        finally:
            self.release()


def _open_lock(path: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            refuse_link(path)
        raise


def _read_owner(fd: int) -> str:
    try:
        return os.pread(fd, 256, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)
