// CUDA kernel of conv_transpose3d_weight_grad (the math: ../conv_transpose3d_weight_grad.h).
//
// On an sm_90 device, in a build with CUTLASS (FUSED_OPS_CUTLASS: setup.py defines it where it
// finds CUTLASS's headers and compiles for sm_90a):
//
//   float32 where PyTorch's convolutions round to TF32 (cuDNN enabled, its TF32 allowed for
//   convolutions): "shifted rows", a TF32 wgmma kernel of our own (shifted_rows_weight_grad.cuh:
//   the math, the tiles) with two consumer warp groups, over operand copies in rows of one length
//   by kernels of its own, a chunk of the batch at a time (the copies at most grad_y's size:
//   run_shifted_rows_in_chunks); a CTA takes up to 5 of the ks shifts, its K ranges' partial sums
//   added after. SPEC's D on an H200 (2026-11-27): the kernel 1.49 ms, the op 1.88 with its relayouts
//   from NCDHW operands, against 2.9-3.0 for CUTLASS's fprop2d formulation (one 2-D convolution per
//   depth tap over (depth, batch) channels, which this path replaced) and 6.4 for cuDNN.
//
//   bfloat16: CUTLASS 3.x's Hopper implicit-GEMM kWgrad (TMA loads, im2col for the sliding
//   operand, wgmma; one producer and one consumer warp group, a CTA per output tile; chosen among
//   CUTLASS's formulations and tiles by a baseline library,
//   bench/results/d_weight_grad_cutlass-nvidia-h200.log), 3-D, x NDHWC as the convolution's
//   "output" (GEMM M = I), grad_y NDHWC as its input (im2col, GEMM N = (O, ks, kr, kt)), no
//   padding; out (I, kt, kr, ks, O), NDHWC operands by ATen copies where they do not lie so.
//
// Sums in float32; out is (I, O, kt, kr, ks) in x's dtype. Everything else -- float16, float64,
// float32 without TF32, another device, sizes the paths do not take (alignment, tiles, over
// 2^31 - 1 elements) -- by aten.convolution_backward, as does a build without CUTLASS.

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

#include <string>

#include "../conv_transpose3d_weight_grad.h"
#include "plane_rows.cuh"

#ifdef FUSED_OPS_CUTLASS
#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>

// (bulk_copy.cuh before CUTLASS's headers, which include cudaTypedefs.h inside their namespace)
#include "bulk_copy.cuh"
#include "cutlass_conv.cuh"
#include "shifted_rows_weight_grad.cuh"
#endif

