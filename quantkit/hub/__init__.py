"""Hub publishing: `quantkit push / pull / verify`, hub repo ids as sources, the model card.

    card.py      the README.md model card, generated from quantkit.json and the files next to it
    client.py    push (validate + verify, upload, remote check), pull (filtered, verified download),
                 hub repo ids resolved to local directories for inspect / convert / plan / kv-scales
    commands.py  the thin CLI commands

This module stays import-light (no huggingface_hub): the converter reads a pulled directory's origin
from here.
"""

from __future__ import annotations

import json
from pathlib import Path

from quantkit.core.jsontypes import JSONObject

__all__ = ["ORIGIN_FILE", "read_origin"]

ORIGIN_FILE = ".quantkit-hub.json"  # hidden: never carried over, never in the manifest


def read_origin(directory: Path) -> JSONObject | None:
    """{repo_id, revision, commit} of a directory `quantkit pull` made, else None."""
    try:
        value = json.loads((directory / ORIGIN_FILE).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) and isinstance(value.get("repo_id"), str) else None
