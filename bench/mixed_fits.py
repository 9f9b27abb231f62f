"""What fits where, for per-unit plans: GLM-5.2, Kimi-K2.6, DeepSeek-V3 on 8 x H200, 8 x H100, 4 x H200, 8 x B200.

    python bench/mixed_fits.py

Sizes only (bundled configs, the planner's memory model): the default uniform recipe, the smallest loadable plan,
the KV tokens each leaves, and how many MoE layers can go INT8 g128 at the uniform recipe's bytes per GPU when
the other experts go to g128 and shared experts / attention from BF16 to INT8 g128. docs/planner.md shows it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantkit.plan.catalog import GIB, get_gpu  # noqa: E402
from quantkit.plan.frontier import kv_tokens_for  # noqa: E402
from quantkit.plan.mixed import model_costs, smallest  # noqa: E402
from quantkit.plan.models import resolve_model  # noqa: E402
from quantkit.plan.planner import Deployment  # noqa: E402


def main() -> None:
    for model in ("glm-5.2", "kimi-k2.6", "deepseek-v3"):
        config = resolve_model(model).config
        for gpu, n in (("h200", 8), ("h100", 8), ("h200", 4), ("b200", 8)):
            dep = Deployment(get_gpu(gpu), n)
            costs = model_costs(config, None, tp=n)
            by = {c.unit.name: c for c in costs.choices}
            fmts = {u: [o.fmt for o in c.options] for u, c in by.items()}
            uniform = {u: "int4-g32" if c.unit.kind == "experts" else "bf16" for u, c in by.items()}
            moved = {u: "int4-g128" if c.unit.kind == "experts" else "int8-g128" if "int8-g128" in fmts[u]
                     else "bf16" for u, c in by.items()}
            experts = [c for c in by.values() if c.unit.kind == "experts"]
            cost = {o.fmt: o.per_gpu for o in experts[0].options}
            g_uniform, g_small = costs.total(uniform, "per_gpu"), smallest(costs, "per_gpu")
            room = g_uniform - costs.total(moved, "per_gpu")
            print(json.dumps({
                "model": model, "gpus": f"{n} x {gpu}",
                "uniform_checkpoint_gib": round(costs.total(uniform, "bytes") / GIB, 1),
                "uniform_per_gpu_gib": round(g_uniform / GIB, 1),
                "uniform_kv_tokens_fp8": kv_tokens_for(config, dep, "fp8", g_uniform),
                "uniform_kv_tokens_bf16": kv_tokens_for(config, dep, "bf16", g_uniform),
                "smallest_per_gpu_gib": round(g_small / GIB, 1),
                "smallest_kv_tokens_fp8": kv_tokens_for(config, dep, "fp8", g_small),
                "moe_layers": len(experts),
                "int8_layers_at_equal_size": int(room // (cost["int8-g128"] - cost["int4-g128"])),
            }))


if __name__ == "__main__":
    main()
