"""Where a long job's progress goes: the CLI's RichReporter draws bars with bytes and ETA; library callers
and tests pass nothing and get `Silent`."""

from __future__ import annotations

from typing import Protocol

__all__ = ["Reporter", "Silent"]


class Reporter(Protocol):
    def stage(self, name: str, total: int | None = None) -> None: ...
    def advance(self, n: int) -> None: ...
    def note(self, message: str) -> None: ...


class Silent:
    """A Reporter that reports nothing."""

    def stage(self, name: str, total: int | None = None) -> None:
        pass

    def advance(self, n: int) -> None:
        pass

    def note(self, message: str) -> None:
        pass
