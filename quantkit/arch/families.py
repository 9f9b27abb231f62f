"""One record per model family: every fact quantkit holds about an architecture, in one place.

A family is a set of model types that share tensor names and a decoder layer. Its record says which
transformers classes run it (calibration), its default recipe per model type, its KV-cache layout, how
its MTP layer is laid out, what the serving engines do differently for it (the quirks found by executing
their loader code, see docs/engines.md) and the shape of the synthetic model the tests generate.
Adding a family is one `Family(...)` here plus its tests; everything else looks the record up.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from quantkit.core.errors import QuantkitError
from quantkit.core.jsontypes import JSONObject

__all__ = [
    "FAMILIES",
    "WRAPPERS",
    "Family",
    "KVLayout",
    "TransformersClasses",
    "Wrapper",
    "family_for",
    "family_of_config",
]


SynthConfig = dict[str, int | float | str | bool]  # config.json keys of a synthetic model


class KVLayout(str, Enum):
    """What one token of KV cache is for a family (and so what an FP8 KV scale means)."""

    MLA = "mla"  # one compressed latent (kv_lora_rank) + the rope key, shared by K and V
    DSA = "dsa"  # MLA plus the sparse-attention indexer's own key cache
    GQA = "gqa"  # per-head K and V

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class TransformersClasses:
    """Where transformers implements the family (used by layer-by-layer calibration)."""

    module: str  # transformers.models.<module>.modeling_<module>
    decoder_layer: str
    rotary: str


@dataclass(frozen=True)
class EngineQuirks:
    """What SGLang / vLLM do differently for this family (each entry names the engine source that decides it)."""

    # SGLang turns shared-expert fusion on for W4A16 and then renames `shared_experts.*` to the fused expert
    # slot, which a WNA16 MoE layer cannot load (glm4_moe.py: shared_experts_fusion_disable_reason).
    sglang_fuses_shared_experts: bool = False
    # SGLang builds the attention's RadixAttention with quant_config, so a k_scale parameter exists.
    sglang_loads_kv_scales: bool = True
    # vLLM's attention for the family is an `Attention` (gets the compressed-tensors KV method);
    # MLAAttention is not, so checkpoint KV scales have no effect there.
    vllm_applies_kv_scales: bool = True
    # SGLang's MoE block reads `shared_experts.gate_up_proj.weight.dtype` when the shared experts are not fused
    # (glm4_moe.py: Glm4MoeSparseMoeBlock.__init__): pack-quantized (INT) shared experts have no `.weight` there.
    sglang_int_shared_experts_fail: bool = False


@dataclass(frozen=True)
class Family:
    """The facts about one architecture family."""

    name: str  # tensor-name family and transformers model_type of the text model
    model_types: tuple[str, ...]  # text-model `model_type`s served by this record
    architecture: str  # `architectures[0]` of a release (and of the synthetic model)
    transformers: TransformersClasses
    default_recipes: dict[str, str]  # model_type -> preset in recipes/
    kv_layout: KVLayout
    mtp_own_embedding: bool  # MTP layers carry their own embed_tokens and shared_head.head
    quirks: EngineQuirks
    # config.json keys of the synthetic model beyond the common ones, from (hidden, heads) and the keys the
    # caller sets itself (a dimension derived from one of those follows it)
    synth: Callable[[int, int, Mapping[str, object]], SynthConfig] = field(repr=False)
    description: str = ""


@dataclass(frozen=True)
class Wrapper:
    """A multimodal release whose language model sits under a name prefix (vision tower kept as is)."""

    model_type: str
    prefix: str
    architecture: str
    default_recipe: str
    kept_patterns: tuple[str, ...]  # ignore entries for the non-language modules


# Keys every DeepSeek-V3 / Kimi K2 / GLM-5 release config.json carries and SGLang reads, but that
# transformers' config classes do not keep in a generated config (values as released).
_DEEPSEEK_RELEASE_KEYS = dict(moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid", ep_size=1)


def _mla_synth(hidden: int, heads: int, given: Mapping[str, object]) -> SynthConfig:
    head = hidden // heads
    return dict(q_lora_rank=hidden // 2, kv_lora_rank=hidden // 2, qk_nope_head_dim=head, qk_rope_head_dim=head // 2,
                v_head_dim=head, num_key_value_heads=heads, **_DEEPSEEK_RELEASE_KEYS)


def _dsa_synth(hidden: int, heads: int, given: Mapping[str, object]) -> SynthConfig:
    mla = _mla_synth(hidden, heads, given)
    # The indexer rotates the first qk_rope_head_dim values of its head, so its head is wider than the rope
    # part: GLM-5.x releases carry 128 vs 64 (twice). hidden // 2 where that is wider (the sizes' old shape).
    rope = given.get("qk_rope_head_dim", mla["qk_rope_head_dim"])
    if not isinstance(rope, int):
        raise QuantkitError(f"synthetic config: qk_rope_head_dim must be an integer, not {rope!r}")
    return dict(mla, index_n_heads=2, index_head_dim=max(hidden // 2, 2 * rope), index_topk=16,
                indexer_rope_interleave=True, rope_interleave=True)


def _gqa_synth(hidden: int, heads: int, given: Mapping[str, object]) -> SynthConfig:
    return dict(num_key_value_heads=max(1, heads // 2), head_dim=hidden // heads, partial_rotary_factor=0.5,
                use_qk_norm=True, attention_bias=True)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            name="deepseek_v3",
            model_types=("deepseek_v3", "kimi_k2"),
            architecture="DeepseekV3ForCausalLM",
            transformers=TransformersClasses("deepseek_v3", "DeepseekV3DecoderLayer", "DeepseekV3RotaryEmbedding"),
            default_recipes={"deepseek_v3": "deepseek-v3-w4a16-g32", "kimi_k2": "kimi-k2-w4a16-g32"},
            kv_layout=KVLayout.MLA,
            mtp_own_embedding=True,
            quirks=EngineQuirks(vllm_applies_kv_scales=False),
            synth=_mla_synth,
            description="DeepSeek V3/R1, Kimi K2.x: MLA attention",
        ),
        Family(
            name="glm_moe_dsa",
            model_types=("glm_moe_dsa",),
            architecture="GlmMoeDsaForCausalLM",
            transformers=TransformersClasses("glm_moe_dsa", "GlmMoeDsaDecoderLayer", "GlmMoeDsaRotaryEmbedding"),
            default_recipes={"glm_moe_dsa": "glm5-w4a16-g32"},
            kv_layout=KVLayout.DSA,
            mtp_own_embedding=False,
            quirks=EngineQuirks(vllm_applies_kv_scales=False),
            synth=_dsa_synth,
            description="GLM-5.x: MLA attention plus the DSA indexer",
        ),
        Family(
            name="glm4_moe",
            model_types=("glm4_moe",),
            architecture="Glm4MoeForCausalLM",
            transformers=TransformersClasses("glm4_moe", "Glm4MoeDecoderLayer", "Glm4MoeRotaryEmbedding"),
            default_recipes={"glm4_moe": "glm4-w4a16-g32"},
            kv_layout=KVLayout.GQA,
            mtp_own_embedding=False,
            quirks=EngineQuirks(sglang_fuses_shared_experts=True, sglang_loads_kv_scales=False,
                                sglang_int_shared_experts_fail=True),
            synth=_gqa_synth,
            description="GLM-4.5 .. 4.7: GQA attention with qk-norm",
        ),
    )
}

WRAPPERS: dict[str, Wrapper] = {
    "kimi_k25": Wrapper(
        model_type="kimi_k25",
        prefix="language_model.",
        architecture="KimiK25ForConditionalGeneration",
        default_recipe="kimi-k2-w4a16-g32",
        kept_patterns=(r"re:.*vision_tower.*", r"re:.*mm_projector.*"),
    ),
}


def family_for(model_type: str | None) -> Family:
    """The record serving a text-model `model_type`; QuantkitError for one quantkit does not know."""
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    known = ", ".join(sorted([*(t for f in FAMILIES.values() for t in f.model_types), *WRAPPERS]))
    raise QuantkitError(f"config.json: unsupported model_type {model_type!r} (supported: {known})")


def family_of_config(config: JSONObject) -> tuple[Family, Wrapper | None, JSONObject]:
    """(family, wrapper or None, text-model config) of a `config.json`."""
    wrapper = WRAPPERS.get(str(config.get("model_type")))
    text = config.get("text_config") if wrapper is not None else config
    if not isinstance(text, dict):
        raise QuantkitError(f"config.json: model_type {config.get('model_type')!r} needs a text_config object")
    return family_for(text.get("model_type")), wrapper, text
