// CUDA kernel of conv_transpose3d_weight_grad (the math: ../conv_transpose3d_weight_grad.h).
//
// On an sm_90 device, in a build with CUTLASS (FUSED_OPS_CUTLASS: setup.py defines it where it
// finds CUTLASS's headers and compiles for sm_90a):
//
//   float32 where PyTorch's convolutions round to TF32 and ks <= 5: "shifted rows", a TF32 wgmma
//   kernel of our own (shifted_rows_weight_grad.cuh: the math, the tiles), with two consumer warp
//   groups, over operand copies in (C, N, D, H, L) rows by kernels of its own, its K ranges'
//   partial sums added after. SPEC's D on an H200 (2026-11-27): kernel 1.49 ms, the op 2.26-2.30
//   with its relayouts, against 2.88-3.06 for fprop2d below and 6.4 for cuDNN.
//
// Else CUTLASS 3.x Hopper implicit-GEMM convolutions (TMA loads, im2col for the sliding operand,
// wgmma; one producer and one consumer warp group, a CTA per output tile; chosen among CUTLASS's
// formulations and tiles by a baseline library, bench/results/d_weight_grad_cutlass-nvidia-h200.log):
//
//   float32 where PyTorch's convolutions round to TF32 (cuDNN enabled, its TF32 allowed for
//   convolutions), ks > 5: "fprop2d". With x' = x as (I, H, W, D, N) and gy' = grad_y as (O, P, Q, Z, N),
//     grad_w[i, o, t, r, s] = sum over h, w and the pairs (z, n) of
//                             gy'[o, h + r, w + s, (z + t, n)] * x'[i, h, w, (z, n)],
//   per depth tap t a 2-D convolution (CUTLASS's kFprop) whose channels are the (depth, batch)
//   pairs: "activation" gy' (batch O, P x Q, the D * N channels from (t, 0) on: a view with row
//   stride Z * N), "filter" x' (I filters of H x W), no padding; its output (O, kr, ks, I) is tap t
//   of out (O, kt, kr, ks, I). Both operands K-major, as TF32's wgmma needs (CUTLASS's wgrad reads
//   them MN-major). The kt taps' launches run concurrently, and a split into S slices of the
//   depth (D / S * N channels each) multiplies them: slice 0 writes out, the others partial outputs
//   in a workspace, which a kernel then adds into out. The tile (128 or 256 rows of the GEMM's
//   O * kr * ks) and S are chosen to fill the multiprocessors (fprop2d_plan).
//
//   bfloat16: CUTLASS's kWgrad, 3-D, x NDHWC as the convolution's "output" (GEMM M = I), grad_y
//   NDHWC as its input (im2col, GEMM N = (O, ks, kr, kt)), no padding; out (I, kt, kr, ks, O).
//
// Sums in float32. The operands' layouts are copies (fprop2d's by chwdn_relayout_kernel, wgrad's
// by ATen) where they do not lie so already; out is permuted back to (I, O, kt, kr, ks) in x's
// dtype. The concurrent launches run on side streams of c10's pool, forked from and joined back
// to the current stream by events (a CUDA graph capture follows them). Everything
// else -- float16, float64, float32 without TF32, another device, sizes CUTLASS refuses
// (can_implement) or the path does not take (alignment, tiles, over 2^31 - 1 elements) -- by
// aten.convolution_backward, as does a build without CUTLASS.

#ifdef FUSED_OPS_CUTLASS
#ifndef NDEBUG
#define NDEBUG  // before any header (cutlass_conv.cuh says why)
#endif
#endif

#include <ATen/ATen.h>
#include <c10/cuda/CUDAEvent.h>
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
#include <exception>
#include <functional>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

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

// out (C, H, W, D, N) contiguous = t (N, C, D, H, W) of any strides, float32: fprop2d's operand layout
// (x', gy'), whose innermost pairs (d, n) are t's outermost and most strided dims. A block stages a
// kRows x 32 tile through shared memory: 32 consecutive values along the lane dim (C where t has
// unit stride there -- channels-last --, else W) at one value of the other two of (C, H, W), and
// kRows consecutive (d, n) pairs; it reads 32 values along the lane dim per row (one 128-byte line
// where that dim has unit stride) and writes each lane value's kRows pairs as one run of out.
struct ChwdnRelayout {
  int64_t size[5], stride[5];  // t's, in (N, C, D, H, W) order
  bool lane_is_c;              // else W
};

