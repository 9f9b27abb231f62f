"""What `quantkit plan` prints about the attention backend: decode tok/s on every backend consistent with the
record's KV scale at 8K / 32K / 128K context (one request and as many as fit), the one the record pins and the
fastest; and, for `plan --pd` / `convert`, the two KV-scale options side by side (measured KL, modelled speed).
"""

from __future__ import annotations

from quantkit.arch import KVLayout, get_adapter
from quantkit.core.jsontypes import JSONObject
from quantkit.engines.kv_choice import (
    MEASURED,
    KVScaleMode,
    RequestedScales,
    choose_scale_mode,
    kv_choice_record,
    sglang_mla_backend,
)
from quantkit.engines.pd import gpu_arch
from quantkit.plan.attention import consistent_backends, kernel
from quantkit.plan.catalog import GPU
from quantkit.plan.inventory import PrecisionPlan
from quantkit.plan.memory import max_concurrent_requests
from quantkit.plan.throughput import decode_tok_s, reference_backend

__all__ = ["CONTEXTS", "attention_table", "attention_text", "kv_options_text", "kv_speed_options", "pd_kv_options",
           "pinned_backend", "record_speed"]

CONTEXTS = (8192, 32768, 131072)


def pinned_backend(config: JSONObject, kv: str, mode: KVScaleMode, gpu: GPU) -> str:
    """The backend the serving record pins for this model's FP8 KV on the GPU (BF16 KV: the planner's reference)."""
    layout = get_adapter(config).kv_layout
    if kv == "fp8" and layout == KVLayout.MLA:
        return sglang_mla_backend(mode, gpu_arch(gpu.key))
    return reference_backend(layout.value, gpu)


def attention_table(config: JSONObject, plan: PrecisionPlan, gpu: GPU, tp: int, kv: str, capacity: int,
                    node_capacity: int, page_size: int, headroom: int, mode: KVScaleMode) -> JSONObject:
    """tok/s per consistent backend and context, at one request and at the most that fit (`capacity`: KV tokens
    per GPU, for fa3 / flashinfer's pool conversion)."""
    layout = get_adapter(config).kv_layout.value
    arch = gpu_arch(gpu.key)
    pinned = pinned_backend(config, kv, mode, gpu)
    scale: KVScaleMode = mode if kv == "fp8" else "unit"
    other: KVScaleMode = "unit" if scale == "calibrated" else "calibrated"
    same = list(dict.fromkeys([pinned, *consistent_backends(layout, scale, arch)]))  # type: ignore[arg-type]
    alt = [b for b in consistent_backends(layout, other, arch) if b not in same] if kv == "fp8" else []  # type: ignore[arg-type]
    backends = same + alt
    rows: dict[str, dict[str, dict[str, float]]] = {}
    requests = {str(c): max(1, max_concurrent_requests(node_capacity, c, page_size, headroom)) for c in CONTEXTS}
    for backend in backends:
        rows[backend] = {}
        for c in CONTEXTS:
            full = requests[str(c)]
            rows[backend][str(c)] = {
                "b1": decode_tok_s(config, plan, gpu, tp, 1, c, kv, backend, capacity),
                "bmax": decode_tok_s(config, plan, gpu, tp, full, c, kv, backend, capacity)}
    def fastest(names: list[str]) -> str | None:
        return max(names, key=lambda b: rows[b][str(CONTEXTS[1])]["bmax"]) if names else None

    constants = {b: {"eta": kernel(arch, b).eta, "t0_us": kernel(arch, b).t0_s * 1e6,
                     "sources": list(kernel(arch, b).sources), "extrapolated": kernel(arch, b).extrapolated}
                 for b in backends}
    return {"kv_scale": scale, "pinned": pinned, "fastest_consistent": fastest(same), "other_scale": other,
            "fastest_other_scale": fastest(alt), "requests": requests, "by_backend": rows, "constants": constants}


def attention_text(table: JSONObject) -> str:
    """The table as text: one line per backend, tok/s at 1 request / at the most that fit per context."""
    heads = "  ".join(f"{c // 1024}K: 1 / {table['requests'][str(c)]} req" for c in CONTEXTS)
    lines = [f"  decode by attention backend (KV scale {table['kv_scale']}; tok/s, model; {heads}):"]
    for backend, by_ctx in table["by_backend"].items():
        marks = ("pinned by the record" if backend == table["pinned"] else "",
                 "fastest consistent" if backend == table["fastest_consistent"] else "",
                 f"fastest with --kv-scales {table['other_scale']}" if backend == table["fastest_other_scale"] else (
                     f"needs --kv-scales {table['other_scale']}" if backend not in (
                         table["pinned"], table["fastest_consistent"]) and table["fastest_other_scale"]
                     and backend in _other(table) else ""),
                 "extrapolated*" if table["constants"][backend]["extrapolated"] else "")
        cells = "  ".join(f"{by_ctx[str(c)]['b1']:>6,.0f} / {by_ctx[str(c)]['bmax']:>7,.0f}" for c in CONTEXTS)
        lines.append(f"    {backend:<12} {cells}   {', '.join(m for m in marks if m)}")
    lines.append("    * constants from published kernel figures at other GPUs / head counts (docs/planner.md)")
    return "\n".join(lines)


