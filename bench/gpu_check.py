"""The sections of the one-command H200 check (issue 14); `bench/gpu_check.sh` runs them, each time-boxed.

    python bench/gpu_check.py SECTION --out DIR --work TMP [--smoke] [--budget-s S]

Each section runs in its own process and writes `DIR/<section>.json` (atomically, also while it runs, so
a section the driver has to kill still leaves what it measured); `summary` turns them into `summary.md`
with pass/fail against the issue's targets. Sections:

    tests       the kernel and serving tests on the GPU (TRITON_INTERPRET=0); files whose packages are
                missing are listed, not run
    kernels     W4A16 GEMV/GEMM and the grouped MoE vs BF16 at GLM-5.2 / Kimi K2.6 TP8 shapes, % of the
                HBM roofline, CUDA GEMV vs Triton, FP8 KV-cache quantization (quantkit.kernels.bench)
    integrity   the pre-decode integrity check as a share of a decode step, batch 1..64
                (quantkit.serving.integrity.bench)
    sglang_plugin  quantkit's SGLang plugins on cuda: the integrity plugin's device work per decode step
                (record the step's new pages + the batched check, quantkit.serving.integrity.sglang), batch
                1..256, context 8K..128K, as a share of the planner's decode step; and the PD plugin's
                BF16 -> FP8 MLA page conversion per page (quantkit.serving.pd.sglang, bench/pd_kv_pages.py)
    gptq_tiny   the tiny trained model calibrated on cuda and on the CPU, KL of each vs the source
    gptq_layer  one real-size GLM-5.2 MoE layer (256 experts, generated on the GPU from a seed) through
                quantkit's expert statistics and GPTQ solver on cuda: seconds, peak memory, projection
    rtn         RTN + packing of the same layer on cuda: GB/s, and codes compared with the CPU's
    stub        record a section the driver killed (time box, crash) without losing what it wrote
    summary     summary.md from the section files

`--smoke` runs the same code at tiny sizes on the CPU (CI); its timings are not measurements.
torch is imported inside the sections only, so `stub` and `summary` run anywhere.
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# "running" while a section works (a file left so was killed), "partial" when its time box stopped it
Status = Literal["running", "ok", "partial", "skipped", "error", "timeout"]
SECTIONS: dict[str, str] = {  # file stem -> title, in the order the summary lists them
    "tests": "Kernel and serving tests on the GPU",
    "kernels": "Kernels at real shapes (TP8)",
    "integrity": "Integrity check vs a decode step",
    "sglang_plugin": "SGLang plugins: integrity per decode step, PD page conversion per page (cuda)",
    "gptq_tiny": "GPTQ on cuda: tiny trained model vs the CPU run",
    "gptq_layer": "GPTQ on cuda: one real-size GLM-5.2 MoE layer",
    "rtn": "RTN on cuda: the real-size layer",
}
REAL_MODELS = ("glm-5.2", "kimi-k2.6")
LAYER_MODEL = "glm-5.2"
TP = 8
M_VALUES = (1, 8, 32, 64, 256)
DECODE_BATCHES = (1, 8, 32, 64)  # the MoE target's "decode batch sizes"; 256 is reported beside them
FP8_ROWS = (64, 8192, 262144)
INTEGRITY_BATCHES = (1, 2, 4, 8, 16, 32, 64)
INTEGRITY_CONTEXTS = (8192, 32768)
INTEGRITY_PAGES = (64, 1)
# `quantkit calibrate` defaults (128 samples x 2048 tokens) and the runner's 8 sequences per forward
CALIB_TOKENS = 128 * 2048
CALIB_BATCH_TOKENS = 8 * 2048
EXPERT_GROUP = 32  # experts quantized per timed step of the real-size layer (a multiple of the chunking)
TARGETS = {
    "gemv_roofline": 80.0,  # % of the HBM roofline, W4A16 GEMV at M = 1
    "gemv_vs_bf16": 3.0,  # x BF16 torch.matmul at M = 1
    "moe_vs_bf16": 2.0,  # x BF16 grouped GEMM at decode batch sizes
    "integrity_pct": 0.3,  # % of a decode step
}
# Tiny stand-ins for the smoke run: the same fields as quantkit.kernels.bench.MODELS.
SMOKE_DIMS = {"hidden": 256, "moe_inter": 128, "experts": 8, "top_k": 2, "heads": 2, "q_lora": 64, "kv_lora": 32,
              "nope": 16, "rope": 16, "v": 16, "group": 32}
SMOKE_LAYER = {"hidden": 64, "moe_inter": 32, "experts": 8, "top_k": 2}
SMOKE_TESTS = ("test_serving_bench.py",)
FIRST_TESTS = ("test_kernels_cuda.py", "test_serving_check.py")  # the ones that only mean something on a GPU


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
    figures: dict[str, Any] = field(default_factory=dict)

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


def torch_device(ctx: Context) -> Any:
    """cuda for the real run (skip without one), cpu for the smoke run."""
    import torch

    if ctx.smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise Skip("no CUDA device visible to torch (use --smoke on a CPU machine)")
    return torch.device("cuda")


def device_name(device: Any) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


# ------------------------------------------------------------------------------------------ tests
def gpu_test_files(smoke: bool) -> list[Path]:
    """The kernel and serving test files, GPU-only ones first; one fast file in the smoke run."""
    tests = REPO / "tests"
    if smoke:
        return [tests / name for name in SMOKE_TESTS]
    found = sorted({*tests.glob("test_kernels_*.py"), *tests.glob("test_serving_*.py")})
    return sorted(found, key=lambda p: (p.name not in FIRST_TESTS, p.name))


def missing_modules(path: Path, seen: set[Path] | None = None) -> set[str]:
    """Third-party packages imported at module level by `path` or the quantkit modules it imports, absent here."""
    seen = set() if seen is None else seen
    if path in seen or not path.exists():
        return set()
    seen.add(path)
    missing: set[str] = set()
    for name in _module_imports(ast.parse(path.read_text(encoding="utf-8"))):
        top = name.split(".")[0]
        if top == "quantkit":
            for file in _quantkit_files(name):
                missing |= missing_modules(file, seen)
        elif top not in sys.stdlib_module_names and top != "__future__" and importlib.util.find_spec(top) is None:
            missing.add(top)
    return missing


def _module_imports(tree: ast.Module) -> list[str]:
    """Modules imported when the file is imported: top level, and inside module-level if/try (not defs)."""
    names: list[str] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body
    return names


def _quantkit_files(module: str) -> list[Path]:
    """Source files executed by importing `module` (its package __init__ files included)."""
    parts = module.split(".")
    files = [REPO.joinpath(*parts[:i], "__init__.py") for i in range(1, len(parts) + 1)]
    files.append(REPO.joinpath(*parts).with_suffix(".py"))
    return [f for f in files if f.exists()]


_RESULT = re.compile(r"^(tests/[\w./-]+\.py)::(\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")
_PROBLEM = re.compile(r"^(FAILED|ERROR) (tests/\S+)(?: - (.*))?$")
_FINAL = re.compile(r"^=+ (.+) in ([\d.]+)s")


def parse_pytest(output: str) -> dict[str, Any]:
    """Per-file outcome counts, the failures' one-line reasons and the final line of `pytest -v -rfE` output."""
    files: dict[str, dict[str, int]] = {}
    problems: list[str] = []
    final = None
    for line in output.splitlines():
        if m := _RESULT.match(line):
            counts = files.setdefault(m.group(1), {})
            outcome = m.group(3).lower()
            counts[outcome] = counts.get(outcome, 0) + 1
        elif m := _PROBLEM.match(line):
            problems.append(line[:300])
            if "::" not in m.group(2):  # a file that failed to collect
                files.setdefault(m.group(2), {})["collection_error"] = 1
        elif m := _FINAL.match(line):
            final = m.group(1)
    totals: dict[str, int] = {}
    for counts in files.values():
        for k, v in counts.items():
            totals[k] = totals.get(k, 0) + v
    return {"files": files, "totals": totals, "problems": problems[:30], "final_line": final}


