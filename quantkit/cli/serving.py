"""CLI commands of the serving area: ``simulate integrity`` and ``bench integrity``.

Heavy imports (torch, triton) happen inside the commands so ``quantkit --help`` stays fast.
"""

from __future__ import annotations

import json

import typer

from quantkit.core.errors import QuantkitError

SIM_KEYS = ("steps", "faults_injected", "faults_that_would_corrupt", "faults_caught", "wrong_data_served",
            "false_aborts")  # fmt: skip


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise QuantkitError(f"--{name} must be comma-separated integers, got {text!r}") from exc
    if not values or min(values) <= 0:
        raise QuantkitError(f"--{name} needs positive integers, got {text!r}")
    return values


def register(app: typer.Typer, bench: typer.Typer, simulate: typer.Typer) -> None:
    """Add this area's commands to the CLI."""

    @simulate.command("integrity")
    def simulate_integrity(
        steps: int = typer.Option(10_000, help="Simulated scheduler steps."),
        seed: int = typer.Option(0, help="Random seed (runs are deterministic)."),
        fault_rate: float = typer.Option(0.02, help="Probability of injecting one fault per step."),
        tracker: str = typer.Option("tags", help="tags | noop"),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
        engine: str = typer.Option("model", help="model (the built-in model) | sglang (SGLang's own code)"),
        page_size: str = typer.Option("1,16,64", help="--engine sglang: KV page sizes (steps split evenly)."),
        sglang_src: str = typer.Option("", help="--engine sglang: SGLang source tree (default: installed "
                                                "sglang, else $QUANTKIT_SGLANG_SRC or .cache/engines/src/sglang)."),
    ) -> None:
        """Paged KV pool + prefix sharing + eviction + preemption with injected page-reuse faults."""
        from quantkit.serving.integrity.simulator import SimConfig, simulate

        if engine == "sglang":
            from quantkit.cli.serving_sglang import simulate_sglang

            simulate_sglang(steps, seed, fault_rate, _ints(page_size, "page-size"), sglang_src or None, as_json)
            return
        if engine != "model":
            raise QuantkitError(f"--engine must be 'model' or 'sglang', got {engine!r}")
        if tracker not in ("tags", "noop"):
            raise QuantkitError(f"--tracker must be 'tags' or 'noop', got {tracker!r}")
        if steps <= 0 or not 0.0 <= fault_rate <= 1.0:
            raise QuantkitError("--steps must be positive and --fault-rate in [0, 1]")
        result = simulate(SimConfig(steps=steps, seed=seed, fault_rate=fault_rate, tracker=tracker)).to_dict()
        if as_json:
            print(json.dumps(result))
            return
        _print_sim(result)

    @bench.command("integrity")
    def bench_integrity(
        batches: str = typer.Option("1,16,64,256", help="Requests per decode batch."),
        contexts: str = typer.Option("8192,32768,131072", help="Context length per request (tokens)."),
        page_sizes: str = typer.Option("64,1", help="KV page sizes (tokens)."),
        device: str = typer.Option("auto", help="auto | cpu | cuda"),
        repeats: int = typer.Option(5, help="Timed samples per configuration (median reported)."),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    ) -> None:
        """Cost of the batched pre-decode check, in µs and as a share of a modelled H200 decode step."""
        from quantkit.serving.integrity.bench import run_bench

        rows = run_bench(
            _ints(batches, "batches"), _ints(contexts, "contexts"), _ints(page_sizes, "page-sizes"),
            device, max(1, repeats),
        )  # fmt: skip
        if as_json:
            print(json.dumps({"rows": rows}))
            return
        _print_bench(rows)


def _print_sim(result: dict[str, object]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"KV integrity simulation (tracker={result['tracker']}, seed={result['seed']})")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key in (*SIM_KEYS, "aborts", "finished", "preemptions", "evictions", "decode_tokens"):
        table.add_row(key, str(result[key]))
    for kind, count in result["faults_by_kind"].items():
        table.add_row(f"  injected: {kind}", str(count))
    Console().print(table)


def _print_bench(rows: list[dict[str, object]]) -> None:
    from rich.console import Console
    from rich.table import Table

    models = list(rows[0]["fractions"]) if rows else []
    table = Table(title=f"Pre-decode integrity check ({rows[0]['device']}, {rows[0]['backend']})" if rows else "")
    for col in ("page", "batch", "context", "entries", "check µs", "no-op µs", "bare call µs"):
        table.add_column(col, justify="right")
    for model in models:
        table.add_column(f"% of {model} step", justify="right")
    for r in rows:
        cells = [str(r["page_size"]), str(r["batch"]), str(r["context"]), str(r["entries"]),
                 f"{r['check_us']:.1f}", f"{r['noop_us']:.3f}", f"{r['bare_us']:.3f}"]  # fmt: skip
        for model in models:
            mark = "" if r["fits_pool"][model] else " *"
            cells.append(f"{100 * r['fractions'][model]:.4f}{mark}")
        table.add_row(*cells)
    console = Console()
    console.print(table)
    if rows:
        console.print(f"decode step source: {rows[0]['step_source']}")
        console.print("* batch x context exceeds the model's node KV pool (shown for scale only)")
