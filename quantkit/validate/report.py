"""The validation report: one line per check (ok / warn / fail) plus every engine's verdict, and the written
checkpoint as the checks read it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from quantkit.checkpoint.safetensors_header import HeaderEntry, ShardHeader
from quantkit.core.jsontypes import JSONObject
from quantkit.engines.verdicts import Engine, EngineVerdict

__all__ = ["Check", "CheckStatus", "Output", "ValidationReport"]

CheckStatus = Literal["ok", "warn", "fail"]



@dataclass
class Check:
    name: str
    status: CheckStatus
    detail: str


@dataclass
class ValidationReport:
    path: str
    checks: list[Check] = field(default_factory=list)
    facts: dict[str, int | list[int]] = field(default_factory=dict)  # modules, shards, bytes, the TPs that fit
    engines: dict[Engine, EngineVerdict] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """No failed check, and no engine that would fail or silently mis-serve the checkpoint."""
        return all(c.status != "fail" for c in self.checks) and all(
            v.verdict != "fails" for v in self.engines.values())

    def add(self, name: str, problems: list[str], detail_ok: str, warn: bool = False) -> None:
        if problems:
            more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
            self.checks.append(Check(name, "warn" if warn else "fail", problems[0] + more))
        else:
            self.checks.append(Check(name, "ok", detail_ok))

    def to_dict(self) -> JSONObject:
        return {"path": self.path, "ok": self.ok, "checks": [asdict(c) for c in self.checks], "facts": self.facts,
                "engines": {e: v.to_dict() for e, v in self.engines.items()}}


@dataclass
class Output:
    """A written checkpoint as the checks read it: config, shard headers, tensor -> (shard, header entry)."""

    root: Path
    config: JSONObject
    headers: dict[str, ShardHeader]
    tensors: dict[str, tuple[str, HeaderEntry]]  # name -> (shard, header entry)