def section_tests(ctx: Context, rep: Report) -> None:
    """Run the kernel/serving test files whose imports are all present, with TRITON_INTERPRET=0 on a GPU."""
    require("pytest")
    if not ctx.smoke:  # (the smoke run spares itself a torch import: pytest's process has its own)
        rep.device = device_name(torch_device(ctx))
    else:
        rep.device = "cpu"
    conftest_missing = missing_modules(REPO / "tests" / "conftest.py")
    run, not_run = [], {}
    for path in gpu_test_files(ctx.smoke):
        missing = sorted(missing_modules(path) | conftest_missing)
        rel = str(path.relative_to(REPO))
        if missing:
            not_run[rel] = f"missing package(s): {', '.join(missing)}"
        else:
            run.append(rel)
    rep.figures["not_run"] = not_run
    if not run:
        raise Skip(f"no test file can be imported here: {not_run}")
    interpret = "1" if ctx.smoke else "0"
    env = {**os.environ, "TRITON_INTERPRET": interpret, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-v", "-rfE", "-p", "no:cacheprovider", *run]
    rep.figures["command"] = f"TRITON_INTERPRET={interpret} python -m pytest -v -rfE " + " ".join(run)
    rep.save()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=max(5.0, ctx.remaining(margin=5)))
        rep.figures["exit_code"] = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        rep.notes.append(f"pytest stopped at the {ctx.budget_s:.0f} s time box: counts are of the tests that ran")
        rep.status = "partial"
    rep.figures.update(parse_pytest(output))
    if not rep.figures["files"]:
        rep.figures["output_tail"] = output[-3000:]


