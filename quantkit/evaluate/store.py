"""Per-item answers kept on disk (resume after interruption) and progress with an ETA.

The store is one JSONL file, one line per finished (task, side, item): appended and flushed as each item
finishes, so a killed run loses at most the item in flight; a rerun with the same state directory skips
what is there. A torn last line (kill mid-write) is ignored.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TextIO

from quantkit.core.jsontypes import JSONObject

__all__ = ["AnswerStore", "Progress"]


class AnswerStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._done: dict[tuple[str, str, str], JSONObject] = {}
        if path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # torn last line of an interrupted run
                self._done[(rec["task"], rec["side"], str(rec["id"]))] = rec["answer"]
        self._fh = path.open("a", encoding="utf-8")

    def get(self, task: str, side: str, item: str) -> JSONObject | None:
        return self._done.get((task, side, item))

    def put(self, task: str, side: str, item: str, answer: JSONObject) -> None:
        self._done[(task, side, item)] = answer
        self._fh.write(json.dumps({"task": task, "side": side, "id": item, "answer": answer}) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def count(self, task: str) -> int:
        return sum(1 for k in self._done if k[0] == task)

    def close(self) -> None:
        self._fh.close()


class Progress:
    """`[task side] done/total  ETA m:ss` lines on stderr, at most one per `every` seconds (and the last)."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None, every: float = 2.0) -> None:
        self.label, self.total, self.stream, self.every = label, total, stream or sys.stderr, every
        self.done = self._fresh = 0
        self.start = self._last = time.monotonic()

    def advance(self, resumed: bool = False) -> None:
        self.done += 1
        if not resumed:
            self._fresh += 1
        now = time.monotonic()
        if now - self._last < self.every and self.done < self.total:
            return
        self._last = now
        left = self.total - self.done
        eta = (now - self.start) / self._fresh * left if self._fresh else 0.0
        self.stream.write(f"[{self.label}] {self.done}/{self.total}  ETA {int(eta) // 60}:{int(eta) % 60:02d}\n")
        self.stream.flush()
