"""The content manifest: sha256 of every output file, in `sha256sum -c` format (`SHA256SUMS`).

Shard digests are computed from the bytes as the streaming writer writes them and kept in a one-line
sidecar (`<file>.sha256`) next to the file until the manifest is assembled, so a resumed conversion
keeps the digests of the shards an earlier run finished and no shard is read a second time. The small
metadata files (config, index, tokenizer, card) are hashed when the manifest is written.

`verify_manifest` re-hashes in parallel (threads: hashlib releases the GIL) and lists mismatches;
`quantkit verify`, `push` (before any byte is sent) and `pull` (after download) use it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from quantkit.core.durable import write_text_atomic
from quantkit.core.errors import QuantkitError
from quantkit.core.paths import open_write, replace

__all__ = [
    "MANIFEST_FILE",
    "RECIPE_FILE",
    "DIGEST_SUFFIX",
    "MANIFEST_NAME",
    "ManifestCheck",
    "manifest_files",
    "move_digest",
    "read_manifest",
    "sha256_file",
    "update_manifest",
    "verify_manifest",
    "write_digest",
    "write_manifest",
]

MANIFEST_NAME = "SHA256SUMS"
MANIFEST_FILE = "quantkit.json"  # the run record: tools, source fingerprint, every tensor's fate, serving
RECIPE_FILE = "quantkit_recipe.yaml"  # the resolved recipe
DIGEST_SUFFIX = ".sha256"
_CHUNK = 8 << 20
_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")


def write_digest(path: Path, hexdigest: str) -> None:
    """Record the digest of `path` (computed while writing it) in its sidecar, atomically."""
    sidecar = path.with_name(path.name + DIGEST_SUFFIX)
    tmp = sidecar.with_name(sidecar.name + ".tmp")
    with open_write(tmp, text=True) as fh:
        fh.write(f"{hexdigest}  {path.name}\n")
    replace(tmp, sidecar)


def move_digest(src: Path, dst: Path) -> None:
    """Move `src`'s sidecar along with a renamed file (no-op when there is none)."""
    sidecar = src.with_name(src.name + DIGEST_SUFFIX)
    if sidecar.exists():
        replace(sidecar, dst.with_name(dst.name + DIGEST_SUFFIX))


def _take_sidecar(path: Path) -> str | None:
    """The digest the writer recorded for `path` while writing it, if any."""
    sidecar = path.with_name(path.name + DIGEST_SUFFIX)
    try:
        text = sidecar.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    m = _LINE.match(text.strip())
    return m.group(1) if m else None


def sha256_file(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    """sha256 of one file, streamed in 8 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := fh.readinto(buf):
            digest.update(view[:n])
            if on_bytes:
                on_bytes(n)
    return digest.hexdigest()


def manifest_files(directory: Path) -> list[str]:
    """Files the manifest covers: everything but the manifest itself, sidecars and hidden paths."""
    out = []
    for p in sorted(directory.rglob("*")):
        rel = p.relative_to(directory).as_posix()
        # the manifest, its temporary file (left by a kill before its rename) and the write-time sidecars
        if not p.is_file() or rel in (MANIFEST_NAME, MANIFEST_NAME + ".tmp") or rel.endswith(
                (DIGEST_SUFFIX, DIGEST_SUFFIX + ".tmp")):
            continue
        if any(part.startswith(".") for part in Path(rel).parts):
            continue  # .cache/huggingface (download metadata), .quantkit-hub.json, editor files
        if "\n" in rel or "\\" in rel:
            raise QuantkitError(f"{p}: file names with a newline or backslash cannot be listed in {MANIFEST_NAME}")
        out.append(rel)
    return out


def _write_lines(directory: Path, digests: dict[str, str]) -> Path:
    path = directory / MANIFEST_NAME
    write_text_atomic(path, "".join(f"{digests[rel]}  {rel}\n" for rel in sorted(digests)))
    return path


def write_manifest(directory: Path) -> Path:
    """Write `SHA256SUMS` for `directory`, using (and removing) the write-time sidecar digests."""
    digests: dict[str, str] = {}
    for rel in manifest_files(directory):
        path = directory / rel
        digests[rel] = _take_sidecar(path) or sha256_file(path)
    out = _write_lines(directory, digests)
    for sidecar in directory.rglob("*" + DIGEST_SUFFIX):
        sidecar.unlink()
    return out


def read_manifest(directory: Path) -> dict[str, str]:
    """relative path -> sha256 from `directory/SHA256SUMS` (QuantkitError when missing or malformed)."""
    path = directory / MANIFEST_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise QuantkitError(f"{path}: missing (convert writes it; `quantkit verify --write` creates one)") from None
    out: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), start=1):
        m = _LINE.match(line)
        if not m:
            raise QuantkitError(f"{path}: line {n} is not `<sha256>  <file>`")
        rel = m.group(2)
        if rel.startswith("/") or ".." in Path(rel).parts:
            raise QuantkitError(f"{path}: line {n} names {rel!r}, outside the directory")
        out[rel] = m.group(1)
    return out


def update_manifest(directory: Path, changed: Iterable[str]) -> Path:
    """Re-hash only `changed` files (new or rewritten) and drop entries for files that are gone."""
    digests = read_manifest(directory)
    for rel in changed:
        path = directory / rel
        if path.is_file():
            digests[rel] = sha256_file(path)
    digests = {rel: h for rel, h in digests.items() if (directory / rel).is_file()}
    return _write_lines(directory, digests)


@dataclass
class ManifestCheck:
    """What `verify_manifest` found."""

    checked: int = 0
    bytes: int = 0
    mismatched: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unlisted: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.mismatched or self.missing or self.unlisted)

    def problems(self) -> list[str]:
        return ([f"{f}: sha256 mismatch" for f in self.mismatched] + [f"{f}: missing" for f in self.missing]
                + [f"{f}: not listed in {MANIFEST_NAME}" for f in self.unlisted])


def verify_manifest(
    directory: Path,
    workers: int = 4,
    on_total: Callable[[int], None] | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> ManifestCheck:
    """Re-hash every listed file in parallel; report mismatched, missing and unlisted files."""
    expected = read_manifest(directory)
    result = ManifestCheck()
    present = {rel for rel in expected if (directory / rel).is_file()}
    result.missing = sorted(set(expected) - present)
    result.unlisted = sorted(set(manifest_files(directory)) - set(expected))
    todo = sorted(present)
    result.bytes = sum((directory / rel).stat().st_size for rel in todo)
    if on_total:
        on_total(result.bytes)
    with ThreadPoolExecutor(max(1, workers)) as pool:
        got = dict(zip(todo, pool.map(lambda rel: sha256_file(directory / rel, on_bytes), todo), strict=True))
    result.checked = len(todo)
    result.mismatched = [rel for rel in todo if got[rel] != expected[rel]]
    return result
