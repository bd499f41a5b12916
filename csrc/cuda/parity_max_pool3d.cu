// CUDA kernels of parity_max_pool3d_mean and parity_max_pool3d_cascade_sum
// (the math: ../parity_max_pool3d.h).
//
// Forwards: thread = (stage-1 position or stage-2 window, channel c); a block
// holds `rows` of them by `cpb` channels, so that a warp's loads cover
// neighbouring channels' windows: one contiguous run of y. Windows are read
// in aligned vectors of VEC elements, kBatch windows' loads issued before
// their compares. The mean's per-thread sums over positions are added per
// block, then per (n, c) over blocks by sum_rows_kernel (a fixed order:
// deterministic); the cascade adds each stage-2 window's channels in the block.
//
// Backwards: grad_y is written once by a grid-stride loop over its vectors,
// consecutive threads on consecutive vectors: each window's pick gets the
// gradient, the rest 0.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>

#include "../dispatch.h"
#include "../parity_max_pool3d.h"
#include "block_reduce.cuh"
#include "plane_rows.cuh"

namespace fused_ops {
namespace {

constexpr int kThreads = 256;
constexpr int kBatch = 4;                 // windows whose loads are in flight together per thread
constexpr int kPositionsPerThread = 16;   // the mean: stage-1 positions per thread and block

// A block's threads as `rows` rows of `cpb` channels (threads past rows * cpb idle).
struct ChannelTile {
  int cpb, rows;
  int64_t channel_blocks;
};

inline ChannelTile channel_tile(int64_t channels) {
  const int cpb = static_cast<int>(std::min<int64_t>(channels, kThreads));
  return {cpb, kThreads / cpb, (channels + cpb - 1) / cpb};
}

// The stage-1 picks of kBatch windows of Q = vecs * VEC elements at window[j]:
// every window's vector v loaded before any compare. Every window[j] is read
// (a caller with fewer windows repeats its first: loads without a branch, as
// the predicated ones spilled registers in some instantiations).
template <typename acc_t, typename scalar_t, int VEC>
__device__ __forceinline__ void parity_picks(const scalar_t* const (&window)[kBatch], int vecs,
                                             WindowPick<acc_t> (&pick)[kBatch]) {
#pragma unroll
  for (int j = 0; j < kBatch; ++j) pick[j] = WindowPick<acc_t>();
  for (int v = 0; v < vecs; ++v) {
    Vector<scalar_t, VEC> in[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      in[j] = load_vector<scalar_t, VEC>(window[j] + v * VEC);
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) pick[j].update(static_cast<acc_t>(in[j].v[e]), v * VEC + e);
    }
  }
}

// Block (item, channel block): item = n * parts + part covers positions
// [part * chunk, (part + 1) * chunk) of batch element n; partial[(n * C + c)
// * parts + part] = the sum of those positions' maxima / M.
template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kThreads) parity_mean_kernel(
    const scalar_t* __restrict__ y, int64_t M, int C, int vecs, ChannelTile tile, int64_t chunk,
    int64_t parts, at::opmath_type<scalar_t>* __restrict__ partial, uint8_t* __restrict__ picks) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t sums[kThreads];
  const int64_t n = blockIdx.x / parts, part = blockIdx.x % parts;
  const int t = threadIdx.x, r = t / tile.cpb;
  const int c = static_cast<int>(blockIdx.y) * tile.cpb + t % tile.cpb;
  const bool active = r < tile.rows && c < C;
  const int Q = vecs * VEC;
  const int64_t end = std::min(M, (part + 1) * chunk);
  acc_t sum = 0;
  if (active) {
    for (int64_t m = part * chunk + r; m < end; m += kBatch * tile.rows) {
      const scalar_t* window[kBatch];
      int64_t index[kBatch];
      const int count = static_cast<int>(std::min<int64_t>(kBatch, (end - m + tile.rows - 1) / tile.rows));
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        index[j] = (n * M + m + (j < count ? j : 0) * tile.rows) * C + c;
        window[j] = y + index[j] * Q;
      }
      WindowPick<acc_t> pick[kBatch];
      parity_picks<acc_t, scalar_t, VEC>(window, vecs, pick);
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        if (j < count) {
          sum += pick[j].value;
          if (picks != nullptr) picks[index[j]] = static_cast<uint8_t>(pick[j].offset);
        }
      }
    }
  }
  sums[t] = sum;
  __syncthreads();
  if (active && r == 0) {
    acc_t total = 0;
    for (int i = 0; i < tile.rows; ++i) total += sums[i * tile.cpb + t];
    partial[(n * C + c) * parts + part] = total / static_cast<acc_t>(M);
  }
}

