"""Keeping a checkpoint's card and manifest current after a command changed files in place."""

from __future__ import annotations

import json
import time
from pathlib import Path

from quantkit.checkpoint.manifest import MANIFEST_NAME, update_manifest
from quantkit.core.durable import write_json_atomic
from quantkit.core.errors import QuantkitError
from quantkit.core.jsontypes import JSONObject
from quantkit.hub.card import CARD_NAME, is_generated_card, write_card

__all__ = ["record_eval", "refresh_outputs"]


def refresh_outputs(directory: Path, changed: list[str]) -> None:
    """Regenerate a quantkit card and re-hash `changed` files in SHA256SUMS (when the directory has them)."""
    files = list(changed)
    if is_generated_card(directory / CARD_NAME) and (directory / "quantkit.json").exists():
        write_card(directory)
        files.append(CARD_NAME)
    if (directory / MANIFEST_NAME).exists():
        update_manifest(directory, files)


def record_eval(directory: Path, result: JSONObject) -> Path:
    """Store `result` as quantkit.json["eval"] in checkpoint `directory` (atomic rewrite of the manifest), then
    regenerate a quantkit-written card and re-hash SHA256SUMS, so `verify` and `push` carry the result."""
    manifest = directory / "quantkit.json"
    if not manifest.is_file():
        raise QuantkitError(f"{manifest}: not found (--record takes a checkpoint directory written by quantkit)")
    data = json.loads(manifest.read_text(encoding="utf-8"))
    data["eval"] = {**result, "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_json_atomic(manifest, data)
    refresh_outputs(directory, ["quantkit.json"])  # the card's Quality section and SHA256SUMS follow
    return manifest
