"""CLI commands of the calibration area: `kv-scales` and `eval` (calibrated `convert` is the converter's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from quantkit.core.locations import CALIBRATION_DATA

DEFAULT_HELDOUT = CALIBRATION_DATA / "heldout.jsonl"
DEFAULT_CALIB = CALIBRATION_DATA / "default.jsonl"


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
    scales: Annotated[str, typer.Option("--kv-scales", help="auto (the measured rule, docs/serving.md) | "
                                        "calibrated | unit (write scale 1.0)")] = "auto",
) -> None:
    """Measure FP8 KV-cache scales (MLA-aware) and add them to a checkpoint without rewriting its shards."""
    import os
    import shutil

    from quantkit.calibrate import kv
    from quantkit.calibrate.runner import RunOptions, run
    from quantkit.checkpoint.source import open_source
    from quantkit.core.errors import QuantkitError
    from quantkit.core.paths import make_parents, refuse_link
    from quantkit.engines.record import update_serving_record
    from quantkit.hub.client import is_hub_id, resolve_source
    from quantkit.hub.refresh import refresh_outputs
    from quantkit.quant.recipe import Recipe

    if out is not None:
        refuse_link(out)  # a link at OUT is not followed (quantkit.core.paths): remove it or name another OUT
    if is_hub_id(str(src)) and out is None:
        raise QuantkitError(f"{src}: a hub source needs --out (the pulled copy is a cache, not a target)")
    src = resolve_source(src)
    source = open_source(src)
    target = out or src
    if not os.path.lexists(target):
        make_parents(target)  # a fresh --out path: its missing parents, each under the path rule
    if source.adapter.kv_layout != "dsa":  # refuse before any calibration work
        probe = (target if target.exists() else src) / "config.json"
        kv.require_kv_scheme_support(probe, json.loads(probe.read_text(encoding="utf-8")))
    if target.exists():
        if open_source(target).adapter.num_layers != source.adapter.num_layers:
            raise QuantkitError(f"{target}: not a checkpoint of the same model as {src} (layer counts differ)")
    if scales not in ("auto", "calibrated", "unit"):
        raise QuantkitError(f"--kv-scales {scales!r}: expected auto, calibrated or unit")
    recipe = Recipe(method="rtn", kv_cache="fp8", kv_scales=scales,  # type: ignore[arg-type]
                    calibration={"dataset": str(calib), "samples": samples, "seq_len": seq_len, "seed": seed})
    work = (target if target.exists() else target.parent) / f".{target.name}.kv-scales.partial"
    result = run(source, recipe, work, typer.echo, RunOptions(quantize=False))
    if not target.exists():
        kv.link_checkpoint(src, target)
    kv_values = result.kv_scales
    written = result.write_reports(target)
    if kv_values:
        written += kv.write_kv_scales(target, kv_values, source.adapter)
        written += update_serving_record(target, _kv_speed(target))
    shutil.rmtree(work, ignore_errors=True)
    refresh_outputs(target, written + ["config.json", "model.safetensors.index.json"])
    typer.echo(result.summary())
    typer.echo(f"wrote {', '.join(written)} in {target}")


def _kv_speed(ckpt: Path) -> dict[str, object] | None:
    """The record's modelled speed of both KV-scale options (the planner; None where it cannot size the model)."""
    from quantkit.core.errors import QuantkitError
    from quantkit.plan.attention_plan import record_speed

    config = json.loads((ckpt / "config.json").read_text(encoding="utf-8"))
    groups = list(((config.get("quantization_config") or {}).get("config_groups") or {}).values())
    group = int(((groups[0].get("weights") or {}).get("group_size") or 32) if groups else 32)
    try:
        return record_speed(config, group if group in (32, 64, 128) else 32)
    except (QuantkitError, KeyError, ValueError, TypeError):
        return None


