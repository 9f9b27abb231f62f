"""OUT and OUT.partial before the work: path checks, the journal, and what a rerun may resume.

`prepare_partial` resumes a partial made by the same run (source fingerprint, recipe, versions) and, within it,
only the shards whose source files still have the size and mtime their journal entry recorded: a source fixed
after a bad tensor was found mid-run redoes whatever the fix touched (`kept` is what the error line says).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from quantkit.checkpoint.source import SourceCheckpoint
from quantkit.convert.publish import WORK_DIRS, is_finished
from quantkit.convert.worker import journal_path
from quantkit.core.durable import RunLock, write_json_atomic
from quantkit.core.errors import QuantkitError
from quantkit.core.jsontypes import JSONObject
from quantkit.core.paths import existing_ancestor, refuse_link, safe_mkdir
from quantkit.core.progress import Reporter
from quantkit.quant.recipe import Recipe

__all__ = ["check_out", "check_paths", "kept", "prepare_partial", "read_journal", "resumable"]

RUN_FILE = "run.json"


def check_paths(src: Path, out: Path) -> None:
    """SRC and OUT do not overlap, OUT's parent (or, when it is missing, its nearest existing ancestor: the
    conversion creates the rest, `make_parents`) is a writable directory, and none of the names quantkit creates
    next to it (OUT, OUT.partial, OUT.old) is a symbolic link (`quantkit.core.paths`): nothing is written through
    one."""
    refuse_link(out, out.with_name(out.name + ".partial"), out.with_name(out.name + ".old"))
    if out == src or out.is_relative_to(src):
        raise QuantkitError(f"{out}: refusing to write inside the source directory {src}")
    if src.is_relative_to(out):
        raise QuantkitError(f"{out}: refusing to write over a directory that contains the source")
    parent = out.parent if os.path.lexists(out.parent) else existing_ancestor(out)  # missing parents: created later
    if not parent.is_dir():
        raise QuantkitError(f"{parent}: not a directory (the output's parent)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise QuantkitError(f"{parent}: not writable (read-only file system or no permission)")


def check_out(out: Path, identity: JSONObject, force: bool) -> None:
    """OUT must not exist (or --force); a lock left in it by a run killed right after publishing is removed."""
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir() or out.is_symlink():
        raise QuantkitError(f"{out}: exists and is not a directory; refusing to replace it")
    stray = RunLock(out)
    if stray.path.exists():  # the publishing run was killed between its rename and removing the lock file
        try:
            with stray.held():
                stray.unlink_before_rename()
        except QuantkitError:
            raise QuantkitError(f"{out}: another quantkit run is publishing it right now") from None
    if force:
        return
    if is_finished(out, identity):
        raise QuantkitError(f"{out}: already converted from this source with this recipe (use --force to redo it)")
    raise QuantkitError(f"{out}: already exists (use --force to replace it)")


def resumable(partial: Path, identity: JSONObject) -> bool:
    """Whether the bytes already in OUT.partial count towards this run (read without the lock: an estimate)."""
    try:
        return is_finished(partial, identity) or json.loads((partial / "journal" / RUN_FILE).read_text()) == identity
    except (OSError, ValueError):
        return False


def prepare_partial(partial: Path, source: SourceCheckpoint, identity: JSONObject, report: Reporter) -> set[int]:
    """Create OUT.partial's work folders, or resume it when it was made by the same source and recipe."""
    run_file = partial / "journal" / RUN_FILE
    refuse_link(*(partial / d for d in WORK_DIRS), run_file)  # before anything there is read, kept or discarded
    contents = [p for p in partial.iterdir() if p.name != RunLock.NAME]
    if contents:
        try:
            same = json.loads(run_file.read_text()) == identity
        except (OSError, ValueError):
            same = False
        if not same:
            why = ("it was made from another source, recipe or quantkit version" if run_file.exists()
                   else "it holds no journal of a quantkit run")
            report.note(f"discarding {partial.name}: {why}")
            for path in contents:
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    safe_mkdir(partial / "parts")
    safe_mkdir(partial / "journal")
    write_json_atomic(run_file, identity)
    done = {i for i in range(len(source.shard_files)) if journal_path(partial, i).exists()}
    stale = {i for i in done if not _same_sources(partial, i, source)}
    if stale:
        report.note(f"redoing {len(stale)} converted shard(s) whose source files changed since they were converted")
        for i in sorted(stale):
            journal_path(partial, i).unlink()
        done -= stale
    for part in (partial / "parts").glob("part-*.safetensors*"):
        if int(part.name.split("-")[1]) not in done:
            refuse_link(part)
            part.unlink()  # an unfinished shard from the interrupted run: redo it
    if done:
        report.note(f"resuming: {len(done)} of {len(source.shard_files)} shards already converted")
    return done


def kept(partial: Path, source: SourceCheckpoint, recipe: Recipe) -> str:
    """The tail of a mid-run input error: what OUT.partial keeps, and why a rerun on a fixed source is safe."""
    n = sum(journal_path(partial, i).exists() for i in range(len(source.shard_files)))
    layers = " and the calibrated layers" if recipe.needs_calibration else ""
    return (f"{partial} keeps the {n} of {len(source.shard_files)} shards converted before it{layers}: a rerun "
            "reuses them only while the source files they were made from keep their size and mtime, so a fixed "
            "source redoes whatever the fix touched")


def _same_sources(partial: Path, index: int, source: SourceCheckpoint) -> bool:
    """Whether the source files a journaled shard was made from still have the size and mtime it recorded."""
    try:
        recorded = read_journal(partial, index)["sources"]
        return isinstance(recorded, dict) and source.stamps(list(recorded)) == recorded
    except (OSError, ValueError, KeyError, TypeError):
        return False


def read_journal(partial: Path, index: int) -> JSONObject:
    return json.loads(journal_path(partial, index).read_text())
