// CUDA kernels of conv_transpose3d_batch_norm_eval_mean (the math: ../conv_transpose3d_batch_norm_eval_mean.h),
// two launches a call: chunk_and_tap_sums_kernel, in blocks of its own first (a warp per row of taps), each
// (input, output channel)'s tap sum (float64) and shared sign, then x's (n, i) planes in chunks of kChunk
// elements (a block each, in an order fixed by the shape); then a block per output channel o, a warp per batch
// element: the dot product of the finite spatial sums (each its chunks' sum) with the tap sums (a warp sum), the
// non-finite ones' signs (warp votes), the bias, the scale and the batch norm. x not contiguous (or more chunks
// than a grid holds): its spatial sums by ATen's reduction first, as one chunk each. No host-side arithmetic on
// the weights or statistics.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <optional>

#include "../conv_transpose3d_batch_norm_eval_mean.h"
#include "block_reduce.cuh"
#include "plane_rows.cuh"

namespace fused_ops {
namespace {

constexpr int kThreads = 256;
// x elements a block of chunk_and_tap_sums_kernel sums: SPEC's D's planes (16 x 32 x 32) in one chunk each.
constexpr int64_t kChunk = 16384;

// Blocks [0, tap_blocks): taps[o, i] = the sum of w[i, o, :] in float64 and its TapSign as a double (tap_sum's,
// summed in lane order), a warp per row of kTapRows consecutive e = o * I + i, its lanes on consecutive taps
// (a row's loads coalesced), weight (I, O, T) contiguous; first in the grid, so that they run beside the
// chunks, not after them. Blocks from tap_blocks on (b = block - tap_blocks): partial[b] = the sum of chunk
// b % chunks of x's plane b / chunks (x (N I, plane) contiguous, in x's accumulation type), each thread adding
// a group of kGroup consecutive elements (16 bytes) in turn, the block's threads on consecutive groups (a warp's
// loads whole 512-byte spans); a group read as one aligned vector where x allows, else as VEC-element pieces
// (the same order either way).
template <typename scalar_t>
constexpr int kGroup = 16 / sizeof(scalar_t);
constexpr int kTapRows = 4;  // rows of taps a warp sums: their loads in flight together
constexpr int64_t kTapRowsPerBlock = kTapRows * kThreads / 32;

template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kThreads)
    chunk_and_tap_sums_kernel(const scalar_t* __restrict__ x, int64_t plane, int64_t chunks, int64_t tap_blocks,
                              const scalar_t* __restrict__ weight, const BatchNormEvalMean g,
                              at::opmath_type<scalar_t>* __restrict__ partial, double* __restrict__ sums,
                              double* __restrict__ signs) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int group = kGroup<scalar_t>;
  static_assert(group % VEC == 0 && kChunk % group == 0, "whole vectors a group, whole groups a chunk");
  __shared__ acc_t scratch[32];
  if (blockIdx.x < tap_blocks) {  // (a whole block: no barrier below for it)
    const int lane = threadIdx.x % 32;
    const int64_t pairs = g.in_channels * g.out_channels;
    const int64_t first = blockIdx.x * kTapRowsPerBlock + threadIdx.x / 32 * kTapRows;
    double sum[kTapRows] = {};
    TapSign sign[kTapRows];
#pragma unroll
    for (int r = 0; r < kTapRows; ++r) {
      const int64_t e = first + r;  // o * I + i
      if (e >= pairs) continue;  // (uniform across the warp)
      const scalar_t* const row = weight + (e % g.in_channels * g.out_channels + e / g.in_channels) * g.taps;
      for (int64_t t = lane; t < g.taps; t += 32) {
        const double v = static_cast<double>(row[t]);
        sum[r] += v;
        sign[r].meet(v);
      }
    }
#pragma unroll
    for (int r = 0; r < kTapRows; ++r) {
      const int64_t e = first + r;
      if (e >= pairs) break;  // (uniform across the warp)
      const double total = warp_sum(sum[r]);
      TapSign row;  // the lanes' signs joined
      row.positive = __all_sync(0xffffffffu, sign[r].positive);
      row.negative = __all_sync(0xffffffffu, sign[r].negative);
      if (lane == 0) {
        sums[e] = total;
        signs[e] = row.sign();
      }
    }
    return;
  }
  const int64_t b = blockIdx.x - tap_blocks;
  const int64_t first = (b % chunks) * kChunk, left = plane - first;
  const scalar_t* const chunk = x + (b / chunks) * plane + first;
  const int64_t size = left < kChunk ? left : kChunk, whole = size / group * group;
  acc_t sum = 0;
#pragma unroll 4
  for (int64_t k = threadIdx.x * group; k < whole; k += kThreads * group) {
#pragma unroll
    for (int v = 0; v < group; v += VEC) {
      const Vector<scalar_t, VEC> in = load_vector<scalar_t, VEC>(chunk + k + v);
#pragma unroll
      for (int j = 0; j < VEC; ++j) sum += static_cast<acc_t>(in.v[j]);
    }
  }
  if (threadIdx.x == 0) {  // (a last group the chunk cuts)
    for (int64_t k = whole; k < size; ++k) sum += static_cast<acc_t>(chunk[k]);
  }
  sum = block_sum(sum, scratch);
  if (threadIdx.x == 0) partial[b] = sum;
}

