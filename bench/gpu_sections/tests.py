"""tests: the kernel and serving test files on the GPU (TRITON_INTERPRET=0), per-file counts; files whose
packages are missing are listed, not run."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import TypedDict

from gpu_sections.common import REPO, Context, Report, Skip, device_name, require, torch_device

SMOKE_TESTS = ("test_serving_bench.py",)
FIRST_TESTS = ("test_kernels_cuda.py", "test_serving_check.py")  # the ones that only mean something on a GPU


class PytestCounts(TypedDict):
    """What `parse_pytest` reads from `pytest -v -rfE` output."""

    files: dict[str, dict[str, int]]  # per file: outcome -> count
    totals: dict[str, int]
    problems: list[str]  # the first 30 FAILED / ERROR lines
    final_line: str | None


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


def parse_pytest(output: str) -> PytestCounts:
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
    return PytestCounts(files=files, totals=totals, problems=problems[:30], final_line=final)


def run(ctx: Context, rep: Report) -> None:
    """Run the kernel/serving test files whose imports are all present, with TRITON_INTERPRET=0 on a GPU."""
    require("pytest")
    if not ctx.smoke:  # (the smoke run spares itself a torch import: pytest's process has its own)
        rep.device = device_name(torch_device(ctx))
    else:
        rep.device = "cpu"
    conftest_missing = missing_modules(REPO / "tests" / "conftest.py")
    runnable: list[str] = []
    not_run: dict[str, str] = {}
    for path in gpu_test_files(ctx.smoke):
        missing = sorted(missing_modules(path) | conftest_missing)
        rel = str(path.relative_to(REPO))
        if missing:
            not_run[rel] = f"missing package(s): {', '.join(missing)}"
        else:
            runnable.append(rel)
    rep.figures["not_run"] = not_run
    if not runnable:
        raise Skip(f"no test file can be imported here: {not_run}")
    interpret = "1" if ctx.smoke else "0"
    env = {**os.environ, "TRITON_INTERPRET": interpret, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-v", "-rfE", "-p", "no:cacheprovider", *runnable]
    rep.figures["command"] = f"TRITON_INTERPRET={interpret} python -m pytest -v -rfE " + " ".join(runnable)
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