constexpr int kChwdnRows = 128, kChwdnLanes = 32, kChwdnWarps = 8;

__global__ void __launch_bounds__(kChwdnLanes * kChwdnWarps)
    chwdn_relayout_kernel(const float* __restrict__ t, float* __restrict__ out, const ChwdnRelayout r) {
  __shared__ float tile[kChwdnRows][kChwdnLanes + 1];  // (+1: the column reads hit 32 banks)
  const int64_t n = r.size[0], c = r.size[1], h = r.size[3], w = r.size[4], rows = r.size[2] * n;
  const int64_t lanes = r.lane_is_c ? c : w, lane_tiles = (lanes + kChwdnLanes - 1) / kChwdnLanes;
  const int64_t row_tiles = (rows + kChwdnRows - 1) / kChwdnRows;
  int64_t block = blockIdx.x;
  const int64_t row0 = block % row_tiles * kChwdnRows;
  block /= row_tiles;
  const int64_t lane0 = block % lane_tiles * kChwdnLanes;
  block /= lane_tiles;
  // block: the other two of (C, H, W), (h, w) with lanes along C, (c, h) along W
  const int64_t hh = r.lane_is_c ? block / w : block % h;
  const int64_t fixed = r.lane_is_c ? block % w : block / h;  // w, or c
  const int64_t lane = lane0 + threadIdx.x;
  const auto base = [&](int64_t l) {  // t's offset and out's (c, h, w) row for lane value l
    const int64_t cc = r.lane_is_c ? l : fixed, ww = r.lane_is_c ? fixed : l;
    return std::pair<int64_t, int64_t>{cc * r.stride[1] + hh * r.stride[3] + ww * r.stride[4], (cc * h + hh) * w + ww};
  };
  if (lane < lanes) {
    const float* from = t + base(lane).first;
    // pair (d, n) = row0 + i, stepped by kChwdnWarps without a division per step (n < 2^31: the
    // CUTLASS paths' int32 extents)
    int d = static_cast<int>((row0 + threadIdx.y) / n), nn = static_cast<int>((row0 + threadIdx.y) % n);
    for (int i = threadIdx.y; i < kChwdnRows && row0 + i < rows; i += kChwdnWarps) {
      tile[i][threadIdx.x] = from[d * r.stride[2] + nn * r.stride[0]];
      for (nn += kChwdnWarps; nn >= n; nn -= static_cast<int>(n)) ++d;
    }
  }
  __syncthreads();
  for (int j = threadIdx.y; j < kChwdnLanes && lane0 + j < lanes; j += kChwdnWarps) {
    float* run = out + base(lane0 + j).second * rows + row0;
    for (int i = threadIdx.x; i < kChwdnRows && row0 + i < rows; i += kChwdnLanes) run[i] = tile[i][j];
  }
}

// t (N, C, D, H, W) float32 as (C, H, W, D, N) contiguous, 16-byte aligned: t's own memory where it
// lies so, else a copy by chwdn_relayout_kernel.
at::Tensor to_chwdn(const at::Tensor& t) {
  const at::Tensor permuted = t.permute({1, 3, 4, 2, 0});
  if (permuted.is_contiguous() && aligned_for_tma(permuted)) return permuted;
  at::Tensor out = at::empty(permuted.sizes(), t.options());
  ChwdnRelayout r{};
  for (int d = 0; d < 5; ++d) {
    r.size[d] = t.size(d);
    r.stride[d] = t.stride(d);
  }
  r.lane_is_c = t.stride(1) == 1 && t.stride(4) != 1;
  const int64_t lanes = r.lane_is_c ? r.size[1] : r.size[4];
  const int64_t blocks = (r.size[2] * r.size[0] + kChwdnRows - 1) / kChwdnRows *
                         ((lanes + kChwdnLanes - 1) / kChwdnLanes) * (r.size[1] * r.size[3] * r.size[4] / lanes);
  TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(), kWhat, ": too many blocks for the operands' relayout");
  chwdn_relayout_kernel<<<static_cast<unsigned>(blocks), dim3(kChwdnLanes, kChwdnWarps), 0,
                          c10::cuda::getCurrentCUDAStream()>>>(t.const_data_ptr<float>(),
                                                               out.mutable_data_ptr<float>(), r);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

