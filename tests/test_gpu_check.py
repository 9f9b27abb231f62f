"""`bench/gpu_check.sh --smoke`: the H200 check's own code paths at tiny sizes on the CPU, and its bookkeeping
(time boxes, killed sections, missing packages, pass/fail against the targets) without a GPU."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from quantkit.kernels import bench

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("tests", "kernels", "integrity", "sglang_plugin", "gptq_tiny", "gptq_layer", "rtn")
TORCH_ONLY = ("kernels", "integrity", "sglang_plugin", "gptq_layer", "rtn")  # need nothing but torch: must run


# A section that never ends on its own: the driver's time box always wins the race, on any machine.
BLOCKS_UNTIL_KILLED = '''"""A section that blocks until the driver kills it."""
import threading


def run(ctx, rep):
    threading.Event().wait()
'''


@pytest.fixture()
def gc(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """bench/gpu_check.py (the driver) as a module (bench/ is not a package)."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    return importlib.import_module("gpu_check")


@pytest.fixture()
def sections(gc: ModuleType) -> ModuleType:
    """bench/gpu_sections: the registry (its `common` and section modules beside it)."""
    return importlib.import_module("gpu_sections")


@pytest.fixture()
def tests_section(gc: ModuleType) -> ModuleType:
    """bench/gpu_sections/tests.py: which test files can run here, and pytest's output counted."""
    return importlib.import_module("gpu_sections.tests")


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHON": sys.executable, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO), **extra}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("gpu-out")
    env = _env(OUT=str(out), GPU_CHECK_WHEELS=str(out / "no-wheels"))  # this machine's packages only
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--smoke"], env=env,
                          cwd=tmp_path_factory.mktemp("cwd"), capture_output=True, text=True, timeout=900)
    return out, proc


def _sections(out: Path) -> dict[str, dict]:
    return {name: json.loads((out / f"{name}.json").read_text()) for name in SECTIONS}


def test_smoke_run_writes_valid_files_within_the_limit(smoke) -> None:
    out, proc = smoke
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all((out / f).is_file() for f in files)
    assert files == sorted([f"{s}.json" for s in SECTIONS] + ["summary.md"])
    for name, data in _sections(out).items():  # every file parses (strict JSON: no NaN) and says how it ended
        assert data["section"] == name and data["smoke"] is True
        assert data["figures"] or data["skip_reason"], name
        assert data["status"] in ("ok", "skipped"), (name, data["status"], data.get("error"), data["notes"])
        if data["status"] == "skipped":
            assert data["skip_reason"].startswith("missing package"), data["skip_reason"]
    assert all(_sections(out)[name]["status"] == "ok" for name in TORCH_ONLY)


def test_smoke_sections_measure_through_the_real_code(smoke) -> None:
    s = _sections(smoke[0])
    rows = s["kernels"]["figures"]["rows"]
    assert {r["kind"] for r in rows} == {"linear", "moe", "fp8_kv"}
    assert {r["m"] for r in rows if r["kind"] == "linear"} == {1, 8}
    assert all(r["time_us"] > 0 and r["bf16_us"] > 0 for r in rows if r["kind"] in ("linear", "moe"))
    assert "gpus.yaml" in s["kernels"]["figures"]["hbm_source"] and s["kernels"]["figures"]["hbm_gbps"] == 4800.0
    assert {r["batch"] for r in s["integrity"]["figures"]["rows"]} == {1, 2}
    assert all(set(r["fractions"]) == {"kimi-k2.6", "glm-5.2"} for r in s["integrity"]["figures"]["rows"])
    layer = s["gptq_layer"]["figures"]
    assert layer["solver"]["experts_done"] == 8 and not layer["solver"]["extrapolated"]
    assert layer["solver"]["gptq_better_than_rtn"] > 0.5  # the solver, not RTN, produced these codes
    assert layer["projection"]["label"].startswith("PROJECTION")
    assert s["rtn"]["figures"]["codes_and_scales_identical_to_cpu"] == 1.0
    pd_rows = s["sglang_plugin"]["figures"]["pd_rows"]  # issue 19: the PD plugin's page conversion, per page
    assert [r["page_size"] for r in pd_rows] == [1, 64] and all(r["us_per_page"] > 0 for r in pd_rows)
    assert s["rtn"]["figures"]["throughput"]["matrices"] == 24
    if s["gptq_tiny"]["status"] == "ok":
        tiny = s["gptq_tiny"]["figures"]
        assert tiny["runs"]["cpu"]["kl_mean"] > 0 and tiny["packed_words_identical"] == 1.0
    if s["tests"]["status"] == "ok":
        assert s["tests"]["figures"]["totals"].get("passed", 0) >= 1
        assert not s["tests"]["figures"]["totals"].get("failed")


