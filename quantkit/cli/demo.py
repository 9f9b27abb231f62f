"""`quantkit demo`: the whole job on a built-in tiny GLM-5 checkpoint, in seconds, with nothing downloaded."""

from __future__ import annotations

import shutil
from pathlib import Path

from rich.console import Console
from rich.table import Table

from quantkit.checkpoint.synth import make_checkpoint
from quantkit.convert.pipeline import convert
from quantkit.core.jsontypes import JSONObject
from quantkit.quant.recipe import load_recipe
from quantkit.validate.checkpoint import validate_checkpoint

__all__ = ["run_demo"]


def run_demo(out: Path, console: Console | None = None, size: str = "small") -> JSONObject:
    """Generate FP8-block GLM-5 (real tensor names, scaled down), convert to INT4, validate, print sizes."""
    console = console or Console()
    source_dir, output_dir = out / "glm5-fp8-source", out / "glm5-int4"
    shutil.rmtree(out, ignore_errors=True)
    console.print(f"[bold]1.[/] generating a {size} GLM-5 (glm_moe_dsa) FP8-block checkpoint in {source_dir}")
    make_checkpoint(source_dir, "glm_moe_dsa", "fp8", size=size, shards=4)
    recipe = load_recipe("glm5-w4a16-g32", {})
    console.print(f"[bold]2.[/] converting with recipe {recipe.name} (RTN W4A16 g{recipe.group_size}) to {output_dir}")
    result = convert(source_dir, output_dir, recipe)
    console.print("[bold]3.[/] validating against the format and the SGLang/vLLM loader rules")
    report = validate_checkpoint(output_dir, source_dir)
    for check in report.checks:
        console.print(f"   {check.status:4}  {check.name}: {check.detail}")
    console.print(_size_table(output_dir))
    console.print(f"{result.source_bytes:,} B -> {result.output_bytes:,} B in {result.seconds:.1f}s; "
                  f"validation {'passed' if report.ok else 'FAILED'}")
    return {"source": str(source_dir), "output": str(output_dir), "ok": report.ok,
            "source_bytes": result.source_bytes, "output_bytes": result.output_bytes}


def _size_table(output_dir: Path) -> Table:
    import json

    summary = json.loads((output_dir / "quantkit.json").read_text())["summary"]
    table = Table("action", "tensors", "bytes before", "bytes after", "ratio", title="size before / after")
    for action, row in summary.items():
        ratio = row["output_bytes"] / max(row["source_bytes"], 1)
        before, after = f"{row['source_bytes']:,}", f"{row['output_bytes']:,}"
        table.add_row(action, str(row["tensors"]), before, after, f"{ratio:.2f}")
    return table