using Fprop2dTf32Tile128 = CutlassConv<Operator::kFprop, 2, float, float, 128, 64, 32>;
using Fprop2dTf32Tile256 = CutlassConv<Operator::kFprop, 2, float, float, 256, 64, 32>;
using WgradBf16 = CutlassConv<Operator::kWgrad, 3, cutlass::bfloat16_t, float, 64, 128, 64>;

// fprop2d's 2-D convolution for one tap and depth slice of `depth` positions (module comment):
// gy' (O, P, Q, a window of depth * N of the Z * N channels), x' (I, H, W, the window of the D * N).
template <class K>
typename K::ProblemShape fprop2d_problem(const TransposedConvWeightGrad& g, int64_t depth) {
  using PS = typename K::ProblemShape;
  using Extent = typename PS::TensorExtent;
  using Stride = typename PS::TensorStride;
  using Spatial = typename PS::SpatialExtent;
  const int64_t window = depth * g.batch, gy_row = g.out(0) * g.batch, x_row = g.in[0] * g.batch;
  const int64_t p = g.out(1), q = g.out(2), h = g.in[1], w = g.in[2];
  return PS(cutlass::conv::Mode::kCrossCorrelation,
            make_array<Extent>(int(g.out_channels), int(p), int(q), int(window)),
            make_array<Stride>(p * q * gy_row, q * gy_row, gy_row, int64_t{1}),
            make_array<Extent>(int(g.in_channels), int(h), int(w), int(window)),
            make_array<Stride>(h * w * x_row, w * x_row, x_row, int64_t{1}), make_array<Spatial>(0, 0),
            make_array<Spatial>(0, 0), make_array<Spatial>(1, 1), make_array<Spatial>(1, 1), 1);
}

// fprop2d's output strides: its M modes (q, p, n) = (s, r, o) and N mode i in out (O, kt, kr, ks, I).
template <class K>
typename K::StrideD fprop2d_stride_d(const TransposedConvWeightGrad& g) {
  typename K::StrideD stride{};
  cute::get<0, 0>(stride) = g.in_channels;
  cute::get<0, 1>(stride) = g.kernel[2] * g.in_channels;
  cute::get<0, 2>(stride) = g.kernel[0] * g.kernel[1] * g.kernel[2] * g.in_channels;
  return stride;
}

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

// A CUTLASS path for a problem: shifted rows (TF32) with `splits` K ranges, fprop2d (TF32) with
// tile_m rows and `splits` depth slices, or wgrad (bf16).
struct CutlassPlan {
  enum Kind { kShiftedRows, kFprop2d, kWgrad } kind;
  int tile_m, splits;

  std::string name() const {
    switch (kind) {
      case kShiftedRows:
        return "tf32 shifted rows split" + std::to_string(splits);
      case kFprop2d:
        return "cutlass tf32 fprop2d " + std::to_string(tile_m) + "x64x32 split" + std::to_string(splits);
      default:
        return "cutlass bf16 wgrad 64x128x64";
    }
  }
};

// The shifted-rows operands' row length L: grad_y's width Q rounded up to 4 (16-byte planes).
int64_t shifted_rows_length(const TransposedConvWeightGrad& g) { return (g.out(2) + 3) / 4 * 4; }

// The shifted-rows path's plan (shifted_rows_weight_grad.cuh) for the device's `sms`
// multiprocessors, or none: ks <= 5 (its column tile), operands whose elements int32 indexes. A
// CTA per output tile -- tap (t, r), 128 output channels, 64 input channels -- times `splits`
// ranges of K, as many as fill the multiprocessors once.
std::optional<CutlassPlan> shifted_rows_plan(const TransposedConvWeightGrad& g, int sms) {
  if (g.kernel[2] > 5) return std::nullopt;
  const int64_t row = shifted_rows_length(g);
  if (!fits_cutlass_extents({g.kernel[2] * g.in_channels * g.batch * g.in[0] * g.in[1] * row,
                             g.out_channels * g.batch * g.out(0) * g.out(1) * row})) {
    return std::nullopt;
  }
  const int64_t tiles = g.kernel[0] * g.kernel[1] * ((g.in_channels + 63) / 64) * ((g.out_channels + 127) / 128);
  const int64_t k_tiles = g.batch * g.in[0] * ((g.in[1] * row + 31) / 32);
  const int64_t filter_numel = g.in_channels * g.out_channels * g.kernel[0] * g.kernel[1] * g.kernel[2];
  // (partial sums are added 4 at a time: add_partials_kernel)
  const int64_t splits = filter_numel % 4 ? 1 : std::clamp<int64_t>(sms / tiles, 1, k_tiles);
  if (tiles * splits > std::numeric_limits<int32_t>::max()) return std::nullopt;
  return CutlassPlan{CutlassPlan::kShiftedRows, 0, static_cast<int>(splits)};
}