# ---------------------------------------------------------------------------------------- kernels
def hbm_peak(device: Any) -> tuple[float, str]:
    """Peak HBM GB/s of the GPU (of an H200 in the smoke run) from quantkit/plan/gpus.yaml."""
    import torch

    name = torch.cuda.get_device_name(device).lower() if device.type == "cuda" else "nvidia h200"
    try:
        from quantkit.plan.catalog import load_catalog

        catalog = load_catalog()
    except ImportError as exc:  # pyyaml missing: the kernel bench's own table (same datasheet figures)
        from quantkit.kernels import bench

        peak = next((bw for key, bw in bench.HBM_GBPS.items() if key.lower() in name), None)
        if peak is None:
            raise Skip(f"GPU {name!r} not in quantkit.kernels.bench.HBM_GBPS and gpus.yaml unreadable ({exc})") from exc
        return peak, f"quantkit.kernels.bench.HBM_GBPS ({exc.name} missing, gpus.yaml not read)"
    keys = [key for key in catalog if key in name.replace(" ", "")]
    if not keys:
        raise Skip(f"GPU {name!r} is not in quantkit/plan/gpus.yaml (add it there)")
    key = max(keys, key=len)  # "h200" over "h20"
    return catalog[key].bandwidth_tbs * 1000.0, f"quantkit/plan/gpus.yaml: {key}"


def section_kernels(ctx: Context, rep: Report) -> None:
    """The kernel sweep at TP8 shapes; rows are saved as they come in."""
    device = torch_device(ctx)
    rep.device = device_name(device)
    from quantkit.kernels import bench

    peak, source = hbm_peak(device)
    if ctx.smoke:
        models = {"smoke": SMOKE_DIMS}
        tp, m_values, tokens, fp8 = 1, (1, 8), (1, 4), (16,)
        extra = ("triton",) if interpreting() else ()
        linear, moe, fp8_b = ("torch", *extra), ("torch", *extra), extra or ("torch",)
        rep.notes.append("smoke: CPU timings of tiny shapes; the roofline % uses the H200 peak and means nothing")
    else:
        models = {m: bench.config_dims(m) for m in REAL_MODELS}
        tp, m_values, tokens, fp8 = TP, M_VALUES, M_VALUES, FP8_ROWS
        linear, moe, fp8_b = ("triton", "cuda"), ("triton",), ("triton",)
    rep.figures.update(hbm_gbps=peak, hbm_source=source, tp=tp, models=models, m_values=list(m_values), rows=[])
    rep.figures["baselines_importable"] = {n: importlib.util.find_spec(m) is not None
                                           for n, m in bench.BASELINE_MODULES.items()}

    def on_rows(new: list[Any]) -> None:
        rep.figures["rows"] += [asdict(row) for row in new]
        rep.save()
        ctx.check_budget(margin=10)

    bench.run_sweep(models, device, tp, m_values, tokens, fp8, linear, moe, fp8_b, peak=peak,
                    reps=1 if ctx.smoke else 5, on_rows=on_rows)


