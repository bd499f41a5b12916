// CUTLASS 3.x Hopper implicit-GEMM convolutions as the ops launch them (conv_transpose3d_weight_grad.cu,
// conv_transpose3d_stride1_channels_last.cu): TMA loads, im2col for the sliding operand, wgmma; one
// producer and one consumer warp group, a CTA per output tile (CUTLASS's only sm_90 conv kernel).
// Included only in a build with CUTLASS (FUSED_OPS_CUTLASS: setup.py defines it where it finds
// CUTLASS's headers, and compiles for sm_90a).
#pragma once

// NDEBUG before any header: CUTLASS's device code asserts, and a live assert is a call inside the
// kernel, across which ptxas serializes every wgmma (warning C7510).
#ifndef NDEBUG
#define NDEBUG
#endif

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <initializer_list>
#include <limits>

// (in this order: the conv collective headers use KernelHardwareInfo without including it)
#include "cutlass/cutlass.h"
#include "cutlass/kernel_hardware_info.hpp"
#include "cute/tensor.hpp"
#include "cutlass/conv/collective/collective_builder.hpp"
#include "cutlass/conv/convnd_problem_shape.hpp"
#include "cutlass/conv/device/conv_universal_adapter.hpp"
#include "cutlass/conv/kernel/conv_universal.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"

#include "plane_rows.cuh"

