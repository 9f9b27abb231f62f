"""What SGLang and vLLM do with a quantkit checkpoint: per-engine verdicts, launch args and the KV scale used.

Every rule below was read from the engines' released sources (the file and function are named next to
it) and is confirmed by `tests/engines/`, which executes that engine code — config parsing, scheme
selection, the shared-expert-fusion decision, `load_weights` name routing, KV-scale remapping — on
checkpoints quantkit generates. The rules work on `CheckpointFacts`, which come either from a written
checkpoint (its config and tensor names) or, for the planner, from a config and a recipe before anything
is converted; both paths give the same record.

A verdict is `loads`, `loads-with-warnings` (loads and serves correctly with the listed `args`; the notes
say what to know) or `fails` (the engine refuses the checkpoint or would silently mis-serve it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Literal

from quantkit.arch import Adapter, KVLayout, Role
from quantkit.core.jsontypes import JSONObject
from quantkit.engines.facts import (
    CheckpointFacts,
    facts_from_checkpoint,
    facts_from_recipe,
    kv_scale_names,
    read_checkpoint_facts,
    scheme_of_config,
)
from quantkit.engines.fp4 import FP4_GPUS, WeightScheme, fp4_sglang, fp4_vllm
from quantkit.engines.mixed import plan_refusals, sglang_moe_backend
from quantkit.quant.precision import PrecisionPlan
from quantkit.quant.scheme import FormatName

__all__ = [
    "ENGINES",
    "ENGINE_VERSIONS",
    "CheckpointFacts",
    "Engine",
    "EngineVerdict",
    "KVCacheUse",
    "WeightScheme",
    "Verdict",
    "engine_verdicts",
    "facts_from_checkpoint",
    "facts_from_recipe",
    "kv_scale_names",
    "launch_command",
    "read_checkpoint_facts",
    "scheme_of_config",
    "unloadable_roles",
]

Engine = Literal["sglang", "vllm"]
Verdict = Literal["loads", "loads-with-warnings", "fails"]
KVDtype = Literal["auto", "bfloat16", "fp8_e4m3", "fp8"]
KVScale = Literal["calibrated", "1.0", "none", "per-tile"]

ENGINES: tuple[Engine, ...] = ("sglang", "vllm")
ENGINE_VERSIONS: dict[Engine, str] = {"sglang": "0.5.23", "vllm": "0.33.0"}

# Roles a vLLM model builds without a quantizable Linear (so `<module>.weight_packed` has nowhere to go):
# lm_head is a ParallelLMHead, embeddings VocabParallelEmbedding, the router a GateLinear, the indexer's
# fused wk_weights_proj gets quant_config=None, the MTP eh_proj/shared_head an nn.Linear
# (deepseek_v2.py, deepseek_mtp.py; AutoWeightsLoader: "no module or parameter named ...weight_packed").
_VLLM_UNQUANTIZED = {
    Role.LM_HEAD: "ParallelLMHead",
    Role.EMBEDDING: "VocabParallelEmbedding",
    Role.ROUTER: "GateLinear",
    Role.INDEXER: "the indexer's fused wk_weights_proj (quant_config=None)",
    Role.MTP_OTHER: "the MTP layer's nn.Linear eh_proj / shared_head",
}
# SGLang's and vLLM's MLA attention post-process kv_b_proj.weight (split into W_UK / W_UV) as BF16.
_MLA_UNQUANTIZED = {Role.ATTENTION: "MLA attention (kv_b_proj.weight is split into W_UK/W_UV at load)"}

_SGLANG_SERVER = "python -m sglang.launch_server"
_VLLM_SERVER = "vllm serve"


@dataclass(frozen=True)
class KVCacheUse:
    """What KV cache an engine will really run for a checkpoint launched with the recorded args."""

    dtype: KVDtype  # the --kv-cache-dtype the args set ("auto" = model dtype unless the config says FP8)
    scale: KVScale  # calibrated (checkpoint scales applied), 1.0 (FP8 without them), none (BF16), per-tile
    detail: str
    attention_backend: str = "engine default"  # the backend that applies it (quantkit/engines/kv_backends.py)


@dataclass
class EngineVerdict:
    """One engine's verdict on one checkpoint."""

    engine: Engine
    version: str
    verdict: Verdict
    args: list[str]
    kv_cache: KVCacheUse
    notes: list[str] = field(default_factory=list)  # what to know (optional flags, how a decision was made)
    warnings: list[str] = field(default_factory=list)  # it serves, with a limitation the user must know
    problems: list[str] = field(default_factory=list)  # it fails to load or would silently mis-serve
    launch: list[str] = field(default_factory=list)
    ignored_tensors: list[str] = field(default_factory=list)  # checkpoint tensors the engine skips by design
    gpus: dict[str, str] = field(default_factory=dict)  # GPU generation -> what the engine really runs (FP4)

    def to_dict(self) -> JSONObject:
        return asdict(self)


