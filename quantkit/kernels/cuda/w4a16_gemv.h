// Host entry of the W4A16 GEMV kernel, free of CUDA and torch headers so that the torch binding
// (w4a16_gemv_binding.cpp) and the kernel (w4a16_gemv.cu) compile separately.
#pragma once
#include <cstdint>

namespace quantkit {

enum class ActDtype : int { kBFloat16 = 0, kFloat16 = 1 };

// out[M, N] = x[M, K] @ dequant(W).T for M <= kMaxRows, W in compressed-tensors pack-quantized form:
// weight_packed int32 [N, K/8] (nibble i of word w = column 8w+i, stored q+8), weight_scale [N, K/group]
// in the activation dtype. Needs K % 32 == 0 and group_size in {32, 64, 128}. Returns a cudaError_t.
constexpr int kMaxRows = 8;

int w4a16_gemv_launch(const void* x, const int32_t* weight_packed, const void* weight_scale, void* out,
                      int M, int N, int K, int group_size, int64_t stride_xm, ActDtype dtype, void* stream);

}  // namespace quantkit
