"""Assembling a finished `OUT.partial/` into a complete checkpoint and publishing it atomically.

Order matters: shards get their final names, the index is rebuilt from the headers actually written,
config.json / recipe / carried-over files are added, quantkit.json is written last (its presence marks
the metadata complete), and only then are the work folders removed and the directory renamed to OUT.
Until that rename nothing at OUT looks complete.

Every step is idempotent, so a run killed anywhere in here resumes: `finalize_shards` maps journal
entries to final names deterministically and skips renames already done; the metadata is rewritten;
a partial whose quantkit.json matches the run is simply published (`is_finished`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from quantkit.checkpoint.manifest import MANIFEST_FILE, RECIPE_FILE, move_digest, write_manifest
from quantkit.checkpoint.safetensors_header import read_header
from quantkit.checkpoint.source import INDEX_NAME, PICKLE_SUFFIXES, SourceCheckpoint, link_root
from quantkit.convert.plan import TensorPlan
from quantkit.core.durable import RunLock, fsync_dir, fsync_tree
from quantkit.core.errors import QuantkitError
from quantkit.core.jsontypes import JSONObject
from quantkit.core.paths import copy_file, refuse_link, replace, safe_mkdir

__all__ = ["MANIFEST_FILE", "RECIPE_FILE", "WORK_DIRS", "carry_over_files",
           "finalize_shards", "is_finished", "publish", "run_identity",
           "source_fingerprint", "tool_versions"]

WORK_DIRS = ("parts", "calibration", "dist", "journal")  # removed before publishing; the journal last


def source_fingerprint(source: SourceCheckpoint) -> str:
    """sha256 over every shard's name, size and header bytes: cheap, and changes with any re-export."""
    digest = hashlib.sha256()
    digest.update(json.dumps(source.config, sort_keys=True).encode())
    for shard, header in source.headers.items():
        digest.update(f"{shard}:{header.file_size}:".encode())
        with open(header.path, "rb") as fh:
            digest.update(fh.read(8 + header.header_len))
    return digest.hexdigest()


def tool_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("quantkit", "torch", "safetensors", "compressed-tensors", "transformers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def run_identity(source: SourceCheckpoint, recipe_json: JSONObject) -> JSONObject:
    """What makes two runs the same run: resuming is allowed only between runs with equal identities."""
    return {"fingerprint": source_fingerprint(source), "recipe": recipe_json, "versions": tool_versions()}


def is_finished(directory: Path, identity: JSONObject) -> bool:
    """True when `directory` holds a complete output of this run (its quantkit.json is written last)."""
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text(encoding="utf-8"))
        seen = {"fingerprint": manifest["source"]["fingerprint"], "recipe": manifest["recipe"],
                "versions": manifest["tool_versions"]}
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return seen == identity


def finalize_shards(partial: Path, journal: list[JSONObject]) -> dict[str, str]:
    """Rename part files to `model-XXXXX-of-YYYYY.safetensors` in order; return the rebuilt weight map.

    Idempotent: the names follow from the journal alone, and a part already renamed by an interrupted
    run is found under its final name.
    """
    parts = [p for entry in journal for p in entry["parts"]]
    weight_map: dict[str, str] = {}
    for i, part in enumerate(parts, start=1):
        final = f"model-{i:05d}-of-{len(parts):05d}.safetensors"
        if (partial / "parts" / part).exists():
            replace(partial / "parts" / part, partial / final)
        elif not (partial / final).exists():
            raise QuantkitError(f"{partial}: the journal lists {part} but neither it nor {final} exists; "
                                f"delete {partial} and rerun")
        move_digest(partial / "parts" / part, partial / final)  # write-time sha256 for the manifest
        for name in read_header(partial / final).tensors:
            weight_map[name] = final
    fsync_dir(partial)
    return dict(sorted(weight_map.items()))