def unloadable_roles(adapter: Adapter, roles: Iterable[Role]) -> dict[Role, str]:
    """Roles a recipe asks to quantize that an engine builds unquantized -> why (engine and module class)."""
    rules = dict(_VLLM_UNQUANTIZED)
    if adapter.kv_layout in (KVLayout.MLA, KVLayout.DSA):
        rules.update(_MLA_UNQUANTIZED)
    out = {}
    for role in roles:
        if role in rules:
            engine = "SGLang and vLLM" if role in _MLA_UNQUANTIZED else f"vLLM {ENGINE_VERSIONS['vllm']}"
            out[role] = f"{engine} build {rules[role]} unquantized and cannot load it as INT4"
    return out


def _has_scales(facts: CheckpointFacts, suffixes: tuple[str, ...]) -> bool:
    return any(n.endswith(suffixes) for n in facts.kv_scale_names)


# ---- rules ------------------------------------------------------------------------------------------
def _common_problems(facts: CheckpointFacts, engine: Engine) -> list[str]:
    problems = []
    roles = facts.roles_outside_units if facts.units else facts.quantized_roles  # units: quantkit/quant/units.py
    for role, why in unloadable_roles(facts.adapter, roles).items():
        if engine == "vllm" or role in _MLA_UNQUANTIZED:
            problems.append(f"{role.value} is quantized: {why}")
    return problems