// Block (group of tile.rows stage-2 windows, channel block): out[n, cell] =
// sum over c of the window's stage-2 pick (written as out_t, the result's
// dtype), or partial[(n, cell), channel block] where the channels span
// several blocks.
template <typename scalar_t, typename out_t, int VEC>
__global__ void __launch_bounds__(kThreads) parity_cascade_kernel(
    const scalar_t* __restrict__ y, ParityLayout l, CascadeStage2 s, int vecs, ChannelTile tile,
    out_t* __restrict__ out, at::opmath_type<scalar_t>* __restrict__ partial,
    uint8_t* __restrict__ picks) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t sums[kThreads];
  const int64_t cells = s.cells(), windows = l.batch * cells;
  const int t = threadIdx.x, r = t / tile.cpb;
  const int c = static_cast<int>(blockIdx.y) * tile.cpb + t % tile.cpb;
  const int64_t window = static_cast<int64_t>(blockIdx.x) * tile.rows + r;  // n * cells + cell
  const bool active = r < tile.rows && c < l.channels && window < windows;
  const int Q = vecs * VEC;
  acc_t value = 0;
  if (active) {
    const int64_t n = window / cells, cell = window % cells;
    const int64_t od = cell / (s.out[1] * s.out[2]), oh = cell / s.out[2] % s.out[1], ow = cell % s.out[2];
    // Position (od k2d + a, oh k2h + b, ow k2w + e) is stage-1 row
    // origin + (a Mh + b) Mw + e; off = (a k2h + b) k2w + e counts them in scan order.
    const int64_t origin = n * l.positions() + (od * s.kernel[0] * l.stage1[1] + oh * s.kernel[1]) * l.stage1[2] +
                           ow * s.kernel[2];
    const int volume = static_cast<int>(s.volume());
    int a = 0, b = 0, e = 0;
    WindowPick<acc_t> stage2;
    for (int off = 0; off < volume; off += kBatch) {
      const scalar_t* at_off[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        at_off[j] = off + j < volume ? y + ((origin + (a * l.stage1[1] + b) * l.stage1[2] + e) * l.channels + c) * Q
                                     : at_off[0];
        if (++e == s.kernel[2]) {
          e = 0;
          if (++b == s.kernel[1]) b = 0, ++a;
        }
      }
      WindowPick<acc_t> first[kBatch];
      parity_picks<acc_t, scalar_t, VEC>(at_off, vecs, first);
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        stage2.update(first[j].value, (off + j) * Q + first[j].offset, off + j < volume);
      }
    }
    value = stage2.value;
    if (picks != nullptr) picks[window * l.channels + c] = static_cast<uint8_t>(stage2.offset);
  }
  sums[t] = value;
  __syncthreads();
  if (active && t % tile.cpb == 0) {
    acc_t total = 0;
    const int here = static_cast<int>(std::min<int64_t>(tile.cpb, l.channels - c));
    for (int i = 0; i < here; ++i) total += sums[t + i];
    if (partial == nullptr) {
      out[window] = static_cast<out_t>(total);
    } else {
      partial[window * tile.channel_blocks + blockIdx.y] = total;
    }
  }
}

