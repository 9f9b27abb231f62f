"""The `quantkit` command line: one thin function per command, defined next to the code it drives.

Each area registers its own commands (`register(app, bench, simulate)`) so the heavy imports
(torch, transformers) happen only inside the command that needs them.
"""

from __future__ import annotations

import sys

import typer

from quantkit.errors import QuantkitError

app = typer.Typer(
    name="quantkit",
    help="Streaming INT4 (W4A16) quantization, FP8 KV scales and serving plans for giant MoE models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
bench_app = typer.Typer(help="Benchmarks (kernels, integrity checks).", no_args_is_help=True)
simulate_app = typer.Typer(help="Simulations (KV-cache integrity).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
app.add_typer(simulate_app, name="simulate")


def _register_all() -> None:
    from quantkit import commands as convert_commands
    from quantkit.calibrate import commands as calibrate_commands
    from quantkit.hub import commands as hub_commands
    from quantkit.kernels import commands as kernel_commands
    from quantkit.plan import commands as plan_commands
    from quantkit.serving import commands as serving_commands

    modules = (convert_commands, calibrate_commands, plan_commands, kernel_commands, serving_commands, hub_commands)
    for module in modules:
        module.register(app, bench_app, simulate_app)


_register_all()


def main() -> None:
    """Entry point: user errors become one line on stderr and exit 2, never a traceback."""
    try:
        code = app(standalone_mode=False)  # click returns typer.Exit codes instead of raising here
        sys.exit(code if isinstance(code, int) else 0)
    except QuantkitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted: nothing was published; rerun the same command to resume", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except SystemExit:
        raise
    except Exception as exc:
        if hasattr(exc, "show") and hasattr(exc, "exit_code"):  # click/typer usage errors
            exc.show()
            sys.exit(2)
        if type(exc).__name__ == "Abort":
            sys.exit(130)
        print(f"internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
