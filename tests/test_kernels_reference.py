"""The torch oracles against compressed-tensors itself and against plain loops: if these hold, the
kernel tests that compare with the oracles prove the kernels read the real checkpoint format."""

import os

import torch

if not torch.cuda.is_available():  # compressed_tensors imports triton: fix the interpreter mode first
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402

from quantkit.kernels import reference  # noqa: E402


def _packed(n: int, k: int, g: int, seed: int = 0, experts: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    lead = () if experts is None else (experts,)
    q = torch.randint(-8, 8, (*lead, n, k), dtype=torch.int8, generator=gen)
    scale = (torch.rand(*lead, n, -(-k // g), generator=gen) * 0.1 + 0.01).to(torch.bfloat16)
    return q, pack_to_int32(q, 4), scale


@pytest.mark.parametrize("k", [8, 64, 100, 256])
def test_unpack_inverts_compressed_tensors_pack(k: int) -> None:
    q, packed, _ = _packed(5, k, 32)
    assert packed.shape == (5, -(-k // 8))
    assert torch.equal(reference.unpack_int4(packed, k), q)
    assert torch.equal(reference.unpack_int4(packed, k), unpack_from_int32(packed, 4, torch.Size([5, k])))


def test_nibble_order_is_lowest_first_offset_binary() -> None:
    # one word holding q = -8, -7, ..., -1 in columns 0..7 -> nibbles 0..7 from the low end
    word = sum(i << (4 * i) for i in range(8))
    unpacked = reference.unpack_int4(torch.tensor([[word]], dtype=torch.int32), 8)
    assert unpacked.tolist() == [[-8, -7, -6, -5, -4, -3, -2, -1]]


def test_dequant_matches_compressed_tensors_compressor() -> None:
    g, n, k = 32, 48, 256
    w = torch.randn(n, k).to(torch.bfloat16)
    scale = (w.float().reshape(n, -1, g).abs().amax(-1) / 7.5).to(torch.bfloat16)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=g))
    stored = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    expected = PackedQuantizationCompressor.decompress(stored, scheme)["weight"]
    mine = reference.dequantize_w4(stored["weight_packed"], stored["weight_scale"], g, k)
    assert torch.equal(mine.to(torch.bfloat16), expected)


def test_dequant_edge_group_uses_its_own_scale() -> None:
    q, packed, scale = _packed(3, 96, 64)  # two groups, the second only half full
    w = reference.dequantize_w4(packed, scale, 64, 96)
    assert torch.equal(w[:, :64], q[:, :64].float() * scale[:, :1].float())
    assert torch.equal(w[:, 64:], q[:, 64:].float() * scale[:, 1:].float())


def test_linear_ref_is_fp32_matmul_of_dequantized_weights() -> None:
    _, packed, scale = _packed(40, 128, 32)
    x = torch.randn(7, 128)
    w = reference.dequantize_w4(packed, scale, 32, 128).double()
    torch.testing.assert_close(reference.w4a16_linear_ref(x, packed, scale, 32).double(), x.double() @ w.T,
                               rtol=1e-5, atol=1e-4)


def test_moe_align_groups_slots_by_expert() -> None:
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [1, 0]])
    sorted_slots, block_expert, num_padded = reference.moe_align(ids, num_experts=5, block_m=4)
    assert int(num_padded) == sorted_slots.numel() == 4 * block_expert.numel()
    sentinel = ids.numel()
    real = sorted_slots[sorted_slots != sentinel]
    assert sorted(real.tolist()) == list(range(ids.numel()))
    flat = ids.reshape(-1)
    for b, expert in enumerate(block_expert.tolist()):
        block = sorted_slots[4 * b: 4 * b + 4]
        assert all(int(flat[s]) == expert for s in block.tolist() if s != sentinel)
    assert block_expert.tolist() == [0, 1, 3]  # experts 2 and 4 get no block


def test_moe_ref_matches_per_slot_loop() -> None:
    _, packed, scale = _packed(24, 64, 32, experts=4)
    ids = torch.tensor([[0, 2], [2, 3], [1, 0]])
    weights = torch.rand(3, 2)
    for x in (torch.randn(3, 64), torch.randn(6, 64)):
        out = reference.w4a16_moe_ref(x, packed, scale, weights, ids, 32)
        for t in range(3):
            for j in range(2):
                row = x[t] if x.shape[0] == 3 else x[2 * t + j]
                w = reference.dequantize_w4(packed[ids[t, j]], scale[ids[t, j]], 32, 64)
                torch.testing.assert_close(out[t, j], weights[t, j] * (row @ w.T), rtol=1e-5, atol=1e-5)


def test_fp8_ref_saturates_and_rounds_half_to_even() -> None:
    x = torch.tensor([1e6, -1e6, 1.0625, 1.1875, 2.0 ** -10, -(2.0 ** -9)])
    q = reference.fp8_kv_quant_ref(x, 1.0).to(torch.float32)
    # 1.0625 lies halfway between 1.0 and 1.125 (even mantissa: 1.0); 1.1875 between 1.125 and 1.25
    # (even: 1.25); 2^-10 is half the smallest subnormal 2^-9 (even: 0)
    assert q.tolist() == [448.0, -448.0, 1.0, 1.25, 0.0, -(2.0 ** -9)]
    back = reference.fp8_kv_dequant_ref(reference.fp8_kv_quant_ref(x, 0.5), 0.5, torch.float32)
    assert back[0] == 224.0  # 1e6 / 0.5 saturates at 448, times 0.5
