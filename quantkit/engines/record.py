"""The `serving` block of a checkpoint's quantkit.json: every engine's verdict and launch line, and SGLang's
prefill/decode pair (and split) — what `convert` writes and `kv-scales` refreshes."""

from __future__ import annotations

import json
from pathlib import Path

from quantkit.arch import KVLayout
from quantkit.checkpoint.manifest import MANIFEST_FILE
from quantkit.core.durable import write_json_atomic
from quantkit.core.jsontypes import JSONObject
from quantkit.engines.facts import CheckpointFacts, read_checkpoint_facts
from quantkit.engines.kv_choice import kv_choice_record
from quantkit.engines.pd import pd_pair, pd_split
from quantkit.engines.verdicts import engine_verdicts

__all__ = ["serving_record", "update_serving_record"]


def serving_record(facts: CheckpointFacts, kv_speed: JSONObject | None = None) -> JSONObject:
    """The `serving` block of quantkit.json: per engine version, verdict, args, KV use, notes, launch line;
    `sglang.pd` is the prefill/decode pair SGLang accepts (quantkit/engines/pd.py); `sglang.kv_choice` the KV
    scale shipped and both options with their measured KL (quantkit/engines/kv_choice.py) and, when the caller
    gives it (`convert`, `kv-scales`: the planner's attention term), their modelled decode speed."""
    record = {e: v.to_dict() for e, v in engine_verdicts(facts).items()}
    record["sglang"]["pd"] = pd_pair(facts).to_dict()
    if facts.adapter.kv_layout != KVLayout.GQA:
        record["sglang"]["pd_split"] = pd_split(facts).to_dict()
    if facts.kv_scale_names:
        choice = kv_choice_record(facts.adapter.kv_layout, facts.kv_scale_mode)
        if choice is not None:
            record["sglang"]["kv_choice"] = {**choice, **({"speed": kv_speed} if kv_speed else {})}
    return record


def update_serving_record(ckpt: Path, kv_speed: JSONObject | None = None) -> list[str]:
    """Recompute `serving` in a checkpoint's quantkit.json (after KV scales were added); returns files written."""
    path = ckpt / MANIFEST_FILE
    if not path.exists():
        return []
    manifest = json.loads(path.read_text(encoding="utf-8"))
    manifest["serving"] = serving_record(read_checkpoint_facts(ckpt), kv_speed)
    write_json_atomic(path, manifest)
    return [MANIFEST_FILE]