namespace fused_ops {
namespace {

#ifdef FUSED_OPS_CUTLASS

constexpr const char* kWhat = "conv_transpose3d_weight_grad";

// out[e] += sum over p of partials[p * count + e], e < count (a multiple of 4; 16-byte aligned).
__global__ void add_partials_kernel(float* __restrict__ out, const float* __restrict__ partials, int64_t count,
                                    int num_partials) {
  const int64_t vectors = count / 4;
  for (int64_t v = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; v < vectors; v += int64_t{gridDim.x} * blockDim.x) {
    float4 sum = reinterpret_cast<const float4*>(out)[v];
    for (int p = 0; p < num_partials; ++p) {
      const float4 part = reinterpret_cast<const float4*>(partials + p * count)[v];
      sum.x += part.x;
      sum.y += part.y;
      sum.z += part.z;
      sum.w += part.w;
    }
    reinterpret_cast<float4*>(out)[v] = sum;
  }
}

// out += the partial sums of slices 1.. of a split (slice 0 wrote out): partials holds
// slices - 1 of out's numel (a multiple of 4) each.
void add_partials(at::Tensor& out, const at::Tensor& partials, int slices) {
  constexpr int kThreads = 256;
  const int64_t count = out.numel();
  const int64_t blocks = std::min<int64_t>((count / 4 + kThreads - 1) / kThreads, 4096);
  add_partials_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      out.mutable_data_ptr<float>(), partials.const_data_ptr<float>(), count, slices - 1);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

using WgradBf16 = CutlassConv<Operator::kWgrad, 3, cutlass::bfloat16_t, float, 64, 128, 64>;

// wgrad's problem: the convolution of "activation" grad_y (N, Z, P, Q, O) by "filter"
// (I, kt, kr, ks, O) whose output is x (N, D, H, W, I), no padding.
typename WgradBf16::ProblemShape wgrad_problem(const TransposedConvWeightGrad& g) {
  using PS = WgradBf16::ProblemShape;
  using Extent = PS::TensorExtent;
  using Spatial = PS::SpatialExtent;
  return PS(cutlass::conv::Mode::kCrossCorrelation,
            make_array<Extent>(int(g.batch), int(g.out(0)), int(g.out(1)), int(g.out(2)), int(g.out_channels)),
            make_array<Extent>(int(g.in_channels), int(g.kernel[0]), int(g.kernel[1]), int(g.kernel[2]),
                               int(g.out_channels)),
            make_array<Spatial>(0, 0, 0), make_array<Spatial>(0, 0, 0), make_array<Spatial>(1, 1, 1),
            make_array<Spatial>(1, 1, 1), 1);
}

// wgrad's output strides, (k, (c, s, r, t)) of out (I, kt, kr, ks, O), packed.
WgradBf16::StrideD wgrad_stride_d(const TransposedConvWeightGrad& g) {
  WgradBf16::StrideD stride{};
  const int64_t o = g.out_channels;
  cute::get<0>(stride) = g.kernel[0] * g.kernel[1] * g.kernel[2] * o;
  cute::get<1, 1>(stride) = o;
  cute::get<1, 2>(stride) = g.kernel[2] * o;
  cute::get<1, 3>(stride) = g.kernel[1] * g.kernel[2] * o;
  return stride;
}

// A path for a problem: shifted rows (TF32), a CTA taking `shifts` of the ks shifts, with `splits` K
// ranges; or CUTLASS's wgrad (bf16).
struct KernelPlan {
  enum Kind { kShiftedRows, kWgrad } kind;
  int shifts, splits;

