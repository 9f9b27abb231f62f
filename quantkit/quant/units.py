"""Quantization units: the pieces of a model that a per-unit plan gives one format each.

Per decoder layer (MTP layers included):
- `layers.N.experts`: every routed expert's gate/up/down of one MoE layer. SGLang and vLLM require one scheme for
  all experts and all three projections of an MoE layer (`get_moe_scheme`: "All MoE projections need to have
  same quantization scheme"), so they are one unit.
- `layers.N.shared_experts`: the layer's shared experts (gate/up/down).
- `layers.N.mlp`: a dense layer's MLP (gate/up/down).
- `layers.N.attention`: the attention projections an engine can load quantized. GQA: q/k/v/o_proj. MLA (DeepSeek
  V3, Kimi K2, GLM-5): `q_b_proj` and `o_proj` only — SGLang loads `q_a_proj` and `kv_a_proj_with_mqa` fused
  (a WNA16 `weight_shape` fails to concatenate) and splits `kv_b_proj` into W_UK/W_UV from `.weight` at
  post-load (executed: tests/engines). `q_proj` of an MLA model without q_lora is left out too (not executed).
Everything else (embeddings, norms, routers, the DSA indexer, lm_head, the MTP layer's eh_proj / shared_head)
is not a unit: the recipe's roles decide it as before.

Units are listed from the family adapter's inventory, so they work on a config.json alone (the planner).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from quantkit.arch import Adapter, KVLayout, Role
from quantkit.quant.scheme import FP8_BLOCK, WeightFormat

if TYPE_CHECKING:
    import torch

__all__ = ["UNIT_KINDS", "UNIT_NAME", "Unit", "UnitKind", "list_units", "unit_name", "unit_of"]

UnitKind = Literal["experts", "shared_experts", "attention", "mlp"]
UNIT_KINDS: tuple[UnitKind, ...] = ("experts", "shared_experts", "attention", "mlp")
UNIT_NAME = re.compile(r"^layers\.(\d+)\.(experts|shared_experts|attention|mlp)$")

_KIND_OF_ROLE: dict[Role, UnitKind] = {Role.ROUTED_EXPERT: "experts", Role.SHARED_EXPERT: "shared_experts",
                                       Role.DENSE_MLP: "mlp", Role.ATTENTION: "attention"}
ROLE_OF_KIND: dict[UnitKind, Role] = {k: r for r, k in _KIND_OF_ROLE.items()}
_GQA_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLA_ATTENTION = ("q_b_proj", "o_proj")
_TENSOR_SUFFIX = re.compile(r"\.(weight|bias|weight_[a-z_]+|input_[a-z_]+)$")


@dataclass(frozen=True)
class Unit:
    """One quantization unit of a model: its weight matrices (shape -> count) and where it sits."""

    name: str  # "layers.3.experts"
    kind: UnitKind
    layer: int
    mtp: bool
    matrices: tuple[tuple[tuple[int, int], int], ...]  # ((out, in), how many), sorted

    @property
    def role(self) -> Role:
        return ROLE_OF_KIND[self.kind]

    @property
    def params(self) -> int:
        """Weights in the unit's matrices."""
        return sum(o * i * n for (o, i), n in self.matrices)

    def nbytes(self, fmt: WeightFormat, model_dtype: torch.dtype | None = None,
               fp8_block: tuple[int, int] = FP8_BLOCK) -> int:
        """Exact bytes the writer stores for the unit in `fmt` (tensor data)."""
        return sum(n * fmt.matrix_bytes(shape, model_dtype, fp8_block) for shape, n in self.matrices)


def unit_name(kind: UnitKind, layer: int) -> str:
    return f"layers.{layer}.{kind}"


def _attention_members(adapter: Adapter) -> tuple[str, ...]:
    return _GQA_ATTENTION if adapter.kv_layout == KVLayout.GQA else _MLA_ATTENTION


def unit_of(adapter: Adapter, name: str) -> str | None:
    """The unit a tensor (`...weight`, `...weight_packed`, `...weight_scale_inv`, ...) or module belongs to."""
    module = _TENSOR_SUFFIX.sub("", name)
    info = adapter.classify(module + ".weight")
    kind = _KIND_OF_ROLE.get(info.role)
    if kind is None or info.layer is None:
        return None
    if kind == "attention" and module.rsplit(".", 1)[-1] not in _attention_members(adapter):
        return None
    if kind == "experts" and not adapter.is_moe_layer(info.layer):
        return None
    return unit_name(kind, info.layer)


def list_units(adapter: Adapter) -> list[Unit]:
    """Every unit of the model the adapter describes, in layer order (experts, shared, attention / mlp)."""
    shapes: dict[str, Counter[tuple[int, int]]] = {}
    where: dict[str, tuple[UnitKind, int, bool]] = {}
    for spec in adapter.inventory():
        if not spec.name.endswith(".weight") or len(spec.shape) != 2:
            continue
        unit = unit_of(adapter, spec.name)
        if unit is None:
            continue
        kind = _KIND_OF_ROLE[spec.role]
        assert spec.layer is not None
        shapes.setdefault(unit, Counter())[(int(spec.shape[0]), int(spec.shape[1]))] += 1
        where[unit] = (kind, spec.layer, spec.mtp)
    order = {k: i for i, k in enumerate(UNIT_KINDS)}
    names = sorted(shapes, key=lambda u: (where[u][1], order[where[u][0]]))
    return [Unit(u, where[u][0], where[u][1], where[u][2], tuple(sorted(shapes[u].items()))) for u in names]
