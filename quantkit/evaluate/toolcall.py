"""Tool-call validity: bundled prompts with JSON-schema tools, sent with `tools=` to /v1/chat/completions.

Per item: `called` (the reply carries a tool call), `valid` (the first call names an offered tool and its
arguments parse as a JSON object valid against that tool's `parameters` schema, checked with `jsonschema`)
and `match` (valid, the expected tool, and every expected argument equal — strings compared trimmed and
case-insensitively, numbers as floats). Items: calibration_data/toolcall.jsonl.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from quantkit.core.errors import QuantkitError
from quantkit.core.jsontypes import JSON, JSONObject
from quantkit.evaluate.client import Endpoint

__all__ = ["ToolChoice", "load_items", "ask", "score"]

ToolChoice = Literal["auto", "required"]
METRICS = ("called", "valid", "match")


def load_items(path: Path) -> list[JSONObject]:
    items = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            item["messages"], item["tools"], item["expected"]["name"]  # noqa: B018 - shape check
        except (ValueError, KeyError, TypeError):
            raise QuantkitError(f"{path}:{n}: not a tool-call item (id, messages, tools, expected)") from None
        items.append(item)
    return items


def ask(ep: Endpoint, item: JSONObject, tool_choice: ToolChoice, max_tokens: int) -> JSONObject:
    """The server's answer, reduced to what scoring needs: [{"name", "arguments" (raw string)}] and text."""
    resp = ep.post("chat/completions", {"messages": item["messages"], "tools": item["tools"],
                                        "tool_choice": tool_choice, "temperature": 0.0, "max_tokens": max_tokens})
    msg = resp["choices"][0].get("message") or {}
    calls = [{"name": (c.get("function") or {}).get("name"), "arguments": (c.get("function") or {}).get("arguments")}
             for c in msg.get("tool_calls") or []]
    return {"calls": calls, "content": msg.get("content")}


def score(item: JSONObject, answer: JSONObject) -> dict[str, float]:
    import jsonschema

    calls = answer.get("calls") or []
    called = bool(calls)
    valid = match = False
    if called:
        call = calls[0]
        tools = {t["function"]["name"]: t["function"].get("parameters") or {} for t in item["tools"]}
        args = _arguments(call.get("arguments"))
        if call.get("name") in tools and args is not None:
            try:
                jsonschema.validate(args, tools[call["name"]])
                valid = True
            except jsonschema.ValidationError:
                valid = False
        expected = item["expected"]
        match = valid and call["name"] == expected["name"] and all(
            _same(args.get(k), v) for k, v in (expected.get("arguments") or {}).items())  # type: ignore[union-attr]
    return {"called": float(called), "valid": float(valid), "match": float(match)}


def _arguments(raw: JSON) -> JSONObject | None:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _same(got: JSON, want: JSON) -> bool:
    if isinstance(want, str):
        return isinstance(got, str) and got.strip().lower() == want.strip().lower()
    if isinstance(want, (int, float)) and not isinstance(want, bool):
        return isinstance(got, (int, float)) and not isinstance(got, bool) and abs(float(got) - float(want)) < 1e-9
    return got == want