# -------------------------------------------------------------------------------------- integrity
def section_integrity(ctx: Context, rep: Report) -> None:
    """`TagTracker.check` per decode batch, as a share of the planner's H200 TP8 decode step."""
    device = torch_device(ctx)
    rep.device = device_name(device)
    from quantkit.serving.integrity.bench import bench_config

    if ctx.smoke:
        batches, contexts, pages, repeats = (1, 2), (256,), (16, 1), 1
    else:
        batches, contexts, pages, repeats = INTEGRITY_BATCHES, INTEGRITY_CONTEXTS, INTEGRITY_PAGES, 5
    rep.figures["rows"] = []
    for page in pages:
        for context in contexts:
            for batch in batches:
                row = asdict(bench_config(batch, context, page, device, repeats))
                rep.figures["rows"].append(row)
                rep.figures["backend"] = row["backend"]
                rep.save()
                ctx.check_budget(margin=5)


def _pd_pages(ctx: Context, rep: Report, device_type: str) -> None:
    """Issue 19: `sglang_pd.mla_pages_to_fp8` per page at page sizes 1 and 64 (bench/pd_kv_pages.py), into
    `figures["pd_rows"]` of the sglang_plugin section ($OUT holds at most 8 files: one section for both plugins)."""
    from pd_kv_pages import measure, measure_staging

    sizes = ((1, 64), (64, 4)) if ctx.smoke else ((1, 65536), (64, 4096))
    rep.figures["pd_rows"] = []
    for page, pages in sizes:
        rep.figures["pd_rows"].append(measure(page, pages, device_type))
        rep.save()
        ctx.check_budget(margin=2)
    rep.figures["pd_staging"] = []  # the plugin's whole send-side round per request, 61 layers
    for page, pages in (((1, 16), (64, 2)) if ctx.smoke else ((1, 8192), (64, 128))):
        rep.figures["pd_staging"].append(measure_staging(page, pages, device_type))
        rep.save()
        ctx.check_budget(margin=2)


def section_sglang_plugin(ctx: Context, rep: Report) -> None:
    """The PD plugin's page conversion per page (first: 15 s), then the integrity plugin's per-step device work
    on cuda (issue 27: allocation bump + decode record + the check with its write redirect + the verdict and the
    mark, `quantkit.serving.integrity.plugin_bench.plugin_step`), synchronised per step, and the host time to
    issue it; SGLang itself is not needed (the hooks' bodies run on quantkit's `PoolState`)."""
    from quantkit.serving.integrity.bench import decode_step
    from quantkit.serving.integrity.plugin_bench import plugin_step

    device = torch_device(ctx)
    rep.device = device_name(device)
    _pd_pages(ctx, rep, device.type)
    if ctx.smoke:
        batches, contexts, pages, repeats = (1, 2), (256,), (16, 1), 1
    else:
        batches, contexts, pages, repeats = (1, 16, 64, 256), (8192, 32768, 131072), (64, 1), 5
    rep.figures["rows"] = []
    for page in pages:
        for context in contexts:
            for batch in batches:
                if page == 1 and batch * context > 2_000_000:
                    continue
                row = {"page_size": page, "batch": batch, "context": context,
                       **plugin_step(batch, context, page, device, repeats)}
                for model in REAL_MODELS:
                    seconds, source = decode_step(model, batch, context)
                    row[f"pct_{model}"] = 100 * row["step_us"] / 1e6 / seconds
                    row["step_source"] = source
                rep.figures["rows"].append(row)
                rep.save()
                ctx.check_budget(margin=5)


