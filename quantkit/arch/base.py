"""Tensor roles, name classification and the config-derived tensor inventory for MoE decoder families."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Literal

from quantkit.arch.families import WRAPPERS, Family, KVLayout, Wrapper, family_of_config
from quantkit.core.errors import QuantkitError
from quantkit.core.jsontypes import JSONObject

__all__ = ["Adapter", "IndexerRule", "Role", "TensorInfo", "TensorSpec", "get_adapter", "text_config"]

# Whose reading of the DSA indexer placement keys applies (see Adapter.has_indexer).
IndexerRule = Literal["transformers", "vllm"]


class Role(str, Enum):
    """What a tensor is for; recipes choose which roles to quantize."""

    EMBEDDING = "embedding"
    LM_HEAD = "lm_head"
    NORM = "norm"
    ATTENTION = "attention"
    INDEXER = "indexer"
    ROUTER = "router"
    ROUTED_EXPERT = "routed_expert"
    SHARED_EXPERT = "shared_expert"
    DENSE_MLP = "dense_mlp"
    MTP_OTHER = "mtp_other"
    OTHER = "other"


@dataclass(frozen=True)
class TensorInfo:
    """The classification of one tensor name."""

    role: Role
    layer: int | None = None
    expert: int | None = None
    mtp: bool = False


@dataclass(frozen=True)
class TensorSpec:
    """One tensor a release holds, as a logical (unquantized) weight."""

    name: str
    shape: tuple[int, ...]
    role: Role
    layer: int | None = None
    expert: int | None = None
    mtp: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.")
# MTP-only modules (DeepSeek V3 / GLM next-token-prediction layers).
_MTP_EXTRA = re.compile(r"^(embed_tokens|enorm|hnorm|eh_proj|shared_head\.(norm|head))\.")
_MTP_ROLES = {
    "embed_tokens": Role.EMBEDDING,
    "enorm": Role.NORM,
    "hnorm": Role.NORM,
    "eh_proj": Role.MTP_OTHER,
    "shared_head.norm": Role.NORM,
    "shared_head.head": Role.MTP_OTHER,
}


def text_config(config: JSONObject) -> JSONObject:
    """The language model's config (unwraps `text_config` of multimodal wrappers such as kimi_k25)."""
    if config.get("model_type") in WRAPPERS and isinstance(config.get("text_config"), dict):
        return config["text_config"]
    return config


def get_adapter(config: JSONObject) -> Adapter:
    """The adapter for a `config.json`; raises QuantkitError for an architecture quantkit does not know."""
    family, wrapper, text = family_of_config(config)
    return Adapter(text, family, wrapper)


