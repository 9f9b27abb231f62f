"""What every section of the GPU check shares: its report file, its context (time box), the skip and
over-budget signals, the device helpers and the real-size MoE layer the GPTQ and RTN sections use.

torch is imported inside the functions only, so the driver's `stub`, `summary` and `boxes` run anywhere.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

REPO = Path(__file__).resolve().parents[2]

# "running" while a section works (a file left so was killed), "partial" when its time box stopped it
Status = Literal["running", "ok", "partial", "skipped", "error", "timeout"]
JSONObject = dict[str, Any]  # a JSON object as the sections write it and summary.md reads it back
SectionData = JSONObject  # one section's file
REAL_MODELS = ("glm-5.2", "kimi-k2.6")
LAYER_MODEL = "glm-5.2"
SMOKE_LAYER = {"hidden": 64, "moe_inter": 32, "experts": 8, "top_k": 2}


class Skip(Exception):
    """The section cannot run here (missing package, no GPU); the message says why."""


class OverBudget(Exception):
    """The section's time box is spent; what was measured so far stands."""


@dataclass
class Report:
    """One section's JSON file: figures or a skip reason, notes, and how it ended."""

    section: str
    title: str
    smoke: bool
    out: Path
    status: Status = "running"
    skip_reason: str | None = None
    error: str | None = None
    device: str = "unknown"
    date: str = field(default_factory=lambda: dt.date.today().isoformat())
    seconds: float | None = None
    notes: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)  # the section's own JSON figures

    @property
    def path(self) -> Path:
        return self.out / f"{self.section}.json"

    def save(self) -> None:
        """Write the file atomically (a killed section leaves the last complete version)."""
        data = _clean({k: v for k, v in asdict(self).items() if k != "out"})
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")
        os.replace(tmp, self.path)


def _clean(value: object) -> object:
    """JSON-safe copy: NaN/Inf become None (a failed timing says why in its row's notes), odd types str."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, bool | int | str):
        return value
    return str(value)


@dataclass
class Context:
    """What every section gets: where to write, whether this is the CPU smoke run, its time box."""

    out: Path
    work: Path
    smoke: bool
    budget_s: float
    start: float = field(default_factory=time.monotonic)

    def remaining(self, margin: float = 0.0) -> float:
        return self.budget_s - (time.monotonic() - self.start) - margin

    def check_budget(self, margin: float = 0.0) -> None:
        if self.remaining(margin) <= 0:
            raise OverBudget(f"time box of {self.budget_s:.0f} s reached")


def require(*modules: str) -> None:
    """Skip the section, naming every missing package, unless all of `modules` import."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise Skip(f"missing package(s): {', '.join(missing)} (carry wheels: see docs/benchmarks.md, GPU check)")


def torch_device(ctx: Context) -> torch.device:
    """cuda for the real run (skip without one), cpu for the smoke run."""
    import torch

    if ctx.smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise Skip("no CUDA device visible to torch (use --smoke on a CPU machine)")
    return torch.device("cuda")


def device_name(device: torch.device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


def sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gib(device: torch.device) -> dict[str, float] | None:
    import torch

    if device.type != "cuda":
        return None
    return {"allocated": torch.cuda.max_memory_allocated(device) / 2**30,
            "reserved": torch.cuda.max_memory_reserved(device) / 2**30}


def fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    """A figure for summary.md: "-" when it is missing."""
    return "-" if value is None else f"{value:{spec}}{suffix}"


# ------------------------------------------------------------------------- the real-size MoE layer
def layer_dims(smoke: bool) -> dict[str, int]:
    """hidden, moe_inter, experts, top_k (and the MoE layer count) of the layer the GPTQ/RTN sections use."""
    if smoke:
        return {**SMOKE_LAYER, "moe_layers": 2}
    cfg = json.loads((REPO / "quantkit" / "plan" / "configs" / LAYER_MODEL / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    return {"hidden": cfg["hidden_size"], "moe_inter": cfg["moe_intermediate_size"],
            "experts": cfg["n_routed_experts"], "top_k": cfg["num_experts_per_tok"],
            "moe_layers": cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]}


def start_layer(ctx: Context, rep: Report) -> tuple[torch.device, dict[str, int]]:
    """The device and the real-size layer's dims of a GPTQ / RTN section; records device, model, dims, group."""
    device = torch_device(ctx)
    rep.device = device_name(device)
    dims = layer_dims(ctx.smoke)
    rep.figures.update(model="synthetic" if ctx.smoke else LAYER_MODEL, dims=dims, group_size=32)
    return device, dims


def expert_weights(e: int, dims: dict[str, int], device: torch.device, dtype: torch.dtype,
                   seed: int = 0) -> dict[str, torch.Tensor]:
    """gate/up `[inter, hidden]` and down `[hidden, inter]` of expert `e`, drawn on `device` from seed + e."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed * 100_003 + e)
    h, i = dims["hidden"], dims["moe_inter"]

    def draw(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen, device=device) * cols**-0.5).to(dtype)

    return {"gate_proj": draw(i, h), "up_proj": draw(i, h), "down_proj": draw(h, i)}