def _sglang(facts: CheckpointFacts) -> EngineVerdict:
    a, q = facts.adapter, facts.adapter.record.quirks
    args: list[str] = []
    notes: list[str] = []
    warnings: list[str] = []
    problems = _common_problems(facts, "sglang")
    if facts.units:
        _mixed_sglang(facts, args, notes, problems)
    elif facts.quantized and facts.scheme != "w4a16":
        notes += fp4_sglang(facts.scheme, problems)
    elif facts.quantized:
        # WNA16 MoE: Marlin is the Hopper kernel; the Triton WNA16 MoE accepts group 32 and 128 only
        # (layers/moe/... _is_wna16_triton_moe_supported) and raises for 64.
        args += ["--moe-runner-backend", "marlin"]
        if facts.group_size == 64:
            warnings.append("group 64: --moe-runner-backend triton raises in SGLang (its WNA16 Triton MoE takes "
                         "groups 32 and 128); keep marlin")
    shared = int(a.config.get("n_shared_experts") or 0)
    if q.sglang_fuses_shared_experts and shared and facts.quantized and Role.SHARED_EXPERT not in facts.quantized_roles:
        # glm4_moe.py: shared_experts_fusion_disable_reason refuses fusion only for w4afp8, so
        # resolve_shared_experts_config fuses; load_weights then renames shared_experts.* to the fused
        # expert slot, `w13_weight`, which a WNA16 MoE layer does not have: the tensors are dropped silently.
        args.append("--disable-shared-experts-fusion")
        notes.append("BF16 shared experts next to INT4 routed experts: shared-expert fusion must be off, or "
                     "SGLang drops the shared experts without a warning")
    # KV cache (mem_cache/kv_cache_dtype.py: configure_kv_cache_dtype: with "auto", a compressed-tensors
    # kv_cache_scheme makes the cache FP8 whether or not any scale loaded).
    if a.kv_layout == KVLayout.DSA:
        kv = KVCacheUse("auto", "per-tile", "DSA: the engine computes FP8 tile scales itself; no checkpoint scales",
                        "DSA default (FP8: flashmla_kv on SM90, trtllm on SM100)")
        notes.append("Blackwell: SGLang's FP8 DSA default (trtllm) stores raw 576 B rows, measured above the KV "
                     "rule's threshold against flashmla_kv's per-tile rows (docs/serving.md): add "
                     "--dsa-prefill-backend flashmla_kv --dsa-decode-backend flashmla_kv there")
        if facts.kv_cache_scheme:
            problems.append("kv_cache_scheme on a DSA model switches SGLang to FP8 KV with no scale to apply")
    elif not facts.kv_cache_scheme:
        kv = KVCacheUse("auto", "none", "BF16 KV cache (no kv_cache_scheme)")
        if facts.kv_scale_names:
            warnings.append("KV scales present without kv_cache_scheme: SGLang ignores them")
    elif a.kv_layout == KVLayout.MLA:
        if _has_scales(facts, ("k_proj.k_scale", "attn_mqa.k_scale")):
            kv = _sglang_mla_scales(facts, args, notes, warnings)
        else:
            # deepseek_weight_loader.py: do_load_weights remaps only k_proj/v_proj scale names.
            kv = KVCacheUse("fp8_e4m3", "1.0", "self_attn.k_scale is not a name SGLang loads: KV silently FP8 "
                            "at scale 1.0", "SGLang default (fa3 on SM90, trtllm_mla on SM100)")
            problems.append("MLA KV scales under names SGLang skips while kv_cache_scheme switches it to FP8 KV "
                            "at scale 1.0 (convert again with this quantkit version, which writes both spellings)")
    else:  # GQA
        if not q.sglang_loads_kv_scales and facts.kv_scale_mode == "unit":
            # unscaled GLM-4.x KV: the scale SGLang applies without loading one (1.0) is the checkpoint's
            args += ["--kv-cache-dtype", "fp8_e4m3"]
            kv = KVCacheUse("fp8_e4m3", "1.0", "FP8 KV at scale 1.0: the checkpoint's KV scales are 1.0 (chosen by "
                            "measurement, docs/serving.md) and SGLang, which loads none for this family, applies 1.0")
        elif not q.sglang_loads_kv_scales:
            # glm4_moe.py: Glm4MoeAttention builds RadixAttention without quant_config: no k_scale parameter.
            args += ["--kv-cache-dtype", "bfloat16"]
            kv = KVCacheUse("bfloat16", "none", "SGLang cannot load this family's GQA KV scales; "
                            "--kv-cache-dtype bfloat16 keeps kv_cache_scheme from switching to FP8 at scale 1.0")
            warnings.append("calibrated KV scales are used by vLLM only; SGLang serves BF16 KV "
                         "(--kv-cache-dtype fp8_e4m3 would run FP8 at scale 1.0)")
        else:
            args += ["--kv-cache-dtype", "fp8_e4m3"]
            kv = KVCacheUse("fp8_e4m3", "calibrated", "FP8 KV with calibrated K and V scales")
    problems += _indexer_problems(facts, "transformers", "SGLang (indexer_types, else index_topk_*)")
    if a.kv_layout == KVLayout.MLA:  # transformers' spelling; SGLang reads the k_proj/v_proj one
        ignored = [n for n in facts.kv_scale_names if n.endswith(("self_attn.k_scale", "self_attn.v_scale"))]
    else:
        ignored = [] if q.sglang_loads_kv_scales else list(facts.kv_scale_names)
    if facts.mtp_present and a.record.mtp_own_embedding:
        # deepseek_weight_loader.py (NextN): "Use shared head and embed weights from target model"
        ignored += [f"{a.prefix}model.layers.{layer}.{t}.weight" for layer in range(a.num_layers, a.num_layers
                    + a.num_mtp_layers) for t in ("embed_tokens", "shared_head.head")]
        notes.append("the NextN draft shares the target's embed_tokens and lm_head; the MTP layer's own copies "
                     "are not read")
    if facts.mtp_present and a.wrapper is not None:
        warnings.append(f"SGLang has no NextN draft for {a.wrapper.architecture}: the MTP layer cannot be served")
    elif facts.mtp_present:
        notes.append("MTP layer present: add --speculative-algorithm NEXTN for speculative decoding")
    return _verdict("sglang", args, kv, notes, warnings, problems, ignored, facts.scheme)