def _other(table: JSONObject) -> list[str]:
    names = list(table["by_backend"])
    first = names.index(table["fastest_other_scale"]) if table["fastest_other_scale"] in names else len(names)
    return names[first:]


def kv_speed_options(config: JSONObject, plan: PrecisionPlan, gpu: GPU, tp: int, capacity: int,
                     requests: int, context: int = CONTEXTS[1]) -> JSONObject | None:
    """Both KV-scale options of an MLA / GQA model at `context`: backend, modelled tok/s at 1 request and at
    `requests`, and the speed delta of unit over calibrated (the record's `kv_choice.speed`)."""
    layout = get_adapter(config).kv_layout
    if layout == KVLayout.DSA:
        return None
    arch = gpu_arch(gpu.key)
    out: JSONObject = {"gpu": gpu.key, "context": context, "requests": requests}
    for mode in ("calibrated", "unit"):
        if layout == KVLayout.MLA:
            backend, kv = sglang_mla_backend(mode, arch), "fp8"  # type: ignore[arg-type]
        else:  # GLM-4.x: SGLang loads no scales, so calibrated runs BF16 KV there
            backend, kv = reference_backend(layout.value, gpu), ("fp8" if mode == "unit" else "bf16")
        out[mode] = {"backend": backend, "kv": kv,
                     "tok_s_1": decode_tok_s(config, plan, gpu, tp, 1, context, kv, backend, capacity),
                     "tok_s_max": decode_tok_s(config, plan, gpu, tp, requests, context, kv, backend, capacity)}
    out["speed_delta_unit_over_calibrated"] = out["unit"]["tok_s_max"] / out["calibrated"]["tok_s_max"] - 1
    return out


def kv_options_text(config: JSONObject, speed: JSONObject | None, shipped: KVScaleMode) -> str:
    """Both options in one line each: backend, measured KL, modelled tok/s (used by `plan --pd`)."""
    layout = get_adapter(config).kv_layout
    choice = kv_choice_record(layout, shipped)
    if choice is None or speed is None:
        return ""
    m = MEASURED.get(layout)
    rule = choice["rule_choice"] or "no measurement"
    lines = [f"KV scales ({layout.value}): the record ships {shipped} (rule: {rule}; --kv-scales calibrated|unit "
             "forces one)"]
    for mode in ("calibrated", "unit"):
        kl = choice["options"][mode]["kl"]  # type: ignore[index]
        s = speed[mode]
        measured = f"KL {kl:.2e}" if kl is not None else "KL not measured"
        lines.append(f"  {mode:<10} {s['backend']:<12} {measured}  {s['tok_s_1']:,.0f} tok/s at 1, "
                     f"{s['tok_s_max']:,.0f} at {speed['requests']} ({speed['context'] // 1024}K)")
    if m is not None:
        lines.append(f"  unit - calibrated: KL {m.delta:+.2e} (+- {m.se:.1e}, threshold {m.threshold:.2e}), "
                     f"speed {speed['speed_delta_unit_over_calibrated']:+.1%} at {speed['requests']} requests")
    return "\n".join(lines)


def record_speed(config: JSONObject, group_size: int, gpu_key: str = "h200", tp: int = 8,
                 context: int = CONTEXTS[1]) -> JSONObject | None:
    """The record's `kv_choice.speed`: both KV-scale options of quantkit's INT4 output of `config` on `tp` x
    `gpu_key` at `context` (one request, and as many as fit at FP8 KV), from the planner's default assumptions."""
    from quantkit.plan.catalog import get_gpu
    from quantkit.plan.inventory import size_model
    from quantkit.plan.memory import Assumptions, plan_memory

    gpu, plan, a = get_gpu(gpu_key), PrecisionPlan("int4", group_size), Assumptions()
    adapter = get_adapter(config)
    mem = plan_memory(size_model(config, plan), adapter, config, gpu, tp, "fp8", a)
    requests = max(1, max_concurrent_requests(mem.node_kv_capacity_tokens, context, a.page_size, a.headroom_tokens))
    return kv_speed_options(config, plan, gpu, tp, mem.kv_capacity_tokens, requests, context)


def pd_kv_options(config: JSONObject, decode: JSONObject, gpu: GPU, group_size: int,
                  kv_scales: RequestedScales = "auto") -> JSONObject | None:
    """`plan --pd`: both KV-scale options for the decode row of a `plan_compare` table (measured KL, modelled
    speed at the row's context and request count) and which one the printed pair ships."""
    layout = get_adapter(config).kv_layout
    if layout == KVLayout.DSA or decode["kv"] != "fp8":
        return None
    shipped = choose_scale_mode(layout, kv_scales)[0]
    weights = str(decode["weights"]).split("-")[0]
    plan = PrecisionPlan(weights if weights in ("bf16", "fp8", "int4", "nvfp4", "mxfp4") else "int4", group_size)
    speed = kv_speed_options(config, plan, gpu, int(decode["assumptions"]["tp"]), int(decode["kv_capacity_tokens"]),
                             max(1, int(decode["max_concurrent_requests"])), int(decode["context"]))
    return {**(kv_choice_record(layout, shipped, gpu_arch(gpu.key)) or {}), "speed": speed}