def eval_cmd(
    model: Annotated[list[Path] | None, typer.Argument(help="model directories (plain or quantized), in-process; "
                                                      "or use --endpoint for served deployments")] = None,
    reference: Annotated[Path | None, typer.Option("--reference", help="source model: adds KL and top-1")] = None,
    data: Annotated[Path, typer.Option("--data", help="held-out JSONL / text / parquet")] = DEFAULT_HELDOUT,
    seq_len: Annotated[int, typer.Option(help="tokens per window")] = 128,
    windows: Annotated[int, typer.Option(help="number of windows")] = 64,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
    endpoint: Annotated[str | None, typer.Option("--endpoint", help="candidate OpenAI-compatible server URL "
                                                 "(SGLang, vLLM)")] = None,
    baseline: Annotated[str | None, typer.Option("--baseline", help="baseline server URL (e.g. the source "
                                                 "model's deployment)")] = None,
    tasks: Annotated[str, typer.Option("--tasks", help="comma list: kl, toolcall and lm-eval task names "
                                       "(gsm8k, arc_challenge, mmlu, ...)")] = "kl,toolcall",
    limit: Annotated[int | None, typer.Option("--limit", help="items per task (default: all)")] = None,
    record: Annotated[Path | None, typer.Option("--record", help="checkpoint directory: results into its "
                                                "quantkit.json['eval'] (card and report show them)")] = None,
    threshold: Annotated[float, typer.Option("--threshold", help="largest allowed drop, points")] = 0.8,
    max_kl: Annotated[float, typer.Option("--max-kl", help="kl: largest mean KL, nats/token")] = 0.05,
    max_flip: Annotated[float, typer.Option("--max-flip", help="kl: largest top-1 flip rate, points")] = 5.0,
    state: Annotated[Path, typer.Option("--state", help="per-item answers; a rerun resumes from them")] = Path(
        ".quantkit-eval"),
    logprobs: Annotated[int, typer.Option("--logprobs", help="kl: top-k logprobs per position")] = 20,
    api: Annotated[str, typer.Option("--api", help="openai (/v1/completions echo; lm-eval "
                                   "local-completions) | sglang (native /generate; lm-eval sglang-generate)")] = (
        "openai"),
    tool_choice: Annotated[str, typer.Option("--tool-choice", help="toolcall: auto | required")] = "auto",
    tool_max_tokens: Annotated[int, typer.Option("--tool-max-tokens", help="toolcall: max_tokens")] = 1024,
    max_length: Annotated[int, typer.Option("--max-length", help="lm-eval: context + generation tokens")] = 32768,
    max_gen_toks: Annotated[int, typer.Option("--max-gen-toks", help="lm-eval: generation limit")] = 16384,
    tokenizer: Annotated[str | None, typer.Option("--tokenizer", help="lm-eval: tokenizer (default: the "
                                                  "served model name)")] = None,
    lm_eval_python: Annotated[Path | None, typer.Option("--lm-eval-python", help="Python with lm-eval "
                                                        "(default: the eval venv of `make vllm-cpu`)")] = None,
    lm_eval_include: Annotated[Path | None, typer.Option("--lm-eval-include", help="extra lm-eval task "
                                                         "YAMLs (offline tasks on local files)")] = None,
    concurrency: Annotated[int, typer.Option("--concurrency", help="requests in flight per server")] = 8,
) -> None:
    """Held-out quality: in-process for small models (MODEL..., KL / top-1 vs --reference), or of served
    deployments side by side (--endpoint [--baseline]); exits 1 when a served task regresses."""
    if endpoint is not None:
        from quantkit.cli.served_eval import served_eval

        ok = served_eval(locals())
        raise typer.Exit(0 if ok else 1)
    if not model:
        from quantkit.core.errors import QuantkitError

        raise QuantkitError("eval: give MODEL directories, or --endpoint URL for a served deployment")
    from quantkit.calibrate.eval import evaluate_in_subprocess, format_table

    res = evaluate_in_subprocess(model, data, reference, seq_len, windows)
    typer.echo(json.dumps(res, indent=2) if as_json else format_table(res))