def _sglang_mla_scales(facts: CheckpointFacts, args: list[str], notes: list[str],
                       warnings: list[str]) -> KVCacheUse:
    """MLA with KV scales SGLang loads: the backend that applies them as the record says (kv_choice.py).

    Calibrated: the MLA pool writes with a plain cast; only triton divides by k_scale on write and multiplies on
    read (flashmla, trtllm_mla, cutedsl_mla read x k_scale only; fa3, flashinfer ignore it; kv_backends.py) --
    and triton divides only on its MLA paths: a fresh prompt prefilled eagerly takes the MHA path, which writes
    a plain cast (executed: tests/engines/test_kv_kl.py). Unit (every scale 1.0): every backend is consistent,
    the fastest one is pinned."""
    from quantkit.engines.kv_choice import MEASURED, UNIT_BACKEND, sglang_mla_backend

    backend = sglang_mla_backend(facts.kv_scale_mode, "sm90")
    if facts.kv_scale_mode == "unit":
        args += ["--kv-cache-dtype", "fp8_e4m3", "--attention-backend", backend, "--page-size", "64"]
        notes.append(f"--attention-backend {backend} --page-size 64 is pinned: the checkpoint's KV scales are 1.0, "
                     "which every SGLang MLA backend applies consistently, and the planner's attention term ranks "
                     f"it fastest on Hopper (Blackwell: {UNIT_BACKEND['sm100']}); fa3 and flashinfer convert the "
                     "whole FP8 pool to BF16 on every layer (sglang#35291); docs/serving.md")
        return KVCacheUse("fp8_e4m3", "1.0", "FP8 KV at scale 1.0: the checkpoint ships KV scales of 1.0, chosen by "
                          "measurement (docs/serving.md, quantkit/engines/kv_choice.py)", backend)
    args += ["--kv-cache-dtype", "fp8_e4m3", "--attention-backend", backend]
    notes.append(f"--attention-backend {backend} is pinned: SGLang's MLA defaults read FP8 KV x k_scale without "
                 "dividing on write (flashmla, trtllm_mla, cutedsl_mla) or ignore the scale (fa3, flashinfer)")
    eager = MEASURED.get(KVLayout.MLA)
    measured = (f" (measured on the tiny MLA model: KL {eager.kl_eager:.2e}, {eager.kl_eager / eager.kl_int4:.0f}x "
                "the INT4 weights' own)") if eager and eager.kl_eager and eager.kl_int4 else ""
    warnings.append("calibrated MLA KV scales are applied consistently only to prompts SGLang prefills inside its "
                    "breakable prefill CUDA graph (its MLA path divides by k_scale); a fresh prompt prefilled "
                    "eagerly (a batch over the captured token buckets, logprob requests, --disable-cuda-graph, "
                    "pp / dcp / two-batch overlap) takes the MHA path, which writes a plain cast that the decode "
                    f"then reads x k_scale{measured}; --enable-deterministic-inference forces the MLA path, or "
                    "convert with --kv-scales unit (docs/serving.md)")
    return KVCacheUse("fp8_e4m3", "calibrated", "FP8 KV with the calibrated per-layer scale "
                      f"(self_attn.k_proj.k_scale -> attn_mqa.k_scale), applied on write and read by "
                      f"--attention-backend {backend}", backend)