class Adapter:
    """Names and shapes of one MoE decoder family, configured by its config.json."""

    def __init__(self, config: JSONObject, record: Family, wrapper: Wrapper | None = None) -> None:
        self.config = config
        self.record = record
        self.wrapper = wrapper
        self.family = record.name
        self.prefix = wrapper.prefix if wrapper else ""
        self.kv_layout: KVLayout = record.kv_layout
        self.num_layers: int = int(config["num_hidden_layers"])
        self.num_mtp_layers: int = int(config.get("num_nextn_predict_layers") or 0)

    # ---- classification -------------------------------------------------------------------------
    def classify(self, name: str) -> TensorInfo:
        """Role, layer and expert of a tensor name (quantized suffixes such as `.weight_packed` too)."""
        if self.prefix and name.startswith(self.prefix):
            name = name[len(self.prefix) :]
        elif self.prefix:
            return TensorInfo(Role.OTHER)  # vision tower, projector: not part of the language model
        if name.startswith("lm_head."):
            return TensorInfo(Role.LM_HEAD)
        if name.startswith("model.embed_tokens."):
            return TensorInfo(Role.EMBEDDING)
        if name.startswith("model.norm."):
            return TensorInfo(Role.NORM)
        match = _LAYER.match(name)
        if not match:
            return TensorInfo(Role.OTHER)
        layer, rest = int(match.group(1)), match.group(2)
        mtp = layer >= self.num_layers
        role, expert = _layer_role(rest)
        if mtp and _MTP_EXTRA.match(rest):
            role = _MTP_ROLES[rest.rsplit(".", 1)[0]]
        return TensorInfo(role, layer, expert, mtp)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has routed experts (MTP layers are MoE layers too)."""
        first_dense = int(self.config.get("first_k_dense_replace", 0) or 0)
        freq = int(self.config.get("moe_layer_freq", 1) or 1)
        return layer >= first_dense and (layer % freq == 0 or layer >= self.num_layers)

    # ---- what to quantize -----------------------------------------------------------------------
    def ignore_patterns(self, quantized_roles: set[Role]) -> list[str]:
        """compressed-tensors `ignore` entries covering every Linear module the recipe keeps."""
        rules = [
            (Role.LM_HEAD, "re:.*lm_head$"),
            (Role.ATTENTION, r"re:.*self_attn.*"),
            (Role.SHARED_EXPERT, r"re:.*shared_experts.*"),
            (Role.DENSE_MLP, r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"),
            (Role.ROUTER, r"re:.*mlp\.gate$"),
            (Role.MTP_OTHER, r"re:.*(eh_proj|shared_head\.head)$"),
        ]
        patterns = [pattern for role, pattern in rules if role not in quantized_roles]
        if Role.INDEXER in quantized_roles and Role.ATTENTION not in quantized_roles:
            raise QuantkitError("recipe: the DSA indexer can only be quantized together with attention")
        if self.wrapper:
            patterns += list(self.wrapper.kept_patterns)
        return patterns

    # ---- inventory from config.json -------------------------------------------------------------
    def inventory(self) -> list[TensorSpec]:
        """Every tensor a release of this config holds (logical shapes, MTP layers included)."""
        c = self.config
        hidden, vocab = int(c["hidden_size"]), int(c["vocab_size"])
        specs = [TensorSpec("model.embed_tokens.weight", (vocab, hidden), Role.EMBEDDING)]
        for layer in range(self.num_layers + self.num_mtp_layers):
            specs += self._layer_specs(layer)
        specs.append(TensorSpec("model.norm.weight", (hidden,), Role.NORM))
        if not c.get("tie_word_embeddings", False):
            specs.append(TensorSpec("lm_head.weight", (vocab, hidden), Role.LM_HEAD))
        return [TensorSpec(self.prefix + s.name, *_rest(s)) for s in specs] if self.prefix else specs

    def _layer_specs(self, layer: int) -> list[TensorSpec]:
        c = self.config
        hidden = int(c["hidden_size"])
        mtp = layer >= self.num_layers
        out: list[TensorSpec] = []

        def add(rest: str, shape: tuple[int, ...], role: Role, expert: int | None = None) -> None:
            out.append(TensorSpec(f"model.layers.{layer}.{rest}", shape, role, layer, expert, mtp))

        for rest, shape, role in self._attention_specs(layer):
            add(rest, shape, role)
        add("input_layernorm.weight", (hidden,), Role.NORM)
        add("post_attention_layernorm.weight", (hidden,), Role.NORM)
        if self.is_moe_layer(layer):
            n_experts, inter = int(c["n_routed_experts"]), int(c["moe_intermediate_size"])
            add("mlp.gate.weight", (n_experts, hidden), Role.ROUTER)
            if c.get("topk_method", "noaux_tc") == "noaux_tc":
                add("mlp.gate.e_score_correction_bias", (n_experts,), Role.ROUTER)
            for e in range(n_experts):
                for proj, shape in _mlp_shapes(hidden, inter):
                    add(f"mlp.experts.{e}.{proj}.weight", shape, Role.ROUTED_EXPERT, e)
            shared = int(c.get("n_shared_experts") or 0)
            for proj, shape in _mlp_shapes(hidden, inter * shared) if shared else []:
                add(f"mlp.shared_experts.{proj}.weight", shape, Role.SHARED_EXPERT)
        else:
            for proj, shape in _mlp_shapes(hidden, int(c["intermediate_size"])):
                add(f"mlp.{proj}.weight", shape, Role.DENSE_MLP)
        if mtp:
            vocab = int(c["vocab_size"])
            add("enorm.weight", (hidden,), Role.NORM)
            add("hnorm.weight", (hidden,), Role.NORM)
            add("eh_proj.weight", (hidden, 2 * hidden), Role.MTP_OTHER)
            add("shared_head.norm.weight", (hidden,), Role.NORM)
            if self.record.mtp_own_embedding:
                add("embed_tokens.weight", (vocab, hidden), Role.EMBEDDING)
                add("shared_head.head.weight", (vocab, hidden), Role.MTP_OTHER)
        return out

    def has_indexer(self, layer: int, rule: IndexerRule = "transformers") -> bool:
        """Whether decoder layer `layer` holds DSA indexer weights ("IndexShare": other layers reuse a top-k).

        `rule` is whose reading of config.json decides: transformers and SGLang take `indexer_types` when
        present, else derive it like vLLM, which reads only `index_topk_pattern` ("S" = shared) or
        `index_topk_freq` / `index_skip_topk_offset`. MTP layers always carry their own indexer.
        """
        if self.kv_layout != KVLayout.DSA:
            return False
        if layer >= self.num_layers:
            return True
        c = self.config
        types = c.get("indexer_types")
        if rule == "transformers" and isinstance(types, list):
            return not (layer < len(types) and types[layer] == "shared")
        pattern = c.get("index_topk_pattern")
        if pattern is not None:
            return not (layer < len(pattern) and pattern[layer] == "S")
        freq = max(int(c.get("index_topk_freq") or 1), 1)
        offset = int(c.get("index_skip_topk_offset", 2) or 0)
        return max(layer - offset + 1, 0) % freq == 0

    def indexer_layers(self, rule: IndexerRule = "transformers") -> list[int]:
        """The layers (MTP included) that hold indexer weights under `rule`."""
        return [i for i in range(self.num_layers + self.num_mtp_layers) if self.has_indexer(i, rule)]

    def _attention_specs(self, layer: int) -> list[tuple[str, tuple[int, ...], Role]]:
        c = self.config
        hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        a, n = "self_attn.", Role.NORM
        if self.kv_layout == KVLayout.GQA:
            head_dim = int(c.get("head_dim") or hidden // heads)
            kv_heads = int(c["num_key_value_heads"])
            specs = [
                (a + "q_proj.weight", (heads * head_dim, hidden), Role.ATTENTION),
                (a + "k_proj.weight", (kv_heads * head_dim, hidden), Role.ATTENTION),
                (a + "v_proj.weight", (kv_heads * head_dim, hidden), Role.ATTENTION),
                (a + "o_proj.weight", (hidden, heads * head_dim), Role.ATTENTION),
            ]
            if c.get("attention_bias"):
                specs += [
                    (a + "q_proj.bias", (heads * head_dim,), Role.ATTENTION),
                    (a + "k_proj.bias", (kv_heads * head_dim,), Role.ATTENTION),
                    (a + "v_proj.bias", (kv_heads * head_dim,), Role.ATTENTION),
                ]
            if c.get("use_qk_norm"):
                specs += [(a + "q_norm.weight", (head_dim,), n), (a + "k_norm.weight", (head_dim,), n)]
            return specs
        nope, rope, v_dim = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c["v_head_dim"])
        kv_lora, q_lora = int(c["kv_lora_rank"]), c.get("q_lora_rank")
        if q_lora:
            specs = [
                (a + "q_a_proj.weight", (int(q_lora), hidden), Role.ATTENTION),
                (a + "q_a_layernorm.weight", (int(q_lora),), n),
                (a + "q_b_proj.weight", (heads * (nope + rope), int(q_lora)), Role.ATTENTION),
            ]
        else:
            specs = [(a + "q_proj.weight", (heads * (nope + rope), hidden), Role.ATTENTION)]
        specs += [
            (a + "kv_a_proj_with_mqa.weight", (kv_lora + rope, hidden), Role.ATTENTION),
            (a + "kv_a_layernorm.weight", (kv_lora,), n),
            (a + "kv_b_proj.weight", (heads * (nope + v_dim), kv_lora), Role.ATTENTION),
            (a + "o_proj.weight", (hidden, heads * v_dim), Role.ATTENTION),
        ]
        if self.has_indexer(layer):
            ih, idim, i = int(c["index_n_heads"]), int(c["index_head_dim"]), a + "indexer."
            specs += [
                (i + "wq_b.weight", (ih * idim, int(q_lora)), Role.INDEXER),
                (i + "wk.weight", (idim, hidden), Role.INDEXER),
                (i + "k_norm.weight", (idim,), Role.INDEXER),
                (i + "k_norm.bias", (idim,), Role.INDEXER),
                (i + "weights_proj.weight", (ih, hidden), Role.INDEXER),
            ]
        return specs


def _mlp_shapes(hidden: int, inter: int) -> list[tuple[str, tuple[int, int]]]:
    return [("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))]


def _rest(spec: TensorSpec) -> tuple[tuple[int, ...], Role, int | None, int | None, bool]:
    return (spec.shape, spec.role, spec.layer, spec.expert, spec.mtp)


def _layer_role(rest: str) -> tuple[Role, int | None]:
    """Role of a name inside a decoder layer (`rest` = the part after `model.layers.N.`)."""
    if rest.startswith("self_attn.indexer."):
        return Role.INDEXER, None
    if rest.startswith("self_attn."):
        return (Role.NORM if "norm." in rest else Role.ATTENTION), None
    expert = _EXPERT.match(rest)
    if expert:
        return Role.ROUTED_EXPERT, int(expert.group(1))
    if rest.startswith("mlp.shared_experts."):
        return Role.SHARED_EXPERT, None
    if rest.startswith("mlp.gate."):
        return Role.ROUTER, None
    if rest.startswith("mlp."):
        return Role.DENSE_MLP, None
    if rest.endswith("layernorm.weight"):
        return Role.NORM, None
    return Role.OTHER, None