// out[n, o] (module comment) for o = blockIdx.x, a warp per batch element n (the block's warps in turn over n):
// its lanes' dot products of the finite spatial sums s[n, i] (each its chunks' sum, in order) with the tap
// sums, a warp sum, the non-finite ones' signs (warp votes), then the bias, the scale and the batch norm; no
// barrier. partial (N, I, chunks) (chunk_and_tap_sums_kernel's), taps and signs (O, I), out (N, O), contiguous.
template <typename scalar_t, typename param_t, typename out_t>
__global__ void __launch_bounds__(kThreads)
    batch_norm_eval_mean_kernel(const at::opmath_type<scalar_t>* __restrict__ partial, int64_t chunks,
                                const double* __restrict__ taps,
                                const double* __restrict__ signs, const scalar_t* __restrict__ conv_bias,
                                const param_t* __restrict__ gamma, const param_t* __restrict__ beta,
                                const param_t* __restrict__ running_mean, const param_t* __restrict__ running_var,
                                const BatchNormEvalMean g, double scale, double eps, out_t* __restrict__ out) {
  constexpr int kWarps = kThreads / 32;
  const int64_t o = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const double* const tap = taps + o * g.in_channels;
  const double* const sign = signs + o * g.in_channels;
  const double gain = (gamma != nullptr ? static_cast<double>(gamma[o]) : 1.0) /
                      sqrt(static_cast<double>(running_var[o]) + eps);
  const double bias = conv_bias != nullptr ? static_cast<double>(conv_bias[o]) : 0.0;
  for (int64_t n = warp; n < g.batch; n += kWarps) {  // (a warp's own loop: uniform across its lanes)
    double dot = 0;
    NonFiniteMean non_finite;
    for (int64_t i = lane; i < g.in_channels; i += 32) {
      const at::opmath_type<scalar_t>* const parts = partial + (n * g.in_channels + i) * chunks;
      at::opmath_type<scalar_t> sum = 0;
      for (int64_t c = 0; c < chunks; ++c) sum += parts[c];
      const double value = static_cast<double>(sum);
      if (isfinite(value)) {
        dot += value * tap[i];
      } else {
        non_finite.meet(value, static_cast<int>(sign[i]));
      }
    }
    dot = warp_sum(dot);
    non_finite.positive = __any_sync(0xffffffffu, non_finite.positive);
    non_finite.negative = __any_sync(0xffffffffu, non_finite.negative);
    non_finite.nan = __any_sync(0xffffffffu, non_finite.nan);
    if (lane == 0) {
      const double mean = non_finite.mean(dot * g.inverse_volume + bias);
      out[n * g.out_channels + o] = static_cast<out_t>(scaled_batch_norm(
          mean, scale, static_cast<double>(running_mean[o]), gain, beta != nullptr ? static_cast<double>(beta[o]) : 0.0));
    }
  }
}

template <typename T>
const T* data_or_null(const std::optional<at::Tensor>& t) {
  return is_given(t) ? t->const_data_ptr<T>() : nullptr;
}