// fprop2d's tile and split for the device's `sms` multiprocessors, or none. A CTA (~200 KB of
// shared memory: one per multiprocessor) takes tile_m x 64 of the (O kr ks) x I outputs of a tap
// over one depth slice, so a launch's time goes as waves x tile_m / splits; the least of that,
// then the larger tile (more work per operand byte), then fewer splits. SPEC's D on an H200 (132
// multiprocessors, 2026-11-26): 256 rows, 2 splits, 130 CTAs: 2.62 ms (128 rows, no split, 125
// CTAs: 2.81; 256 rows, no split, 65 CTAs: 3.32; cuDNN 6.41).
std::optional<CutlassPlan> fprop2d_plan(const TransposedConvWeightGrad& g, int sms) {
  // the window's start (t + j D / S) N channels in must be 16-byte aligned, out's rows too
  if (g.batch % 4 || g.in_channels % 4) return std::nullopt;
  std::optional<CutlassPlan> best;
  int64_t best_cost = 0;
  for (const int tile_m : {256, 128}) {
    for (const int splits : {1, 2, 4}) {
      // each slice's D / S * N channels a whole number of the tile's K (32)
      if (g.in[0] % splits || g.in[0] / splits * g.batch % 32) continue;
      const int64_t ctas = g.kernel[0] * splits * ((g.out_channels * g.kernel[1] * g.kernel[2] + tile_m - 1) / tile_m) *
                           ((g.in_channels + 63) / 64);
      const int64_t cost = (ctas + sms - 1) / sms * tile_m * (4 / splits);  // waves x tile_m / splits, x 4
      if (!best || cost < best_cost) {  // (ties: the first, the larger tile and fewer splits)
        best = CutlassPlan{CutlassPlan::kFprop2d, tile_m, splits};
        best_cost = cost;
      }
    }
  }
  if (!best) return std::nullopt;
  const int64_t depth = g.in[0] / best->splits;
  const bool implementable =
      best->tile_m == 256
          ? Fprop2dTf32Tile256::can_implement(fprop2d_problem<Fprop2dTf32Tile256>(g, depth),
                                              fprop2d_stride_d<Fprop2dTf32Tile256>(g))
          : Fprop2dTf32Tile128::can_implement(fprop2d_problem<Fprop2dTf32Tile128>(g, depth),
                                              fprop2d_stride_d<Fprop2dTf32Tile128>(g));
  return implementable ? best : std::nullopt;
}

std::optional<CutlassPlan> wgrad_plan(const TransposedConvWeightGrad& g) {
  // x's NDHWC rows 16-byte aligned; grad_y's im2col boxes read 64 channels at a time along the
  // (c, s, r, t) N mode: a box must not run past a tap's channels
  if (g.in_channels % 8 || g.out_channels % 64) return std::nullopt;
  if (!WgradBf16::can_implement(wgrad_problem(g), wgrad_stride_d(g))) return std::nullopt;
  return CutlassPlan{CutlassPlan::kWgrad, WgradBf16::kTileM, 1};
}

