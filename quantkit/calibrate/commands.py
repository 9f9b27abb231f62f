"""CLI commands of the calibration area: `kv-scales` and `eval` (calibrated `convert` is the converter's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

DEFAULT_HELDOUT = Path(__file__).resolve().parents[2] / "calibration_data" / "heldout.jsonl"
DEFAULT_CALIB = Path(__file__).resolve().parents[2] / "calibration_data" / "default.jsonl"


def register(app: typer.Typer, bench: typer.Typer, simulate: typer.Typer) -> None:
    """Add this area's commands to the CLI."""
    app.command("kv-scales")(kv_scales)
    app.command("eval")(eval_cmd)


def kv_scales(
    src: Annotated[Path, typer.Argument(help="checkpoint to calibrate (BF16, FP8-block or INT4): a directory or "
                                        "a hub repo id owner/name[@rev] (then --out is required)")],
    out: Annotated[Path | None, typer.Option("--out", help="checkpoint to add the scales to (default: SRC; "
                                             "a new directory gets hard links to SRC's shards)")] = None,
    calib: Annotated[Path, typer.Option("--calib", help="JSONL / text / parquet")] = DEFAULT_CALIB,
    samples: Annotated[int, typer.Option(help="calibration sequences")] = 128,
    seq_len: Annotated[int, typer.Option(help="tokens per sequence")] = 2048,
    seed: Annotated[int, typer.Option(help="sampling seed")] = 0,
) -> None:
    """Measure FP8 KV-cache scales (MLA-aware) and add them to a checkpoint without rewriting its shards."""
    import shutil

    from quantkit.calibrate import kv
    from quantkit.calibrate.runner import RunOptions, run
    from quantkit.checkpoint.source import open_source
    from quantkit.engines import update_serving_record
    from quantkit.errors import QuantkitError
    from quantkit.hub.client import is_hub_id, resolve_source
    from quantkit.hub.refresh import refresh_outputs
    from quantkit.paths import refuse_link
    from quantkit.recipe import Recipe

    if out is not None:
        refuse_link(out)  # a link at OUT is not followed (quantkit.paths): remove it or name another OUT
    if is_hub_id(str(src)) and out is None:
        raise QuantkitError(f"{src}: a hub source needs --out (the pulled copy is a cache, not a target)")
    src = resolve_source(src)
    source = open_source(src)
    target = out or src
    if source.adapter.kv_layout != "dsa":  # refuse before any calibration work
        probe = (target if target.exists() else src) / "config.json"
        kv.require_kv_scheme_support(probe, json.loads(probe.read_text(encoding="utf-8")))
    if target.exists():
        if open_source(target).adapter.num_layers != source.adapter.num_layers:
            raise QuantkitError(f"{target}: not a checkpoint of the same model as {src} (layer counts differ)")
    recipe = Recipe(method="rtn", kv_cache="fp8",
                    calibration={"dataset": str(calib), "samples": samples, "seq_len": seq_len, "seed": seed})
    work = (target if target.exists() else target.parent) / f".{target.name}.kv-scales.partial"
    result = run(source, recipe, work, typer.echo, RunOptions(quantize=False))
    if not target.exists():
        kv.link_checkpoint(src, target)
    scales = result.kv_scales
    written = result.write_reports(target)
    if scales:
        written += kv.write_kv_scales(target, scales, source.adapter)
        written += update_serving_record(target)
    shutil.rmtree(work, ignore_errors=True)
    refresh_outputs(target, written + ["config.json", "model.safetensors.index.json"])
    typer.echo(result.summary())
    typer.echo(f"wrote {', '.join(written)} in {target}")


def eval_cmd(
    model: Annotated[list[Path], typer.Argument(help="model directories (plain or quantized)")],
    reference: Annotated[Path | None, typer.Option("--reference", help="source model: adds KL and top-1")] = None,
    data: Annotated[Path, typer.Option("--data", help="held-out JSONL / text / parquet")] = DEFAULT_HELDOUT,
    seq_len: Annotated[int, typer.Option(help="tokens per window")] = 128,
    windows: Annotated[int, typer.Option(help="number of windows")] = 64,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Held-out perplexity of small models (and KL / top-1 vs --reference), in a fresh process."""
    from quantkit.calibrate.eval import evaluate_in_subprocess, format_table

    res = evaluate_in_subprocess(model, data, reference, seq_len, windows)
    typer.echo(json.dumps(res, indent=2) if as_json else format_table(res))
