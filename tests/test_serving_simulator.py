"""The serving simulator: wrong data without the tracker, aborts and nothing wrong with it.

Together the property tests below run well over 10,000 randomised steps with injected faults.
"""

from __future__ import annotations

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from quantkit.serving.integrity.simulator import FAULT_KINDS, SimConfig, simulate

FAULTY_EXAMPLES, FAULTY_STEPS = 12, 900  # 10,800 steps with the tag tracker and faults
# A simulated run is seconds long: report the failing seed rather than spend minutes shrinking it.
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)


def _config(seed: int, fault_rate: float, page_size: int, tracker: str, steps: int) -> SimConfig:
    # Pool small enough that eviction and preemption happen, whatever the page size.
    return SimConfig(steps=steps, seed=seed, fault_rate=fault_rate, tracker=tracker, page_size=page_size,
                     num_pages=384 // page_size)  # fmt: skip


@settings(phases=NO_SHRINK, max_examples=FAULTY_EXAMPLES, deadline=None, derandomize=True)
@given(st.integers(0, 2**31), st.floats(0.02, 0.2), st.sampled_from([1, 2, 4]))
def test_tag_tracker_catches_every_fault_that_would_serve_wrong_data(seed, fault_rate, page_size):
    res = simulate(_config(seed, fault_rate, page_size, "tags", FAULTY_STEPS))
    assert res.steps == FAULTY_STEPS
    assert res.faults_injected > 0
    assert res.wrong_data_served == 0
    assert res.uncaught_corrupting_faults == 0
    assert res.faults_caught >= res.faults_that_would_corrupt
    assert res.false_aborts == 0


@settings(phases=NO_SHRINK, max_examples=4, deadline=None, derandomize=True)
@given(st.integers(0, 2**31), st.sampled_from([1, 4]), st.sampled_from(["tags", "noop"]))
def test_fault_free_runs_have_no_aborts_and_no_wrong_data(seed, page_size, tracker):
    res = simulate(_config(seed, 0.0, page_size, tracker, 400))
    assert res.faults_injected == 0
    assert res.aborts == res.false_aborts == res.wrong_data_served == 0
    assert res.finished > 0 and res.decode_tokens > 0


@settings(phases=NO_SHRINK, max_examples=6, deadline=None, derandomize=True)
@given(st.integers(0, 2**31), st.sampled_from([1, 4]))
def test_without_the_tracker_faults_serve_wrong_data(seed, page_size):
    res = simulate(_config(seed, 0.1, page_size, "noop", 600))
    assert res.faults_caught == 0 and res.aborts == 0
    assert res.faults_that_would_corrupt > 0
    assert res.wrong_data_served > 0


def test_same_seed_same_workload_both_ways():
    tags = simulate(SimConfig(steps=800, seed=11, fault_rate=0.05, tracker="tags"))
    noop = simulate(SimConfig(steps=800, seed=11, fault_rate=0.05, tracker="noop"))
    assert tags.wrong_data_served == 0 < noop.wrong_data_served
    assert tags.faults_caught > 0 and tags.preemptions > 0 and tags.evictions > 0
    assert set(tags.faults_by_kind) == set(FAULT_KINDS) and all(tags.faults_by_kind.values())
    assert simulate(SimConfig(steps=300, seed=11, fault_rate=0.05)) == simulate(
        SimConfig(steps=300, seed=11, fault_rate=0.05)
    )


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="tracker"):
        simulate(SimConfig(tracker="maybe"))
    with pytest.raises(ValueError, match="fault_rate"):
        simulate(SimConfig(fault_rate=2.0))
