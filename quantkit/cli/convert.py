"""CLI commands of the converter: inspect, convert, validate, demo (thin: parse, call, print)."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from quantkit.cli.common import RichReporter, console, human_bytes, source_config
from quantkit.core.errors import QuantkitError
from quantkit.core.jsontypes import JSON

__all__ = ["register"]

def _emit_json(value: JSON) -> None:
    typer.echo(json.dumps(value, indent=2))


def inspect_cmd(
    src: Path = typer.Argument(..., help="Source checkpoint directory or hub repo id (owner/name[@rev])."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Validate a source checkpoint and show what it holds and what `convert` would do with it."""
    from quantkit.convert.inspect import inspect_source
    from quantkit.hub.client import resolve_source

    info = inspect_source(resolve_source(src))
    if as_json:
        _emit_json(info)
        return
    out = Console()
    out.print(f"[bold]{info['path']}[/]  {info['architecture']} ({info['family']}, KV layout {info['kv_layout']})")
    out.print(f"format {info['format']}, {info['shards']} shards, {human_bytes(info['bytes'])}, "
              f"{info['params'] / 1e9:.3f}B parameters, MTP layers: {info['mtp_layers']}")
    table = Table("role", "tensors", "params", "source bytes", "action (default recipe)", "output bytes")
    for role, row in info["roles"].items():
        table.add_row(role, str(row["tensors"]), f"{row['params']:,}", human_bytes(row["source_bytes"]),
                      ", ".join(row["actions"]), human_bytes(row["output_bytes"]))
    out.print(table)
    estimate = human_bytes(info["estimated_output_bytes"])
    out.print(f"recipe {info['recipe']}: {human_bytes(info['bytes'])} -> ~{estimate}")
    for w in info["warnings"]:
        out.print(f"[yellow]warning:[/] {w}")