// The CUTLASS path for these (checked) arguments, or none.
std::optional<CutlassPlan> cutlass_plan(const at::Tensor& grad_y, const at::Tensor& x,
                                        const TransposedConvWeightGrad& g) {
  const int device = x.get_device();
  if (!runs_sm90a(device)) return std::nullopt;
  const int64_t filter_numel = g.in_channels * g.out_channels * g.kernel[0] * g.kernel[1] * g.kernel[2];
  if (!fits_cutlass_extents({x.numel(), grad_y.numel(), filter_numel})) return std::nullopt;
  if (tf32_convolution(x)) {
    const int sms = device_attribute(cudaDevAttrMultiProcessorCount, device);
    if (auto plan = shifted_rows_plan(g, sms)) return plan;
    return fprop2d_plan(g, sms);
  }
  if (x.scalar_type() == at::kBFloat16) return wgrad_plan(g);
  return std::nullopt;
}

// jobs[0] on the current stream, each other on a side stream of c10's pool that first waits for
// what the current stream has queued; then the current stream waits for every side stream (also
// where a job throws, rethrown after: the memory the jobs use is the current stream's).
void run_concurrently(const std::vector<std::function<void(cudaStream_t)>>& jobs) {
  const c10::cuda::CUDAStream origin = c10::cuda::getCurrentCUDAStream();
  c10::cuda::CUDAEvent fork;
  fork.record(origin);
  std::vector<c10::cuda::CUDAEvent> joins(jobs.size());  // (joins[0] unused)
  std::exception_ptr failure;
  size_t forked = 1;
  for (; forked < jobs.size() && !failure; ++forked) {
    const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, origin.device_index());
    fork.block(side);
    try {
      jobs[forked](side.stream());
    } catch (...) {
      failure = std::current_exception();
    }
    joins[forked].record(side);
  }
  if (!failure) {
    try {
      jobs[0](origin.stream());
    } catch (...) {
      failure = std::current_exception();
    }
  }
  for (size_t j = 1; j < forked; ++j) joins[j].block(origin);
  if (failure) std::rethrow_exception(failure);
}