# ---------------------------------------------------------------------------------------- GPTQ tiny
def _smoke_source(work: Path) -> Path:
    """A random-weight deepseek_v3 checkpoint (quantkit.checkpoint.synth) with the tiny models' BPE tokenizer."""
    from quantkit.calibrate.tiny import build_tokenizer
    from quantkit.checkpoint.synth import make_checkpoint

    src = make_checkpoint(work / "smoke-src", "deepseek_v3", "bf16", "tiny", mtp=False,
                          config_overrides={"vocab_size": 512})
    build_tokenizer(src)
    return src


def _code_agreement(a: Any, b: Any) -> float | None:
    """Share of packed int32 words (each holds 8 codes) identical between two calibration results."""
    same = total = 0
    for module in a.modules_quantized():
        pa, pb = a.quantized(module), b.quantized(module)
        total += pa.weight_packed.numel()
        if pb is not None:
            same += int((pa.weight_packed == pb.weight_packed).sum())
    return same / total if total else None


def section_gptq_tiny(ctx: Context, rep: Report) -> None:
    """Calibrate the tiny trained model on the CPU and on cuda with the same tokens; compare both to the source."""
    require("transformers", "tokenizers", "safetensors", "compressed_tensors", "pydantic")
    device = torch_device(ctx)
    rep.device = device_name(device)
    from transformers import AutoTokenizer

    from quantkit.arch import Role
    from quantkit.calibrate.data import calibration_tokens
    from quantkit.calibrate.eval import evaluate, fake_quantized_copy
    from quantkit.calibrate.runner import RunOptions, run
    from quantkit.calibrate.tiny import CORPUS, HELDOUT, build_tiny
    from quantkit.checkpoint.source import open_source
    from quantkit.quant.recipe import Recipe

    if ctx.smoke:
        src, samples, seq, windows = _smoke_source(ctx.work), 4, 64, 4
        rep.notes.append("smoke: a random-weight synthetic model, both runs on the CPU")
    else:
        t = time.perf_counter()
        src, samples, seq, windows = build_tiny("deepseek_v3"), 32, 128, 32
        rep.figures["model_ready_s"] = time.perf_counter() - t
    ctx.check_budget(margin=10)
    tokens = calibration_tokens(CORPUS, AutoTokenizer.from_pretrained(src), samples, seq, 0)
    recipe = Recipe(method="gptq", calibration={"dataset": str(CORPUS), "samples": samples, "seq_len": seq, "seed": 0})
    rep.figures.update(model=src.name, samples=samples, seq_len=seq, group_size=recipe.group_size, runs={})
    results, copies = {}, []
    for label, dev in (("cpu", "cpu"), ("cuda", device.type)):
        t = time.perf_counter()
        try:
            results[label] = run(open_source(src), recipe, ctx.work / f"calib-{label}", None,
                                 RunOptions(device=dev, tokens=tokens))
        except TypeError as exc:  # a runner without a device option: say so rather than guess
            raise Skip(f"the calibration runner does not take a device here ({exc})") from exc
        rep.figures["runs"][label] = {"device": dev, "seconds": time.perf_counter() - t}
        copy = ctx.work / f"fakequant-{label}"
        fake_quantized_copy(src, copy, results[label].quantized, recipe.group_size, {Role.ROUTED_EXPERT.value})
        copies.append(copy)
        rep.save()
        ctx.check_budget(margin=10)
    rep.figures["packed_words_identical"] = _code_agreement(results["cpu"], results["cuda"])
    ev = evaluate(copies, HELDOUT, reference=src, seq_len=seq, windows=windows)
    for label, copy in zip(("cpu", "cuda"), copies, strict=True):
        rep.figures["runs"][label].update(ev["models"][str(copy)])
    rep.figures["eval_tokens"] = ev["tokens"]
    rep.figures["source_perplexity"] = ev["reference"]["perplexity"]
    kl_cpu, kl_cuda = rep.figures["runs"]["cpu"]["kl_mean"], rep.figures["runs"]["cuda"]["kl_mean"]
    rep.figures["kl_cuda_over_cpu"] = kl_cuda / kl_cpu if kl_cpu > 0 else None


