"""Keeping a checkpoint's card and manifest current after a command changed files in place."""

from __future__ import annotations

from pathlib import Path

from quantkit.checkpoint.manifest import MANIFEST_NAME, update_manifest
from quantkit.hub.card import CARD_NAME, is_generated_card, write_card

__all__ = ["refresh_outputs"]


def refresh_outputs(directory: Path, changed: list[str]) -> None:
    """Regenerate a quantkit card and re-hash `changed` files in SHA256SUMS (when the directory has them)."""
    files = list(changed)
    if is_generated_card(directory / CARD_NAME) and (directory / "quantkit.json").exists():
        write_card(directory)
        files.append(CARD_NAME)
    if (directory / MANIFEST_NAME).exists():
        update_manifest(directory, files)