  std::string name() const {
    if (kind == kWgrad) return "cutlass bf16 wgrad 64x128x64";
    return "tf32 shifted rows " + std::to_string(shifts) + " shifts split" + std::to_string(splits);
  }
};

// The shifted-rows operands' row length L: grad_y's width Q rounded up to 4 (16-byte planes).
int64_t shifted_rows_length(const TransposedConvWeightGrad& g) { return (g.out(2) + 3) / 4 * 4; }

// The shifted-rows path's plan (shifted_rows_weight_grad.cuh) for the device's `sms`
// multiprocessors, or none (operands whose elements int32 does not index). A CTA per output tile --
// tap (t, r), 128 output channels, 64 input channels, a block of up to 5 shifts (the ks shifts
// split evenly) -- times `splits` ranges of K, as many as fill the multiprocessors once.
std::optional<KernelPlan> shifted_rows_plan(const TransposedConvWeightGrad& g, int sms) {
  const int64_t row = shifted_rows_length(g);
  if (!fits_cutlass_extents({g.kernel[2] * g.in_channels * g.batch * g.in[0] * g.in[1] * row,
                             g.out_channels * g.batch * g.out(0) * g.out(1) * row})) {
    return std::nullopt;
  }
  const int64_t shift_blocks = (g.kernel[2] + 4) / 5, shifts = (g.kernel[2] + shift_blocks - 1) / shift_blocks;
  const int64_t tiles =
      g.kernel[0] * g.kernel[1] * shift_blocks * ((g.in_channels + 63) / 64) * ((g.out_channels + 127) / 128);
  const int64_t k_tiles = g.batch * g.in[0] * ((g.in[1] * row + 31) / 32);
  // (partial sums are added 4 at a time: add_partials_kernel)
  const int64_t splits = g.filter_numel() % 4 ? 1 : std::clamp<int64_t>(sms / tiles, 1, k_tiles);
  if (tiles * splits > std::numeric_limits<int32_t>::max()) return std::nullopt;
  return KernelPlan{KernelPlan::kShiftedRows, static_cast<int>(shifts), static_cast<int>(splits)};
}

std::optional<KernelPlan> wgrad_plan(const TransposedConvWeightGrad& g) {
  // x's NDHWC rows 16-byte aligned; grad_y's im2col boxes read 64 channels at a time along the
  // (c, s, r, t) N mode: a box must not run past a tap's channels
  if (g.in_channels % 8 || g.out_channels % 64) return std::nullopt;
  if (!WgradBf16::can_implement(wgrad_problem(g), wgrad_stride_d(g))) return std::nullopt;
  return KernelPlan{KernelPlan::kWgrad, 0, 1};
}

// The kernel path (shifted rows or CUTLASS's wgrad) for these (checked) arguments, or none.
std::optional<KernelPlan> kernel_plan(const at::Tensor& grad_y, const at::Tensor& x,
                                      const TransposedConvWeightGrad& g) {
  const int device = x.get_device();
  if (!runs_sm90a(device)) return std::nullopt;
  if (!fits_cutlass_extents({x.numel(), grad_y.numel(), g.filter_numel()})) return std::nullopt;
  if (tf32_convolution(x)) return shifted_rows_plan(g, device_attribute(cudaDevAttrMultiProcessorCount, device));
  if (x.scalar_type() == at::kBFloat16) return wgrad_plan(g);
  return std::nullopt;
}

// out (shifts, C, N, D, H, row) float32 from t (N, C, D, H, W) float32 of any strides: its rows
// shifted by 0 .. shifts - 1, padded with zeros (shifted_rows_weight_grad.cuh's RowsRelayout): by
// channels_last_rows_kernel where t's C has unit stride (and its W not), else by rows_copy_kernel.
at::Tensor to_rows(const at::Tensor& t, int64_t row, int shifts) {
  at::Tensor out = at::empty({shifts, t.size(1), t.size(0), t.size(2), t.size(3), row}, t.options());
  RowsRelayout r{};
  for (int d = 0; d < 5; ++d) {
    r.size[d] = t.size(d);
    r.stride[d] = t.stride(d);
  }
  r.row = static_cast<int>(row);
  r.shifts = shifts;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  int64_t blocks;
  if (t.stride(1) == 1 && t.stride(4) != 1) {
    blocks = (t.size(3) * row + kChannelsLastPositions - 1) / kChannelsLastPositions * ((t.size(1) + 31) / 32) *
             t.size(0) * t.size(2);
    TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(), kWhat, ": too many blocks for the operands' relayout");
    channels_last_rows_kernel<<<static_cast<unsigned>(blocks), dim3(32, 8), 0, stream>>>(
        t.const_data_ptr<float>(), out.mutable_data_ptr<float>(), r);
  } else {
    blocks = shifts * t.size(1) * t.size(0);
    TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(), kWhat, ": too many blocks for the operands' relayout");
    rows_copy_kernel<<<static_cast<unsigned>(blocks), kRowsRelayoutThreads, 0, stream>>>(
        t.const_data_ptr<float>(), out.mutable_data_ptr<float>(), r);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// A tensor map over `t` (S, C, N, D, H, L) contiguous float32 (to_rows') as (H L, D, N, C, S)
// innermost first, boxes of 32 positions x `channels`, 128-byte swizzled (shifted_rows_weight_grad_kernel's).
CUtensorMap shifted_rows_map(const at::Tensor& t, cuuint32_t channels) {
  const cuuint64_t plane = t.size(4) * t.size(5);
  const cuuint64_t dims[5] = {plane, cuuint64_t(t.size(3)), cuuint64_t(t.size(2)), cuuint64_t(t.size(1)),
                              cuuint64_t(t.size(0))};
  cuuint64_t strides[4];
  strides[0] = plane * sizeof(float);
  for (int d = 1; d < 4; ++d) strides[d] = strides[d - 1] * dims[d];
  const cuuint32_t box[5] = {32, 1, 1, channels, 1};
  return tiled_tensor_map(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, t.const_data_ptr(), 5, dims, strides, box,
                          CU_TENSOR_MAP_SWIZZLE_128B);
}

// The shifted-rows path (shifted_rows_weight_grad.cuh), KS shifts a CTA: out (I, O, kt, kr, ks) float32.
template <int KS>
at::Tensor run_shifted_rows(const TransposedConvWeightGrad& g, int splits, const at::Tensor& grad_y,
                            const at::Tensor& x) {
  using Config = ShiftedRowsConfig<KS>;
  const int64_t row = shifted_rows_length(g);
  const at::Tensor x_rows = to_rows(x, row, static_cast<int>(g.kernel[2])), grad_y_rows = to_rows(grad_y, row, 1);
  const CUtensorMap g_map = shifted_rows_map(grad_y_rows, Config::kRowsG);
  const CUtensorMap x_map = shifted_rows_map(x_rows, Config::kRowsX);
  ShiftedRows p{};
  p.depth = static_cast<int>(g.in[0]);
  p.kt = static_cast<int>(g.kernel[0]);
  p.kr = static_cast<int>(g.kernel[1]);
  p.ks = static_cast<int>(g.kernel[2]);
  p.shift_blocks = (p.ks + KS - 1) / KS;
  p.row = static_cast<int>(row);
  p.in_channels = static_cast<int>(g.in_channels);
  p.out_channels = static_cast<int>(g.out_channels);
  p.in_blocks = static_cast<int>((g.in_channels + Config::kRowsX - 1) / Config::kRowsX);
  p.out_blocks = static_cast<int>((g.out_channels + Config::kRowsG - 1) / Config::kRowsG);
  p.plane_tiles = static_cast<int>((g.in[1] * row + Config::kTileK - 1) / Config::kTileK);
  p.k_tiles = g.batch * g.in[0] * p.plane_tiles;
  p.splits = splits;
  at::Tensor out = at::empty({g.in_channels, g.out_channels, g.kernel[0], g.kernel[1], g.kernel[2]}, x.options());
  p.filter_numel = out.numel();
  at::Tensor partials = at::empty({(splits - 1) * p.filter_numel}, out.options());
  // (allowed on each device it runs on: the attribute is a device's)
  allow_dynamic_shared_memory(shifted_rows_weight_grad_kernel<KS>, Config::kSmemBytes);
  const int64_t blocks = int64_t{p.kt} * p.kr * p.shift_blocks * p.in_blocks * p.out_blocks * splits;
  shifted_rows_weight_grad_kernel<KS><<<static_cast<unsigned>(blocks), Config::kThreads, Config::kSmemBytes,
                                        c10::cuda::getCurrentCUDAStream()>>>(
      g_map, x_map, out.mutable_data_ptr<float>(), partials.mutable_data_ptr<float>(), p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (splits > 1) add_partials(out, partials, splits);
  return out;
}

at::Tensor run_shifted_rows_plan(const KernelPlan& plan, const TransposedConvWeightGrad& g, const at::Tensor& grad_y,
                                 const at::Tensor& x) {
  switch (plan.shifts) {
    case 1:
      return run_shifted_rows<1>(g, plan.splits, grad_y, x);
    case 2:
      return run_shifted_rows<2>(g, plan.splits, grad_y, x);
    case 3:
      return run_shifted_rows<3>(g, plan.splits, grad_y, x);
    case 4:
      return run_shifted_rows<4>(g, plan.splits, grad_y, x);
    default:
      return run_shifted_rows<5>(g, plan.splits, grad_y, x);
  }
}

// The shifted-rows path over the batch in equal chunks whose operand copies (to_rows': ks shifted
// copies of x's rows, one of grad_y's) take at most grad_y's own bytes, each chunk's sums added to the
// last in order. A module's backward that holds grad_y so peaks under twice its size, under what the
// original holds there (D's: its batch norm's input and output gradients and saved input; SPEC's D,
// whose copies of the whole batch are 2.5 times grad_y's size, in 2 chunks).
at::Tensor run_shifted_rows_in_chunks(const TransposedConvWeightGrad& g, const at::Tensor& grad_y,
                                      const at::Tensor& x) {
  const int64_t row = shifted_rows_length(g);
  const int64_t per_element = (g.kernel[2] * g.in_channels * g.in[0] * g.in[1] + g.out_channels * g.out(0) * g.out(1)) *
                              row * static_cast<int64_t>(sizeof(float));
  const int64_t fit = std::max<int64_t>(1, grad_y.numel() * static_cast<int64_t>(sizeof(float)) / per_element);
  const int64_t chunks = (g.batch + fit - 1) / fit, size = (g.batch + chunks - 1) / chunks;
  const int sms = device_attribute(cudaDevAttrMultiProcessorCount, x.get_device());
  at::Tensor out;
  for (int64_t first = 0; first < g.batch; first += size) {
    TransposedConvWeightGrad chunk = g;
    chunk.batch = std::min(size, g.batch - first);
    const auto plan = shifted_rows_plan(chunk, sms);  // (a part of a problem whose plan fits)
    TORCH_INTERNAL_ASSERT(plan.has_value());
    const at::Tensor sums = run_shifted_rows_plan(*plan, chunk, grad_y.narrow(0, first, chunk.batch),
                                                  x.narrow(0, first, chunk.batch));
    out = out.defined() ? out.add_(sums) : sums;
  }
  return out;
}

at::Tensor run_plan(const KernelPlan& plan, const at::Tensor& grad_y, const at::Tensor& x,
                    const TransposedConvWeightGrad& g) {
  if (plan.kind == KernelPlan::kShiftedRows) return run_shifted_rows_in_chunks(g, grad_y, x);
  const int64_t kt = g.kernel[0], kr = g.kernel[1], ks = g.kernel[2];
  // x, grad_y -> NDHWC (a channels_last_3d tensor's permute is its memory: no copy)
  const at::Tensor x_ndhwc = relayout(x, {0, 2, 3, 4, 1});
  const at::Tensor grad_y_ndhwc = relayout(grad_y, {0, 2, 3, 4, 1});
  at::Tensor out = at::empty({g.in_channels, kt, kr, ks, g.out_channels}, x.options().dtype(at::kFloat));
  WgradBf16::launch(kWhat, wgrad_problem(g), x_ndhwc.const_data_ptr(), grad_y_ndhwc.const_data_ptr(),
                    out.mutable_data_ptr<float>(), wgrad_stride_d(g), c10::cuda::getCurrentCUDAStream());
  // (I, kt, kr, ks, O) float32 -> (I, O, kt, kr, ks) bfloat16
  return at::empty({g.in_channels, g.out_channels, kt, kr, ks}, x.options()).copy_(out.permute({0, 4, 1, 2, 3}));
}

#endif  // FUSED_OPS_CUTLASS

at::Tensor conv_transpose3d_weight_grad_cuda(const at::Tensor& grad_y, const at::Tensor& x,
                                             at::IntArrayRef kernel_size) {
  const TransposedConvWeightGrad g = transposed_conv_weight_grad_setup(grad_y, x, kernel_size);
  const c10::cuda::CUDAGuard guard(x.device());
#ifdef FUSED_OPS_CUTLASS
  if (const auto plan = kernel_plan(grad_y, x, g)) return run_plan(*plan, grad_y, x, g);
#endif
  return transposed_conv_weight_grad_by_aten(grad_y, x, g);
}

std::string conv_transpose3d_weight_grad_path_cuda(const at::Tensor& grad_y, const at::Tensor& x,
                                                   at::IntArrayRef kernel_size) {
  [[maybe_unused]] const TransposedConvWeightGrad g = transposed_conv_weight_grad_setup(grad_y, x, kernel_size);
  const c10::cuda::CUDAGuard guard(x.device());
#ifdef FUSED_OPS_CUTLASS
  if (const auto plan = kernel_plan(grad_y, x, g)) return plan->name();
  return kWeightGradByAten;
#else
  return std::string(kWeightGradByAten) + " (built without CUTLASS)";
#endif
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("conv_transpose3d_weight_grad", &conv_transpose3d_weight_grad_cuda);
  m.impl("conv_transpose3d_weight_grad_path", &conv_transpose3d_weight_grad_path_cuda);
}

}  // namespace fused_ops