// grad_y[n, m, c, :] = one-hot(pick) * grad_mean[n, c] / M. Item = one
// vector of VEC elements of grad_y (vector v of window (n, m, c)), so that a
// warp's stores are one contiguous run of whole sectors.
template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kThreads) parity_mean_backward_kernel(
    const scalar_t* __restrict__ grad_mean, int64_t gs0, int64_t gs1, const uint8_t* __restrict__ picks,
    int M, int C, int vecs, int64_t items, scalar_t* __restrict__ grad_y) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  ItemCursor<4> at(item, stride, {M, C, vecs});  // (n, m, c, v)
  for (; item < items; item += stride, at.next()) {
    // (the pick's place in this vector; a pick past the window's Q elements is past every vector's: none)
    const int q = static_cast<int>(picks[(at.leading() * M + at[1]) * C + at[2]]) - at[3] * VEC;
    const auto g = static_cast<scalar_t>(static_cast<acc_t>(grad_mean[at.leading() * gs0 + at[2] * gs1]) /
                                         static_cast<acc_t>(M));
    Vector<scalar_t, VEC> o;
#pragma unroll
    for (int e = 0; e < VEC; ++e) o.v[e] = e == q ? g : scalar_t(0);
    *reinterpret_cast<Vector<scalar_t, VEC>*>(grad_y + item * VEC) = o;
  }
}

// grad_y[n, m, c, :] = one-hot(q) * grad_out[n, cell] where (n, cell, c)'s
// pick is (off, q) and m is position off of cell's window; else 0. Item =
// one vector of grad_y, as in parity_mean_backward_kernel.
template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kThreads) parity_cascade_backward_kernel(
    const scalar_t* __restrict__ grad_out, const uint8_t* __restrict__ picks, ParityLayout l,
    CascadeStage2 s, int vecs, int64_t items, scalar_t* __restrict__ grad_y) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int k[3] = {static_cast<int>(s.kernel[0]), static_cast<int>(s.kernel[1]), static_cast<int>(s.kernel[2])};
  const int Q = vecs * VEC;
  ItemCursor<6> at(item, stride,
                   {static_cast<int>(l.stage1[0]), static_cast<int>(l.stage1[1]), static_cast<int>(l.stage1[2]),
                    static_cast<int>(l.channels), vecs});  // (n, md, mh, mw, c, v)
  for (; item < items; item += stride, at.next()) {
    const int od = at[1] / k[0], oh = at[2] / k[1], ow = at[3] / k[2];
    int q = -1;
    scalar_t g(0);
    if (od < s.out[0] && oh < s.out[1] && ow < s.out[2]) {
      const int64_t cell = (at.leading() * s.out[0] + od) * s.out[1] * s.out[2] + oh * s.out[2] + ow;
      const int off = ((at[1] - od * k[0]) * k[1] + at[2] - oh * k[1]) * k[2] + at[3] - ow * k[2];
      // (a pick past the window's volume * Q elements leaves q >= VEC at every off and vector: none)
      q = static_cast<int>(picks[cell * l.channels + at[4]]) - off * Q - at[5] * VEC;
      g = grad_out[cell];
    }
    Vector<scalar_t, VEC> o;
#pragma unroll
    for (int e = 0; e < VEC; ++e) o.v[e] = e == q ? g : scalar_t(0);
    *reinterpret_cast<Vector<scalar_t, VEC>*>(grad_y + item * VEC) = o;
  }
}

// The kernels index positions and channels with int.
void check_int_sizes(const char* what, const ParityLayout& l) {
  TORCH_CHECK_VALUE(l.positions() * l.channels <= std::numeric_limits<int>::max(), what,
                    ": inputs with 2^31 or more (position, channel) pairs per batch element are not "
                    "supported by the CUDA kernels");
}

// Calls f(VEC) with the widest vector in which y's windows of Q elements at
// data can be moved.
template <typename scalar_t, typename F>
void dispatch_window_vector(const void* data, int64_t Q, F&& f) {
  dispatch_vector_width<scalar_t>(aligned_vector_width<scalar_t>(data, {Q}), f);
}

