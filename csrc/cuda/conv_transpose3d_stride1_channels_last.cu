// CUDA kernel of conv_transpose3d_stride1_channels_last (the math:
// ../conv_transpose3d_stride1_channels_last.h).
//
// On an sm_90 device, in a build with CUTLASS (cutlass_conv.cuh), CUTLASS's Hopper implicit-GEMM
// 3-D fprop: the convolution of x (NDHWC, GEMM K = (C, S, R, T) by im2col TMA loads, zeros
// outside x: the padding k - 1 - p) with the flipped, transposed kernel w' (KTRSC), its output y
// (NDHWC: GEMM M = (Q, P, Z, N), N = O) in x's dtype, the bias added in the epilogue; TF32 for
// float32 where PyTorch's convolutions round to TF32 (cuDNN enabled, its TF32 allowed for
// convolutions), bfloat16 operands for bfloat16, sums in float32. A 128 x 128 tile of (positions,
// output channels) per CTA; in TF32, clusters of 4 CTAs along M that load the filter's tile once by TMA
// multicast (SPEC's D on an H200: 2.54 ms against 2.94 without, 0.86x; bf16 1.42 either way:
// bench/bench_conv_transpose3d_stride1_variants.py, bench/results/conv_transpose3d_stride1_variants-*).
// x is read in place where it is channels_last_3d and 16-byte aligned, else from an NDHWC copy; w' is made
// by a copy (flipped_filter_kernel: the weight's size). Everything else -- float16, float64, float32 without
// TF32, another device, channels not a multiple of 16 bytes, sizes CUTLASS refuses (can_implement) or over
// 2^31 - 1 elements -- by aten.conv_transpose3d, as does a build without CUTLASS.

#ifdef FUSED_OPS_CUTLASS
#ifndef NDEBUG
#define NDEBUG  // before any header (cutlass_conv.cuh says why)
#endif
#endif

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <string>

#include "../conv_transpose3d_stride1_channels_last.h"

#ifdef FUSED_OPS_CUTLASS
#include "conv_transpose3d_stride1_fprop.cuh"
#endif

namespace fused_ops {
namespace {

#ifdef FUSED_OPS_CUTLASS

constexpr const char* kWhat = "conv_transpose3d_stride1_channels_last";

using FpropTf32 = CutlassConv<Operator::kFprop, 3, float, float, 128, 128, 32, /*kBias=*/true, /*kClusterM=*/4>;
using FpropBf16 = CutlassConv<Operator::kFprop, 3, cutlass::bfloat16_t, cutlass::bfloat16_t, 128, 128, 64, true>;

// Calls f(K) for the CUTLASS kernel these (checked) arguments take, and returns whether one does.
template <class F>
bool with_cutlass_kernel(const at::Tensor& x, const TransposedConvStride1& g, F&& f) {
  const auto take = [&](auto kernel) {
    if (!fprop_takes<decltype(kernel)>(x, g)) return false;
    f(kernel);
    return true;
  };
  if (tf32_convolution(x)) return take(FpropTf32{});
  if (x.scalar_type() == at::kBFloat16) return take(FpropBf16{});
  return false;
}

#endif  // FUSED_OPS_CUTLASS

at::Tensor conv_transpose3d_stride1_channels_last_cuda(const at::Tensor& x, const at::Tensor& weight,
                                                       const std::optional<at::Tensor>& bias,
                                                       at::IntArrayRef padding) {
  const TransposedConvStride1 g = transposed_conv_stride1_setup(x, weight, bias, padding);
  const c10::cuda::CUDAGuard guard(x.device());
#ifdef FUSED_OPS_CUTLASS
  at::Tensor y;
  if (with_cutlass_kernel(x, g, [&](auto kernel) { y = run_cutlass<decltype(kernel)>(kWhat, x, weight, bias, g); })) {
    return y;
  }
#endif
  return transposed_conv_stride1_by_aten(x, weight, bias, g);
}

std::string conv_transpose3d_stride1_channels_last_path_cuda(const at::Tensor& x, const at::Tensor& weight,
                                                             const std::optional<at::Tensor>& bias,
                                                             at::IntArrayRef padding) {
  [[maybe_unused]] const TransposedConvStride1 g = transposed_conv_stride1_setup(x, weight, bias, padding);
  const c10::cuda::CUDAGuard guard(x.device());
#ifdef FUSED_OPS_CUTLASS
  std::string name = kStride1ByAten;
  with_cutlass_kernel(x, g, [&](auto kernel) { name = kernel_name<decltype(kernel)>(); });
  return name;
#else
  return std::string(kStride1ByAten) + " (built without CUTLASS)";
#endif
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("conv_transpose3d_stride1_channels_last", &conv_transpose3d_stride1_channels_last_cuda);
  m.impl("conv_transpose3d_stride1_channels_last_path", &conv_transpose3d_stride1_channels_last_path_cuda);
}

}  // namespace fused_ops