# ------------------------------------------------------------------------------ real-size layer
def layer_dims(smoke: bool) -> dict[str, int]:
    """hidden, moe_inter, experts, top_k (and the MoE layer count) of the layer the GPTQ/RTN sections use."""
    if smoke:
        return {**SMOKE_LAYER, "moe_layers": 2}
    cfg = json.loads((REPO / "quantkit" / "plan" / "configs" / LAYER_MODEL / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    return {"hidden": cfg["hidden_size"], "moe_inter": cfg["moe_intermediate_size"],
            "experts": cfg["n_routed_experts"], "top_k": cfg["num_experts_per_tok"],
            "moe_layers": cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]}


def expert_weights(e: int, dims: dict[str, int], device: Any, dtype: Any, seed: int = 0) -> dict[str, Any]:
    """gate/up `[inter, hidden]` and down `[hidden, inter]` of expert `e`, drawn on `device` from seed + e."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed * 100_003 + e)
    h, i = dims["hidden"], dims["moe_inter"]

    def draw(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen, device=device) * cols**-0.5).to(dtype)

    return {"gate_proj": draw(i, h), "up_proj": draw(i, h), "down_proj": draw(h, i)}


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_gib(device: Any) -> dict[str, float] | None:
    import torch

    if device.type != "cuda":
        return None
    return {"allocated": torch.cuda.max_memory_allocated(device) / 2**30,
            "reserved": torch.cuda.max_memory_reserved(device) / 2**30}


def _router(weight: Any, top_k: int) -> Any:
    """A softmax top-k router module in the form `ExpertMoE` calls it: x -> (logits, weights, ids)."""
    import torch
    from torch import nn

    class Router(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = weight

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            logits = x @ self.weight.T
            w, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
            return logits, w / w.sum(-1, keepdim=True), ids

    return Router()


def section_gptq_layer(ctx: Context, rep: Report) -> None:
    """Expert statistics over a realistic token count, then GPTQ of every expert, on the GPU, time-boxed.

    The layer is quantkit's `ExpertMoE` with every token sent to every expert (the runner's default);
    the statistics pass and the solver (`quantize_experts`, i.e. `quantkit.calibrate.gptq`) are timed in
    steps. A step beyond the time box is not run: its time is extrapolated linearly and labelled so.
    """
    import torch

    from quantkit.calibrate.moe import ExpertMoE, quantize_experts
    from quantkit.quant.recipe import GPTQSettings

    settings = GPTQSettings(dampening_frac=0.01, block_size=128, actorder="static")

    device = torch_device(ctx)
    rep.device = device_name(device)
    dims = layer_dims(ctx.smoke)
    tokens, batch = (256, 64) if ctx.smoke else (CALIB_TOKENS, CALIB_BATCH_TOKENS)
    rep.figures.update(model="synthetic" if ctx.smoke else LAYER_MODEL, dims=dims, group_size=32, damping=0.01,
                       block_size=128, tokens=tokens, tokens_per_forward=batch)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t = time.perf_counter()
    experts = [expert_weights(e, dims, device, torch.float32) for e in range(dims["experts"])]
    gen = torch.Generator(device=device).manual_seed(1)
    gate = torch.randn(dims["experts"], dims["hidden"], generator=gen, device=device) * dims["hidden"] ** -0.5
    moe = ExpertMoE(_router(gate, dims["top_k"]), None, experts, torch.nn.functional.silu)
    _sync(device)
    rep.figures["generate_s"] = time.perf_counter() - t
    collect_until = ctx.budget_s * 0.45
    moe.start_collecting("all")
    done, t = 0, time.perf_counter()
    with torch.no_grad():
        while done < tokens and (done == 0 or time.monotonic() - ctx.start < collect_until):
            x = torch.randn(min(batch, tokens - done), dims["hidden"], generator=gen, device=device)
            moe(x)
            _sync(device)
            done += x.shape[0]
    h_in, h_down = moe.h_in, moe.h_down  # stop_collecting drops the per-expert accumulators
    moe.stop_collecting()
    measured = time.perf_counter() - t
    rep.figures["statistics"] = {"tokens_done": done, "seconds_measured": measured,
                                 "seconds_full": measured * tokens / done, "extrapolated": done < tokens}
    rep.figures["peak_gib_after_statistics"] = _peak_gib(device)
    rep.save()
    solve_s, quantized, records = 0.0, 0, []
    step = 4 if ctx.smoke else EXPERT_GROUP  # several steps in the smoke run too
    for lo in range(0, dims["experts"], step):
        if quantized and ctx.remaining(margin=15) < solve_s / quantized * step:
            break
        part = ExpertMoE(moe.gate, None, moe.experts[lo : lo + step], moe.act)
        part.h_in, part.h_down = h_in, h_down[lo : lo + step]
        part.routed_tokens = moe.routed_tokens[lo : lo + step]
        t = time.perf_counter()
        _, recs = quantize_experts(part, "model.layers.3.mlp.experts.", 3, 32, settings, torch.bfloat16)
        _sync(device)
        solve_s += time.perf_counter() - t
        quantized += len(part.experts)
        records += recs
        rep.figures["solver"] = _solver_figures(solve_s, quantized, dims["experts"], records)
        rep.save()
    rep.figures["peak_gib"] = _peak_gib(device)
    if device.type != "cuda":
        rep.notes.append("smoke: CPU; no GPU memory figure")
    per_layer = rep.figures["statistics"]["seconds_full"] + rep.figures["solver"]["seconds_full"]
    rep.figures["projection"] = _projection(per_layer, dims["moe_layers"], rep.figures["peak_gib"])


def _solver_figures(seconds: float, done: int, experts: int, records: list[dict[str, Any]]) -> dict[str, Any]:
    """Solver time (extrapolated to every expert when the time box stopped it) and GPTQ-vs-RTN error."""
    errors = [(r["rel_error"][p], r["rtn_rel_error"][p]) for r in records for p in r["rel_error"]]
    return {
        "experts_done": done, "seconds_measured": seconds, "seconds_full": seconds * experts / done,
        "extrapolated": done < experts, "matrices": len(errors),
        "mean_rel_error": sum(g for g, _ in errors) / len(errors),
        "mean_rtn_rel_error": sum(r for _, r in errors) / len(errors),
        "gptq_better_than_rtn": sum(g < r for g, r in errors) / len(errors),
        "fallbacks": sum(bool(r["fallback"]) for r in records),
    }


def _projection(per_layer_s: float, moe_layers: int, peak: dict[str, float] | None) -> dict[str, Any]:
    """Whole-model routed-expert calibration time from one layer's, labelled as the projection it is."""
    one_gpu_h = per_layer_s * moe_layers / 3600
    return {
        "label": "PROJECTION, not a measurement",
        "seconds_per_moe_layer": per_layer_s,
        "moe_layers": moe_layers,
        "one_gpu_hours": one_gpu_h,
        "eight_h200_hours": one_gpu_h / 8,
        "peak_gib_per_gpu": peak["allocated"] if peak else None,
        "assumes": "one layer's statistics + GPTQ x the MoE layer count (MTP not calibrated); 8xH200 = each "
                   "layer's experts split 8 ways with linear scaling (the runner uses one device today); "
                   "attention/dense forwards, activation I/O and the quantized second pass are not included",
    }