def _vllm(facts: CheckpointFacts) -> EngineVerdict:
    a, q = facts.adapter, facts.adapter.record.quirks
    args: list[str] = []
    notes: list[str] = []
    warnings: list[str] = []
    problems = _common_problems(facts, "vllm")
    if facts.units:
        _mixed_vllm(facts, notes, problems)
    elif facts.quantized and facts.scheme != "w4a16":
        notes += fp4_vllm(facts.scheme, warnings)
    if not facts.kv_scale_names:
        kv = KVCacheUse("auto", "per-tile" if a.kv_layout == KVLayout.DSA else "none",
                        "BF16 KV cache" if a.kv_layout != KVLayout.DSA else "DSA: engine-side FP8 tile scales")
    elif not q.vllm_applies_kv_scales:
        # MLAAttention is not an Attention subclass: get_quant_method gives it no KV method and
        # weight_utils.maybe_remap_kv_scale_name returns None, so the scales are skipped.
        sat = facts.kv_saturation_at_1
        at_one = f"; at scale 1.0 the worst layer saturates {sat:.4%} of values" if sat is not None else ""
        kv = KVCacheUse("auto", "none", "vLLM's MLA ignores checkpoint KV scales: BF16 KV by default; "
                        f"--kv-cache-dtype fp8 would use scale 1.0{at_one}",
                        "vLLM's MLA default (every MLA backend reads _k_scale = 1.0)")
        warnings.append("calibrated KV scales are not applied by vLLM for MLA (kept for SGLang and transformers)")
    elif facts.kv_cache_scheme:
        args += ["--kv-cache-dtype", "fp8"]
        kv = (KVCacheUse("fp8", "1.0", "FP8 KV with the checkpoint's K and V scales of 1.0 (chosen by measurement, "
                         "docs/serving.md)") if facts.kv_scale_mode == "unit" else
              KVCacheUse("fp8", "calibrated", "FP8 KV with calibrated K and V scales (self_attn.attn.k_scale)"))
    else:
        kv = KVCacheUse("auto", "none", "KV scales present without kv_cache_scheme: vLLM creates no KV method")
        warnings.append(kv.detail)
    problems += _indexer_problems(facts, "vllm", "vLLM (index_topk_pattern / index_topk_freq)")
    ignored = [] if q.vllm_applies_kv_scales else list(facts.kv_scale_names)
    if facts.mtp_present and a.wrapper is not None:
        warnings.append(f"vLLM has no MTP draft for {a.wrapper.architecture} (Unsupported speculative method "
                        "'mtp'): the MTP layer cannot be served")
    elif facts.mtp_present:
        notes.append('MTP layer present: add --speculative-config \'{"method": "mtp", "num_speculative_tokens": 1}\'')
    return _verdict("vllm", args, kv, notes, warnings, problems, ignored, facts.scheme)


def _mixed_sglang(facts: CheckpointFacts, args: list[str], notes: list[str], problems: list[str]) -> None:
    """A per-unit output in SGLang: the one `--moe-runner-backend` every MoE layer's scheme runs under, the
    shared-expert fusion a family must keep off, and the plan's refusals (quantkit/engines/mixed.py)."""
    plan, formats = _plan(facts)
    backend = sglang_moe_backend(plan)
    args += ["--moe-runner-backend", backend]
    if backend == "auto":
        notes.append("FP8-block MoE layers: --moe-runner-backend auto (WNA16 layers on Marlin, FP8 on Triton on "
                     "SM90); under marlin an FP8 MoE layer gets no runner")
    shared = int(facts.adapter.config.get("n_shared_experts") or 0)
    fuses = facts.adapter.record.quirks.sglang_fuses_shared_experts
    if fuses and shared and Role.SHARED_EXPERT in facts.quantized_roles:  # else the uniform rule below adds it
        # glm4_moe.py fuses the shared experts into the routed MoE layer, whose scheme is the routed experts'
        args.append("--disable-shared-experts-fusion")
        notes.append("per-unit formats: shared-expert fusion off (a fused shared expert would take the routed "
                     "experts' scheme)")
    problems += _unknown_formats(formats) + [r.line().split(": ", 1)[1] for r in plan_refusals(
        plan, facts.adapter, ("sglang",))]
    notes.append(f"per-unit formats: {_format_counts(formats)}")