def carry_over_files(source: SourceCheckpoint, partial: Path) -> tuple[list[str], list[dict[str, str]]]:
    """Copy every non-weight file (tokenizer, chat template, generation config, custom *.py, docs).

    Returns (copied, skipped-with-reason). Weight shards, the old index and config.json are rewritten;
    pickle files are never copied (they would be loaded by some tools and are never needed), nor are
    symlinks that resolve outside the checkpoint (or, for a Hugging Face cache snapshot, its repo folder).
    """
    copied, skipped = [], []
    weight_files = set(source.shard_files)
    allowed = link_root(source.root)
    for path in sorted(source.root.rglob("*")):
        rel = path.relative_to(source.root).as_posix()
        if path.is_dir() or any(part.startswith(".") for part in Path(rel).parts):
            continue
        if rel in weight_files or rel in (INDEX_NAME, "config.json"):
            continue
        if rel.endswith(PICKLE_SUFFIXES):
            skipped.append({"file": rel, "reason": "pickle file: never read or copied"})
            continue
        if rel.endswith(".safetensors"):
            skipped.append({"file": rel, "reason": "safetensors file not listed in the index: stale, not copied"})
            continue
        if not path.resolve().is_relative_to(allowed):
            skipped.append({"file": rel, "reason": "symlink to a file outside the checkpoint: not copied"})
            continue
        target = partial / rel
        for parent in reversed(target.relative_to(partial).parents[:-1]):
            safe_mkdir(partial / parent)
        copy_file(path, target)
        copied.append(rel)
    return copied, skipped


def account(plans: dict[str, list[TensorPlan]], weight_map: dict[str, str]) -> dict[str, JSONObject]:
    """Per source tensor (physical name): what happened to it, with bytes and where it went."""
    out: dict[str, JSONObject] = {}
    for shard_plans in plans.values():
        for plan in shard_plans:
            outputs = [o.name for o in plan.outputs]
            missing = [o for o in outputs if o not in weight_map]
            if missing:
                raise RuntimeError(f"planned output {missing[0]} is not in any written shard")
            for part, shard in sorted(plan.source.parts.items()):
                primary = part == plan.name or part.endswith(".weight_packed")
                if plan.action == "passthrough":
                    action, reason, into = "passthrough", plan.reason, [part]
                elif primary:
                    action, reason, into = plan.action, plan.reason, outputs
                else:
                    action, reason, into = "absorbed", f"part of {plan.name}: {plan.reason}", []
                out[part] = {
                    "shard": shard,
                    "role": plan.role.value,
                    "action": action,
                    "reason": reason,
                    "outputs": into,
                    "output_shards": sorted({weight_map[o] for o in into}),
                }
    return dict(sorted(out.items()))


def publish(partial: Path, out: Path, force: bool) -> None:
    """Atomically move the finished directory into place (replacing OUT only with --force).

    The caller holds the run lock (`OUT.partial/.quantkit.lock`); the lock file travels with the rename and is
    removed from OUT right after it, so no second run can slip into OUT.partial while it is published.
    """
    published = [p for p in partial.iterdir() if p.name not in (*WORK_DIRS, RunLock.NAME)]
    for path in published:  # everything that will be in OUT is on disk before the work is dropped
        fsync_tree(path)
    for leftover in WORK_DIRS:  # calibration: per-layer GPTQ work files; the journal goes last
        shutil.rmtree(partial / leftover, ignore_errors=True)
    write_manifest(partial)  # SHA256SUMS of the final contents; shards from their write-time digests
    fsync_dir(partial)
    old = out.with_name(out.name + ".old")
    refuse_link(out, old)  # checked up front too; a link is never renamed over or removed as if it were ours
    shutil.rmtree(old, ignore_errors=True)  # left by a run killed while replacing OUT
    if out.exists():
        if not force:  # checked up front too; the directory may have appeared meanwhile
            raise QuantkitError(f"{out}: appeared while this run was converting; not replaced (use --force)")
        os.replace(out, old)
    os.replace(partial, out)
    fsync_dir(out.parent)
    (out / RunLock.NAME).unlink(missing_ok=True)
    fsync_dir(out)
    shutil.rmtree(old, ignore_errors=True)

