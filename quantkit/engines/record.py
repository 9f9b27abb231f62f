"""The `serving` block of a checkpoint's quantkit.json: every engine's verdict and launch line, and SGLang's
prefill/decode pair (and split) — what `convert` writes and `kv-scales` refreshes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from quantkit.arch import KVLayout
from quantkit.checkpoint.manifest import MANIFEST_FILE
from quantkit.core.durable import write_json_atomic
from quantkit.engines.facts import CheckpointFacts, read_checkpoint_facts
from quantkit.engines.pd import pd_pair, pd_split
from quantkit.engines.verdicts import engine_verdicts

__all__ = ["serving_record", "update_serving_record"]


def serving_record(facts: CheckpointFacts) -> dict[str, Any]:
    """The `serving` block of quantkit.json: per engine version, verdict, args, KV use, notes, launch line;
    `sglang.pd` is the prefill/decode pair SGLang accepts (quantkit/engines/pd.py)."""
    record = {e: v.to_dict() for e, v in engine_verdicts(facts).items()}
    record["sglang"]["pd"] = pd_pair(facts).to_dict()
    if facts.adapter.kv_layout != KVLayout.GQA:
        record["sglang"]["pd_split"] = pd_split(facts).to_dict()
    return record


def update_serving_record(ckpt: Path) -> list[str]:
    """Recompute `serving` in a checkpoint's quantkit.json (after KV scales were added); returns files written."""
    path = ckpt / MANIFEST_FILE
    if not path.exists():
        return []
    manifest = json.loads(path.read_text(encoding="utf-8"))
    manifest["serving"] = serving_record(read_checkpoint_facts(ckpt))
    write_json_atomic(path, manifest)
    return [MANIFEST_FILE]
