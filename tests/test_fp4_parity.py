"""FP4 (NVFP4, MXFP4) bytes versus compressed-tensors' own path (llm-compressor's observers + CT's compressor),
across weight dtypes and edge cases; compressed-tensors 0.17 (vLLM's pin) in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fp4_refs import ct_compress

from quantkit.quant import fused
from quantkit.quant.fp4 import (
    dequantize_mxfp4,
    dequantize_nvfp4,
    mxfp4_quantize,
    nvfp4_global_scale,
    nvfp4_quantize,
    tensor_amax,
)

REPO = Path(__file__).resolve().parent.parent
CT017 = REPO / ".cache" / "engines" / "ct017"
_TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 4.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 6.0]


def edge_weight(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random rows over six decades plus: an all-zero group, -0.0, tiny negatives, exact E2M1 ties (the row's
    amax is 6 so the per-group scale is 1), denormal-size groups (fp16 MXFP4 scale underflow)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 256, generator=gen) * torch.logspace(-4, 2, 64).unsqueeze(1)
    w[0, :32] = 0
    w[1, :32] = -0.0
    w[1, 32:64] = -1e-30
    w[2] = torch.tensor(_TIES * 16)
    w[3] = -torch.tensor(_TIES * 16)
    w[4, 16:32] = 1e-38
    w[5, 32:64] = 1e-7
    w[5, 64:96] = 3e-5
    return w.to(dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _assert_same(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(ref)
    for k in ref:
        assert ours[k].dtype == ref[k].dtype and ours[k].shape == ref[k].shape, k
        assert torch.equal(_bytes(ours[k]), _bytes(ref[k])), k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_nvfp4_fused_pair_matches_compressed_tensors(dtype):
    """A gate/up pair fused by llm-compressor's observers: one global scale from both amaxes, same bytes."""
    gate, up = edge_weight(dtype, 0), (edge_weight(dtype, 1) * 3).to(dtype)
    ref = ct_compress([gate, up], "NVFP4A16")
    shared = nvfp4_global_scale(torch.maximum(tensor_amax(gate), tensor_amax(up)), dtype)
    for w, r in zip((gate, up), ref, strict=True):
        _assert_same(nvfp4_quantize(w, shared).tensors("m"), {f"m.{k}": v for k, v in r.items()})
    assert ref[0]["weight_global_scale"] == ref[1]["weight_global_scale"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_nvfp4_single_matches_compressed_tensors(dtype):
    w = edge_weight(dtype, 2)
    ref = ct_compress([w], "NVFP4A16")[0]
    _assert_same(nvfp4_quantize(w, nvfp4_global_scale(tensor_amax(w), dtype)).tensors("m"),
                 {f"m.{k}": v for k, v in ref.items()})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mxfp4_matches_compressed_tensors(dtype):
    w = edge_weight(dtype, 3)
    ref = ct_compress([w], "MXFP4A16")[0]
    _assert_same(mxfp4_quantize(w).tensors("m"), {f"m.{k}": v for k, v in ref.items()})


def test_all_zero_and_signed_zero_edge_cases():
    """An all-zero tensor (global scale from a zero amax: CT's 1.0 fallback is never hit in bf16, 2688/tiny)
    and -0.0 versus a tiny negative that rounds to zero: 0x0 versus 0x8, as CT."""
    zero = torch.zeros(16, 64, dtype=torch.bfloat16)
    ref = ct_compress([zero], "NVFP4A16")[0]
    ours = nvfp4_quantize(zero, nvfp4_global_scale(tensor_amax(zero), torch.bfloat16))
    _assert_same(ours.tensors("m"), {f"m.{k}": v for k, v in ref.items()})
    w = torch.full((16, 64), 6.0, dtype=torch.bfloat16)
    w[0, 0], w[0, 1] = -0.0, -1e-3
    packed = nvfp4_quantize(w, nvfp4_global_scale(tensor_amax(w), torch.bfloat16)).weight_packed
    assert packed[0, 0] == 0x80  # low nibble (column 0, -0.0) = 0x0, high nibble (column 1, tiny negative) = 0x8
    assert torch.equal(packed, ct_compress([w], "NVFP4A16")[0]["weight_packed"])


def test_fp8_block_source_dequantized_to_bf16_first():
    """An FP8-block weight: dequantize to bf16 (as the peer does), then quantize: same bytes as CT on that bf16."""
    gen = torch.Generator().manual_seed(5)
    raw = (torch.randn(256, 256, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(2, 2, generator=gen) * 1e-3 + 1e-5
    bf16, bad = fused.dequant_fp8_block_bf16(raw, scale_inv, (128, 128))
    assert bad == 0
    expected = (raw.float().view(2, 128, 2, 128) * scale_inv[:, None, :, None]).view(256, 256).to(torch.bfloat16)
    assert torch.equal(bf16, expected)
    for preset, ours in (("NVFP4A16", nvfp4_quantize(bf16, nvfp4_global_scale(tensor_amax(bf16), torch.bfloat16))),
                         ("MXFP4A16", mxfp4_quantize(bf16))):
        _assert_same(ours.tensors("m"), {f"m.{k}": v for k, v in ct_compress([expected], preset)[0].items()})


def test_dequantized_error_is_bounded():
    w = torch.randn(32, 128, dtype=torch.float32)
    nv = nvfp4_quantize(w, nvfp4_global_scale(tensor_amax(w), torch.float32))
    mx = mxfp4_quantize(w)
    # E2M1's widest step is 2 (between 4 and 6): |error| <= scale per group, relative error well under 30%
    for deq in (dequantize_nvfp4(nv), dequantize_mxfp4(mx)):
        assert deq.shape == w.shape
        assert (deq - w).norm() / w.norm() < 0.2


_CT017_SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1]); sys.path.insert(1, sys.argv[2])
import compressed_tensors
from fp4_refs import ct_only_compress
from test_fp4_parity import edge_weight
out = {"version": compressed_tensors.__version__}
for preset in ("NVFP4A16", "MXFP4A16"):
    ws = [edge_weight(torch.bfloat16, 0), edge_weight(torch.bfloat16, 1)]
    for i, r in enumerate(ct_only_compress(ws if preset == "NVFP4A16" else ws[:1], preset)):
        for k, v in r.items():
            v = v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v
            out[f"{preset}.{i}.{k}"] = v.contiguous().view(torch.uint8).flatten().tolist()
print(json.dumps(out))
"""


@pytest.mark.slow  # ~10-20 s (a fresh interpreter importing compressed-tensors 0.17)
@pytest.mark.skipif(not (CT017 / "compressed_tensors").is_dir(), reason="engine wheels not fetched (make engines)")
def test_compressed_tensors_017_gives_the_same_bytes():
    """vLLM pins compressed-tensors 0.17: its own compressor, run in a subprocess, gives our bytes too."""
    proc = subprocess.run([sys.executable, "-c", _CT017_SCRIPT, str(CT017), str(REPO / "tests")],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got.pop("version").startswith("0.17")
    gate, up = edge_weight(torch.bfloat16, 0), edge_weight(torch.bfloat16, 1)
    shared = nvfp4_global_scale(torch.maximum(tensor_amax(gate), tensor_amax(up)), torch.bfloat16)
    ours = {f"NVFP4A16.{i}.{k.removeprefix('m.')}": v for i, w in enumerate((gate, up))
            for k, v in nvfp4_quantize(w, shared).tensors("m").items()}
    ours |= {f"MXFP4A16.0.{k.removeprefix('m.')}": v for k, v in mxfp4_quantize(gate).tensors("m").items()}
    assert sorted(got) == sorted(ours)
    for k, v in ours.items():
        assert _bytes(v).contiguous().view(torch.uint8).flatten().tolist() == got[k], k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_numba_pass_equals_the_torch_ops(dtype, monkeypatch):
    """The fused CPU pass (group amax, quotient, E2M1, packing) gives the torch path's bytes."""
    import quantkit.quant.fp4 as fp4

    w = torch.cat([edge_weight(dtype, 7), (torch.randn(64, 256) * 50).to(dtype)])
    g = nvfp4_global_scale(tensor_amax(w), dtype)
    fused_nv, fused_mx = nvfp4_quantize(w, g), mxfp4_quantize(w)
    monkeypatch.setattr(fp4, "use_fused", False)
    torch_nv, torch_mx = nvfp4_quantize(w, g), mxfp4_quantize(w)
    for a, b in ((fused_nv, torch_nv), (fused_mx, torch_mx)):
        assert torch.equal(a.weight_packed, b.weight_packed)
        assert torch.equal(_bytes(a.weight_scale), _bytes(b.weight_scale))
