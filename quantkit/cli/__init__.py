"""The `quantkit` command line: one thin function per command, defined next to the code it drives.

Each area registers its own commands (`register(app, bench, simulate)`) so the heavy imports
(torch, transformers) happen only inside the command that needs them.
"""

from __future__ import annotations

import sys

import typer

# typer 0.29 runs on its own copy of click; these are the classes its parser raises.
from typer._click.exceptions import ClickException

from quantkit.core.durable import is_no_space
from quantkit.core.errors import QuantkitError

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
    from quantkit.cli import calibrate as calibrate_commands
    from quantkit.cli import convert as convert_commands
    from quantkit.cli import hub as hub_commands
    from quantkit.cli import kernels as kernel_commands
    from quantkit.cli import mixed as mixed_commands
    from quantkit.cli import plan as plan_commands
    from quantkit.cli import serving as serving_commands
    modules = (convert_commands, calibrate_commands, plan_commands, kernel_commands, serving_commands, hub_commands,
               mixed_commands)
    for module in modules:
        module.register(app, bench_app, simulate_app)


_register_all()


def main() -> None:
    """Entry point and the exit-code contract: 0 success; 2 anything the user can fix (a QuantkitError,
    a usage error, a full disk), one line on stderr, never a traceback; 130 interrupted; 1 internal error.
    """
    try:
        code = app(standalone_mode=False)  # click returns typer.Exit codes instead of raising here
    except QuantkitError as exc:
        _fail(f"error: {exc}", 2)
    except ClickException as exc:  # usage errors: unknown option, bad or missing parameter
        exc.show()
        sys.exit(2)
    except (KeyboardInterrupt, typer.Abort):
        _fail("interrupted: nothing was published; rerun the same command to resume", 130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except OSError as exc:
        if is_no_space(exc):
            _fail(f"error: {exc.filename or 'output'}: no space left on device", 2)
        _fail(f"internal error: {type(exc).__name__}: {exc}", 1)
    except Exception as exc:
        _fail(f"internal error: {type(exc).__name__}: {exc}", 1)
    if code == 130:  # typer turns Ctrl-C inside a command into Exit(130)
        _fail("interrupted: nothing was published; rerun the same command to resume", 130)
    sys.exit(code if isinstance(code, int) else 0)


def _fail(message: str, code: int) -> None:
    print(" ".join(message.split()), file=sys.stderr)  # one line, whatever the message held
    sys.exit(code)