namespace fused_ops {

using cutlass::conv::Operator;

// One convolution: operator Op over Rank spatial dimensions, Element operands (float: TF32 MMA;
// bfloat16), float32 accumulation, ElementD output D (no C), a kTileM x kTileN x kTileK tile per
// CTA, kClusterM CTAs along M a cluster (their B tiles, the same where N is one tile, loaded once
// by TMA multicast); with kBias, D = acc + bias[output channel] (a null bias adds 0). Wgrad's N
// mode is (C, S, R, T): its tile wraps N in a Shape; every K does.
template <Operator Op, int Rank, class Element_, class ElementD_, int kTileM_, int kTileN_, int kTileK_,
          bool kBias = false, int kClusterM_ = 1>
struct CutlassConv {
  using Element = Element_;
  using ElementD = ElementD_;
  static constexpr int kTileM = kTileM_, kTileN = kTileN_, kTileK = kTileK_, kClusterM = kClusterM_;
  static constexpr int kAlignment = 128 / cutlass::sizeof_bits<Element>::value;  // 16-byte TMA rows
  static constexpr int kAlignmentD = 128 / cutlass::sizeof_bits<ElementD>::value;
  using TileN = cute::conditional_t<Op == Operator::kWgrad, cute::Shape<cute::Int<kTileN>>, cute::Int<kTileN>>;
  using TileShape = cute::Shape<cute::Int<kTileM>, TileN, cute::Shape<cute::Int<kTileK>>>;
  using ClusterShape = cute::Shape<cute::Int<kClusterM>, cute::_1, cute::_1>;
  // activations NDHWC / NHWC; the output: wgrad's a filter (KTRSC), fprop's activations
  using LayoutAB = cute::conditional_t<Rank == 3, cutlass::layout::TensorNDHWC, cutlass::layout::TensorNHWC>;
  using LayoutD = cute::conditional_t<Op == Operator::kWgrad, cutlass::layout::TensorKCSRT, LayoutAB>;
  using Fusion = cute::conditional_t<kBias,
                                     cutlass::epilogue::fusion::LinCombPerColBias<ElementD, float, ElementD, void, float>,
                                     cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD, kAlignmentD,  // no C
      ElementD, LayoutD, kAlignmentD, cutlass::epilogue::TmaWarpSpecialized, Fusion>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::conv::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Op, Element, LayoutAB, kAlignment, Element, LayoutAB,
      kAlignment, float, TileShape, ClusterShape,
      cutlass::conv::collective::StageCountAutoCarveout<int(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::conv::KernelImplicitTmaWarpSpecializedSm90>::CollectiveOp;

  using ProblemShape = cutlass::conv::ConvProblemShape<Op, Rank>;
  using Kernel = cutlass::conv::kernel::ConvUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Conv = cutlass::conv::device::ConvUniversalAdapter<Kernel>;
  using StrideD = typename Kernel::StrideD;

  // The launch's arguments: D = the convolution of A and B (+ bias) (device pointers; null to ask
  // can_implement).
  static typename Conv::Arguments arguments(const ProblemShape& problem, const void* a, const void* b, ElementD* d,
                                            const StrideD& stride_d, const ElementD* bias = nullptr) {
    cutlass::KernelHardwareInfo hw_info;
    hw_info.device_id = c10::cuda::current_device();
    hw_info.sm_count = device_attribute(cudaDevAttrMultiProcessorCount, hw_info.device_id);
    typename Kernel::MainloopArguments mainloop{static_cast<const Element*>(a), static_cast<const Element*>(b)};
    typename Kernel::EpilogueArguments epilogue{};
    epilogue.thread.alpha = 1.f;
    epilogue.thread.beta = 0.f;
    if constexpr (kBias) epilogue.thread.bias_ptr = bias;
    epilogue.ptr_C = nullptr;
    epilogue.dC = stride_d;
    epilogue.ptr_D = d;
    epilogue.dD = stride_d;
    return typename Conv::Arguments(problem, mainloop, epilogue, hw_info);
  }

  static bool can_implement(const ProblemShape& problem, const StrideD& stride_d) {
    return Conv::can_implement(arguments(problem, nullptr, nullptr, nullptr, stride_d)) == cutlass::Status::kSuccess;
  }

  // Runs it on `stream`; `what` names the op in errors.
  static void launch(const char* what, const ProblemShape& problem, const void* a, const void* b, ElementD* d,
                     const StrideD& stride_d, cudaStream_t stream, const ElementD* bias = nullptr) {
    const auto args = arguments(problem, a, b, d, stride_d, bias);
    Conv conv;
    TORCH_CHECK(Conv::get_workspace_size(args) == 0, what, ": a CUTLASS kernel wants a workspace of its own");
    cutlass::Status status = conv.initialize(args, nullptr, stream);
    if (status == cutlass::Status::kSuccess) status = conv.run(stream);
    TORCH_CHECK(status == cutlass::Status::kSuccess, what, ": CUTLASS: ", cutlassGetStatusString(status));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

// A std::array-like of CUTLASS's (extents, strides, paddings) from values.
template <class Array, class... T>
Array make_array(T... values) {
  Array a{};
  int i = 0;
  ((a[i++] = values), ...);
  return a;
}

// Whether t's data is 16-byte aligned (TMA's requirement).
inline bool aligned_for_tma(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

// t permuted by dims, contiguous, its data 16-byte aligned: a copy unless t lies so in memory.
inline at::Tensor relayout(const at::Tensor& t, at::IntArrayRef dims) {
  const at::Tensor permuted = t.permute(dims).contiguous();
  return aligned_for_tma(permuted) ? permuted : permuted.clone();
}

// Whether the device is an sm_90 one (the kernels' sm_90a code runs there alone).
inline bool runs_sm90a(int device) {
  return device_attribute(cudaDevAttrComputeCapabilityMajor, device) == 9 &&
         device_attribute(cudaDevAttrComputeCapabilityMinor, device) == 0;
}

// Whether a convolution's tensors of these element counts suit the kernels: none empty, each
// indexable by CUTLASS's int32 extents.
inline bool fits_cutlass_extents(std::initializer_list<int64_t> numels) {
  for (const int64_t n : numels) {
    if (n == 0 || n > std::numeric_limits<int32_t>::max()) return false;
  }
  return true;
}

// Whether PyTorch's convolutions of a float32 x round to TF32 (cuDNN enabled, its TF32 allowed for
// convolutions): where the kernels take float32 operands as TF32.
inline bool tf32_convolution(const at::Tensor& x) {
  const at::Context& context = at::globalContext();
  return x.scalar_type() == at::kFloat && context.userEnabledCuDNN() && context.allowTF32CuDNN(at::Float32Op::CONV);
}

}  // namespace fused_ops