def test_smoke_summary_lists_targets_as_not_applicable(smoke, sections) -> None:
    text = (smoke[0] / "summary.md").read_text()
    assert "Smoke run" in text
    targets = text.split("## Targets")[1].split("## Sections")[0]
    verdict_rows = [line for line in targets.splitlines() if line.startswith("| ") and "verdict" not in line]
    assert len(verdict_rows) == 6 and all(line.split("|")[4].strip() == "n/a" for line in verdict_rows)
    assert all(title in text for title in sections.SECTIONS.values())


def test_time_box_keeps_what_was_measured(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "integrity", "--smoke",
                           "--budget-s", "0.01", "--out", str(tmp_path)], env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "integrity.json").read_text())
    assert data["status"] == "partial" and len(data["figures"]["rows"]) == 1
    assert any("time box" in n for n in data["notes"])


def test_driver_kills_a_section_at_its_box_and_goes_on(tmp_path: Path) -> None:
    bench = tmp_path / "checkout" / "bench"  # a copy of the check whose rtn section blocks until it is killed
    shutil.copytree(REPO / "bench" / "gpu_sections", bench / "gpu_sections",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("gpu_check.sh", "gpu_check.py", "gpu_check_summary.py"):
        shutil.copy2(REPO / "bench" / name, bench / name)
    (bench / "gpu_sections" / "rtn.py").write_text(BLOCKS_UNTIL_KILLED)
    out = tmp_path / "out"
    env = _env(OUT=str(out), GPU_CHECK_BOXES="rtn=1", GPU_CHECK_WHEELS=str(tmp_path / "none"))
    proc = subprocess.run(["bash", str(bench / "gpu_check.sh"), "--smoke", "--only", "rtn"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((out / "rtn.json").read_text())
    assert data["status"] == "timeout" and "1 s time box" in (data["skip_reason"] or " ".join(data["notes"]))
    assert sorted(p.name for p in out.iterdir()) == ["rtn.json", "summary.md"]
    assert "| not run |" in (out / "summary.md").read_text()  # the sections left out say so


def test_stub_marks_a_killed_section_and_keeps_its_rows(gc, sections, tmp_path: Path) -> None:
    common = importlib.import_module("gpu_sections.common")
    rep = common.Report("kernels", sections.SECTIONS["kernels"], False, tmp_path, figures={"rows": [{"m": 1}]})
    rep.save()  # what a section leaves behind while it is still "running"
    log = tmp_path / "kernels.log"
    log.write_text("compiling...\nlast line before the kill\n")
    gc.stub("kernels", tmp_path, False, "timeout", "hit its 150 s time box", log)
    data = json.loads((tmp_path / "kernels.json").read_text())
    assert data["status"] == "timeout" and data["figures"]["rows"] == [{"m": 1}]
    assert any("last line before the kill" in n for n in data["notes"])
    gc.stub("rtn", tmp_path, False, "error", "exited with status 139", None)  # died before writing anything
    data = json.loads((tmp_path / "rtn.json").read_text())
    assert data["status"] == "error" and "139" in data["skip_reason"]


def test_missing_packages_are_found_through_quantkit_imports(tests_section, tmp_path: Path) -> None:
    test = tmp_path / "test_x.py"
    test.write_text("import os\nimport qk_absent_pkg_one.sub\nfrom quantkit.kernels import bench\n"
                    "if True:\n    from qk_absent_pkg_two import thing\n"
                    "def later():\n    import qk_absent_in_function\n")
    assert tests_section.missing_modules(test) == {"qk_absent_pkg_one", "qk_absent_pkg_two"}
    assert tests_section.missing_modules(REPO / "quantkit" / "kernels" / "bench.py") == set()  # torch is here


def test_pytest_output_is_counted_per_file(tests_section) -> None:
    output = "\n".join([
        "tests/test_a.py::test_one PASSED                                   [ 25%]",
        "tests/test_a.py::test_two[1-2] FAILED                              [ 50%]",
        "tests/test_b.py::test_three SKIPPED (no nvcc)                      [ 75%]",
        "FAILED tests/test_a.py::test_two[1-2] - AssertionError: 3 != 4",
        "ERROR tests/test_c.py - ModuleNotFoundError: No module named 'x'",
        "=========== 1 failed, 1 passed, 1 skipped, 1 error in 12.34s ===========",
    ])
    res = tests_section.parse_pytest(output)
    assert res["files"]["tests/test_a.py"] == {"passed": 1, "failed": 1}
    assert res["files"]["tests/test_b.py"] == {"skipped": 1}
    assert res["files"]["tests/test_c.py"] == {"collection_error": 1}
    assert res["totals"] == {"passed": 1, "failed": 1, "skipped": 1, "collection_error": 1}
    assert res["final_line"].startswith("1 failed") and len(res["problems"]) == 2


def _kernel_row(kind: str, m: int, time_us: float, pct: float, bf16_us: float, layer: str = "l") -> dict:
    return {"kind": kind, "model": "glm-5.2", "layer": layer, "m": m, "n": 512, "k": 6144, "backend": "triton",
            "time_us": time_us, "gbytes": pct / 100 * 4800 * time_us * 1e-6, "gbps": pct / 100 * 4800,
            "pct_roofline": pct, "bf16_us": bf16_us, "speedup_vs_bf16": bf16_us / time_us,
            "speedup_vs_baseline": None, "notes": []}


def test_summary_verdicts_follow_the_targets(gc, tmp_path: Path) -> None:
    summary = importlib.import_module("gpu_check_summary")
    rows = [_kernel_row("linear", 1, 10.0, 85.0, 40.0, "a"), _kernel_row("linear", 1, 10.0, 70.0, 35.0, "b"),
            *[_kernel_row("moe", m, 10.0, 50.0, 25.0) for m in (1, 8, 32, 64)],
            _kernel_row("moe", 256, 10.0, 50.0, 5.0)]  # M = 256 is not a decode batch size here
    kernels = {"status": "ok", "figures": {"rows": rows, "hbm_gbps": 4800.0}}
    roof, speed = summary.gemv_targets(kernels, smoke=False)
    assert roof.verdict == "FAIL" and roof.measured.startswith("77.5%") and roof.detail.startswith("1/2")
    assert speed.verdict == "pass" and speed.measured.startswith("3.75x")
    assert summary.moe_target(kernels, smoke=False).verdict == "pass"
    rows[3]["speedup_vs_bf16"] = 1.9
    assert summary.moe_target(kernels, smoke=False).verdict == "FAIL"
    integrity = {"status": "ok", "figures": {"rows": [
        {"batch": 1, "context": 8192, "page_size": 64, "fractions": {"glm-5.2": 0.0014},
         "fits_pool": {"glm-5.2": True}},
        {"batch": 64, "context": 32768, "page_size": 1, "fractions": {"glm-5.2": 0.01},
         "fits_pool": {"glm-5.2": False}}]}}  # beyond the pool: shown, not judged
    assert summary.integrity_target(integrity, smoke=False).verdict == "pass"
    assert summary.integrity_target(None, smoke=False).detail == "section not run"


def test_real_shapes_come_from_the_bundled_configs_sharded_for_tp8() -> None:
    for model in ("glm-5.2", "kimi-k2.6"):
        dims = bench.config_dims(model)
        assert dims == bench.MODELS[model]
        full, tp8 = dict((n, (a, b)) for n, a, b in bench.linear_shapes(dims)), bench.linear_shapes(dims, 8)
        for layer, n, k in tp8:
            fn, fk = full[layer]
            split_out = layer in ("expert.gate_up_proj", "attn.q_b_proj", "attn.kv_b_proj")
            split_in = layer in ("expert.down_proj", "attn.o_proj")
            assert (n, k) == ((fn // 8 if split_out else fn), (fk // 8 if split_in else fk)), layer
            assert k % dims["group"] == 0  # every TP8 shard still holds whole quantization groups


def test_every_section_module_is_registered_and_runnable(sections) -> None:
    modules = {p.stem for p in (REPO / "bench" / "gpu_sections").glob("*.py")} - {"__init__", "common"}
    assert modules == set(sections.BY_NAME)  # a section module is one registry line away from running
    assert all(callable(s.runner()) for s in sections.REGISTRY)
    order = [s.name for s in sections.run_order()]
    assert order[:4] == ["integrity", "sglang_plugin", "gptq_layer", "rtn"] and order[-1] == "gptq_tiny"