def _mixed_vllm(facts: CheckpointFacts, notes: list[str], problems: list[str]) -> None:
    """A per-unit output in vLLM (its default MoE backend runs WNA16 4/8-bit and FP8-block MoE layers)."""
    plan, formats = _plan(facts)
    problems += _unknown_formats(formats) + [r.line().split(": ", 1)[1] for r in plan_refusals(
        plan, facts.adapter, ("vllm",))]
    notes.append(f"per-unit formats: {_format_counts(formats)}")


def _plan(facts: CheckpointFacts) -> tuple[PrecisionPlan, dict[str, FormatName | None]]:
    formats = dict(facts.units)
    return PrecisionPlan(units={u: f for u, f in formats.items() if f is not None}), formats


def _unknown_formats(formats: dict[str, FormatName | None]) -> list[str]:
    return [f"unit {u}: its config group is not a format quantkit writes" for u, f in formats.items() if f is None]


def _format_counts(formats: dict[str, FormatName | None]) -> str:
    counts: dict[str, int] = {}
    for f in formats.values():
        counts[str(f)] = counts.get(str(f), 0) + 1
    return ", ".join(f"{n} x {f}" for f, n in counts.items())


def _indexer_problems(facts: CheckpointFacts, rule: Literal["transformers", "vllm"], who: str) -> list[str]:
    """The engine builds an indexer exactly where its placement rule says; one without weights is garbage."""
    a = facts.adapter
    if a.kv_layout != KVLayout.DSA:
        return []
    expected = set(a.indexer_layers(rule))
    if not facts.mtp_present:
        expected = {i for i in expected if i < a.num_layers}
    present = set(facts.indexer_layers)
    problems = []
    if expected - present:
        problems.append(f"{who} builds DSA indexers in layers {sorted(expected - present)[:6]} whose weights "
                        "the checkpoint lacks (left uninitialised); config and tensors disagree")
    if present - expected:
        problems.append(f"indexer weights of layers {sorted(present - expected)[:6]} have no indexer in {who}")
    return problems


def _verdict(engine: Engine, args: list[str], kv: KVCacheUse, notes: list[str], warnings: list[str],
             problems: list[str], ignored: list[str], scheme: WeightScheme = "w4a16") -> EngineVerdict:
    verdict: Verdict = "fails" if problems else ("loads-with-warnings" if warnings else "loads")
    return EngineVerdict(engine, ENGINE_VERSIONS[engine], verdict, args, kv, notes, warnings, problems,
                         [launch_command(engine, args)], sorted(ignored), dict(FP4_GPUS[engine].get(scheme, {})))


def launch_command(engine: Engine, args: list[str], model: str = "<MODEL>", tp: int = 8,
                   extra: list[str] | None = None) -> str:
    """The server command line for one engine: the model, tensor parallelism, the checkpoint's args."""
    if engine == "sglang":
        parts = [_SGLANG_SERVER, "--model-path", model, "--tp-size", str(tp)]
    else:
        parts = [_VLLM_SERVER, model, "--tensor-parallel-size", str(tp)]
    return " ".join(parts + list(extra or []) + list(args))


def engine_verdicts(facts: CheckpointFacts, engines: Iterable[Engine] = ENGINES) -> dict[Engine, EngineVerdict]:
    """Each engine's verdict, args and KV-cache use for a checkpoint."""
    rules = {"sglang": _sglang, "vllm": _vllm}
    return {e: rules[e](facts) for e in engines}
