"""Which precision for prefill and which for decode, and the SGLang flags for each side.

Prefill is compute-bound: the plan with the highest modelled prefill speed wins, preferring BF16 KV
(the cache it writes is read once by decode; BF16 keeps it exact). The launch commands are the PD pair
stock SGLang accepts (`quantkit.engines.pd`): FP8 KV on both sides, the note says what the prefill gives
up. Decode is bandwidth- and capacity-bound: the plan with the highest modelled throughput at the largest
batch that fits the context wins. The numbers decide, not a fixed rule; for GLM-5.2 / Kimi on H200 they give the
production choice (prefill FP8 + BF16 KV, decode INT4 + FP8 KV).

The checkpoint-specific SGLang flags of an INT4 side (MoE backend, shared-expert fusion, what KV scale is
really applied) come from `quantkit.engines.verdicts`, the same record `convert` writes into quantkit.json.
"""

from __future__ import annotations

from quantkit.arch import KVLayout
from quantkit.core.jsontypes import JSONObject
from quantkit.engines.kv_choice import RequestedScales
from quantkit.engines.pd import PDPair, gpu_arch, pd_pair, pd_problems, pd_split
from quantkit.engines.verdicts import engine_verdicts, facts_from_recipe

__all__ = ["int4_engine_args", "pd_record", "recommend", "sglang_flags"]

_KV_FLAGS = ("--kv-cache-dtype",)


def int4_engine_args(config: JSONObject, group_size: int, kv_fp8: bool) -> tuple[list[str], str | None]:
    """SGLang's args for quantkit's default INT4 checkpoint of `config` (KV flags left to the planner),
    and a note when FP8 KV would not get calibrated scales in SGLang."""
    from quantkit.quant.recipe import load_recipe

    roles = load_recipe(None, config).quantize_roles
    verdict = engine_verdicts(facts_from_recipe(config, group_size, roles, kv_fp8), ("sglang",))["sglang"]
    args, skip = [], False
    for a in verdict.args:
        if skip or a in _KV_FLAGS:
            skip = not skip
            continue
        args.append(a)
    note = None
    if kv_fp8 and verdict.kv_cache.scale not in ("calibrated", "per-tile"):
        note = f"FP8 KV in SGLang runs at scale 1.0 for this model: {verdict.kv_cache.detail}"
    return args, note


def _best(rows: list[JSONObject], key: str, kv: str | None = None) -> JSONObject | None:
    candidates = [  # FP4 rows are shown, not recommended: modelled as INT4's bytes (no FP4 kernel measured)
        r for r in rows if r["fits"] and r["max_concurrent_requests"] > 0 and (kv is None or r["kv"] == kv)
        and not r["weights"].endswith("fp4a16")
    ]
    return max(candidates, key=lambda r: r[key]) if candidates else None


def _deployment_args(row: JSONObject, mode: str) -> list[str]:
    """The planner's per-side SGLang args (memory, chunking, context, EP / DP attention, batch cap)."""
    a = row["assumptions"]
    args = ["--mem-fraction-static", str(row["mem_fraction_effective"]), "--chunked-prefill-size",
            str(a["headroom_tokens"]), "--context-length", str(a["context"])]
    if a["ep"]:
        args += ["--ep-size", str(a["tp"])]
    if a["dp_attention"]:
        args += ["--enable-dp-attention", "--dp-size", str(a["tp"])]
    if mode == "decode":
        args += ["--max-running-requests", str(max(1, row["max_concurrent_requests"]))]
    return args


def sglang_flags(args: list[str]) -> str:
    """A launch argv as a copyable shell command, one flag per line."""
    lines, current = [], list(args[:3])
    for a in args[3:]:
        if a.startswith("--") and current:
            lines.append(" ".join(current))
            current = []
        current.append(a)
    lines.append(" ".join(current))
    return " \\\n    ".join(lines)


def pd_record(config: JSONObject, prefill: JSONObject, decode: JSONObject, group_size: int,
              split: bool = False, kv_scales: RequestedScales = "auto") -> PDPair:
    """The PD pair for the chosen rows: prefill on the FP8 source, decode on quantkit's INT4 output; with `split`,
    the production split through quantkit's SGLang plugin (BF16 KV on the prefill; MLA/DSA models only)."""
    from quantkit.quant.recipe import load_recipe

    roles = load_recipe(None, config).quantize_roles
    int4 = decode["weights"].startswith("int4")
    facts = facts_from_recipe(config, group_size, roles if int4 else (), decode["kv"] == "fp8",
                              kv_scale_mode=None if kv_scales == "auto" else kv_scales)
    a = decode["assumptions"]
    build = pd_split if split else pd_pair
    return build(facts, source=f"<{prefill['weights']}-source>", output=f"<{decode['weights']}-checkpoint>",
                   tp=a["tp"], arch=gpu_arch(a["gpu"]), page_size=a["page_size"], weights=decode["weights"],
                   prefill_weights=prefill["weights"],
                   prefill_extra=_deployment_args(prefill, "prefill"), decode_extra=_deployment_args(decode, "decode"))


def recommend(rows: list[JSONObject], config: JSONObject, group_size: int = 32,
              kv_scales: RequestedScales = "auto") -> JSONObject:
    """Pick the prefill and decode plans from a `plan_compare` table, with launch flags (the KV scales the decode
    checkpoint ships: `kv_scales`, auto = the measured rule of quantkit.engines.kv_choice)."""
    prefill = _best(rows, "prefill_tok_s", kv="bf16") or _best(rows, "prefill_tok_s")
    decode = _best(rows, "decode_tok_s_at_full_batch")
    out: JSONObject = {"prefill": None, "decode": None, "pd": None}
    if not (prefill and decode):
        out["note"] = "no PD pair: a side has no plan that fits"
        return out
    pair = pd_record(config, prefill, decode, group_size, kv_scales=kv_scales)
    out["pd"] = pair.to_dict()
    if facts_from_recipe(config, group_size, (), False).adapter.kv_layout != KVLayout.GQA:
        out["pd_split"] = pd_record(config, prefill, decode, group_size, split=True, kv_scales=kv_scales).to_dict()
    out["prefill"] = {"weights": prefill["weights"], "kv": "fp8", "planned_kv": prefill["kv"],
                      "prefill_tok_s": prefill["prefill_tok_s"], "sglang": sglang_flags(pair.prefill.args)}
    out["decode"] = {"weights": decode["weights"], "kv": decode["kv"],
                     "max_concurrent_requests": decode["max_concurrent_requests"],
                     "decode_tok_s_at_full_batch": decode["decode_tok_s_at_full_batch"],
                     "sglang": sglang_flags(pair.decode.args)}
    out["router"] = sglang_flags(pair.router.args)
    notes = [f"the modelled best prefill KV is {prefill['kv']}; the pair stock SGLang accepts runs FP8 KV on both "
             f"sides (prefill gives up: {pair.gives_up})"] if prefill["kv"] != "fp8" else []
    problems = pd_problems(pair)
    out["note"] = " ".join(notes + pair.notes + [f"PROBLEM: {p}" for p in problems])
    return out
