// W4A16 GEMV for decode (M <= 8): one warp per output row, reading the compressed-tensors layout as stored.
//
// Each lane loads 16 bytes of packed weights at a time (4 int32 words = 32 consecutive input columns,
// which never straddle a scale group because group_size is a multiple of 32), unpacks the 8 nibbles of
// each word with shifts, removes the +8 offset, and accumulates q * x in fp32 for every activation row.
// The group's scale multiplies the 32-column partial sum once. Lanes then reduce with warp shuffles.
// Weight loads are streamed (__ldcs, read once); activations (16-byte loads, rows 16-byte aligned) are
// re-read by every warp and stay cached.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "w4a16_gemv.h"

namespace quantkit {
namespace {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 4;

__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }

__device__ __forceinline__ float2 pair_to_f32(uint32_t v, __nv_bfloat16) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
}
__device__ __forceinline__ float2 pair_to_f32(uint32_t v, __half) {
  return __half22float2(*reinterpret_cast<const __half2*>(&v));
}

// sum_i (nibble_i - 8) * x_i over one packed word and the 8 activations it multiplies (one 16-byte load).
template <typename T>
__device__ __forceinline__ float dot_word(uint32_t word, uint4 xv) {
  const uint32_t xs[4] = {xv.x, xv.y, xv.z, xv.w};
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 xf = pair_to_f32(xs[i], T());
    s = fmaf(static_cast<float>((word >> (8 * i)) & 0xFu) - 8.f, xf.x, s);
    s = fmaf(static_cast<float>((word >> (8 * i + 4)) & 0xFu) - 8.f, xf.y, s);
  }
  return s;
}

// MT is the row tile (1, 2, 4 or 8); rows m >= M of a tile read row 0 again and are not stored, which keeps
// the inner loops free of branches.
template <typename T, int MT>
__global__ void w4a16_gemv_kernel(const T* __restrict__ x, const uint4* __restrict__ wp,
                                  const T* __restrict__ ws, T* __restrict__ out, int M, int N, int K,
                                  int group_size, int64_t stride_xm) {
  const int lane = threadIdx.x % kWarp;
  const int n = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp;
  if (n >= N) return;
  const int chunks = K / 32;  // 16-byte chunks per weight row
  const uint4* row = wp + static_cast<int64_t>(n) * chunks;
  const T* scale_row = ws + static_cast<int64_t>(n) * (K / group_size);
  float acc[MT];
  int64_t row_offset[MT];
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    acc[m] = 0.f;
    row_offset[m] = m < M ? m * stride_xm : 0;
  }

#pragma unroll 2
  for (int c = lane; c < chunks; c += kWarp) {
    const uint4 w = __ldcs(row + c);
    const int k0 = c * 32;
    const float s = to_f32(scale_row[k0 / group_size]);
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      const uint4* xr = reinterpret_cast<const uint4*>(x + row_offset[m] + k0);  // 8 activations each
      const float part = dot_word<T>(w.x, __ldg(xr)) + dot_word<T>(w.y, __ldg(xr + 1)) +
                         dot_word<T>(w.z, __ldg(xr + 2)) + dot_word<T>(w.w, __ldg(xr + 3));
      acc[m] = fmaf(part, s, acc[m]);
    }
  }
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    float v = acc[m];
#pragma unroll
    for (int off = kWarp / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == 0 && m < M) out[static_cast<int64_t>(m) * N + n] = from_f32<T>(v);
  }
}

template <typename T, int MT>
cudaError_t launch_rows(const void* x, const int32_t* wp, const void* ws, void* out, int M, int N, int K,
                        int group_size, int64_t stride_xm, cudaStream_t stream) {
  const dim3 grid((N + kWarpsPerBlock - 1) / kWarpsPerBlock);
  const dim3 block(kWarpsPerBlock * kWarp);
  w4a16_gemv_kernel<T, MT><<<grid, block, 0, stream>>>(
      static_cast<const T*>(x), reinterpret_cast<const uint4*>(wp), static_cast<const T*>(ws),
      static_cast<T*>(out), M, N, K, group_size, stride_xm);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_typed(const void* x, const int32_t* wp, const void* ws, void* out, int M, int N, int K,
                         int group_size, int64_t stride_xm, cudaStream_t stream) {
  if (M < 1 || M > kMaxRows) return cudaErrorInvalidValue;
  if (M == 1) return launch_rows<T, 1>(x, wp, ws, out, M, N, K, group_size, stride_xm, stream);
  if (M == 2) return launch_rows<T, 2>(x, wp, ws, out, M, N, K, group_size, stride_xm, stream);
  if (M <= 4) return launch_rows<T, 4>(x, wp, ws, out, M, N, K, group_size, stride_xm, stream);
  return launch_rows<T, 8>(x, wp, ws, out, M, N, K, group_size, stride_xm, stream);
}

}  // namespace

int w4a16_gemv_launch(const void* x, const int32_t* weight_packed, const void* weight_scale, void* out,
                      int M, int N, int K, int group_size, int64_t stride_xm, ActDtype dtype, void* stream) {
  if (K % 32 != 0 || group_size % 32 != 0 || K % group_size != 0) return cudaErrorInvalidValue;
  auto s = static_cast<cudaStream_t>(stream);
  if (dtype == ActDtype::kBFloat16)
    return launch_typed<__nv_bfloat16>(x, weight_packed, weight_scale, out, M, N, K, group_size, stride_xm, s);
  return launch_typed<__half>(x, weight_packed, weight_scale, out, M, N, K, group_size, stride_xm, s);
}

}  // namespace quantkit