std::tuple<at::Tensor, at::Tensor> parity_max_pool3d_mean_cuda(const at::Tensor& y_in, bool save_indices,
                                                               std::optional<at::ScalarType> dtype) {
  constexpr const char* what = "parity_max_pool3d_mean";
  const auto l = parity_layout(what, y_in);
  check_int_sizes(what, l);
  const at::Tensor y = y_in.contiguous();
  at::Tensor mean = at::empty({l.batch, l.channels}, y.options().dtype(result_dtype(what, y.scalar_type(), dtype)));
  at::Tensor picks = saved_picks(y, save_indices, {l.batch, l.stage1[0], l.stage1[1], l.stage1[2], l.channels});
  const c10::cuda::CUDAGuard guard(y.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const ChannelTile tile = channel_tile(l.channels);
  const int64_t M = l.positions();
  const int64_t chunk = static_cast<int64_t>(tile.rows) * kPositionsPerThread;
  const int64_t parts = (M + chunk - 1) / chunk;
  TORCH_CHECK_VALUE(tile.channel_blocks <= 65535, what, ": too many channels for the CUDA kernel, got ",
                    l.channels);
  FUSED_OPS_DISPATCH_FLOATING_TYPES(y.scalar_type(), "parity_max_pool3d_mean_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    at::Tensor partial = at::empty({l.batch * l.channels * parts}, y.options().dtype(at::toOpMathType(y.scalar_type())));
    dispatch_window_vector<scalar_t>(y.const_data_ptr(), l.classes, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      const dim3 grid(static_cast<unsigned>(l.batch * parts), static_cast<unsigned>(tile.channel_blocks));
      parity_mean_kernel<scalar_t, VEC><<<grid, kThreads, 0, stream>>>(
          y.const_data_ptr<scalar_t>(), M, static_cast<int>(l.channels), static_cast<int>(l.classes / VEC), tile,
          chunk, parts, partial.mutable_data_ptr<acc_t>(),
          save_indices ? picks.mutable_data_ptr<uint8_t>() : nullptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    dispatch_scalar_or_acc<scalar_t>(mean.scalar_type(), [&](auto* tag) {
      using out_t = std::remove_pointer_t<decltype(tag)>;
      sum_rows_kernel<acc_t, out_t><<<static_cast<unsigned>(l.batch * l.channels), 32, 0, stream>>>(
          partial.const_data_ptr<acc_t>(), parts, mean.mutable_data_ptr<out_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {mean, picks};
}

at::Tensor parity_max_pool3d_mean_backward_cuda(const at::Tensor& grad_mean, const at::Tensor& picks_in,
                                                int64_t parity_classes) {
  auto args = parity_mean_backward_setup(grad_mean, picks_in, parity_classes);
  const ParityLayout& l = args.layout;
  check_int_sizes("parity_max_pool3d_mean_backward", l);
  if (args.grad_y.numel() == 0) return args.grad_y;
  const c10::cuda::CUDAGuard guard(grad_mean.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  FUSED_OPS_DISPATCH_FLOATING_TYPES(grad_mean.scalar_type(), "parity_max_pool3d_mean_backward_cuda", [&] {
    dispatch_window_vector<scalar_t>(args.grad_y.const_data_ptr(), l.classes, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      const int64_t items = args.grad_y.numel() / VEC;
      const auto kernel = parity_mean_backward_kernel<scalar_t, VEC>;
      kernel<<<grid_stride_blocks(kernel, kThreads, 0, items, kThreads), kThreads, 0, stream>>>(
          grad_mean.const_data_ptr<scalar_t>(), grad_mean.stride(0), grad_mean.stride(1),
          args.picks.const_data_ptr<uint8_t>(), static_cast<int>(l.positions()), static_cast<int>(l.channels),
          static_cast<int>(l.classes / VEC), items, args.grad_y.mutable_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return args.grad_y;
}

std::tuple<at::Tensor, at::Tensor> parity_max_pool3d_cascade_sum_cuda(const at::Tensor& y_in,
                                                                     at::IntArrayRef kernel2,
                                                                     bool save_indices,
                                                                     std::optional<at::ScalarType> dtype) {
  constexpr const char* what = "parity_max_pool3d_cascade_sum";
  const auto l = parity_layout(what, y_in);
  const auto s = cascade_stage2(what, l.stage1, l.classes, kernel2);
  const at::Tensor y = y_in.contiguous();
  at::Tensor out = at::empty({l.batch, 1, s.out[0], s.out[1], s.out[2]},
                             y.options().dtype(result_dtype(what, y.scalar_type(), dtype)));
  at::Tensor picks = saved_picks(y, save_indices, {l.batch, s.out[0], s.out[1], s.out[2], l.channels});
  const c10::cuda::CUDAGuard guard(y.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const ChannelTile tile = channel_tile(l.channels);
  const int64_t windows = l.batch * s.cells();
  const int64_t blocks = (windows + tile.rows - 1) / tile.rows;
  TORCH_CHECK_VALUE(blocks <= std::numeric_limits<int>::max() && tile.channel_blocks <= 65535, what,
                    ": input too large for the CUDA kernel, got shape ", y.sizes());
  FUSED_OPS_DISPATCH_FLOATING_TYPES(y.scalar_type(), "parity_max_pool3d_cascade_sum_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const bool split = tile.channel_blocks > 1;  // channels over several blocks: partial sums
    at::Tensor partial = at::empty({split ? windows * tile.channel_blocks : 0},
                                   y.options().dtype(at::toOpMathType(y.scalar_type())));
    dispatch_scalar_or_acc<scalar_t>(out.scalar_type(), [&](auto* tag) {
      using out_t = std::remove_pointer_t<decltype(tag)>;
      dispatch_window_vector<scalar_t>(y.const_data_ptr(), l.classes, [&](auto vec) {
        constexpr int VEC = decltype(vec)::value;
        const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(tile.channel_blocks));
        parity_cascade_kernel<scalar_t, out_t, VEC><<<grid, kThreads, 0, stream>>>(
            y.const_data_ptr<scalar_t>(), l, s, static_cast<int>(l.classes / VEC), tile,
            out.mutable_data_ptr<out_t>(), split ? partial.mutable_data_ptr<acc_t>() : nullptr,
            save_indices ? picks.mutable_data_ptr<uint8_t>() : nullptr);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
      if (split) {
        sum_rows_kernel<acc_t, out_t><<<static_cast<unsigned>(windows), 32, 0, stream>>>(
            partial.const_data_ptr<acc_t>(), tile.channel_blocks, out.mutable_data_ptr<out_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    });
  });
  return {out, picks};
}

at::Tensor parity_max_pool3d_cascade_sum_backward_cuda(const at::Tensor& grad_out, const at::Tensor& picks_in,
                                                       at::IntArrayRef stage1_size, at::IntArrayRef kernel2,
                                                       int64_t parity_classes) {
  constexpr const char* what = "parity_max_pool3d_cascade_sum_backward";
  auto args = parity_cascade_backward_setup(grad_out, picks_in, stage1_size, kernel2, parity_classes);
  const ParityLayout& l = args.layout;
  check_int_sizes(what, l);
  if (args.grad_y.numel() == 0) return args.grad_y;
  const c10::cuda::CUDAGuard guard(grad_out.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor go = grad_out.contiguous();
  FUSED_OPS_DISPATCH_FLOATING_TYPES(grad_out.scalar_type(), "parity_max_pool3d_cascade_sum_backward_cuda", [&] {
    dispatch_window_vector<scalar_t>(args.grad_y.const_data_ptr(), l.classes, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      const int64_t items = args.grad_y.numel() / VEC;
      const auto kernel = parity_cascade_backward_kernel<scalar_t, VEC>;
      kernel<<<grid_stride_blocks(kernel, kThreads, 0, items, kThreads), kThreads, 0, stream>>>(
          go.const_data_ptr<scalar_t>(), args.picks.const_data_ptr<uint8_t>(), l, args.stage2,
          static_cast<int>(l.classes / VEC), items, args.grad_y.mutable_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return args.grad_y;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("parity_max_pool3d_mean", &parity_max_pool3d_mean_cuda);
  m.impl("parity_max_pool3d_mean_backward", &parity_max_pool3d_mean_backward_cuda);
  m.impl("parity_max_pool3d_cascade_sum", &parity_max_pool3d_cascade_sum_cuda);
  m.impl("parity_max_pool3d_cascade_sum_backward", &parity_max_pool3d_cascade_sum_backward_cuda);
}

}  // namespace fused_ops
