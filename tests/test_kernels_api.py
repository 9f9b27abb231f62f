"""The public API in `quantkit.kernels`: dispatch rules, input validation, the benchmark and its CLI."""

import json
import os
import sys
from pathlib import Path

import torch

_TRITON_WAS_IMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

import quantkit.kernels as qk  # noqa: E402
from quantkit.kernels import bench, reference  # noqa: E402

CONFIGS = Path(qk.__file__).resolve().parent.parent / "plan" / "configs"  # the bundled release configs
# Triton runs on the GPU when there is one (and the interpreter is off), else on CPU tensors, interpreted
DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")
needs_triton = pytest.mark.skipif(_TRITON_WAS_IMPORTED and not torch.cuda.is_available(),
                                  reason="triton was imported before TRITON_INTERPRET=1 was set")


def _layer(n: int, k: int, g: int, experts: int | None = None):
    gen = torch.Generator().manual_seed(7)
    lead = () if experts is None else (experts,)
    q = torch.randint(-8, 8, (*lead, n, k), dtype=torch.int8, generator=gen)
    return pack_to_int32(q, 4), (torch.rand(*lead, n, -(-k // g), generator=gen) * 0.05).to(torch.bfloat16)


def test_public_names() -> None:
    assert set(qk.__all__) == {"w4a16_linear", "w4a16_moe", "fp8_kv_quant", "fp8_kv_dequant"}


def test_cpu_default_is_the_torch_reference() -> None:
    wp, ws = _layer(32, 128, 32)
    x = torch.randn(2, 3, 128)  # leading dims are flattened and restored
    out = qk.w4a16_linear(x, wp, ws, 32)
    assert out.shape == (2, 3, 32)
    assert torch.equal(out.reshape(6, 32), reference.w4a16_linear_ref(x.reshape(6, 128), wp, ws, 32))


@needs_triton
def test_forced_triton_backend_agrees() -> None:
    wp, ws = (t.to(DEVICE) for t in _layer(64, 256, 64))
    x = torch.randn(3, 256, device=DEVICE)
    torch.testing.assert_close(qk.w4a16_linear(x, wp, ws, 64, backend="triton"),
                               qk.w4a16_linear(x, wp, ws, 64, backend="torch"), rtol=1e-4, atol=1e-3)


@needs_triton
def test_moe_backends_agree() -> None:
    wp, ws = (t.to(DEVICE) for t in _layer(32, 128, 32, experts=4))
    ids = torch.tensor([[0, 3], [3, 1]], device=DEVICE)
    weights = torch.tensor([[0.7, 0.3], [0.4, 0.6]], device=DEVICE)
    x = torch.randn(2, 128, device=DEVICE)
    ref = qk.w4a16_moe(x, wp, ws, weights, ids, 32)
    torch.testing.assert_close(qk.w4a16_moe(x, wp, ws, weights, ids, 32, backend="triton"), ref,
                               rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("bad,match", [
    ({"group_size": 48}, "power of two"),
    ({"weight_packed": torch.zeros(32, 15, dtype=torch.int32)}, "does not pack"),
    ({"weight_scale": torch.zeros(32, 3)}, "weight_scale"),
    ({"weight_packed": torch.zeros(32, 16, dtype=torch.int64)}, "int32"),
    ({"backend": "marlin"}, "backend"),
])
def test_linear_rejects_bad_inputs(bad: dict, match: str) -> None:
    wp, ws = _layer(32, 128, 32)
    args = {"x": torch.randn(1, 128), "weight_packed": wp, "weight_scale": ws, "group_size": 32} | bad
    with pytest.raises(ValueError, match=match):
        qk.w4a16_linear(**args)


def test_linear_rejects_expert_stacks_and_handles_empty_batch() -> None:
    wp, ws = _layer(32, 128, 32, experts=2)
    with pytest.raises(ValueError, match="w4a16_moe"):
        qk.w4a16_linear(torch.randn(1, 128), wp, ws, 32)
    assert qk.w4a16_linear(torch.randn(0, 128), wp[0], ws[0], 32).shape == (0, 32)


def test_cuda_backend_refuses_cpu_tensors() -> None:
    wp, ws = _layer(32, 128, 32)
    with pytest.raises(ValueError, match="cuda backend"):
        qk.w4a16_linear(torch.randn(1, 128), wp, ws, 32, backend="cuda")


def test_moe_rejects_out_of_range_experts() -> None:
    wp, ws = _layer(32, 128, 32, experts=2)
    with pytest.raises(ValueError, match="topk_ids"):
        qk.w4a16_moe(torch.randn(1, 128), wp, ws, torch.ones(1, 1), torch.tensor([[2]]), 32)


@needs_triton
def test_fp8_torch_and_triton_write_the_same_cache() -> None:
    rows = (torch.randn(5, 576, generator=torch.Generator().manual_seed(0)) * 10).to(DEVICE)
    slots = torch.tensor([4, 0, 7, 2, 6], device=DEVICE)
    caches = []
    for backend in ("torch", "triton"):
        cache = torch.zeros(8, 576, dtype=torch.float8_e4m3fn, device=DEVICE)
        qk.fp8_kv_quant(rows, 0.1, out=cache, slot_mapping=slots, backend=backend)
        caches.append(cache.view(torch.uint8))
    assert torch.equal(caches[0], caches[1])
    back = qk.fp8_kv_dequant(caches[0].view(torch.float8_e4m3fn)[slots], 0.1, torch.float32)
    # |rows| / 0.1 stays below 448 here, so only rounding: relative 2^-4 (3 mantissa bits), or 2^-10 absolute
    assert ((back - rows).abs() <= rows.abs() * 2.0 ** -4 + 2.0 ** -10).all()


def test_fp8_dequant_rejects_non_fp8() -> None:
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        qk.fp8_kv_dequant(torch.zeros(2, 576), 1.0)


@pytest.mark.parametrize("model", sorted(bench.MODELS))
def test_benchmark_shapes_match_published_configs(model: str) -> None:
    cfg = json.loads((CONFIGS / model / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    mine = bench.MODELS[model]
    assert mine["hidden"] == cfg["hidden_size"] and mine["moe_inter"] == cfg["moe_intermediate_size"]
    assert mine["experts"] == cfg["n_routed_experts"] and mine["top_k"] == cfg["num_experts_per_tok"]
    assert (mine["q_lora"], mine["kv_lora"]) == (cfg["q_lora_rank"], cfg["kv_lora_rank"])
    assert (mine["nope"], mine["rope"], mine["v"]) == (cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                                                       cfg["v_head_dim"])
    assert mine["heads"] == cfg["num_attention_heads"]


def test_roofline_byte_count() -> None:
    # one 8192x8192 g=128 layer at M=1: 32 MiB of nibbles + 1 MiB of scales + activations
    assert bench.w4_bytes(1, 8192, 8192, 128) == 8192 * 4096 + 2 * 8192 * 64 + 2 * 8192 + 2 * 8192


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_bench_full_sweep_refuses_cpu() -> None:
    from quantkit.cli import app

    result = CliRunner().invoke(app, ["bench", "kernels", "--full"])
    assert result.exit_code != 0 and "needs a CUDA GPU" in str(result.exception)


def test_bench_cli_smoke_json() -> None:
    from quantkit.cli import app

    result = CliRunner().invoke(app, ["bench", "kernels", "--json", "--smoke"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    if data["device"] == "cpu":
        assert data["gpu_figures_pending"] and data["smoke"]
    assert {r["kind"] for r in data["rows"]} == {"linear", "moe"}
    assert all(r["time_us"] > 0 and r["gbps"] > 0 for r in data["rows"])
    assert data["max_abs_err_smoke"] < 1e-3
