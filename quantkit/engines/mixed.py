"""What SGLang 0.5.23 and vLLM 0.33.0 load of a per-unit (mixed) precision plan, as rules on the plan.

Executed in tests/engines (test_mixed.py runs both engines' loader code on mixed outputs quantkit writes); the
findings (docs/mixed-precision.md):
- Per-layer `config_groups` with `re:` targets are honoured per layer by both engines
  (`CompressedTensorsConfig.get_scheme_dict` -> `find_matched_target`); one scheme per MoE layer is guaranteed by
  the units (`get_moe_scheme`: "All MoE projections need to have same quantization scheme").
- INT4 / INT8 W*A16 groups (g32 / g64 / g128) mix freely under SGLang's Marlin (`--moe-runner-backend marlin` or
  `auto`) and vLLM's default; SGLang's Triton WNA16 MoE takes INT4 g32 / g128 only (not pinned).
- A kept unit must be in `ignore`: SGLang raises "Unable to find matching target" for a Linear no group matches.
- FP8-block groups: compressed-tensors writes the top-level format `mixed-precision`, and SGLang's
  `CompressedTensorsWNA16MoE.__init__` checks the top-level format, so quantkit writes `pack-quantized` with the
  per-group formats kept (vLLM reads the group's format either way). An FP8-block MoE layer gets no runner
  under `--moe-runner-backend marlin` (`CompressedTensorsW8A8Fp8MoE.create_moe_runner`): such plans pin `auto`.
- An FP8-block group also targets `Linear`: SGLang's merged FP8 Linears (a dense MLP's or shared experts'
  `gate_up_proj`) read their block from `weight_block_size`, which looks only at the `Linear` target (executed:
  without it, `TypeError` in linear.py weight_loader_v2).
- GLM-4.x in SGLang: `Glm4MoeSparseMoeBlock.__init__` reads `shared_experts.gate_up_proj.weight` — INT shared
  experts fail (executed: AttributeError); FP8-block or BF16 shared experts load.
- FP4 groups beside INT / FP8 groups: the top-level format would be `mixed-precision` again, and SGLang's
  NVFP4 MoE scheme selection reads the top-level format too; not executed, so refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from quantkit.arch import Adapter
from quantkit.core.errors import QuantkitError
from quantkit.quant.precision import PrecisionPlan, resolve_precision
from quantkit.quant.recipe import Recipe
from quantkit.quant.scheme import FORMATS, FormatName
from quantkit.quant.units import Unit

__all__ = ["Refusal", "candidate_formats", "check_plan_loadable", "plan_refusals", "sglang_moe_backend",
           "top_level_format"]

Engine = Literal["sglang", "vllm"]
MoeBackend = Literal["marlin", "auto"]


@dataclass(frozen=True)
class Refusal:
    """One engine refusing one unit of a plan, and the rule (engine file and function) that decides it."""

    engine: Engine
    unit: str
    rule: str

    def line(self) -> str:
        return f"{self.engine}: unit {self.unit}: {self.rule}"


def sglang_moe_backend(plan: PrecisionPlan) -> MoeBackend:
    """The `--moe-runner-backend` SGLang runs every MoE layer of the plan under: `marlin` (WNA16 on Hopper, as
    for uniform INT4), `auto` when an MoE layer is FP8-block (Marlin builds no FP8 MoE runner; auto gives
    WNA16 -> Marlin and FP8 -> Triton on SM90)."""
    fp8_moe = any(FORMATS[f].kind == "fp8" for u, f in plan.units.items() if u.endswith(".experts"))
    return "auto" if fp8_moe else "marlin"


def top_level_format(plan: PrecisionPlan, uniform_ct_format: str | None) -> str | None:
    """The top-level `format` quantkit writes: the one group format, or `pack-quantized` for an INT + FP8 mix."""
    formats = {FORMATS[f].ct_format for f in plan.units.values()} - {None}
    if uniform_ct_format is not None:
        formats.add(uniform_ct_format)  # type: ignore[arg-type]
    if not formats:
        return None
    if len(formats) == 1:
        return next(iter(formats))
    return "pack-quantized"


def plan_refusals(plan: PrecisionPlan, adapter: Adapter, engines: tuple[Engine, ...] = ("sglang", "vllm"),
                  uniform: FormatName | None = None) -> list[Refusal]:
    """Each engine's refusals of `plan` (empty: both load it). `uniform` is the format of quantized non-unit
    tensors (a recipe quantizing e.g. lm_head), which shares the config with the units."""
    out: list[Refusal] = []
    names = list(plan.units.values()) + ([uniform] if uniform else [])
    kinds = {FORMATS[f].kind for f in names}
    if "fp4" in kinds and kinds & {"int", "fp8"}:
        fp4_unit = next(u for u, f in plan.units.items() if FORMATS[f].kind == "fp4")
        for engine in engines:
            out.append(Refusal(engine, fp4_unit, "FP4 units beside INT / FP8 units: the top-level format is "
                               "`mixed-precision`, which SGLang's MoE schemes refuse (compressed_tensors_wNa16_moe.py "
                               "__init__); the mix is not verified in either engine"))
    for unit, name in plan.units.items():
        if not FORMATS[name].mixable:
            out += [Refusal(e, unit, f"{name} is a uniform-recipe format only") for e in engines]
        elif (unit.endswith(".shared_experts") and FORMATS[name].kind == "int" and "sglang" in engines
              and adapter.record.quirks.sglang_int_shared_experts_fail):
            out.append(Refusal("sglang", unit, _INT_SHARED))
    return out


_INT_SHARED = ("INT shared experts fail in SGLang for this family: Glm4MoeSparseMoeBlock.__init__ reads "
               "shared_experts.gate_up_proj.weight, which a pack-quantized Linear does not have (glm4_moe.py)")


def candidate_formats(unit: Unit, fp8_source: bool = False, fp4: bool = False,
                      adapter: Adapter | None = None) -> list[FormatName]:
    """The formats a solver may give `unit`: all of them load in both engines under the pinned backends
    (`fp4`: a Blackwell target's NVFP4A16 menu; FP4 does not mix with INT / FP8 units)."""
    if fp4:
        return ["nvfp4a16", "bf16"]
    names: list[FormatName] = ["int4-g32", "int4-g64", "int4-g128", "int8-g128", "bf16"]
    if fp8_source:
        names.append("fp8-block")
    if unit.kind == "shared_experts" and adapter is not None and adapter.record.quirks.sglang_int_shared_experts_fail:
        names = [n for n in names if FORMATS[n].kind != "int"]
    return names


def check_plan_loadable(recipe: Recipe, adapter: Adapter, engines: tuple[Engine, ...] = ("sglang", "vllm")) -> None:
    """Refuse, before anything is written, a per-unit recipe an engine would not load: one line naming the engine,
    the unit and the rule."""
    refusals = plan_refusals(resolve_precision(recipe, adapter), adapter, engines)
    if refusals:
        more = f" (and {len(refusals) - 1} more)" if len(refusals) > 1 else ""
        raise QuantkitError(f"recipe {recipe.name}: {refusals[0].line()}{more}")
