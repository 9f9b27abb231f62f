"""The sections of the GPU check (`bench/gpu_check.sh`), one module each, and their registry.

A section is a module `gpu_sections/<name>.py` exposing `run(ctx: Context, rep: Report) -> None` (and,
optionally, `summary_lines(data) -> list[str]`: its block of summary.md); it writes `<name>.json`
through `rep` as it goes. **Adding a section is one line in `REGISTRY` below**: its name, the title
the summary shows, its time box on the H200 and in the CPU smoke run. `gpu_check.sh` reads the order
and the boxes from here (`gpu_check.py boxes`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from gpu_sections.common import Context, Report, SectionData


@dataclass(frozen=True)
class Section:
    """One registry line: `gpu_sections.<name>` writes `<name>.json`, killed after `box_s` seconds."""

    name: str
    title: str
    box_s: int  # time box on the H200 (the whole check stays within 8 minutes)
    smoke_box_s: int  # on the CPU at tiny sizes: the cap only stops a hang
    # 0: needs the GPU only, runs first; 1..3: runs after the background CPU preparation (the CUDA
    # extension's build, the tiny model's training) that overlaps stage 0
    stage: int = 0
    # True: run only when named in `gpu_check.sh --only` (a second call): one call returns at most 8 files
    # from $OUT (7 default sections + summary.md) and stays inside the 10-minute call limit
    extra: bool = False

    def module(self) -> ModuleType:
        return importlib.import_module(f"gpu_sections.{self.name}")

    def runner(self) -> Callable[[Context, Report], None]:
        return self.module().run

    def renderer(self) -> Callable[[SectionData], list[str]] | None:
        return getattr(self.module(), "summary_lines", None)


# In the order summary.md lists them; they run by stage, then in this order. H200 boxes: 495 s together
# (sglang_plugin: the integrity plugin 30 s + the PD page conversion 15 s).
REGISTRY: tuple[Section, ...] = (
    Section("tests", "Kernel and serving tests on the GPU", 75, 180, stage=2),
    Section("kernels", "Kernels at real shapes (TP8)", 150, 180, stage=1),
    Section("integrity", "Integrity check vs a decode step", 30, 120),
    Section("sglang_plugin", "SGLang plugins: integrity per decode step, PD page conversion per page (cuda)",
            45, 120),
    Section("gptq_tiny", "GPTQ on cuda: tiny trained model vs the CPU run", 70, 240, stage=3),
    Section("gptq_layer", "GPTQ on cuda: one real-size GLM-5.2 MoE layer", 105, 120),
    Section("rtn", "RTN on cuda: the real-size layer", 20, 120),
    Section("integrity_server", "Integrity plugin in a real SGLang server: decode tok/s off / on (overlap on)", 240,
            120, extra=True),
    Section("attention", "MLA decode attention vs the planner's attention term", 60, 240, extra=True),
)
BY_NAME: dict[str, Section] = {s.name: s for s in REGISTRY}
SECTIONS: dict[str, str] = {s.name: s.title for s in REGISTRY}  # file stem -> title, in the summary's order


def run_order() -> list[Section]:
    """Stage 0 first (GPU-only, while the CPU preparation runs in the background), then stages 1, 2, 3."""
    return sorted(REGISTRY, key=lambda s: s.stage)
