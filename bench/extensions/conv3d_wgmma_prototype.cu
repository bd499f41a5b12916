// A's wgmma convolution (csrc/cuda/conv3d_wgmma_pool.cuh: the kernel, its layouts and what it computes) as a
// torch extension of its own, for bench/bench_conv3d_wgmma_prototype.py: each operand layout (the library
// takes TF32 swizzled and bf16 pairs), y alone or the pool's epilogue, from a channels-last x (a copy where it
// is not) or from x float32 NCDHW as the library's op reads it.
#ifndef NDEBUG
#define NDEBUG  // before any header (csrc/cuda/cutlass_conv.cuh says why)
#endif

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>

#include "conv3d_wgmma_pool.cuh"  // (first: its bulk_copy.cuh before CUTLASS's headers)
#include "cutlass_conv.cuh"       // (runs_sm90a, tf32_convolution)
#include "../dispatch.h"          // (ReciprocalMultiply)
#include "tf32_rounding.cuh"

namespace fused_ops {
namespace {

using namespace wgmma_conv3d;

enum Layout : int64_t {
  kTf32Swizzled = 0,
  kTf32Planes = 1,
  kBf16Pairs = 2,
  kTf32SwizzledRegisterA = 3,
  kBf16PairsRegisterA = 4
};

template <class F>
void with_layout(int64_t layout, F&& f) {
  if (layout == kTf32Swizzled) {
    f(Tf32Swizzled{});
  } else if (layout == kTf32Planes) {
    f(Tf32Planes{});
  } else if (layout == kTf32SwizzledRegisterA) {
    f(Tf32SwizzledRegisterA{});
  } else if (layout == kBf16PairsRegisterA) {
    f(Bf16PairsRegisterA{});
  } else {
    TORCH_CHECK_VALUE(layout == kBf16Pairs, "conv3d_wgmma: layout ", layout, " out of range");
    f(Bf16Pairs{});
  }
}

// Whether the prototype takes the call in `layout`: an sm_90 GPU, x (N, 8, D, H, 64) with D, H >= 3 float32 with
// TF32 convolutions allowed (Tf32*) or bfloat16 (Bf16Pairs), weight (16, 8, 3, 3, 3) of x's dtype, a bias of 16;
// `ncdhw`: x float32 NCDHW contiguous (A's input as it comes, the fused op's call), the weight float32 (TF32
// allowed) or bfloat16 (Bf16Pairs: x rounded to bfloat16 as read).
bool takes(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, int64_t layout, bool ncdhw) {
  const bool bf16 = layout == kBf16Pairs || layout == kBf16PairsRegisterA;
  const auto operand = bf16 ? at::kBFloat16 : at::kFloat;
  const bool dtype = (ncdhw ? x.scalar_type() == at::kFloat && x.is_contiguous() : x.scalar_type() == operand) &&
                     weight.scalar_type() == operand && (bf16 || tf32_convolution(x));
  return dtype && x.is_cuda() && x.dim() == 5 &&
         x.size(1) == kChannelsIn && x.size(4) == kRow && x.size(2) >= 3 && x.size(3) >= 3 &&
         runs_sm90a(x.get_device()) && weight.sizes() == at::IntArrayRef({kChannelsOut, kChannelsIn, 3, 3, 3}) &&
         bias.numel() == kChannelsOut;
}

// w (16, 8, 3, 3, 3) as layout L's B operands, K-major rows (the TMA box's order), TF32's rounded to nearest
// (as cuDNN's TF32 rounds).
template <class L>
at::Tensor weights_for(const at::Tensor& weight) {
  at::Tensor w = weight.permute({2, 3, 4, 0, 1}).contiguous();  // (t, r, s, o, c)
  if constexpr (std::is_base_of_v<Bf16Pairs, L>) {
    // (t, step, chunk, o, c): step 0..2 = (r = step, s = 0 | 1); 3 = ((0, 2) | (1, 2)); 4 = ((2, 2) | zeros)
    at::Tensor pairs = at::zeros({3, 5, 2, kChannelsOut, kChannelsIn}, w.options());
    for (int r = 0; r < 3; ++r) {
      pairs.select(1, r).select(1, 0).copy_(w.select(1, r).select(1, 0));
      pairs.select(1, r).select(1, 1).copy_(w.select(1, r).select(1, 1));
    }
    pairs.select(1, 3).select(1, 0).copy_(w.select(1, 0).select(1, 2));
    pairs.select(1, 3).select(1, 1).copy_(w.select(1, 1).select(1, 2));
    pairs.select(1, 4).select(1, 0).copy_(w.select(1, 2).select(1, 2));
    return pairs.view({1, L::kWeightSteps, L::kWeightRows, L::kBoxChannels});
  } else {
    w = rounded_to_tf32(w);
    if constexpr (std::is_same_v<L, Tf32Planes>) {  // (tap, chunk, o, 4 channels)
      w = w.view({27, kChannelsOut, 2, 4}).transpose(1, 2).contiguous();
    }
    return w.view({1, L::kWeightSteps, L::kWeightRows, L::kBoxChannels});  // (boxes of at most 256 along each)
  }
}

// The kernel's launch on x (kNcdhw: as it is, NCDHW; else read channels-last: a copy unless x is
// channels_last_3d) with p's pool fields set where pooled; y defined where not.
// The SMs the kernel spreads over: the device's, or `sms` where positive (fewer CTAs, so that each takes columns
// of several tiles: a sanitizer's small case).
int sms_for(const at::Tensor& x, int64_t sms) {
  return sms > 0 ? static_cast<int>(sms) : device_attribute(cudaDevAttrMultiProcessorCount, x.get_device());
}

template <class L, Epilogue kEpilogue, bool kNcdhw>
void launch(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, Conv3dTiles& p, at::Tensor& y,
            int sms) {
  const at::Tensor x_ndhwc = kNcdhw ? x : x.contiguous(at::MemoryFormat::ChannelsLast3d).permute({0, 2, 3, 4, 1});
  const at::Tensor w = weights_for<L>(weight);
  TORCH_INTERNAL_ASSERT(w.numel() * w.element_size() == L::kWeightBytes);
  const CUtensorMap x_map =
      kNcdhw ? contiguous_tensor_map(x, {kRow, kBoxRows, 1, kChannelsIn, 1})
             : contiguous_tensor_map(x_ndhwc, {L::kBoxChannels, kRow, kBoxRows, 1, 1}, L::kSwizzle);
  const CUtensorMap w_map =
      contiguous_tensor_map(w, {L::kBoxChannels, L::kWeightRows, L::kWeightSteps, 1}, L::kSwizzle);
  const at::Tensor bias_values = bias.to(at::kFloat).contiguous();
  const auto kernel = conv3d_wgmma_kernel<L, kEpilogue, kNcdhw>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Smem<L, kNcdhw>::kBytes));
  const int blocks = std::min(p.columns, sms);
  kernel<<<blocks, kThreads, Smem<L, kNcdhw>::kBytes, c10::cuda::getCurrentCUDAStream()>>>(
      x_map, w_map, bias_values.const_data_ptr<float>(),
      kEpilogue == Epilogue::kY ? y.mutable_data_ptr<float>() : nullptr, p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// y = conv3d(x, weight, bias) (float32) by the prototype in `layout`, or None where it does not take the call.
std::optional<at::Tensor> conv3d_wgmma(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                       int64_t layout, int64_t sms) {
  if (!takes(x, weight, bias, layout, false)) return std::nullopt;
  const int spread = sms_for(x, sms);
  Conv3dTiles p = tiles_of(x, spread);
  at::Tensor y = at::empty({x.size(0), kChannelsOut, p.depth_out, p.height_out, p.width_out},
                           x.options().dtype(at::kFloat).memory_format(at::MemoryFormat::ChannelsLast3d));
  with_layout(layout, [&](auto l) { launch<decltype(l), Epilogue::kY, false>(x, weight, bias, p, y, spread); });
  return y;
}

// conv3d_max_pool3d_mean(x, weight, bias, 0, 2, divisor, save_indices=True) by the prototype in `layout`:
// (mean (N, 16) float32, picks (N, 16, PD, PH, PW) uint8), or None where it does not take the call (takes, D'
// and H' at least 2). `ncdhw`: from x float32 NCDHW as it comes, converted by the producer (takes' ncdhw).
std::optional<std::tuple<at::Tensor, at::Tensor>> conv3d_wgmma_pool(const at::Tensor& x, const at::Tensor& weight,
                                                                    const at::Tensor& bias, double divisor,
                                                                    int64_t layout, bool ncdhw, int64_t sms) {
  if (!takes(x, weight, bias, layout, ncdhw) || x.size(2) < 4 || x.size(3) < 4) return std::nullopt;
  const int spread = sms_for(x, sms);
  Conv3dTiles p = tiles_of(x, spread);
  p.reciprocal = ReciprocalMultiply<float>(divisor).reciprocal;
  p.pooled[0] = p.depth_out / 2;
  p.pooled[1] = p.height_out / 2;
  p.pooled[2] = p.width_out / 2;
  at::Tensor picks = at::empty({x.size(0), kChannelsOut, p.pooled[0], p.pooled[1], p.pooled[2]},
                               x.options().dtype(at::kByte));
  at::Tensor partial = at::empty({x.size(0), int64_t{p.tiles} / x.size(0) * 8, kChannelsOut},
                                 x.options().dtype(at::kFloat));
  p.picks = picks.mutable_data_ptr<uint8_t>();
  p.partial = partial.mutable_data_ptr<float>();
  at::Tensor unused;
  with_layout(layout, [&](auto l) {
    if (ncdhw) {
      launch<decltype(l), Epilogue::kMeanAndPicks, true>(x, weight, bias, p, unused, spread);
    } else {
      launch<decltype(l), Epilogue::kMeanAndPicks, false>(x, weight, bias, p, unused, spread);
    }
  });
  const double windows = static_cast<double>(p.pooled[0]) * p.pooled[1] * p.pooled[2];
  return std::make_tuple(partial.sum(1).div_(windows), picks);
}

}  // namespace
}  // namespace fused_ops

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("conv3d_wgmma", &fused_ops::conv3d_wgmma,
        "y = conv3d(x, weight, bias) by the wgmma prototype in a layout (0: TF32 swizzled, 1: TF32 planes, 2: bf16 "
        "pairs, 3 and 4: TF32 swizzled and bf16 pairs with A from registers; None where it does not take the call); "
        "sms: the SMs it spreads over (0: the device's)",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("layout"), py::arg("sms") = 0);
  m.def("conv3d_wgmma_pool", &fused_ops::conv3d_wgmma_pool,
        "(mean, picks) of conv3d_max_pool3d_mean(x, weight, bias, 0, 2, divisor) by the wgmma prototype with its "
        "pool epilogue, in a layout (as conv3d_wgmma's); ncdhw: from x float32 NCDHW, converted by the producer; "
        "sms as conv3d_wgmma's",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("divisor"), py::arg("layout"),
        py::arg("ncdhw") = false, py::arg("sms") = 0);
}