def convert_cmd(
    src: Path = typer.Argument(..., help="Source checkpoint (BF16, FP8-block or INT4 safetensors): a directory "
                               "or a hub repo id owner/name[@rev], pulled first."),
    out: Path = typer.Argument(..., help="Output directory (written to OUT.partial, then renamed)."),
    recipe: Optional[str] = typer.Option(None, help="Preset name from recipes/ or a YAML path."),  # noqa: UP045
    method: Optional[str] = typer.Option(None, help="rtn | gptq"),  # noqa: UP045
    group_size: Optional[int] = typer.Option(None, help="32 | 64 | 128"),  # noqa: UP045
    scale_search: Optional[str] = typer.Option(None, help="minmax (compressed-tensors exact) | mse"),  # noqa: UP045
    scheme: Optional[str] = typer.Option(None, help="w4a16 (INT4, default) | nvfp4a16 | mxfp4a16 | nvfp4 (W4A4: "  # noqa: UP045
                                         "needs --calib) — docs/fp4.md"),
    calib: Optional[str] = typer.Option(None, help="Calibration data: JSONL, text or parquet."),  # noqa: UP045
    samples: Optional[int] = typer.Option(None, help="Calibration samples."),  # noqa: UP045
    seq_len: Optional[int] = typer.Option(None, help="Calibration sequence length."),  # noqa: UP045
    kv_cache: Optional[str] = typer.Option(None, help="fp8: calibrate and write FP8 KV-cache scales."),  # noqa: UP045
    kv_scales: Optional[str] = typer.Option(  # noqa: UP045
        None, "--kv-scales", help="With --kv-cache fp8: auto (the measured rule, docs/serving.md) | calibrated | "
        "unit (ship scale 1.0: every SGLang MLA backend is consistent, the fastest is pinned)."),
    workers: int = typer.Option(1, min=1, help="Worker threads (one source shard each), per rank under torchrun."),
    device: str = typer.Option("auto", help="Where RTN and calibration compute: auto (CUDA when present) | cpu | "
                               "cuda | cuda:N (same bytes for RTN)."),
    max_shard_size: Optional[str] = typer.Option(None, help="Largest output shard, e.g. 5GB."),  # noqa: UP045
    max_size: Optional[str] = typer.Option(None, help="Budget: bytes of the output's shards (421GB, 392GiB, "  # noqa: UP045
                                           "or a byte count); each unit's format chosen for the least predicted KL."),
    fit: Optional[str] = typer.Option(None, help="Budget: the deployment GPU:N (e.g. h200:8) with --kv-tokens or "  # noqa: UP045
                                      "--context and --concurrency (docs/mixed-precision.md)."),
    kv_tokens: Optional[int] = typer.Option(None, help="With --fit: KV tokens the deployment holds."),  # noqa: UP045
    context: Optional[int] = typer.Option(None, help="With --fit: tokens per request."),  # noqa: UP045
    concurrency: Optional[int] = typer.Option(None, help="With --fit: requests at once."),  # noqa: UP045
    sensitivity: Optional[Path] = typer.Option(None, help="With a budget: a table from `quantkit sensitivity` "  # noqa: UP045
                                               "(default: measured first, kept as OUT.sensitivity.json)."),
    force: bool = typer.Option(False, help="Replace OUT if it exists."),
    quiet: bool = typer.Option(False, help="No progress output."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Convert a checkpoint to SGLang/vLLM-loadable INT4 (W4A16 group-wise, compressed-tensors).

    Under torchrun (`torchrun --nproc-per-node N -m quantkit convert ...`) every rank runs this command;
    rank 0 alone prints progress and the summary (docs/distributed.md)."""
    from quantkit.convert.pipeline import check_device, convert
    from quantkit.core.distributed import World
    from quantkit.hub.client import resolve_source
    from quantkit.quant.recipe import load_recipe

    world = World.from_env(check_device(device))
    quiet = quiet or not world.is_main
    with RichReporter(quiet=quiet or as_json) as reporter:
        src = resolve_source(src, progress=reporter)
    config = source_config(src)
    overrides = {"method": method, "group_size": group_size, "scale_search": scale_search, "scheme": scheme,
                 "kv_cache": kv_cache, "kv_scales": kv_scales,
                 "calibration.dataset": calib, "calibration.samples": samples, "calibration.seq_len": seq_len,
                 "max_shard_size": max_shard_size}
    resolved = load_recipe(recipe, config, overrides)
    from quantkit.cli.mixed import apply_budget, plan_lines

    budget_options = {"max_size": max_size, "fit": fit, "kv_tokens": kv_tokens, "context": context,
                      "concurrency": concurrency, "sensitivity": sensitivity}
    say = (lambda m: None) if quiet or as_json else (lambda m: console.print(m, highlight=False))
    resolved, budgeted = apply_budget(src, out, resolved, config, budget_options, method is not None, device, world,
                                      say)
    if budgeted is not None:
        for line in plan_lines(budgeted):
            say(line)
    if resolved.scheme == "nvfp4" and calib is None:
        raise QuantkitError("--scheme nvfp4 (W4A4) needs activation global scales from calibration: pass --calib "
                            "DATA (or use nvfp4a16, data-free)")
    with RichReporter(quiet=quiet or as_json) as reporter:
        result = convert(src, out, resolved, workers=workers, force=force, reporter=reporter, device=device,
                         world=world)
    if not world.is_main:
        return
    if budgeted is not None:
        from quantkit.convert.budget import record_plan

        record_plan(result.out, budgeted)
    summary = {"out": str(result.out), "source_bytes": result.source_bytes, "output_bytes": result.output_bytes,
               "seconds": round(result.seconds, 2), "actions": result.actions, "resumed_shards": result.resumed_shards,
               "recipe": resolved.name, "warnings": result.warnings}
    if budgeted is not None:
        summary["budget"] = budgeted.summary()
    if as_json:
        _emit_json(summary)
    elif not quiet:
        ratio = result.output_bytes / max(result.source_bytes, 1)
        console.print(f"[green]done[/] {result.out}: {human_bytes(result.source_bytes)} -> "
                      f"{human_bytes(result.output_bytes)} ({ratio:.1%}) in {result.seconds:.1f}s; {result.actions}")
        if result.calibration_summary:
            console.print(result.calibration_summary)
        for w in result.warnings:
            console.print(f"[yellow]warning:[/] {w}")


class EngineChoice(str, Enum):
    sglang = "sglang"
    vllm = "vllm"
    all = "all"


def validate_cmd(
    out: Path = typer.Argument(..., help="Converted checkpoint directory."),
    source: Optional[Path] = typer.Option(None, help="The source it was converted from."),  # noqa: UP045
    engine: EngineChoice = typer.Option(EngineChoice.all, "--engine", help="Engine verdicts to give."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Check a converted checkpoint against the compressed-tensors format and SGLang/vLLM loader rules.

    Exits 2 when a check fails or a selected engine would fail to load or silently mis-serve it."""
    if not out.is_dir():
        raise QuantkitError(f"{out}: not a directory")
    from quantkit.engines.verdicts import ENGINES
    from quantkit.validate.checkpoint import validate_checkpoint

    engines = ENGINES if engine == EngineChoice.all else (engine.value,)
    report = validate_checkpoint(out, source, engines=engines)
    if as_json:
        _emit_json(report.to_dict())
    else:
        table = Table("check", "status", "detail")
        colors = {"ok": "green", "warn": "yellow", "fail": "red", "loads": "green", "loads-with-warnings": "yellow",
                  "fails": "red"}
        for c in report.checks:
            table.add_row(c.name, f"[{colors[c.status]}]{c.status}[/]", c.detail)
        console = Console()
        console.print(table)
        for v in report.engines.values():
            console.print(f"[bold]{v.engine} {v.version}[/]: [{colors[v.verdict]}]{v.verdict}[/]; "
                          f"KV cache {v.kv_cache.dtype}, scale {v.kv_cache.scale} ({v.kv_cache.detail})")
            for label, lines in (("fails", v.problems), ("warning", v.warnings), ("note", v.notes)):
                for line in lines:
                    console.print(f"  {label}: {line}", highlight=False)
            console.print(f"  launch: {v.launch[0]}", highlight=False, soft_wrap=True)
    if not report.ok:
        raise typer.Exit(2)


def demo_cmd(
    out: Path = typer.Option(Path("demo-output"), help="Directory for the demo's source and output."),
) -> None:
    """Generate a tiny GLM-5 FP8-block checkpoint, convert it to INT4, validate it, show sizes."""
    from quantkit.cli.demo import run_demo

    run_demo(out, Console())


def register(app: typer.Typer, bench: typer.Typer, simulate: typer.Typer) -> None:
    """Add the converter's commands to the CLI."""
    app.command("inspect")(inspect_cmd)
    app.command("convert")(convert_cmd)
    app.command("validate")(validate_cmd)
    app.command("demo")(demo_cmd)
