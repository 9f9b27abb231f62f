"""`quantkit simulate integrity` and `quantkit bench integrity` through the real CLI app."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from quantkit.cli import app
from quantkit.cli.serving import SIM_KEYS

runner = CliRunner()


def test_simulate_integrity_json_has_the_promised_figures():
    out = runner.invoke(app, ["simulate", "integrity", "--steps", "2000", "--json"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.output)
    assert set(SIM_KEYS) <= set(result)
    assert result["steps"] == 2000 and result["faults_injected"] > 0
    assert result["wrong_data_served"] == 0 and result["false_aborts"] == 0


def test_simulate_integrity_table_and_noop():
    out = runner.invoke(app, ["simulate", "integrity", "--steps", "300", "--tracker", "noop", "--fault-rate", "0.2"])
    assert out.exit_code == 0, out.output
    assert "wrong_data_served" in out.output and "tracker=noop" in out.output


def test_simulate_integrity_rejects_unknown_tracker():
    out = runner.invoke(app, ["simulate", "integrity", "--tracker", "sometimes"])
    assert out.exit_code != 0


def test_bench_integrity_json_small_grid():
    # medians of 5 samples: one stalled sample cannot flip the check against the no-op
    args = ["bench", "integrity", "--batches", "1,4", "--contexts", "512", "--page-sizes", "64,1",
            "--repeats", "5", "--json"]  # fmt: skip
    out = runner.invoke(app, args)
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output)["rows"]
    assert [(r["page_size"], r["batch"]) for r in rows] == [(64, 1), (64, 4), (1, 1), (1, 4)]
    assert [r["entries"] for r in rows] == [8, 32, 512, 2048]
    for r in rows:
        assert r["check_us"] > 0 and r["noop_us"] < r["check_us"]
        assert set(r["fractions"]) == {"kimi-k2.6", "glm-5.2"} and all(0 < f < 1 for f in r["fractions"].values())
        assert r["step_source"]


def test_bench_integrity_rejects_bad_lists():
    out = runner.invoke(app, ["bench", "integrity", "--batches", "x"])
    assert out.exit_code != 0
