"""CLI commands of the planner: `quantkit plan` and `quantkit report`.

Thin: parse options, call the planner, print text or JSON. matplotlib is imported only by
`report --html`.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from quantkit.core.jsontypes import JSON, JSONObject
from quantkit.plan.memory import Assumptions

_D = Assumptions()


def _assumptions(
    mem_fraction: float,
    multimodal_factor: float,
    reserve_gib: float,
    page_size: int,
    headroom_tokens: int,
    mtp: bool,
    shared_indexer: bool,
) -> Assumptions:
    from quantkit.core.errors import QuantkitError

    if page_size < 1 or headroom_tokens < 0 or reserve_gib < 0 or not 0 < multimodal_factor <= 1:
        raise QuantkitError(
            "expected --page-size >= 1, --headroom-tokens >= 0, --reserve-gib >= 0, "
            "0 < --multimodal-factor <= 1"
        )
    return Assumptions(
        mem_fraction, multimodal_factor, reserve_gib, page_size, headroom_tokens, mtp, shared_indexer
    )


def _print_json(obj: JSON) -> None:
    typer.echo(json.dumps(obj, indent=2, default=str))


def rows_decode(rows: list[JSONObject], rec: JSONObject) -> JSONObject:
    """The `plan_compare` row the recommendation decodes on."""
    decode = rec["decode"]
    return next(r for r in rows if r["weights"] == decode["weights"] and r["kv"] == decode["kv"])  # type: ignore[index]


def register(app: typer.Typer, bench: typer.Typer, simulate: typer.Typer) -> None:
    """Add `plan` and `report` to the CLI."""

    @app.command("plan")
    def plan_cmd(
        model: str = typer.Argument(
            ..., help="Bundled name (glm-5.2, kimi-k2.6, ...), config.json, checkpoint or hub repo id."
        ),
        gpu: str = typer.Option("h200", "--gpu", help="GPU catalog key: h100 h200 b200 b300 gb200 h20 a100 l40s."),
        tp: int = typer.Option(8, "--tp", help="Tensor-parallel size (GPUs)."),
        ep: bool = typer.Option(False, "--ep", help="Expert parallel over the TP group."),
        dp_attention: bool = typer.Option(
            False, "--dp-attention", help="SGLang DP attention (attention replicated)."
        ),
        weights: str = typer.Option("native", "--weights", help="native | bf16 | fp8 | int4 | nvfp4 | mxfp4"),
        group_size: int = typer.Option(32, "--group-size", help="INT4 group size."),
        kv: str = typer.Option("bf16", "--kv", help="KV-cache dtype: bf16 | fp8"),
        context: int = typer.Option(32768, "--context", help="Tokens per request (prompt + output)."),
        batch: int = typer.Option(1, "--batch", help="Concurrent requests for decode_tok_s."),
        mem_fraction: float = typer.Option(
            _D.mem_fraction, "--mem-fraction", help="SGLang --mem-fraction-static."
        ),
        multimodal_factor: float = typer.Option(_D.multimodal_factor, "--multimodal-factor"),
        reserve_gib: float = typer.Option(_D.reserve_gib, "--reserve-gib"),
        page_size: int = typer.Option(_D.page_size, "--page-size"),
        headroom_tokens: int = typer.Option(_D.headroom_tokens, "--headroom-tokens"),
        mtp: bool = typer.Option(_D.speculative, "--mtp/--no-mtp", help="Size the MTP draft layer too."),
        shared_indexer: bool = typer.Option(_D.shared_indexer, "--shared-indexer"),
        gpu_file: Path | None = typer.Option(None, "--gpu-file", help="Extra GPU catalog YAML."),
        compare: bool = typer.Option(
            False, "--compare", help="Table: weights {bf16,fp8,int4} (+nvfp4 on Blackwell) x KV {bf16,fp8}."
        ),
        pd: bool = typer.Option(
            False, "--pd", help="The prefill/decode pair SGLang accepts (with --json: the record)."
        ),
        split: bool = typer.Option(
            False, "--split", help="With --pd --json: the production split through quantkit's SGLang plugin "
            "(BF16 KV on the prefill, FP8 pages converted in transit; MLA/DSA models)."
        ),
        kv_scales: str = typer.Option(
            "auto", "--kv-scales", help="FP8 KV scales the INT4 checkpoint ships: auto (the measured rule, "
            "docs/serving.md) | calibrated | unit; decides the attention backend the record and the pair pin."
        ),
        as_json: bool = typer.Option(False, "--json", help="Print JSON."),
        sensitivity: Path | None = typer.Option(
            None, "--sensitivity", help="A table of this model (`quantkit sensitivity`): the mixed plans that fit, "
            "with their predicted KL."
        ),
        html_path: Path | None = typer.Option(None, "--html", help="With --sensitivity: KL against size, as HTML."),
    ) -> None:
        """Will it fit, how many tokens of KV, how many requests, how fast: per precision plan, per GPU."""
        from quantkit.arch import get_adapter
        from quantkit.plan.catalog import get_gpu
        from quantkit.plan.inventory import read_shard_headers
        from quantkit.plan.models import resolve_model
        from quantkit.plan.planner import Deployment, plan_compare, plan_one, resolve_plan
        from quantkit.plan.recommend import recommend
        from quantkit.plan.render import assumptions_text, compare_text, plan_text, recommend_text
        from quantkit.plan.report import sized_from_headers

        a = _assumptions(
            mem_fraction, multimodal_factor, reserve_gib, page_size, headroom_tokens, mtp, shared_indexer
        )
        dep = Deployment(get_gpu(gpu, gpu_file), tp, ep, dp_attention, context, batch, a)
        from quantkit.hub.client import is_hub_id, resolve_source

        source = resolve_model(str(resolve_source(model, config_only=True)) if is_hub_id(model) else model)
        if kv_scales not in ("auto", "calibrated", "unit"):
            from quantkit.core.errors import QuantkitError

            raise QuantkitError(f"--kv-scales {kv_scales!r}: expected auto, calibrated or unit")
        if sensitivity is not None:
            from quantkit.calibrate.sensitivity_table import load_table
            from quantkit.plan.frontier import frontier_html, frontier_report, frontier_text

            rep = frontier_report(source, dep, kv, load_table(sensitivity))
            if html_path is not None:
                frontier_html(rep, html_path)
            if as_json:
                _print_json(rep)
                return
            typer.echo(frontier_text(rep))
            if not compare:
                return
        if compare or pd:
            from quantkit.plan.attention_plan import kv_options_text, pd_kv_options

            rows = plan_compare(source, dep, group_size, kv_scales)  # type: ignore[arg-type]
            rec = recommend(rows, source.config, group_size, kv_scales)  # type: ignore[arg-type]
            options = pd_kv_options(source.config, rows_decode(rows, rec), dep.gpu, group_size,
                                    kv_scales) if rec.get("decode") else None  # type: ignore[arg-type]
            if pd and as_json:
                if split and not rec.get("pd_split"):
                    from quantkit.core.errors import QuantkitError

                    raise QuantkitError(f"{source.name}: no plugin split (the PD KV plugin converts MLA/DSA pages)")
                record = rec["pd_split"] if split else rec["pd"]
                _print_json({**record, **({"kv_choice": options} if options else {})})
                return
            if as_json:
                _print_json(rows)
                return
            typer.echo(f"{source.name} on {tp} x {dep.gpu.name}")
            typer.echo(compare_text(rows))
            typer.echo(recommend_text(rec))
            if options:
                typer.echo(kv_options_text(source.config, options["speed"], options["shipped"]))
            typer.echo(assumptions_text(rows[0]["assumptions"]))
            return
        plan = resolve_plan(source.config, weights, group_size)
        tensors, origin = None, "config.json inventory"
        if source.checkpoint_dir is not None and weights == "native":
            headers, _ = read_shard_headers(source.checkpoint_dir)
            tensors = sized_from_headers(headers, get_adapter(source.config))
            origin = "shard headers"
        row = plan_one(source, dep, plan, kv, tensors, origin)
        if as_json:
            _print_json(row)
            return
        typer.echo(plan_text(row))
        typer.echo(assumptions_text(row["assumptions"]))

    @app.command("report")
    def report_cmd(
        checkpoint: Path = typer.Argument(..., help="Checkpoint directory (shards + index + config.json)."),
        source: str | None = typer.Option(
            None, "--source", help="Source checkpoint dir or model, for before/after."
        ),
        html_path: Path | None = typer.Option(
            None, "--html", help="Write a self-contained HTML page with plots."
        ),
        gpu: str = typer.Option("h200", "--gpu"),
        tp: int = typer.Option(8, "--tp"),
        context: int = typer.Option(32768, "--context"),
        gpu_file: Path | None = typer.Option(None, "--gpu-file"),
        as_json: bool = typer.Option(False, "--json"),
    ) -> None:
        """Real sizes from shard headers by role and dtype, before/after, per-GPU memory and KV capacity."""
        from quantkit.plan.catalog import get_gpu
        from quantkit.plan.planner import Deployment
        from quantkit.plan.render import gib_gb, plan_text
        from quantkit.plan.report import checkpoint_report

        dep = Deployment(get_gpu(gpu, gpu_file), tp, context=context)
        rep = checkpoint_report(checkpoint, dep, source)
        if html_path is not None:
            from quantkit.plan.html import write_html

            write_html(rep, html_path)
        if as_json:
            _print_json(rep)
            return
        disk = rep["disk"]
        typer.echo(
            f"{checkpoint}: {len(disk['shards'])} shards, {gib_gb(disk['shard_bytes_on_disk'])} on disk"
        )
        typer.echo(
            f"  headers {disk['header_bytes']:,} B + tensors {disk['tensor_bytes']:,} B = "
            f"{disk['header_bytes'] + disk['tensor_bytes']:,} B "
            f"({'matches' if disk['headers_plus_tensors_equal_disk'] else 'DOES NOT match'} the files)"
        )
        typer.echo("  by role:   " + ", ".join(f"{k} {gib_gb(v)}" for k, v in rep["by_role"].items()))
        typer.echo("  by dtype:  " + ", ".join(f"{k} {gib_gb(v)}" for k, v in rep["by_stored_dtype"].items()))
        verdict = "matches" if rep["planned_matches_disk"] else "differs from"
        typer.echo(
            f"  planned:   {rep['planned_tensor_bytes']:,} B from config.json ({verdict} the tensor bytes)"
        )
        if rep["index"].get("present"):
            typer.echo(f"  index:     {'ok' if rep['index']['ok'] else 'MISMATCH ' + str(rep['index'])}")
        if "source" in rep:
            s = rep["source"]
            typer.echo(
                f"  source:    {s['name']} {gib_gb(s['tensor_bytes'])} -> {gib_gb(disk['tensor_bytes'])} "
                f"(x{s['ratio']:.3f})"
            )
        for row in rep["per_gpu"]:
            typer.echo(plan_text(row))
        if html_path is not None:
            typer.echo(f"wrote {html_path}")
