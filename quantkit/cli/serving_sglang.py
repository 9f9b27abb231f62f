"""``quantkit simulate integrity --engine sglang``: the fault campaign over SGLang's own code, with the plugin."""

from __future__ import annotations

import json
from typing import Literal

from quantkit.core.errors import QuantkitError
from quantkit.serving.integrity.campaign import (
    _COUNTS,
    FAULT_KINDS,
    ORDERINGS,
    CampaignConfig,
    CampaignResult,
    merge_results,
)

__all__ = ["SGLANG_KEYS", "simulate_sglang", "summarise"]

SGLANG_KEYS = ("sglang_version", "steps", "injected", "detected", "false_positives", "wrong_data_served",
               "wrong_tokens_streamed")  # fmt: skip
REUSE_MODES: tuple[Literal["immediate", "staged"], ...] = ("immediate", "staged")


def summarise(runs: list[CampaignResult]) -> dict[str, object]:
    """Totals over runs, the per-fault-kind table and each run's figures."""
    total: dict[str, object] = {"sglang_version": runs[0].sglang_version if runs else ""}
    for key in _COUNTS:
        total[key] = sum(getattr(r, key) for r in runs)
    total["by_kind"] = {k: {"injected": sum(r.by_kind[k]["injected"] for r in runs),
                            "detected": sum(r.by_kind[k]["detected"] for r in runs)} for k in FAULT_KINDS}  # fmt: skip
    total["runs"] = [{k: v for k, v in r.to_dict().items() if k != "sglang_version"} for r in runs]
    return total


def simulate_sglang(steps: int, seed: int, fault_rate: float, page_sizes: list[int], src: str | None,
                    as_json: bool) -> None:  # fmt: skip
    from quantkit.serving.integrity.campaign import load_plugin, run_campaign
    from quantkit.serving.integrity.sglang_env import load_sglang

    if steps <= 0 or not 0.0 <= fault_rate <= 1.0:
        raise QuantkitError("--steps must be positive and --fault-rate in [0, 1]")
    version = load_sglang(src)
    load_plugin()
    configs = [(ps, reuse) for ps in page_sizes for reuse in REUSE_MODES]
    share = -(-steps // len(configs))
    runs = []
    for i, (ps, reuse) in enumerate(configs):  # each (page size, reuse) run: half its steps in each ordering
        parts = [run_campaign(CampaignConfig(steps=n, seed=seed + i, page_size=ps, reuse=reuse, ordering=order,
                                             fault_rate=fault_rate), version)
                 for order, n in zip(ORDERINGS, (share // 2, share - share // 2), strict=True) if n]  # fmt: skip
        runs.append(merge_results(parts))
    result = summarise(runs)
    if as_json:
        print(json.dumps(result))
        return
    _print(result)


def _print(result: dict[str, object]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"KV integrity campaign on SGLang {result['sglang_version']} (plugin loaded)")
    for col in ("fault kind", "injected", "detected"):
        table.add_column(col, justify="right")
    for kind, row in result["by_kind"].items():
        table.add_row(kind, str(row["injected"]), str(row["detected"]))
    table.add_row("all", str(result["injected"]), str(result["detected"]))
    console.print(table)
    for key in _COUNTS:
        if key in ("injected", "detected"):
            continue
        console.print(f"{key}: {result[key]}")
