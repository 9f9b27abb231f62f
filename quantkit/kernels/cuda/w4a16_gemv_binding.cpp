// torch binding of the W4A16 GEMV kernel: argument checks, output allocation, current stream.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "w4a16_gemv.h"

namespace {

torch::Tensor w4a16_gemv(torch::Tensor x, torch::Tensor weight_packed, torch::Tensor weight_scale,
                         int64_t group_size) {
  TORCH_CHECK(x.is_cuda() && weight_packed.is_cuda() && weight_scale.is_cuda(), "tensors must be on CUDA");
  TORCH_CHECK(x.dim() == 2 && weight_packed.dim() == 2 && weight_scale.dim() == 2, "2-D tensors expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, "x must be bf16 or fp16");
  TORCH_CHECK(weight_packed.scalar_type() == at::kInt, "weight_packed must be int32");
  const int64_t M = x.size(0), K = x.size(1), N = weight_packed.size(0);
  TORCH_CHECK(M >= 1 && M <= quantkit::kMaxRows, "GEMV handles 1..", quantkit::kMaxRows, " rows, got ", M);
  TORCH_CHECK(K % 32 == 0 && K % group_size == 0 && group_size % 32 == 0, "K % 32, K % group, group % 32");
  TORCH_CHECK(weight_packed.size(1) == K / 8, "weight_packed must be [N, K/8]");
  TORCH_CHECK(weight_scale.size(0) == N && weight_scale.size(1) == K / group_size, "weight_scale [N, K/g]");
  const c10::cuda::CUDAGuard guard(x.device());
  // The kernel reads activations 16 bytes at a time: rows contiguous and 16-byte aligned.
  const bool aligned = x.stride(1) == 1 && (x.stride(0) * x.element_size()) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  if (!aligned) x = x.clone(at::MemoryFormat::Contiguous);
  auto wp = weight_packed.contiguous();  // read 16 bytes at a time: re-align a view that starts mid-row
  if (reinterpret_cast<uintptr_t>(wp.data_ptr()) % 16 != 0) wp = wp.clone();
  auto ws = weight_scale.to(x.scalar_type()).contiguous();
  auto out = torch::empty({M, N}, x.options());
  const auto dtype = x.scalar_type() == at::kBFloat16 ? quantkit::ActDtype::kBFloat16 : quantkit::ActDtype::kFloat16;
  const int err = quantkit::w4a16_gemv_launch(x.data_ptr(), wp.data_ptr<int32_t>(), ws.data_ptr(), out.data_ptr(),
                                              static_cast<int>(M), static_cast<int>(N), static_cast<int>(K),
                                              static_cast<int>(group_size), x.stride(0), dtype,
                                              c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "w4a16_gemv launch failed with cudaError ", err);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("w4a16_gemv", &w4a16_gemv, "W4A16 GEMV on compressed-tensors pack-quantized weights (M <= 8)");
}
