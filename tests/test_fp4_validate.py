"""`quantkit validate` on FP4 checkpoints: quantkit's own passes; the layout llm-compressor's data-free
`model_free_ptq` writes for an MoE (each expert's gate_proj and up_proj with their own global scales) is
refused, naming the group — the peer's output is built here by the peer itself."""

from __future__ import annotations

import pytest

from quantkit.convert.pipeline import convert
from quantkit.quant.recipe import load_recipe
from quantkit.validate.checkpoint import validate_checkpoint


def _check(report, name):
    return next(c for c in report.checks if c.name == name)


@pytest.fixture(scope="module")
def peer_nvfp4(tmp_path_factory):
    from compressed_tensors.quantization import preset_name_to_scheme
    from llmcompressor import model_free_ptq

    from quantkit.checkpoint.synth import make_checkpoint

    root = tmp_path_factory.mktemp("peer")
    src = make_checkpoint(root / "src", "deepseek_v3", "bf16")
    scheme = preset_name_to_scheme("NVFP4A16", ["re:.*mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$"])
    model_free_ptq(str(src), str(root / "peer"), scheme=scheme, ignore=[], max_workers=1)
    return src, root / "peer"


def test_validate_refuses_the_peers_unfused_global_scales(peer_nvfp4):
    _, peer = peer_nvfp4
    report = validate_checkpoint(peer)
    check = _check(report, "fused global scales")
    assert check.status == "fail" and "experts." in check.detail and "gate_up_proj" in check.detail, check.detail
    assert not report.ok


def test_validate_accepts_quantkits_fused_nvfp4(peer_nvfp4, tmp_path):
    src, _ = peer_nvfp4
    convert(src, tmp_path / "ours", load_recipe("deepseek-v3-w4a16-g32", {}, {"scheme": "nvfp4a16"}))
    report = validate_checkpoint(tmp_path / "ours", source=src)
    assert _check(report, "fused global scales").status == "ok"
    assert _check(report, "quantization_config").detail.startswith("NVFP4 A16")
    assert report.ok, [c for c in report.checks if c.status == "fail"]
