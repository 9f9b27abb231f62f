"""CLI commands of the converter: inspect, convert, validate, demo."""

from __future__ import annotations

import typer


def register(app: typer.Typer, bench: typer.Typer, simulate: typer.Typer) -> None:
    """Add the converter's commands to the CLI."""
