"""Recipes: what to quantize and how, as a typed model loaded from `recipes/*.yaml` or a user's YAML.

A recipe is chosen by preset name (`glm5-w4a16-g32`), by path, or by default from the architecture in
config.json; command-line options override its fields. The resolved recipe is written next to the
output so a run can be repeated exactly.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from quantkit.arch import Role, family_of_config
from quantkit.core.errors import QuantkitError
from quantkit.quant.scheme import FORMATS, FormatName, UnitScheme, WeightFormat

__all__ = ["Recipe", "Scheme", "load_recipe", "parse_size", "RECIPES_DIR", "default_recipe_name"]

# w4a16: INT4 group-wise (pack-quantized); nvfp4a16 / mxfp4a16: FP4 weights, 16-bit activations;
# nvfp4: FP4 weights and activations (W4A4, needs activation scales from calibration). docs/fp4.md
Scheme = Literal["w4a16", "nvfp4a16", "mxfp4a16", "nvfp4"]

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
_UNIT_KEY = re.compile(r"layers\.[0-9*?\[\]!-]+\.(experts|shared_experts|attention|mlp|\*)")


class GPTQSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dampening_frac: float = Field(0.01, gt=0, lt=1)
    block_size: int = Field(128, gt=0)
    actorder: Literal["static"] | None = "static"
    scale_search: Literal["minmax", "mse"] = "minmax"  # group scales inside GPTQ (see docs/calibration.md)
    refit_scales: bool = True  # after GPTQ: each row's scales re-solved for its codes (least squares in H)
    routed_token_weight: float = Field(0.0, ge=0)  # routed tokens count 1 + w times in down_proj Hessians
    routed_weight_gate_up: bool = False  # ... and in per-expert gate/up Hessians (one factorisation per expert)
    # GPTAQ-style: fit Q on the quantized model's inputs to the full-precision model's outputs (a second,
    # full-precision activation stream; see quantkit/calibrate/asymmetric.py)
    asymmetric: bool = False
    asymmetric_strength: float = Field(1.0, ge=0, le=1)  # fraction of the asymmetric correction applied
    asymmetric_down: bool = True  # routed experts' down_proj too (per-expert fp inner activations: costly)
    # routed experts: down_proj first (Hessian from source gate/up) or gate/up first (from the quantized ones)
    expert_order: Literal["down_first", "gate_up_first"] = "down_first"


class CalibrationSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dataset: str | None = "calibration_data/default.jsonl"
    samples: int = Field(512, gt=0)
    seq_len: int = Field(2048, gt=0)
    seed: int = 0


class Recipe(BaseModel):
    """Everything a conversion needs to know besides SRC and OUT."""

    model_config = ConfigDict(extra="forbid")
    name: str = "custom"
    architecture: str | None = None
    method: Literal["rtn", "gptq"] = "rtn"
    scheme: Scheme = "w4a16"
    group_size: Literal[32, 64, 128] = 32
    quantize_roles: list[Role] = [Role.ROUTED_EXPERT]
    scale_search: Literal["minmax", "mse"] = "minmax"
    gptq: GPTQSettings = GPTQSettings()
    calibration: CalibrationSettings = CalibrationSettings()
    kv_cache: Literal["fp8"] | None = None
    # which FP8 KV scales to ship: calibrated, 1.0 (unit), or the measured rule's choice (quantkit.engines.kv_choice)
    kv_scales: Literal["auto", "calibrated", "unit"] = "auto"
    max_shard_size: str = "5GB"
    # per-unit formats overriding the uniform scheme (docs/mixed-precision.md): unit name ("layers.3.experts") or
    # an fnmatch pattern ("layers.*.shared_experts"; an exact name wins over patterns, later patterns over
    # earlier ones) -> format. Empty: the uniform recipe, written exactly as before (the key is not serialized).
    units: dict[str, FormatName] = Field(default_factory=dict)

    @field_validator("units")
    @classmethod
    def _units_named(cls, value: dict[str, FormatName]) -> dict[str, FormatName]:
        for key, name in value.items():
            if not _UNIT_KEY.fullmatch(key):
                raise ValueError(f"unit {key!r}: expected layers.N.(experts|shared_experts|attention|mlp), "
                                 "N a layer number or an fnmatch pattern")
            if not FORMATS[name].mixable:
                raise ValueError(f"unit {key!r}: format {name} is for uniform recipes only")
        return value

    @model_serializer(mode="wrap")
    def _omit_empty_units(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if not self.units:
            data.pop("units", None)
        return data

    @field_validator("max_shard_size")
    @classmethod
    def _size_parses(cls, value: str) -> str:
        parse_size(value)
        return value

    @model_validator(mode="after")
    def _fp4_is_data_free(self) -> Recipe:
        if self.scheme != "w4a16" and self.method == "gptq":
            raise ValueError(f"scheme {self.scheme}: GPTQ writes INT4 only; use method rtn (data-free FP4)")
        if self.scheme != "w4a16" and self.scale_search != "minmax":
            raise ValueError(f"scheme {self.scheme}: scale_search is minmax only (compressed-tensors' FP4 scales)")
        if self.units and not self.uniform_format.mixable:
            raise ValueError(f"scheme {self.scheme}: per-unit formats need a mixable uniform scheme "
                             "(w4a16 or nvfp4a16)")
        return self

    @property
    def uniform_format(self) -> WeightFormat:
        """The format of every quantized role's tensors that no `units` entry overrides."""
        return FORMATS[f"int4-g{self.group_size}" if self.scheme == "w4a16" else self.scheme]  # type: ignore[index]

    @property
    def mixed(self) -> bool:
        """Whether the recipe carries per-unit formats (a precision plan)."""
        return bool(self.units)

    def unit_scheme(self, fmt: WeightFormat) -> UnitScheme:
        """How a tensor in `fmt` is written under this recipe (GPTQ only computes INT formats; FP4 is data-free)."""
        method = self.method if fmt.kind == "int" else "rtn"
        return UnitScheme(fmt, method, self.scale_search if fmt.kind == "int" else "minmax")

    @property
    def fp4(self) -> Literal["nvfp4", "mxfp4"] | None:
        """The FP4 format of the weights, None for INT4."""
        return None if self.scheme == "w4a16" else "mxfp4" if self.scheme == "mxfp4a16" else "nvfp4"

    @property
    def max_shard_bytes(self) -> int:
        return parse_size(self.max_shard_size)

    @property
    def needs_calibration(self) -> bool:
        return self.method == "gptq" or self.kv_cache is not None or self.scheme == "nvfp4"

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000, '512MiB' -> 536_870_912, '1000' -> 1000."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if not match:
        raise QuantkitError(f"bad size {text!r} (use e.g. 5GB, 500MB, 2GiB)")
    number, unit, binary = float(match.group(1)), match.group(2).upper(), match.group(3)
    base = 1024 if binary else 1000
    size = int(number * base ** "_KMGT".index(unit or "_"))
    if size <= 0:
        raise QuantkitError(f"bad size {text!r}: must be positive")
    return size


def default_recipe_name(config: dict[str, Any]) -> str:
    """The preset for an architecture, from its family record (a wrapper such as kimi_k25 has its own)."""
    try:
        family, wrapper, text = family_of_config(config)
    except QuantkitError:
        raise QuantkitError(f"config.json: no default recipe for model_type {config.get('model_type')!r}; "
                            "pass --recipe") from None
    return wrapper.default_recipe if wrapper else family.default_recipes[text["model_type"]]


def load_recipe(spec: str | None, config: dict[str, Any], overrides: dict[str, Any] | None = None) -> Recipe:
    """Load a preset name or YAML path (or the architecture default), then apply CLI overrides."""
    name = spec or default_recipe_name(config)
    path = Path(name)
    if not (path.suffix in (".yaml", ".yml") and path.exists()):
        path = RECIPES_DIR / f"{name}.yaml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
        raise QuantkitError(f"recipe {name!r} not found (presets: {known}; or pass a YAML path)")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise QuantkitError(f"{path}: not valid YAML ({exc.__class__.__name__})") from None
    data = _merge(data, {k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise QuantkitError(f"{path}: {where}: {first['msg']}") from None


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Apply dotted overrides like {'calibration.samples': 64} to a nested dict."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for key, value in overrides.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out