at::Tensor conv_transpose3d_batch_norm_eval_mean_cuda(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
    const at::Tensor& running_mean, const at::Tensor& running_var, at::IntArrayRef stride,
    at::IntArrayRef output_padding, double scale, double eps, std::optional<at::ScalarType> dtype) {
  const BatchNormEvalMean g = batch_norm_eval_mean_setup(x, weight, bias, bn_weight, bn_bias, running_mean,
                                                         running_var, stride, output_padding, dtype);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({g.batch, g.out_channels}, x.options().dtype(g.result));
  if (out.numel() == 0) return out;
  // x's planes in chunks by the first kernel where x is contiguous and the grid holds them, else x's spatial
  // sums by ATen's reduction (one chunk a plane) and the first kernel's tap blocks alone
  const int64_t plane = x.numel() / std::max<int64_t>(g.batch * g.in_channels, 1);
  const int64_t chunks = std::max<int64_t>((plane + kChunk - 1) / kChunk, 1);
  const int64_t pairs = g.in_channels * g.out_channels;
  const int64_t tap_blocks = (pairs + kTapRowsPerBlock - 1) / kTapRowsPerBlock;
  const bool chunked = x.is_contiguous() && g.batch * g.in_channels * chunks + tap_blocks <= INT_MAX;
  const int64_t chunk_blocks = chunked ? g.batch * g.in_channels * chunks : 0;
  // one allocation for the (O, I) tap sums and signs (float64) and the chunks' sums after them
  const at::ScalarType acc = at::toOpMathType(x.scalar_type());
  const int64_t tap_bytes = 2 * pairs * static_cast<int64_t>(sizeof(double));
  const at::Tensor scratch =
      at::empty({tap_bytes + chunk_blocks * static_cast<int64_t>(at::elementSize(acc))}, x.options().dtype(at::kByte));
  double* const tap_sums = reinterpret_cast<double*>(scratch.mutable_data_ptr<uint8_t>());
  double* const tap_signs = tap_sums + pairs;
  const at::Tensor sums = chunked ? at::Tensor() : spatial_sums(x).contiguous();
  void* const partial = chunked ? static_cast<void*>(scratch.mutable_data_ptr<uint8_t>() + tap_bytes)
                                : sums.mutable_data_ptr();
  const at::Tensor w = weight.contiguous();
  const auto per_channel = [](const std::optional<at::Tensor>& t) {
    return is_given(t) ? std::optional<at::Tensor>(t->contiguous()) : std::nullopt;
  };
  const auto gamma = per_channel(bn_weight), beta = per_channel(bn_bias);
  const auto conv_bias = per_channel(bias);
  const at::Tensor mean = running_mean.contiguous(), var = running_var.contiguous();
  const auto stream = c10::cuda::getCurrentCUDAStream();
  FUSED_OPS_DISPATCH_FLOATING_TYPES(x.scalar_type(), "conv_transpose3d_batch_norm_eval_mean_cuda", [&] {
    using x_t = scalar_t;
    if (chunk_blocks + tap_blocks > 0) {  // (none where x has no channels)
      const int vec = chunked ? aligned_vector_width<x_t>(x.const_data_ptr(), {plane}) : 1;  // (at most a group)
      dispatch_vector_width<x_t>(vec, [&](auto width) {
        chunk_and_tap_sums_kernel<x_t, decltype(width)::value>
            <<<static_cast<unsigned>(chunk_blocks + tap_blocks), kThreads, 0, stream>>>(
                x.const_data_ptr<x_t>(), plane, chunks, tap_blocks, w.const_data_ptr<x_t>(), g,
                static_cast<at::opmath_type<x_t>*>(partial), tap_sums, tap_signs);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    }
    FUSED_OPS_DISPATCH_FLOATING_TYPES(g.param_dtype, "conv_transpose3d_batch_norm_eval_mean_cuda", [&] {
      using param_t = scalar_t;
      dispatch_scalar_or_acc<x_t>(g.result, [&](auto* out_type) {
        using out_t = std::remove_pointer_t<decltype(out_type)>;
        batch_norm_eval_mean_kernel<x_t, param_t, out_t><<<static_cast<unsigned>(g.out_channels), kThreads, 0,
                                                            stream>>>(
            static_cast<const at::opmath_type<x_t>*>(partial), chunked ? chunks : 1, tap_sums, tap_signs,
            data_or_null<x_t>(conv_bias), data_or_null<param_t>(gamma), data_or_null<param_t>(beta),
            mean.const_data_ptr<param_t>(), var.const_data_ptr<param_t>(), g, scale, eps, out.mutable_data_ptr<out_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("conv_transpose3d_batch_norm_eval_mean", &conv_transpose3d_batch_norm_eval_mean_cuda);
}

}  // namespace fused_ops