# ------------------------------------------------------------------------------------------------ RTN
def section_rtn(ctx: Context, rep: Report) -> None:
    """RTN + nibble packing of every expert matrix of the real-size layer on the device (bf16 in)."""
    import torch

    from quantkit.quant.int4 import pack_nibbles, quantize_rtn

    device = torch_device(ctx)
    rep.device = device_name(device)
    dims = layer_dims(ctx.smoke)
    rep.figures.update(model="synthetic" if ctx.smoke else LAYER_MODEL, dims=dims, group_size=32)
    first = expert_weights(0, dims, device, torch.bfloat16)
    same = total = 0
    for w in first.values():  # correctness first: the device's codes and scales against the CPU's
        q, s = quantize_rtn(w, 32)
        q_cpu, s_cpu = quantize_rtn(w.cpu(), 32)
        same += int((q.cpu() == q_cpu).sum()) + int((s.cpu() == s_cpu).sum())
        total += q.numel() + s.numel()
    rep.figures["codes_and_scales_identical_to_cpu"] = same / total
    seconds, nbytes, matrices = 0.0, 0, 0
    for e in range(dims["experts"]):
        for w in expert_weights(e, dims, device, torch.bfloat16).values():
            _sync(device)
            t = time.perf_counter()
            q, s = quantize_rtn(w, 32)
            pack_nibbles(q)
            _sync(device)
            seconds += time.perf_counter() - t
            nbytes += w.numel() * w.element_size()
            matrices += 1
        rep.figures["throughput"] = {"matrices": matrices, "experts_done": e + 1, "source_gb": nbytes / 1e9,
                                     "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9,
                                     "partial": e + 1 < dims["experts"]}
        if e % 16 == 15:
            rep.save()
        ctx.check_budget(margin=5)


