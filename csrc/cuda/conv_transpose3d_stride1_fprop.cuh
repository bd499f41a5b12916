// The CUTLASS Hopper 3-D fprop that conv_transpose3d_stride1_channels_last runs (its .cu says when, and the
// math: ../conv_transpose3d_stride1_channels_last.h): the problem and output strides as CUTLASS takes them,
// the flipped filter, one launch by a CutlassConv fprop type K. Shared by the op and the benchmark of its
// kernel variants (bench/bench_conv_transpose3d_stride1_variants.py). Only in a build with CUTLASS.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

#include "../conv_transpose3d_stride1_channels_last.h"
#include "cutlass_conv.cuh"

namespace fused_ops {

// fprop's problem: x (N, D, H, W, I) by the filter w' (O, kt, kr, ks, I), padded by k - 1 - p.
template <class K>
typename K::ProblemShape fprop_problem(const TransposedConvStride1& g) {
  using PS = typename K::ProblemShape;
  using Extent = typename PS::TensorExtent;
  using Spatial = typename PS::SpatialExtent;
  const Spatial pad = make_array<Spatial>(int(g.kernel[0] - 1 - g.padding[0]), int(g.kernel[1] - 1 - g.padding[1]),
                                          int(g.kernel[2] - 1 - g.padding[2]));
  return PS(cutlass::conv::Mode::kCrossCorrelation,
            make_array<Extent>(int(g.batch), int(g.in[0]), int(g.in[1]), int(g.in[2]), int(g.in_channels)),
            make_array<Extent>(int(g.out_channels), int(g.kernel[0]), int(g.kernel[1]), int(g.kernel[2]),
                               int(g.in_channels)),
            pad, pad, make_array<Spatial>(1, 1, 1), make_array<Spatial>(1, 1, 1), 1);
}

// fprop's output strides: M modes (q, p, z, n) of y (N, D', H', W', O), packed; N (o) is 1.
template <class K>
typename K::StrideD fprop_stride_d(const TransposedConvStride1& g) {
  typename K::StrideD stride{};
  cute::get<0, 0>(stride) = g.out_channels;
  cute::get<0, 1>(stride) = g.out(2) * g.out_channels;
  cute::get<0, 2>(stride) = g.out(1) * g.out(2) * g.out_channels;
  cute::get<0, 3>(stride) = g.out(0) * g.out(1) * g.out(2) * g.out_channels;
  return stride;
}

// Whether kernel K takes the (checked) call: an sm_90 device, extents within CUTLASS's int32, 16-byte rows of
// x's and w''s channels (TMA) and of y's (the epilogue's stores), and CUTLASS's own can_implement.
template <class K>
bool fprop_takes(const at::Tensor& x, const TransposedConvStride1& g) {
  if (!runs_sm90a(x.get_device())) return false;
  const int64_t y_numel = g.batch * g.out_channels * g.out(0) * g.out(1) * g.out(2);
  const int64_t filter_numel = g.in_channels * g.out_channels * g.kernel[0] * g.kernel[1] * g.kernel[2];
  if (!fits_cutlass_extents({x.numel(), y_numel, filter_numel})) return false;
  if (g.in_channels % K::kAlignment || g.out_channels % K::kAlignmentD) return false;
  return K::can_implement(fprop_problem<K>(g), fprop_stride_d<K>(g));
}

// K's name as conv_transpose3d_stride1_channels_last_path gives it, e.g. "cutlass tf32 fprop3d 128x128x32"
// (and " cluster 2" where K's clusters are of 2 CTAs).
template <class K>
std::string kernel_name() {
  return std::string("cutlass ") + (std::is_same_v<typename K::Element, float> ? "tf32" : "bf16") + " fprop3d " +
         std::to_string(K::kTileM) + "x" + std::to_string(K::kTileN) + "x" + std::to_string(K::kTileK) +
         (K::kClusterM > 1 ? " cluster " + std::to_string(K::kClusterM) : std::string());
}

// fprop's filter w' (O, kt, kr, ks, I) from the weight w (I, O, kt, kr, ks) in one pass: flipping all three
// kernel dims reverses the flattened tap index (w'[o, v, i] = w[i, o, V - 1 - v], V = kt kr ks), a copy of
// the elements' bits (ATen's flip, then a permuted copy, took two passes, and its first call in a process
// loaded ATen's flip kernels: 18 ms of D's first training step on an H200).
template <typename Bits>
__global__ void flipped_filter_kernel(const Bits* __restrict__ w, Bits* __restrict__ out, int in_channels,
                                      int out_channels, int volume) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // of out (O, V, I)
  if (index >= static_cast<int64_t>(in_channels) * out_channels * volume) return;
  const int i = static_cast<int>(index % in_channels);
  const int64_t rest = index / in_channels;
  const int v = static_cast<int>(rest % volume), o = static_cast<int>(rest / volume);
  out[index] = w[(static_cast<int64_t>(i) * out_channels + o) * volume + volume - 1 - v];
}

inline at::Tensor flipped_filter(const at::Tensor& weight) {
  const at::Tensor w = weight.contiguous();
  const int in_channels = static_cast<int>(w.size(0)), out_channels = static_cast<int>(w.size(1));
  const int volume = static_cast<int>(w.size(2) * w.size(3) * w.size(4));
  at::Tensor out = at::empty({w.size(1), w.size(2), w.size(3), w.size(4), w.size(0)}, w.options());
  const int64_t count = out.numel();  // (under 2^31 where fprop_takes held)
  const unsigned blocks = static_cast<unsigned>((count + 255) / 256);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (w.element_size() == 2) {
    flipped_filter_kernel<<<blocks, 256, 0, stream>>>(static_cast<const uint16_t*>(w.const_data_ptr()),
                                                     static_cast<uint16_t*>(out.mutable_data_ptr()), in_channels,
                                                     out_channels, volume);
  } else {
    TORCH_INTERNAL_ASSERT(w.element_size() == 4, "flipped_filter: a weight of 2- or 4-byte elements");
    flipped_filter_kernel<<<blocks, 256, 0, stream>>>(static_cast<const uint32_t*>(w.const_data_ptr()),
                                                     static_cast<uint32_t*>(out.mutable_data_ptr()), in_channels,
                                                     out_channels, volume);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// y = conv_transpose3d(x, weight, bias) by CUTLASS kernel K (the checked arguments g; one K takes the call:
// with_cutlass_kernel, or a benchmark's variant), `what` naming the caller in errors.
template <class K>
at::Tensor run_cutlass(const char* what, const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, const TransposedConvStride1& g) {
  const at::Tensor x_ndhwc = relayout(x, {0, 2, 3, 4, 1});  // (no copy for an aligned channels_last_3d x)
  const at::Tensor filter = flipped_filter(weight);  // (O, kt, kr, ks, I)
  const std::optional<at::Tensor> bias_values = bias ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
  at::Tensor y = transposed_conv_stride1_output(x, g);  // (memory (N, D', H', W', O))
  using ElementD = typename K::ElementD;
  K::launch(what, fprop_problem<K>(g), x_ndhwc.const_data_ptr(), filter.const_data_ptr(),
            static_cast<ElementD*>(y.data_ptr()), fprop_stride_d<K>(g), c10::cuda::getCurrentCUDAStream(),
            bias_values ? static_cast<const ElementD*>(bias_values->const_data_ptr()) : nullptr);
  return y;
}

}  // namespace fused_ops
