"""GPU catalog: the six bundled GPUs and extension by a user YAML file."""

from __future__ import annotations

from pathlib import Path

import pytest

from quantkit.core.errors import QuantkitError
from quantkit.plan.catalog import get_gpu, load_catalog


def test_bundled_gpus_have_memory_bandwidth_and_flops() -> None:
    catalog = load_catalog()
    assert {"h100", "h200", "b200", "h20", "a100", "l40s"} <= set(catalog)
    for gpu in catalog.values():
        assert gpu.memory_mib > 40_000 and gpu.bandwidth_tbs > 0.5 and gpu.bf16_tflops > 100
        assert gpu.fp8_tflops is None or gpu.fp8_tflops >= 2 * gpu.bf16_tflops * 0.99
    h200 = get_gpu("H200")
    assert h200.memory_mib == 143771 and h200.bandwidth_tbs == 4.8
    assert get_gpu("a100").flops("fp8") == get_gpu("a100").flops("bf16")  # no FP8 units: W8A16


def test_yaml_file_adds_and_overrides(tmp_path: Path) -> None:
    extra = tmp_path / "gpus.yaml"
    extra.write_text(
        "gpus:\n  mi300x: {name: AMD MI300X, memory_mib: 196592, bandwidth_tbs: 5.3, bf16_tflops: 1307, "
        "fp8_tflops: 2615}\n  h200: {memory_mib: 140000, bandwidth_tbs: 4.8, bf16_tflops: 989}\n"
    )
    assert get_gpu("mi300x", extra).memory_mib == 196592
    assert get_gpu("h200", extra).memory_mib == 140000
    assert get_gpu("h100", extra).memory_mib == 81559


def test_bad_input_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(QuantkitError, match="unknown GPU"):
        get_gpu("tpu-v9")
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpus:\n  x: {name: X}\n")
    with pytest.raises(QuantkitError, match="bad.yaml"):
        load_catalog(bad)