# --------------------------------------------------------------------------------------- driver
RUNNERS: dict[str, Callable[[Context, Report], None]] = {
    "tests": section_tests, "kernels": section_kernels, "integrity": section_integrity,
    "sglang_plugin": section_sglang_plugin,
    "gptq_tiny": section_gptq_tiny, "gptq_layer": section_gptq_layer, "rtn": section_rtn,
}


def run_section(name: str, ctx: Context) -> Report:
    """Run one section; whatever happens, its JSON file says how it ended."""
    rep = Report(name, SECTIONS[name], ctx.smoke, ctx.out)
    rep.save()
    try:
        RUNNERS[name](ctx, rep)
        if rep.status == "running":
            rep.status = "ok"
    except Skip as exc:
        rep.status, rep.skip_reason = "skipped", str(exc)
    except OverBudget as exc:
        rep.status = "partial"
        rep.notes.append(f"stopped: {exc}; the figures are of what ran")
    except Exception as exc:  # one failure must not kill the other sections: record it
        rep.status, rep.error = "error", f"{type(exc).__name__}: {exc}"[:500]
        rep.notes.append("traceback tail: " + " | ".join(traceback.format_exc().strip().splitlines()[-6:])[:1500])
    rep.seconds = time.monotonic() - ctx.start
    rep.save()
    return rep


def stub(name: str, out: Path, smoke: bool, status: Literal["timeout", "error"], reason: str,
         log: Path | None) -> None:
    """The driver killed or lost a section: keep its last saved figures, mark how it ended."""
    rep = Report(name, SECTIONS[name], smoke, out)
    if rep.path.exists():
        data = json.loads(rep.path.read_text())
        rep.figures, rep.notes, rep.device = data.get("figures", {}), data.get("notes", []), data.get("device", "")
        rep.skip_reason, rep.error = data.get("skip_reason"), data.get("error")
    rep.status = status
    rep.notes.append(f"section {reason}")
    if log is not None and log.exists():
        rep.notes.append("log tail: " + " | ".join(log.read_text(errors="replace").strip().splitlines()[-8:])[:1500])
    if not rep.figures and not rep.skip_reason:
        rep.skip_reason = f"no figures: the section {reason}"
    rep.save()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("section", choices=[*SECTIONS, "stub", "summary"])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a folder under --out's parent)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--budget-s", type=float, default=120.0)
    ap.add_argument("--name", choices=list(SECTIONS), help="stub: the section to mark")
    ap.add_argument("--status", choices=["timeout", "error"], default="error", help="stub: how it ended")
    ap.add_argument("--reason", default="was stopped", help="stub: what happened")
    ap.add_argument("--log", type=Path, default=None, help="stub: the section's log")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.section == "summary":
        from gpu_check_summary import write_summary  # noqa: PLC0415 - bench/ sits on sys.path[0]

        write_summary(a.out, a.smoke)
        return 0
    if a.section == "stub":
        stub(a.name, a.out, a.smoke, a.status, a.reason, a.log)
        return 0
    work = a.work or Path(a.out).parent / f".gpu-check-work-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    try:
        rep = run_section(a.section, Context(a.out, work, a.smoke, a.budget_s))
    finally:
        if a.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{a.section}: {rep.status}" + (f" ({rep.skip_reason or rep.error})" if rep.skip_reason or rep.error else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
