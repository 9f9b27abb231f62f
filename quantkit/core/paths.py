"""The one path-safety rule: quantkit never writes, renames onto or deletes through a symbolic link it did not
create.

Every path quantkit itself names below a directory the user chose — OUT, OUT.partial, OUT.old, the part files,
the journal, the lock, the calibration spill, a hub pull's destination and its origin file — goes through the
helpers here: directories are `lstat`-checked before and after `mkdir`, files are opened with `O_NOFOLLOW`, a
rename's destination is `lstat`-checked, and a link found at any of them is refused by name (exit 2, one line),
leaving the link and whatever it points to untouched. The directories the user named (OUT's parent, the hub
cache root, their ancestors) may themselves be links: that is the user's choice, not a planted one.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import IO

from quantkit.core.errors import QuantkitError

__all__ = ["copy_file", "existing_ancestor", "is_link", "make_parents", "open_write", "refuse_link", "remove_tree",
           "replace", "safe_mkdir"]

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def is_link(path: Path) -> bool:
    """`lstat`: True for a symbolic link (dangling or not)."""
    return os.path.islink(path)


def link_error(path: Path) -> QuantkitError:
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return QuantkitError(f"{path}: is a symbolic link (to {target}); quantkit never writes through a link it did "
                         "not create: remove the link and rerun (its target was not touched)")


def refuse_link(*paths: Path) -> None:
    """Raise a one-line QuantkitError naming the first of `paths` that is a symbolic link."""
    for path in paths:
        if is_link(path):
            raise link_error(path)


def safe_mkdir(path: Path, parents: bool = False) -> Path:
    """`mkdir -p`-like for a directory quantkit owns: refused when `path` is (or turns into) a link or a file.
    With `parents`, missing ancestors are created; existing ones are the user's and are not checked."""
    refuse_link(path)
    path.mkdir(parents=parents, exist_ok=True)
    refuse_link(path)  # planted between the check and the mkdir: mkdir(exist_ok) accepts a link to a directory
    return path


def existing_ancestor(path: Path) -> Path:
    """The nearest ancestor of `path` that exists (as anything, a link included)."""
    parent = path.parent
    while not os.path.lexists(parent) and parent != parent.parent:
        parent = parent.parent
    return parent


def make_parents(path: Path) -> list[Path]:
    """Create the missing parent directories of `path` (as `save_pretrained` and `hf download --local-dir` do),
    outermost first, each one with `safe_mkdir`: a link planted at a component quantkit creates is refused, never
    followed. The nearest existing ancestor is the user's (it may be a link to a directory); it must be a
    writable directory. Returns the directories created."""
    base = existing_ancestor(path)
    if not base.is_dir():
        raise QuantkitError(f"{base}: not a directory (a parent of {path})")
    if not os.access(base, os.W_OK | os.X_OK):
        raise QuantkitError(f"{base}: not writable (read-only file system or no permission)")
    created = []
    for parent in reversed(path.parents):
        if len(parent.parts) <= len(base.parts):
            continue
        safe_mkdir(parent)
        created.append(parent)
    return created


def open_write(path: Path, text: bool = False, exclusive: bool = False) -> IO[str] | IO[bytes]:
    """Open `path` for writing (created or truncated) without following a link at it (`O_NOFOLLOW`)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC) | _NOFOLLOW
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP or is_link(path):
            raise link_error(path) from None
        raise
    return os.fdopen(fd, "w", encoding="utf-8") if text else os.fdopen(fd, "wb")


def replace(src: Path, dst: Path) -> None:
    """`os.replace` whose destination must not be a link (rename would silently drop a link someone planted
    there; refusing it says so instead)."""
    refuse_link(src, dst)
    os.replace(src, dst)


def copy_file(src: Path, dst: Path) -> None:
    """Copy the bytes of `src` (which may be a link the checker allowed) to `dst`, never through a link at dst."""
    with open(src, "rb") as reader, open_write(dst) as writer:
        shutil.copyfileobj(reader, writer, 8 << 20)


def remove_tree(path: Path) -> None:
    """Remove a directory (or file) quantkit created; a link there is removed as a link, its target untouched.
    A missing path is fine."""
    if is_link(path) or path.is_file():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path)
