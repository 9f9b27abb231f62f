"""CLI commands of the hub area: `push`, `pull`, `verify` (thin: parse, call, print)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

__all__ = ["register"]


def register(app: typer.Typer, bench: typer.Typer, simulate: typer.Typer) -> None:
    """Add this area's commands to the CLI."""
    app.command("push")(push_cmd)
    app.command("pull")(pull_cmd)
    app.command("verify")(verify_cmd)


def _workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _quiet_client(quiet: bool) -> None:
    """--quiet also silences huggingface_hub's own transfer bars."""
    if quiet:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


def push_cmd(
    out: Annotated[Path, typer.Argument(help="converted checkpoint directory")],
    repo_id: Annotated[str, typer.Argument(help="hub repo id, owner/name")],
    private: Annotated[bool, typer.Option(help="create the repo private")] = False,
    revision: Annotated[str | None, typer.Option(help="branch to push to (created if missing)")] = None,
    commit_message: Annotated[str | None, typer.Option(help="commit message")] = None,
    create_pr: Annotated[bool, typer.Option(help="open a pull request instead of committing to main")] = False,
    base_model: Annotated[str | None, typer.Option(help="hub id of the source model, for the card")] = None,
    keep_card: Annotated[bool, typer.Option(help="upload README.md as it is (no regeneration)")] = False,
    quiet: Annotated[bool, typer.Option(help="no progress output")] = False,
) -> None:
    """Verify SHA256SUMS and validate, upload (resumable), then check the hub's files against the manifest."""
    from quantkit.cli.common import RichReporter, console, human_bytes
    from quantkit.hub.client import push

    _quiet_client(quiet)
    with RichReporter(quiet=quiet) as reporter:
        result = push(out, repo_id, private=private, revision=revision, commit_message=commit_message,
                      create_pr=create_pr, base_model=base_model, keep_card=keep_card, workers=_workers(),
                      progress=reporter)
    console.print(f"[green]pushed[/] {result.files} files ({human_bytes(result.bytes)}) to {result.repo_id} "
                  f"@ {result.commit}; remote sizes and sha256 match {out / 'SHA256SUMS'}")
    if result.pr_url:
        console.print(f"pull request: {result.pr_url}")
    if result.extra_remote_files:
        extra = ", ".join(result.extra_remote_files)
        console.print(f"note: the repo also holds files this checkpoint does not: {extra}")


def pull_cmd(
    repo_id: Annotated[str, typer.Argument(help="hub repo id, owner/name")],
    directory: Annotated[Path, typer.Argument(help="where to put it (plain files; reruns resume)")],
    revision: Annotated[str | None, typer.Option(help="branch, tag or commit")] = None,
    quiet: Annotated[bool, typer.Option(help="no progress output")] = False,
) -> None:
    """Download safetensors, configs, tokenizer, chat template and *.py (never pickle files), verified."""
    from quantkit.cli.common import RichReporter, console, human_bytes
    from quantkit.hub.client import pull

    _quiet_client(quiet)
    with RichReporter(quiet=quiet) as reporter:
        result = pull(repo_id, directory, revision, workers=_workers(), progress=reporter)
    console.print(f"[green]pulled[/] {len(result.files)} files ({human_bytes(result.bytes)}) of {result.repo_id} "
                  f"@ {result.commit} into {result.directory}; sizes and sha256 match the hub")
    if result.refused:
        console.print(f"refused {len(result.refused)} pickle file(s): {', '.join(result.refused)}")
    if result.skipped:
        console.print(f"not downloaded: {', '.join(result.skipped)}")


def verify_cmd(
    directory: Annotated[Path, typer.Argument(help="checkpoint directory with SHA256SUMS")],
    write: Annotated[bool, typer.Option(help="(re)write SHA256SUMS from the files as they are now")] = False,
    workers: Annotated[int, typer.Option(min=0, help="hashing threads (0: one per core, up to 8)")] = 0,
    quiet: Annotated[bool, typer.Option(help="no progress output")] = False,
) -> None:
    """Re-hash every file listed in SHA256SUMS in parallel and list mismatches (exit 2 on any)."""
    from quantkit.checkpoint.manifest import MANIFEST_NAME, verify_manifest, write_manifest
    from quantkit.cli.common import RichReporter, console, human_bytes
    from quantkit.core.errors import QuantkitError

    if not directory.is_dir():
        raise QuantkitError(f"{directory}: not a directory")
    if write:
        path = write_manifest(directory)
        console.print(f"wrote {path}")
        return
    with RichReporter(quiet=quiet) as reporter:
        check = verify_manifest(directory, workers or _workers(),
                                on_total=lambda n: reporter.stage("verifying sha256", n), on_bytes=reporter.advance)
    for problem in check.problems():
        typer.echo(f"{directory / problem}")
    if not check.ok:
        raise QuantkitError(f"{directory}: {len(check.problems())} file(s) do not match {MANIFEST_NAME}")
    console.print(f"[green]ok[/] {check.checked} files ({human_bytes(check.bytes)}) match {directory / MANIFEST_NAME}")
