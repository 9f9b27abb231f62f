"""What the command modules share: the stderr console, byte formatting, the progress reporter, and reading a
source's config.json with errors that name the file."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from quantkit.core.errors import QuantkitError
from quantkit.core.jsontypes import JSONObject

__all__ = ["RichReporter", "console", "human_bytes", "source_config"]

console = Console(stderr=True)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n} B"


class RichReporter:
    """Progress bars with bytes and ETA per stage; notes printed above them."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TimeElapsedColumn(),
            TextColumn("eta"), TimeRemainingColumn(), console=console, disable=quiet, transient=False,
        )
        self.task: TaskID | None = None

    def __enter__(self) -> RichReporter:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def stage(self, name: str, total: int | None = None) -> None:
        self.task = self.progress.add_task(name, total=total)

    def advance(self, n: int) -> None:
        if self.task is not None:
            self.progress.advance(self.task, n)

    def note(self, message: str) -> None:
        if not self.quiet:
            self.progress.console.print(message)


def source_config(src: Path) -> JSONObject:
    """SRC/config.json of an architecture quantkit knows; errors name the file by its full path."""
    from quantkit.arch import get_adapter
    from quantkit.checkpoint.source import read_config

    path = src / "config.json"
    config = read_config(src)
    try:
        get_adapter(config)
    except QuantkitError as exc:
        raise QuantkitError(f"{path}: {str(exc).removeprefix('config.json: ')}") from None
    return config
