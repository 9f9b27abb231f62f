"""CLI of mixed precision sized to a budget: `quantkit sensitivity`, and the budget options of `convert`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from quantkit.core.errors import QuantkitError

if TYPE_CHECKING:
    from quantkit.convert.budget import BudgetedRecipe
    from quantkit.core.distributed import World
    from quantkit.quant.recipe import Recipe

__all__ = ["register", "apply_budget"]


def sensitivity_cmd(
    src: Path = typer.Argument(..., help="Source checkpoint directory (or hub repo id)."),
    out: Path = typer.Option(..., "--out", help="Where to write the table (JSON)."),
    calib: Optional[str] = typer.Option(None, help="Calibration data (default: the bundled set)."),  # noqa: UP045
    samples: Optional[int] = typer.Option(None, help="Calibration windows (default: the recipe's)."),  # noqa: UP045
    seq_len: Optional[int] = typer.Option(None, help="Tokens per window (default: the recipe's)."),  # noqa: UP045
    formats: str = typer.Option("int4-g32,int4-g64,int4-g128,int8-g128", help="Candidate formats to score "
                                "(kept BF16 / FP8-block predict 0); add nvfp4a16 for Blackwell targets."),
    draws: int = typer.Option(1, min=1, help="Label draws per window (each one backward pass: less noise)."),
    batch_size: int = typer.Option(8, min=1, help="Windows per forward."),
    checkpoint_every: int = typer.Option(0, min=0, help="Keep every k-th layer's activations (k > 1: less disk, "
                                         "the layers between run forward twice); 0: automatic (sqrt of the layers "
                                         "beyond 16)."),
    work_dir: Optional[Path] = typer.Option(None, help="Resumable work directory (default OUT.work)."),  # noqa: UP045
    device: str = typer.Option("auto", help="auto (CUDA when present) | cpu | cuda | cuda:N"),
    quiet: bool = typer.Option(False, help="No progress output."),
) -> None:
    """Predicted KL of every quantization unit in every candidate format, measured layer by layer.

    Under torchrun every rank runs this command (expert-parallel, as convert). docs/mixed-precision.md."""
    from quantkit.calibrate.sensitivity import write_table
    from quantkit.calibrate.sensitivity_run import sensitivity_of
    from quantkit.cli.common import console, source_config
    from quantkit.convert.pipeline import check_device
    from quantkit.core.distributed import World
    from quantkit.hub.client import resolve_source
    from quantkit.quant.recipe import load_recipe

    dev = check_device(device)
    world = World.from_env(dev)
    world.start()
    src = resolve_source(src)
    recipe = load_recipe(None, source_config(src), {"calibration.dataset": calib, "calibration.samples": samples,
                                                     "calibration.seq_len": seq_len})
    c = recipe.calibration
    if not c.dataset:
        raise QuantkitError("sensitivity needs calibration data: pass --calib FILE")
    say = (lambda m: None) if quiet or not world.is_main else (lambda m: console.print(m, highlight=False))
    work = work_dir or out.with_name(out.name + ".work")
    with world.guard(lambda: work / "dist"):
        table = sensitivity_of(src, c.dataset, work, samples=c.samples, seq_len=c.seq_len, draws=draws,
                               formats=tuple(f.strip() for f in formats.split(",") if f.strip()),
                               batch_size=batch_size, checkpoint_every=checkpoint_every,
                               device=world.device(dev) if dev != "auto" else None, world=world, progress=say,
                               seed=c.seed)
    if world.is_main:
        write_table(table, out)
        import shutil

        shutil.rmtree(work, ignore_errors=True)
        say(f"wrote {out}: {len(table.units)} units x {len(table.formats)} formats in {table.seconds:.1f}s")
    world.stop()


def apply_budget(src: Path, out: Path, recipe: Recipe, config: dict[str, Any], options: dict[str, Any],
                 method_given: bool, device: str, world: World, say: Callable[[str], None]
                 ) -> tuple[Recipe, BudgetedRecipe | None]:
    """The recipe `convert` runs under a budget (and the solver's result), or (recipe, None) without one."""
    from quantkit.convert.budget import budgeted_recipe
    from quantkit.plan.budget import budget_from_options

    kv = "fp8" if recipe.kv_cache == "fp8" else "bf16"
    budget = budget_from_options(config, options.get("max_size"), options.get("fit"), options.get("kv_tokens"),
                                 options.get("context"), options.get("concurrency"), kv)
    if budget is None:
        if options.get("sensitivity") is not None:
            raise QuantkitError("--sensitivity is used with a budget: pass --max-size or --fit")
        return recipe, None
    if not method_given and recipe.method != "gptq" and recipe.fp4 is None:
        recipe = recipe.model_copy(update={"method": "gptq"})  # the default when a budget is given
    result = budgeted_recipe(src, out, recipe, config, budget, options.get("sensitivity"),
                             None if device == "auto" else world.device(device), world, say)
    return result.recipe, result


def plan_lines(result: BudgetedRecipe) -> list[str]:
    """The solver's plan, one line per unit that is not at the uniform format, for the summary."""
    s = result.solution
    lines = [f"budget: {result.budget.label}; plan: {s.total_bytes / 2**30:.2f} GiB checkpoint, "
             f"{s.per_gpu_bytes / 2**30:.2f} GiB weights per GPU, predicted KL {s.kl:.3e}"]
    uniform = result.recipe.uniform_format.name
    for unit, fmt in s.units.items():
        if fmt != uniform:
            lines.append(f"  {unit:<28} {fmt:<10} predicted KL {s.predicted_kl.get(unit, 0.0):.2e}")
    return lines


def register(app: typer.Typer, bench: typer.Typer, simulate: typer.Typer) -> None:
    app.command("sensitivity")(sensitivity_cmd)
