"""Assembling a finished `OUT.partial/` into a complete checkpoint and publishing it atomically.

Order matters: shards get their final names, the index is rebuilt from the headers actually written,
config.json / recipe / quantkit.json / carried-over files are added, and only then is the directory
renamed to OUT. Until that rename nothing at OUT looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from quantkit.checkpoint.manifest import move_digest, write_manifest
from quantkit.checkpoint.safetensors_header import read_header
from quantkit.checkpoint.source import INDEX_NAME, PICKLE_SUFFIXES, SourceCheckpoint
from quantkit.checkpoint.writer import fsync_dir
from quantkit.convert.plan import TensorPlan

__all__ = ["carry_over_files", "finalize_shards", "publish", "source_fingerprint", "write_json", "tool_versions"]

RECIPE_FILE = "quantkit_recipe.yaml"
MANIFEST_FILE = "quantkit.json"


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


def finalize_shards(partial: Path, journal: list[dict[str, Any]]) -> dict[str, str]:
    """Rename part files to `model-XXXXX-of-YYYYY.safetensors` in order; return the rebuilt weight map."""
    parts = [p for entry in journal for p in entry["parts"]]
    weight_map: dict[str, str] = {}
    for i, part in enumerate(parts, start=1):
        final = f"model-{i:05d}-of-{len(parts):05d}.safetensors"
        os.replace(partial / "parts" / part, partial / final)
        move_digest(partial / "parts" / part, partial / final)  # write-time sha256 for the manifest
        for name in read_header(partial / final).tensors:
            weight_map[name] = final
    return dict(sorted(weight_map.items()))


def carry_over_files(source: SourceCheckpoint, partial: Path) -> tuple[list[str], list[dict[str, str]]]:
    """Copy every non-weight file (tokenizer, chat template, generation config, custom *.py, docs).

    Returns (copied, skipped-with-reason). Weight shards, the old index and config.json are rewritten;
    pickle files are never copied (they would be loaded by some tools and are never needed).
    """
    copied, skipped = [], []
    weight_files = set(source.shard_files)
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
        target = partial / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        copied.append(rel)
    return copied, skipped


def account(plans: dict[str, list[TensorPlan]], weight_map: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Per source tensor (physical name): what happened to it, with bytes and where it went."""
    out: dict[str, dict[str, Any]] = {}
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


def write_json(path: Path, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(value, fh, indent=2)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())


def publish(partial: Path, out: Path, force: bool) -> None:
    """Atomically move the finished directory into place (replacing OUT only with --force)."""
    for leftover in ("parts", "journal", "calibration"):  # calibration: per-layer GPTQ work files
        shutil.rmtree(partial / leftover, ignore_errors=True)
    write_manifest(partial)  # SHA256SUMS of the final contents; shards from their write-time digests
    fsync_dir(partial)
    if out.exists():
        if not force:  # checked up front too; the directory may have appeared meanwhile
            raise FileExistsError(out)
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(partial, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(partial, out)
    fsync_dir(out.parent)