// fprop2d (module comment): out (O, kt, kr, ks, I) float32, tap t and depth slice j from
// gy' + (t + j D / S) N, x' + j D / S N; slices past the first into partial outputs, then added.
template <class K>
void run_fprop2d(const TransposedConvWeightGrad& g, int splits, const at::Tensor& x_chwdn,
                 const at::Tensor& grad_y_kpqzn, at::Tensor& out) {
  const int64_t depth = g.in[0] / splits, filter_numel = out.numel();
  const auto problem = fprop2d_problem<K>(g, depth);
  const auto stride_d = fprop2d_stride_d<K>(g);
  at::Tensor partials = at::empty({(splits - 1) * filter_numel}, out.options());
  const int64_t tap = g.kernel[1] * g.kernel[2] * g.in_channels;  // out's elements per depth tap
  const float* xs = x_chwdn.const_data_ptr<float>();
  const float* gys = grad_y_kpqzn.const_data_ptr<float>();
  std::vector<std::function<void(cudaStream_t)>> jobs;
  for (int j = 0; j < splits; ++j) {
    float* slice_out =
        j == 0 ? out.mutable_data_ptr<float>() : partials.mutable_data_ptr<float>() + (j - 1) * filter_numel;
    for (int64_t t = 0; t < g.kernel[0]; ++t) {
      const float* a = gys + (t + j * depth) * g.batch;
      const float* b = xs + j * depth * g.batch;
      float* d = slice_out + t * tap;
      jobs.push_back([=](cudaStream_t stream) { K::launch(kWhat, problem, a, b, d, stride_d, stream); });
    }
  }
  run_concurrently(jobs);
  if (splits > 1) add_partials(out, partials, splits);
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
    blocks = (t.size(3) * row + 31) / 32 * ((t.size(1) + 31) / 32) * t.size(0) * t.size(2);
    TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(), kWhat, ": too many blocks for the operands' relayout");
    channels_last_rows_kernel<<<static_cast<unsigned>(blocks), dim3(32, 8), 0, stream>>>(
        t.const_data_ptr<float>(), out.mutable_data_ptr<float>(), r);
  } else {
    blocks = shifts * t.size(1) * t.size(0) * t.size(2);
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

// The shifted-rows path (shifted_rows_weight_grad.cuh): out (I, O, kt, kr, ks) float32.
template <int KS>
at::Tensor run_shifted_rows(const TransposedConvWeightGrad& g, int splits, const at::Tensor& grad_y,
                            const at::Tensor& x) {
  using Config = ShiftedRowsConfig<KS>;
  const int64_t row = shifted_rows_length(g);
  const at::Tensor x_rows = to_rows(x, row, KS), grad_y_rows = to_rows(grad_y, row, 1);
  const CUtensorMap g_map = shifted_rows_map(grad_y_rows, Config::kRowsG);
  const CUtensorMap x_map = shifted_rows_map(x_rows, Config::kRowsX);
  ShiftedRows p{};
  p.depth = static_cast<int>(g.in[0]);
  p.kt = static_cast<int>(g.kernel[0]);
  p.kr = static_cast<int>(g.kernel[1]);
  p.row = static_cast<int>(row);
  p.in_channels = static_cast<int>(g.in_channels);
  p.out_channels = static_cast<int>(g.out_channels);
  p.in_blocks = static_cast<int>((g.in_channels + Config::kRowsX - 1) / Config::kRowsX);
  p.out_blocks = static_cast<int>((g.out_channels + Config::kRowsG - 1) / Config::kRowsG);
  p.plane_tiles = static_cast<int>((g.in[1] * row + Config::kTileK - 1) / Config::kTileK);
  p.k_tiles = g.batch * g.in[0] * p.plane_tiles;
  p.splits = splits;
  at::Tensor out = at::empty({g.in_channels, g.out_channels, g.kernel[0], g.kernel[1], KS}, x.options());
  p.filter_numel = out.numel();
  at::Tensor partials = at::empty({(splits - 1) * p.filter_numel}, out.options());
  static const bool configured = [] {  // (per KS: its own kernel)
    C10_CUDA_CHECK(cudaFuncSetAttribute(shifted_rows_weight_grad_kernel<KS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        Config::kSmemBytes));
    return true;
  }();
  (void)configured;
  const int64_t blocks = int64_t{p.kt} * p.kr * p.in_blocks * p.out_blocks * splits;
  shifted_rows_weight_grad_kernel<KS><<<static_cast<unsigned>(blocks), Config::kThreads, Config::kSmemBytes,
                                        c10::cuda::getCurrentCUDAStream()>>>(
      g_map, x_map, out.mutable_data_ptr<float>(), partials.mutable_data_ptr<float>(), p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (splits > 1) add_partials(out, partials, splits);
  return out;
}

at::Tensor run_cutlass(const CutlassPlan& plan, const at::Tensor& grad_y, const at::Tensor& x,
                       const TransposedConvWeightGrad& g) {
  const int64_t kt = g.kernel[0], kr = g.kernel[1], ks = g.kernel[2];
  if (plan.kind == CutlassPlan::kShiftedRows) {
    switch (ks) {
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
  if (plan.kind == CutlassPlan::kFprop2d) {
    // x (N, I, D, H, W) -> (I, H, W, D, N), grad_y (N, O, Z, P, Q) -> (O, P, Q, Z, N)
    const at::Tensor x_chwdn = to_chwdn(x);
    const at::Tensor grad_y_kpqzn = to_chwdn(grad_y);
    at::Tensor out = at::empty({g.out_channels, kt, kr, ks, g.in_channels}, x.options());
    if (plan.tile_m == 256) {
      run_fprop2d<Fprop2dTf32Tile256>(g, plan.splits, x_chwdn, grad_y_kpqzn, out);
    } else {
      run_fprop2d<Fprop2dTf32Tile128>(g, plan.splits, x_chwdn, grad_y_kpqzn, out);
    }
    return out.permute({4, 0, 1, 2, 3}).contiguous();  // (O, kt, kr, ks, I) -> (I, O, kt, kr, ks)
  }
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
  if (const auto plan = cutlass_plan(grad_y, x, g)) return run_cutlass(*plan, grad_y, x, g);
#endif
  return transposed_conv_weight_grad_by_aten(grad_y, x, g);
}

std::string conv_transpose3d_weight_grad_path_cuda(const at::Tensor& grad_y, const at::Tensor& x,
                                                   at::IntArrayRef kernel_size) {
  [[maybe_unused]] const TransposedConvWeightGrad g = transposed_conv_weight_grad_setup(grad_y, x, kernel_size);
  const c10::cuda::CUDAGuard guard(x.device());
#ifdef FUSED_OPS_CUTLASS
  if (const auto plan = cutlass_plan(grad_y, x, g)) return plan->name();
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
