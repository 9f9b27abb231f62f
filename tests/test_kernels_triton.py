"""Every Triton kernel against the torch oracle: on a GPU for real, on a CPU under TRITON_INTERPRET=1.

Shapes stay small (K <= 1024, N <= 512) because the interpreter runs each program with numpy; the
launch configs are forced so that every kernel body runs: the dot-free GEMV, split-K with atomics,
the 16-row dot with the scale applied after the dot (BLOCK_K <= group) and per group (BLOCK_K > group),
the tiled path, odd N and M, a partial last K block and a partial last group.
"""

import os
import sys

import torch

_TRITON_WAS_IMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

if _TRITON_WAS_IMPORTED and not torch.cuda.is_available():
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; run with TRITON_INTERPRET=1",
                allow_module_level=True)

from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # noqa: E402

from quantkit.kernels import reference  # noqa: E402
from quantkit.kernels.triton_fp8kv import triton_fp8_kv_dequant, triton_fp8_kv_quant  # noqa: E402
from quantkit.kernels.triton_moe import MoeConfig, triton_w4a16_moe  # noqa: E402
from quantkit.kernels.triton_w4a16 import W4A16Config, interpreting, triton_w4a16_linear  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() and not interpreting() else "cpu")


def _layer(n: int, k: int, g: int, seed: int = 0, experts: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    lead = () if experts is None else (experts,)
    q = torch.randint(-8, 8, (*lead, n, k), dtype=torch.int8, generator=gen)
    scale = (torch.rand(*lead, n, -(-k // g), generator=gen) * 0.05 + 0.005).to(torch.bfloat16)
    return pack_to_int32(q, 4).to(DEVICE), scale.to(DEVICE)


def _close(out: torch.Tensor, ref: torch.Tensor, bf16: bool = False) -> None:
    tol = 2e-2 if bf16 else 1e-4
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), rtol=tol, atol=tol * ref.abs().max().item())


LINEAR_CASES = [
    # m, n, k, g, config (None = the dispatcher's heuristic)
    (1, 64, 256, 32, None),
    (1, 96, 512, 64, W4A16Config(1, 32, 128, split_k=2)),  # GEMV, split-K, BLOCK_K spans 2 groups
    (5, 37, 320, 64, None),  # odd M and N, last K block partial
    (16, 64, 512, 128, W4A16Config(16, 64, 64, split_k=4)),  # scale after the dot, split-K atomics
    (13, 48, 256, 32, W4A16Config(16, 32, 128)),  # dot with per-group scaling in the block
    (33, 100, 384, 128, None),  # tiled path, edge tiles in M and N
    (3, 40, 96, 64, W4A16Config(16, 64, 32)),  # partial last group (96 = 64 + 32)
]


@pytest.mark.parametrize("m,n,k,g,config", LINEAR_CASES)
def test_w4a16_linear_matches_reference(m: int, n: int, k: int, g: int, config: W4A16Config | None) -> None:
    wp, ws = _layer(n, k, g, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    out = triton_w4a16_linear(x, wp, ws, g, config)
    assert out.shape == (m, n) and out.dtype == x.dtype
    _close(out, reference.w4a16_linear_ref(x, wp, ws, g))


def test_w4a16_linear_rejects_non_power_of_two_blocks() -> None:
    wp, ws = _layer(48, 256, 32)
    with pytest.raises(ValueError, match="powers of two"):
        triton_w4a16_linear(torch.randn(2, 256).to(DEVICE), wp, ws, 32, W4A16Config(16, 48, 128))


def test_w4a16_linear_bf16_activations() -> None:
    wp, ws = _layer(64, 256, 32)
    x = torch.randn(4, 256).to(torch.bfloat16).to(DEVICE)
    out = triton_w4a16_linear(x, wp, ws, 32)
    assert out.dtype == torch.bfloat16
    _close(out, reference.w4a16_linear_ref(x.float(), wp, ws, 32), bf16=True)


def test_w4a16_linear_strided_activations() -> None:
    wp, ws = _layer(32, 128, 32)
    x = torch.randn(3, 256).to(DEVICE)[:, ::2]  # non-contiguous rows are copied, not misread
    _close(triton_w4a16_linear(x, wp, ws, 32), reference.w4a16_linear_ref(x.contiguous(), wp, ws, 32))


def _routing(tokens: int, top_k: int, experts: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts - 1, generator=gen)[:top_k] for _ in range(tokens)])  # last unused
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
    return weights.to(DEVICE), ids.to(DEVICE)


@pytest.mark.parametrize("per_slot_rows,config,mul", [
    (False, None, True),  # gate/up: every choice reads its token's row
    (True, None, True),  # down: one row per slot
    (False, MoeConfig(16, 32, 64, split_k=2), False),  # split-K, routing weight not applied
])
def test_w4a16_moe_matches_reference(per_slot_rows: bool, config: MoeConfig | None, mul: bool) -> None:
    experts, n, k, g, tokens, top_k = 6, 40, 192, 64, 5, 2
    wp, ws = _layer(n, k, g, experts=experts)
    weights, ids = _routing(tokens, top_k, experts)
    x = torch.randn(tokens * top_k if per_slot_rows else tokens, k).to(DEVICE)
    out = triton_w4a16_moe(x, wp, ws, weights, ids, g, mul_routed_weight=mul, config=config)
    assert out.shape == (tokens, top_k, n)
    _close(out, reference.w4a16_moe_ref(x, wp, ws, weights, ids, g, mul_routed_weight=mul))


def test_w4a16_moe_expert_spanning_several_blocks() -> None:
    experts, n, k, g = 3, 32, 128, 32
    wp, ws = _layer(n, k, g, seed=5, experts=experts)
    ids = torch.tensor([[0, 2]] * 20 + [[2, 1]] * 3).to(DEVICE)  # expert 2: 23 slots -> 2 blocks of 16
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    x = torch.randn(ids.shape[0], k).to(DEVICE)
    _close(triton_w4a16_moe(x, wp, ws, weights, ids, g), reference.w4a16_moe_ref(x, wp, ws, weights, ids, g))


def _fp8_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in representable steps between two e4m3fn tensors (sign-magnitude bit patterns)."""
    def ordinal(t: torch.Tensor) -> torch.Tensor:
        u = t.view(torch.uint8).to(torch.int32)
        return torch.where(u >= 128, -(u & 127), u & 127)

    return (ordinal(a.cpu()) - ordinal(b.cpu())).abs()


@pytest.mark.parametrize("shape,scale", [((37, 1, 576), 0.05), ((9, 128), 2.0 ** -7)])
def test_fp8_kv_quant_bit_patterns(shape: tuple[int, ...], scale: float) -> None:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3)) * 4
    flat = x.view(-1)
    flat[:8] = torch.tensor([1e5, -1e5, 1e-7, -1e-7, 0.0, 1.0625 * scale, 1.1875 * scale, 31.9 * scale])
    x = x.to(torch.bfloat16).to(DEVICE)
    q = triton_fp8_kv_quant(x, torch.tensor([scale]))
    ref = reference.fp8_kv_quant_ref(x, scale)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert int(_fp8_ulps(q, ref).max()) <= 1
    assert q.view(-1)[0].item() == 448.0 and q.view(-1)[1].item() == -448.0  # saturated, not NaN


def test_fp8_kv_quant_scatters_into_cache_slots() -> None:
    rows = torch.randn(6, 1, 576).to(DEVICE)
    cache = torch.zeros(20, 1, 576, dtype=torch.float8_e4m3fn, device=DEVICE)
    slots = torch.tensor([17, 2, 9, 0, 11, 5], device=DEVICE)
    triton_fp8_kv_quant(rows, 0.02, out=cache, slot_mapping=slots)
    expected = reference.fp8_kv_quant_ref(rows, 0.02)
    assert int(_fp8_ulps(cache[slots], expected).max()) <= 1
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert not cache.cpu()[untouched].float().any()


def test_fp8_kv_dequant_matches_reference() -> None:
    q = reference.fp8_kv_quant_ref(torch.randn(11, 576) * 3, 0.01).to(DEVICE)
    exact = triton_fp8_kv_dequant(q, 0.01, torch.float32)
    assert torch.equal(exact.cpu(), reference.fp8_kv_dequant_ref(q, 0.01, torch.float32).cpu())
    # bf16 output: the interpreter truncates fp32 -> bf16 instead of rounding, so allow one bf16 step
    half = triton_fp8_kv_dequant(q, 0.01, torch.bfloat16)
    ref = reference.fp8_kv_dequant_ref(q, 0.01, torch.bfloat16)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float().cpu(), ref.float().cpu(), rtol=2 ** -7, atol=0)
