"""CLI commands of the kernels area: `quantkit bench kernels`."""

from __future__ import annotations

import json

import typer


def register(app: typer.Typer, bench: typer.Typer, simulate: typer.Typer) -> None:
    """Add this area's commands to the CLI."""

    @bench.command("kernels")
    def bench_kernels(
        as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
        smoke: bool = typer.Option(None, "--smoke/--full", help="Tiny shapes (default on CPU) or the full sweep."),
        hbm_gbps: float = typer.Option(None, "--hbm-gbps", help="Peak HBM GB/s when the GPU is not in the table."),
        group_size: int = typer.Option(None, "--group-size", help="Override the models' group size (32)."),
    ) -> None:
        """W4A16 GEMM / MoE kernels: time, GB/s, % of HBM roofline, speed-up vs BF16 (GPU figures need a GPU)."""
        from quantkit.kernels.bench import format_rows, run_benchmark

        result = run_benchmark(smoke=smoke, hbm=hbm_gbps, group_size=group_size)
        typer.echo(json.dumps(result, indent=2) if as_json else format_rows(result))
