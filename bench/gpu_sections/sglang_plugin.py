"""sglang_plugin: quantkit's SGLang plugins on cuda: the integrity plugin's device work per decode step
(record the step's new pages + the batched check, quantkit.serving.integrity.sglang), batch 1..256, context
8K..128K, as a share of the planner's decode step; and the PD plugin's BF16 -> FP8 MLA page conversion per
page (quantkit.serving.pd.sglang, bench/pd_kv_pages.py)."""

from __future__ import annotations

from gpu_sections.common import REAL_MODELS, Context, Report, SectionData, device_name, torch_device


def _pd_pages(ctx: Context, rep: Report, device_type: str) -> None:
    """Issue 19: `sglang_pd.mla_pages_to_fp8` per page at page sizes 1 and 64 (bench/pd_kv_pages.py), into
    `figures["pd_rows"]` of the sglang_plugin section ($OUT holds at most 8 files: one section for both plugins)."""
    from pd_kv_pages import measure, measure_staging

    sizes = ((1, 64), (64, 4)) if ctx.smoke else ((1, 65536), (64, 4096))
    rep.figures["pd_rows"] = []
    for page, pages in sizes:
        rep.figures["pd_rows"].append(measure(page, pages, device_type))
        rep.save()
        ctx.check_budget(margin=2)
    rep.figures["pd_staging"] = []  # the plugin's whole send-side round per request, 61 layers
    for page, pages in (((1, 16), (64, 2)) if ctx.smoke else ((1, 8192), (64, 128))):
        rep.figures["pd_staging"].append(measure_staging(page, pages, device_type))
        rep.save()
        ctx.check_budget(margin=2)


def run(ctx: Context, rep: Report) -> None:
    """The PD plugin's page conversion per page (first: 15 s), then the integrity plugin's per-step device work
    on cuda (issue 27: allocation bump + decode record + the check with its write redirect + the verdict and the
    mark, `quantkit.serving.integrity.plugin_bench.plugin_step`), synchronised per step, and the host time to
    issue it; SGLang itself is not needed (the hooks' bodies run on quantkit's `PoolState`)."""
    from quantkit.serving.integrity.bench import decode_step
    from quantkit.serving.integrity.plugin_bench import plugin_step

    device = torch_device(ctx)
    rep.device = device_name(device)
    _pd_pages(ctx, rep, device.type)
    if ctx.smoke:
        batches, contexts, pages, repeats = (1, 2), (256,), (16, 1), 1
    else:
        batches, contexts, pages, repeats = (1, 16, 64, 256), (8192, 32768, 131072), (64, 1), 5
    rep.figures["rows"] = []
    for page in pages:
        for context in contexts:
            for batch in batches:
                if page == 1 and batch * context > 2_000_000:
                    continue
                row = {"page_size": page, "batch": batch, "context": context,
                       **plugin_step(batch, context, page, device, repeats)}
                for model in REAL_MODELS:
                    seconds, source = decode_step(model, batch, context)
                    row[f"pct_{model}"] = 100 * row["step_us"] / 1e6 / seconds
                    row["step_source"] = source
                rep.figures["rows"].append(row)
                rep.save()
                ctx.check_budget(margin=5)



def summary_lines(sec: SectionData) -> list[str]:
    rows = sec["figures"].get("rows", [])
    lines = ["Record + check per decode step on cuda (target < 0.3% of a decode step).", "",
             "| page | batch | context | us | % of glm-5.2 step | % of kimi-k2.6 step |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['page_size']} | {r['batch']} | {r['context']} | {r['step_us']:.1f} | "
                     f"{r['pct_glm-5.2']:.3f} | {r['pct_kimi-k2.6']:.3f} |")
    return lines
