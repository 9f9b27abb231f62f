"""integrity: the pre-decode integrity check (`TagTracker.check`) as a share of a decode step, batch 1..64
(quantkit.serving.integrity.bench)."""

from __future__ import annotations

from dataclasses import asdict

from gpu_sections.common import Context, Report, SectionData, device_name, torch_device

INTEGRITY_BATCHES = (1, 2, 4, 8, 16, 32, 64)
INTEGRITY_CONTEXTS = (8192, 32768)
INTEGRITY_PAGES = (64, 1)


def run(ctx: Context, rep: Report) -> None:
    """`TagTracker.check` per decode batch, as a share of the planner's H200 TP8 decode step."""
    device = torch_device(ctx)
    rep.device = device_name(device)
    from quantkit.serving.integrity.bench import bench_config

    if ctx.smoke:
        batches, contexts, pages, repeats = (1, 2), (256,), (16, 1), 1
    else:
        batches, contexts, pages, repeats = INTEGRITY_BATCHES, INTEGRITY_CONTEXTS, INTEGRITY_PAGES, 5
    rep.figures["rows"] = []
    for page in pages:
        for context in contexts:
            for batch in batches:
                row = asdict(bench_config(batch, context, page, device, repeats))
                rep.figures["rows"].append(row)
                rep.figures["backend"] = row["backend"]
                rep.save()
                ctx.check_budget(margin=5)



def summary_lines(integrity: SectionData) -> list[str]:
    rows = integrity["figures"].get("rows", [])
    models = list(rows[0]["fractions"]) if rows else []
    lines = [f"Backend: {integrity['figures'].get('backend', '-')}; step source: "
             f"{rows[0]['step_source'] if rows else '-'}; `*` = beyond the model's KV pool.", "",
             "| page | batch | context | entries | check us | no-op us | "
             + " | ".join(f"% of {m} step" for m in models) + " |",
             "|---:|---:|---:|---:|---:|---:|" + "---:|" * len(models)]
    for r in rows:
        cells = [f"{100 * r['fractions'][m]:.3f}{'' if r['fits_pool'][m] else ' *'}" for m in models]
        lines.append(f"| {r['page_size']} | {r['batch']} | {r['context']} | {r['entries']} | {r['check_us']:.1f} "
                     f"| {r['noop_us']:.2f} | " + " | ".join(cells) + " |")
    return lines
