"""The integrity bench: real timings on a tiny grid, and the decode-step source it reports."""

from __future__ import annotations

import sys

import torch

from quantkit.serving.integrity import bench


def test_bench_config_times_a_clean_state_and_reports_fractions():
    row = bench.bench_config(2, 256, 1, torch.device("cpu"), repeats=5)  # a median: one stalled sample cannot flip it
    assert row.entries == 512 and row.backend == "torch"
    assert row.check_us > row.noop_us > 0
    for model in bench.MODELS:
        step_s, _ = bench.decode_step(model, 2, 256)
        assert abs(row.fractions[model] - row.check_us * 1e-6 / step_s) < 1e-12
        assert row.fits_pool[model]


def test_decode_step_falls_back_to_the_documented_constant_without_the_planner(monkeypatch):
    monkeypatch.setitem(sys.modules, "quantkit.plan.throughput", None)  # import now raises ImportError
    seconds, source = bench.decode_step("glm-5.2", 1, 8192)
    assert source.startswith("fallback")
    assert abs(seconds - (1 / 92 + 8192 * 61_464 / 4.8e12)) < 1e-12
    longer, _ = bench.decode_step("glm-5.2", 64, 131072)
    assert longer > seconds  # the KV-read term grows with batch x context
