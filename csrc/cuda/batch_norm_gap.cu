// CUDA kernels of batch_norm_gap and batch_norm_update_running_stats (the
// math: ../batch_norm_gap.h).
//
// Forward, two launches. plane_moments_kernel: a grid-stride loop of warps,
// each alone on its items, item = (b, c, chunk of a plane's elements in flat
// (d, h, w) order: lane_loads vectors per lane, 1024 elements for 4- and
// 2-byte types on aligned planes). A lane issues all its loads (16-byte
// vectors where each plane is one aligned contiguous run: 128 bytes in flight
// per lane for float32) before any arithmetic; the warp then takes the
// chunk's mean and M2 about the channel's shift by two passes over the
// values in registers (a warp sum each) into partial[item]. x is read once,
// in place. Then channel_stats_kernel, a block per channel, combines the
// channel's partials in float64 in a fixed order (deterministic): each
// plane's by a group of lanes, then the planes'; it writes out and the saved
// statistics.
//
// Backward, one launch: grad_x_kernel over the forward's items: a lane loads
// its vectors of x, the warp sums its channel over the batch (grad_weight,
// grad_bias, the plane's coefficients), then the lane stores its vectors of
// grad_x (contiguous); with running statistics it only stores. Without
// grad_x, channel_grad_kernel (a warp per channel) gives the weight and bias
// gradients alone.
//
// A channels_last_3d x (memory (B, S, C)) is read in vectors over channels
// instead: plane_moments_channels_last_kernel's items (b, chunk of 256
// positions, group of channels) write the same partials (the chunks' moments
// merged by Chan's formula in registers), and through batch statistics the
// backward is two launches: channel_grad_kernel with grad_x's coefficients
// per (b, c), then grad_x_channels_last_kernel, grad_x laid out as x.
//
// batch_norm_update_running_stats: one block (update_running_stats_kernel).
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

#include "../batch_norm_gap.h"
#include "../dispatch.h"
#include "../memory_format.h"
#include "block_reduce.cuh"
#include "plane_rows.cuh"

namespace fused_ops {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Vectors of VEC elements per lane and item, all loaded before the item's
// arithmetic: 128 bytes, but at most 32 values (16-bit types: 64 bytes) and
// 16 loads, so that they fit the registers unpacked.
template <typename scalar_t, int VEC>
constexpr int lane_loads() {
  constexpr int values = sizeof(scalar_t) >= 4 ? 128 / static_cast<int>(sizeof(scalar_t)) : 32;
  return values / VEC < 16 ? values / VEC : 16;
}
// Elements per item: a chunk of a plane.
template <typename scalar_t, int VEC>
constexpr int chunk_elements() {
  return 32 * VEC * lane_loads<scalar_t, VEC>();
}

// The blocks per multiprocessor the register allocation of plane_moments_kernel
// and grad_x_kernel must allow: 4 (64 registers a thread, 32 warps), each lane
// with a whole item's loads in flight; 3 (80 registers) where the planes are
// not one contiguous run (each load's offset takes divisions).
template <bool FLAT>
constexpr int min_blocks() {
  return FLAT ? 4 : 3;
}

// The (b, c) planes of x as the kernels read them: plane (b, c) starts at
// b * xs.b + c * xs.c; element e of a plane (flat (d, h, w) order) lies at e
// where the plane is one contiguous run (FLAT), else at its strided offset.
struct Planes {
  InputStrides xs;
  int channels;
  int size;  // S = D * H * W
  int height_width, width;

  template <bool FLAT>
  __device__ int offset(int e) const {
    if constexpr (FLAT) {
      return e;
    } else {
      const int d = e / height_width, r = e - d * height_width, h = r / width;
      return d * xs.d + h * xs.h + (r - h * width) * xs.w;
    }
  }
};

template <typename acc_t>
struct alignas(2 * sizeof(acc_t)) MeanM2 {
  acc_t mean, m2;
};

// The number of a lane's kLoads vectors, at start + j * 32 * VEC, that lie
// inside a plane of `size` elements: a prefix.
template <int VEC>
__device__ __forceinline__ int lane_vectors_inside(int size, int start, int loads) {
  return ::min(loads, ::max(0, (size - start + 32 * VEC - 1) / (32 * VEC)));
}

template <typename scalar_t, int VEC>
__device__ __forceinline__ Vector<scalar_t, VEC> filled_vector(scalar_t v) {
  Vector<scalar_t, VEC> r;
#pragma unroll
  for (int e = 0; e < VEC; ++e) r.v[e] = v;
  return r;
}

// y = x * scale rounded as PyTorch rounds it, in the accumulation type.
template <typename scalar_t>
__device__ __forceinline__ at::opmath_type<scalar_t> scaled(const Multiply<scalar_t>& multiply,
                                                            scalar_t v) {
  using acc_t = at::opmath_type<scalar_t>;
  return static_cast<acc_t>(multiply(static_cast<acc_t>(v)));
}

// The mean and M2 of y - shift over item (b, c, chunk), y = x * scale, into
// partial[item], by two passes over the values in registers: the warp's sum
// (the mean: times 1 / count, a power of two or, for a plane's last chunk,
// tail_reciprocal), then the warp's sum of squared deviations from it. A
// lane's vectors j lie at chunk start + (j * 32 + lane) * VEC: each load
// instruction of the warp reads 32 consecutive vectors. A lane's vectors
// inside the plane are a prefix of its kLoads (the plane's size is a
// multiple of VEC); past the plane a lane takes the shift's element (0 where
// the shift is: finite_shift), which adds exactly 0 to the first pass, and
// drops it from the second.
template <typename scalar_t, int VEC, bool FLAT>
__global__ void __launch_bounds__(kThreads, min_blocks<FLAT>())
    plane_moments_kernel(const scalar_t* __restrict__ x, Planes p, Multiply<scalar_t> multiply,
                         int chunks, int64_t items, at::opmath_type<scalar_t> tail_reciprocal,
                         MeanM2<at::opmath_type<scalar_t>>* __restrict__ partial) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int kLoads = lane_loads<scalar_t, VEC>();
  constexpr acc_t kChunkReciprocal = acc_t(1) / chunk_elements<scalar_t, VEC>();
  const int lane = threadIdx.x;  // blockDim.x == 32
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.y;
  ItemCursor<3> at(warp, warps, {p.channels, chunks});
  for (int64_t item = warp; item < items; item += warps, at.next()) {
    const int c = at[1];
    const scalar_t* plane = x + at.leading() * p.xs.b + c * p.xs.c;
    const scalar_t shift_element = x[c * p.xs.c];  // y[0, c, 0, 0, 0]
    const acc_t shift = finite_shift(scaled(multiply, shift_element));
    const scalar_t pad = shift == acc_t(0) ? scalar_t(0) : shift_element;  // (scaled to shift exactly)
    const int start = at[2] * chunk_elements<scalar_t, VEC>() + lane * VEC;
    const int inside = lane_vectors_inside<VEC>(p.size, start, kLoads);
    Vector<scalar_t, VEC> in[kLoads];
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      in[j] = j < inside ? load_vector<scalar_t, VEC>(plane + p.offset<FLAT>(start + j * 32 * VEC))
                         : filled_vector<scalar_t, VEC>(pad);
    }
    acc_t sum = 0;
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) sum += scaled(multiply, in[j].v[e]) - shift;
    }
    const acc_t mean = warp_sum(sum) * (at[2] == chunks - 1 ? tail_reciprocal : kChunkReciprocal);
    acc_t m2 = 0;
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const acc_t delta = scaled(multiply, in[j].v[e]) - shift - mean;
        m2 += j < inside ? delta * delta : acc_t(0);
      }
    }
    m2 = warp_sum(m2);
    if (lane == 0) partial[item] = {mean, m2};
  }
}

// A channels_last_3d x (memory (B, S, C)) as the channels-last kernels read it:
// items (b, chunk of kChunkPositions positions, group of `lanes` x VEC
// channels); in an item, lane = row * lanes + column (lanes a power of two:
// as many as C / VEC needs, at most 32), column reading channels (group *
// lanes + column) * VEC + [0, VEC) of positions row, row + rows, ... of the
// chunk (rows = 32 / lanes): each load instruction of the warp reads `rows`
// runs of lanes x VEC contiguous channels.
constexpr int kChunkPositions = 256;
// A lane's vectors held at once: 16, or 64 / VEC for VEC > 4 (64 values)
template <int VEC>
constexpr int pass_positions() {
  return VEC > 4 ? 64 / VEC : 16;
}

struct ChannelsLast {
  int64_t batch_stride;  // S * C
  int channels, positions, lanes, groups, chunks;
  int vec;  // VEC (the launch's)
};

// Calls f(b, chunk, c0) for each of a warp's items of a ChannelsLast (a
// grid-stride loop), c0 the first of the VEC channels the lane reads (none at
// or past C).
template <int VEC, typename F>
__device__ __forceinline__ void for_each_channels_last_item(const ChannelsLast& l, int64_t items, F&& f) {
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.y;
  ItemCursor<3> at(warp, warps, {l.chunks, l.groups});
  for (int64_t item = warp; item < items; item += warps, at.next()) {
    f(at.leading(), at[1], (at[2] * l.lanes + static_cast<int>(threadIdx.x) % l.lanes) * VEC);
  }
}

// plane_moments_kernel over a channels_last_3d x: per lane and channel, the
// moments (count, mean, M2) of y - shift[c] over its positions of the chunk,
// kPassPositions at a time by two passes over the values in registers,
// merged by Chan's formula; then the rows' lanes of a column merged (xor
// shuffles), and lane `column` writes partial[(b, c, chunk)] for its VEC
// channels (the layout channel_stats_kernel reads, chunk_size
// kChunkPositions).
template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kThreads)
    plane_moments_channels_last_kernel(const scalar_t* __restrict__ x, ChannelsLast l, Multiply<scalar_t> multiply,
                                       int64_t items, MeanM2<at::opmath_type<scalar_t>>* __restrict__ partial) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int kPassPositions = pass_positions<VEC>();
  const int rows = 32 / l.lanes, row = threadIdx.x / l.lanes;  // (blockDim.x == 32)
  for_each_channels_last_item<VEC>(l, items, [&](int64_t b, int chunk, int c0) {
    const bool active = c0 < l.channels;
    const int first = chunk * kChunkPositions;
    const int end = ::min(first + kChunkPositions, l.positions);
    const scalar_t* base = x + b * l.batch_stride + (active ? c0 : 0);
    // y[0, c, 0, 0, 0] (finite_shift), and what a lane takes past the chunk: the shift's element, or 0
    // where the shift is (scaled to the shift exactly: adds 0 to the first pass)
    Vector<scalar_t, VEC> pad = load_vector<scalar_t, VEC>(x + (active ? c0 : 0));
    acc_t shift[VEC], count = 0, mean[VEC], m2[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      shift[e] = finite_shift(scaled(multiply, pad.v[e]));
      if (shift[e] == acc_t(0)) pad.v[e] = scalar_t(0);
      mean[e] = m2[e] = 0;
    }
    for (int s0 = first + row; s0 < end; s0 += rows * kPassPositions) {
      Vector<scalar_t, VEC> in[kPassPositions];
      const int inside = ::min(kPassPositions, (end - s0 + rows - 1) / rows);
#pragma unroll
      for (int j = 0; j < kPassPositions; ++j) {
        in[j] = j < inside ? load_vector<scalar_t, VEC>(base + static_cast<int64_t>(s0 + j * rows) * l.channels)
                           : pad;
      }
      const acc_t n = static_cast<acc_t>(inside);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        acc_t sum = 0;
#pragma unroll
        for (int j = 0; j < kPassPositions; ++j) sum += scaled(multiply, in[j].v[e]) - shift[e];  // (0 past the end)
        const acc_t pass_mean = sum / n;
        acc_t pass_m2 = 0;
#pragma unroll
        for (int j = 0; j < kPassPositions; ++j) {
          const acc_t delta = scaled(multiply, in[j].v[e]) - shift[e] - pass_mean;
          pass_m2 += j < inside ? delta * delta : acc_t(0);
        }
        merge_moments(count, mean[e], m2[e], n, pass_mean, pass_m2);
      }
      count += n;
    }
    for (int offset = l.lanes; offset < 32; offset <<= 1) {  // the column's rows, by xor shuffles
      const acc_t count_b = __shfl_xor_sync(0xffffffffu, count, offset);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const acc_t mean_b = __shfl_xor_sync(0xffffffffu, mean[e], offset);
        const acc_t m2_b = __shfl_xor_sync(0xffffffffu, m2[e], offset);
        merge_moments(count, mean[e], m2[e], count_b, mean_b, m2_b);
      }
      count += count_b;
    }
    if (active && row == 0) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) partial[(b * l.channels + c0 + e) * l.chunks + chunk] = {mean[e], m2[e]};
    }
  });
}

// Sum of v over aligned groups of `group` lanes (a power of two, at most 32);
// every lane of the warp must call it.
template <typename T>
__device__ __forceinline__ T group_sum(T v, int group) {
  for (int offset = group / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Per channel (block c), in float64: each plane's shifted mean D[b] and M2[b]
// from its chunks' partials (a group of `group` lanes per plane, two passes:
// the mean, then Chan's sum of M2 and squared deviations), then the channel's
// statistics (ChannelNorm) from the planes', in a fixed order; out[b, c], the
// saved plane deviations, mean, var and rstd. plane_mean (B, C) holds D[b]
// between the phases. out is written as out_t, the result's dtype.
template <typename scalar_t, typename param_t, typename out_t>
__global__ void __launch_bounds__(kThreads)
    channel_stats_kernel(const MeanM2<at::opmath_type<scalar_t>>* __restrict__ partial,
                         const scalar_t* __restrict__ x, int64_t x_stride_c, Multiply<scalar_t> multiply,
                         int64_t batch, int chunks, int chunk_size, int plane_size, int group,
                         bool batch_stats, const param_t* __restrict__ weight,
                         const param_t* __restrict__ bias, const param_t* __restrict__ running_mean,
                         const param_t* __restrict__ running_var, double eps, double* __restrict__ plane_mean,
                         out_t* __restrict__ out, at::opmath_type<scalar_t>* __restrict__ plane_dev,
                         at::opmath_type<scalar_t>* __restrict__ mean, at::opmath_type<scalar_t>* __restrict__ rstd,
                         at::opmath_type<scalar_t>* __restrict__ var) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ double scratch[32];
  __shared__ double shared_d;
  __shared__ ChannelNorm<acc_t> shared_norm;
  const int c = blockIdx.x, channels = gridDim.x;
  const int tid = threadIdx.x, groups = blockDim.x / group, in_group = tid % group;
  const double size = plane_size;
  auto chunk_count = [&](int j) { return static_cast<double>(::min(chunk_size, plane_size - j * chunk_size)); };

  double sum_d = 0, sum_m2 = 0;  // over this thread's planes (first lane of a group)
  for (int64_t b0 = 0; b0 < batch; b0 += groups) {
    const int64_t b = b0 + tid / group;
    const MeanM2<acc_t>* row = partial + (b * channels + c) * chunks;
    double sum = 0;
    if (b < batch) {
      for (int j = in_group; j < chunks; j += group) sum += chunk_count(j) * row[j].mean;
    }
    const double d = group_sum(sum, group) / size;
    double m2 = 0;
    if (b < batch) {
      for (int j = in_group; j < chunks; j += group) {
        const MeanM2<acc_t> part = row[j];
        const double delta = part.mean - d;
        m2 += part.m2 + chunk_count(j) * delta * delta;
      }
    }
    m2 = group_sum(m2, group);
    if (b < batch && in_group == 0) {
      plane_mean[b * channels + c] = d;
      sum_d += d;
      sum_m2 += m2;
    }
  }
  sum_d = block_sum(sum_d, scratch);
  if (tid == 0) shared_d = batch > 0 ? sum_d / static_cast<double>(batch) : 0.0;
  __syncthreads();
  const double d = shared_d;
  double squares = 0;
  for (int64_t b = tid; b < batch; b += blockDim.x) {
    const double delta = plane_mean[b * channels + c] - d;
    squares += delta * delta;
  }
  squares = block_sum(squares, scratch);
  __syncthreads();
  sum_m2 = block_sum(sum_m2, scratch);
  if (tid == 0) {
    const double shift = batch > 0 ? finite_shift(scaled(multiply, x[c * x_stride_c])) : acc_t(0);
    const ChannelNorm<acc_t> norm =
        batch_stats ? ChannelNorm<acc_t>::batch(shift, d, sum_m2 + size * squares,
                                                static_cast<double>(batch) * size, eps)
                    : ChannelNorm<acc_t>::running(shift, static_cast<acc_t>(running_mean[c]),
                                                  static_cast<acc_t>(running_var[c]), eps);
    mean[c] = norm.mean;
    var[c] = norm.var;
    rstd[c] = norm.rstd;
    shared_norm = norm;
  }
  __syncthreads();
  const ChannelNorm<acc_t> norm = shared_norm;
  const double w = weight != nullptr ? static_cast<double>(weight[c]) : 1.0;
  const double beta = bias != nullptr ? static_cast<double>(bias[c]) : 0.0;
  for (int64_t b = tid; b < batch; b += blockDim.x) {
    const double D = plane_mean[b * channels + c];
    plane_dev[b * channels + c] = static_cast<acc_t>(D - norm.dev_offset);
    out[b * channels + c] = static_cast<out_t>(norm.output(D, w, beta));
  }
}

// What the backward reads per channel: grad_out (B, C) at its strides, the
// saved plane deviations (B, C) and rstd (C), the weight (C, or null: 1).
template <typename scalar_t, typename param_t>
struct ChannelGradArgs {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* grad_out;
  int64_t grad_stride_b, grad_stride_c;
  const acc_t* plane_dev;
  const acc_t* rstd;
  const param_t* weight;
  int64_t batch;
  int channels, plane_size;
  acc_t scale;
  bool batch_stats;
  param_t* grad_weight;  // (C), written by the one call of channel(c, write = true) per channel
  param_t* grad_bias;

  __device__ acc_t grad(int64_t b, int c) const {
    return static_cast<acc_t>(grad_out[b * grad_stride_b + c * grad_stride_c]);
  }
  // Channel c's ChannelGrad, by the whole warp (lanes over the batch). d out[b]
  // / d weight = (m[b] - mu) rstd and d out[b] / d bias = 1: grad_weight =
  // rstd P, P = sum_b g[b] (m[b] - mu) = sum_b g[b] dev[b] - lo G (lo = mean_b
  // dev[b] with batch statistics, else 0), grad_bias = G = sum_b g[b]; and
  // grad_x's coefficients (the math: ../batch_norm_gap.h). Lane 0 writes the
  // weight and bias gradients where `write` is set.
  __device__ ChannelGrad<acc_t> channel(int c, bool write) const {
    acc_t sum_g = 0, sum_dev = 0, sum_g_dev = 0;
    for (int64_t b = threadIdx.x; b < batch; b += 32) {
      const acc_t g = grad(b, c), dev = plane_dev[b * channels + c];
      sum_g += g;
      sum_dev += dev;
      sum_g_dev += g * dev;
    }
    const acc_t w = weight != nullptr ? static_cast<acc_t>(weight[c]) : acc_t(1);
    const auto cg = ChannelGrad<acc_t>::make(warp_sum(sum_g), warp_sum(sum_dev), warp_sum(sum_g_dev), batch,
                                             plane_size, w, rstd[c], scale, batch_stats);
    if (write && threadIdx.x == 0) {
      grad_weight[c] = static_cast<param_t>(cg.grad_weight);
      grad_bias[c] = static_cast<param_t>(cg.grad_bias);
    }
    return cg;
  }
};

// The weight and bias gradients, a warp per channel; where plane_term is
// given, also grad_x's coefficients: plane_term[b, c] and slope[c]
// (grad_x_channels_last_kernel's).
template <typename scalar_t, typename param_t>
__global__ void __launch_bounds__(kThreads)
    channel_grad_kernel(ChannelGradArgs<scalar_t, param_t> a, at::opmath_type<scalar_t>* __restrict__ plane_term,
                        at::opmath_type<scalar_t>* __restrict__ slope) {
  const int c = blockIdx.x * blockDim.y + threadIdx.y;
  if (c >= a.channels) return;
  const auto cg = a.channel(c, true);
  if (plane_term == nullptr) return;
  for (int64_t b = threadIdx.x; b < a.batch; b += 32) plane_term[b * a.channels + c] = cg.plane_term(a.grad(b, c));
  if (threadIdx.x == 0) slope[c] = cg.slope;
}

// grad_y = w rstd (g[b] / S - G / N) - w rstd^3 P (y - mu) / N: out's derivative
// through m[b] (1 / S), mu (1 / N) and rstd (-rstd^3 (y - mu) / N); with
// (y - mu) = (y - mean) - lo and grad_x = scale * grad_y, that is
// grad_x[b, c, s] = plane_term(g[b]) + slope * (y[b, c, s] - mean[c]): one
// read of x and one write of grad_x per element. Without BATCH_STATS slope
// is 0 (grad_y = w rstd g[b] / S): only writes. Items as plane_moments_kernel's;
// grad_x contiguous. Each item's warp sums its channel over the batch itself
// (one launch; B loads per item), the warp of (b 0, chunk 0) writing the
// weight and bias gradients; holding x's values meanwhile takes up to 128
// registers (2 blocks per multiprocessor: 16 warps, 64 KB of loads in flight).
template <typename scalar_t, typename param_t, int VEC, bool FLAT, bool BATCH_STATS>
__global__ void __launch_bounds__(kThreads, BATCH_STATS ? 2 : min_blocks<FLAT>())
    grad_x_kernel(const scalar_t* __restrict__ x, Planes p, Multiply<scalar_t> multiply,
                  ChannelGradArgs<scalar_t, param_t> cga, const at::opmath_type<scalar_t>* __restrict__ mean,
                  int chunks, int64_t items, scalar_t* __restrict__ grad_x) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int kLoads = lane_loads<scalar_t, VEC>();
  const int lane = threadIdx.x;  // blockDim.x == 32
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.y;
  ItemCursor<3> at(warp, warps, {p.channels, chunks});
  for (int64_t item = warp; item < items; item += warps, at.next()) {
    const int c = at[1];
    const int64_t plane_index = at.leading() * p.channels + c;
    const int start = at[2] * chunk_elements<scalar_t, VEC>() + lane * VEC;
    const int inside = lane_vectors_inside<VEC>(p.size, start, kLoads);
    Vector<scalar_t, VEC> v[kLoads];
    if constexpr (BATCH_STATS) {
      const scalar_t* plane = x + at.leading() * p.xs.b + c * p.xs.c;
#pragma unroll
      for (int j = 0; j < kLoads; ++j) {
        v[j] = j < inside ? load_vector<scalar_t, VEC>(plane + p.offset<FLAT>(start + j * 32 * VEC))
                          : filled_vector<scalar_t, VEC>(scalar_t(0));
      }
    }
    const auto cg = cga.channel(c, at.leading() == 0 && at[2] == 0);
    const acc_t a = cg.plane_term(cga.grad(at.leading(), c));
    const acc_t k = BATCH_STATS ? cg.slope : acc_t(0), center = BATCH_STATS ? mean[c] : acc_t(0);
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        v[j].v[e] = BATCH_STATS ? static_cast<scalar_t>(a + k * (scaled(multiply, v[j].v[e]) - center))
                                : static_cast<scalar_t>(a);
      }
    }
    scalar_t* out = grad_x + plane_index * p.size;
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      if (j < inside) *reinterpret_cast<Vector<scalar_t, VEC>*>(out + start + j * 32 * VEC) = v[j];
    }
  }
}

// grad_x_kernel over a channels_last_3d x with batch statistics:
// grad_x[b, s, c] = plane_term[b, c] + slope[c] * (y[b, s, c] - mean[c]), the
// coefficients from channel_grad_kernel; grad_x laid out as x. Items and lanes
// as plane_moments_channels_last_kernel's.
template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kThreads)
    grad_x_channels_last_kernel(const scalar_t* __restrict__ x, ChannelsLast l, Multiply<scalar_t> multiply,
                                const at::opmath_type<scalar_t>* __restrict__ plane_term,
                                const at::opmath_type<scalar_t>* __restrict__ slope,
                                const at::opmath_type<scalar_t>* __restrict__ mean, int64_t items,
                                scalar_t* __restrict__ grad_x) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int kPassPositions = pass_positions<VEC>();
  const int rows = 32 / l.lanes, row = threadIdx.x / l.lanes;  // (blockDim.x == 32)
  for_each_channels_last_item<VEC>(l, items, [&](int64_t b, int chunk, int c0) {
    if (c0 >= l.channels) return;
    acc_t a[VEC], k[VEC], center[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      a[e] = plane_term[b * l.channels + c0 + e];
      k[e] = slope[c0 + e];
      center[e] = mean[c0 + e];
    }
    const int end = ::min((chunk + 1) * kChunkPositions, l.positions);
    const int64_t step = static_cast<int64_t>(rows) * l.channels;  // between a lane's positions
    for (int s0 = chunk * kChunkPositions + row; s0 < end; s0 += rows * kPassPositions) {
      const int64_t offset = b * l.batch_stride + static_cast<int64_t>(s0) * l.channels + c0;
      const int inside = ::min(kPassPositions, (end - s0 + rows - 1) / rows);
      Vector<scalar_t, VEC> v[kPassPositions];
#pragma unroll
      for (int j = 0; j < kPassPositions; ++j) {
        v[j] = j < inside ? load_vector<scalar_t, VEC>(x + offset + j * step) : filled_vector<scalar_t, VEC>(scalar_t(0));
      }
#pragma unroll
      for (int j = 0; j < kPassPositions; ++j) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          v[j].v[e] = static_cast<scalar_t>(a[e] + k[e] * (scaled(multiply, v[j].v[e]) - center[e]));
        }
      }
#pragma unroll
      for (int j = 0; j < kPassPositions; ++j) {
        if (j < inside) *reinterpret_cast<Vector<scalar_t, VEC>*>(grad_x + offset + j * step) = v[j];
      }
    }
  });
}

// nn.BatchNorm3d's update (RunningStatsUpdate), one block: thread 0 reads and
// increments the counter before any thread uses the factor.
template <typename param_t>
__global__ void update_running_stats_kernel(param_t* __restrict__ running_mean, int64_t mean_stride,
                                            param_t* __restrict__ running_var, int64_t var_stride,
                                            int64_t* __restrict__ num_batches_tracked,
                                            const at::opmath_type<param_t>* __restrict__ mean,
                                            const at::opmath_type<param_t>* __restrict__ var, int64_t channels,
                                            int64_t count, bool cumulative, double momentum) {
  using acc_t = at::opmath_type<param_t>;
  __shared__ int64_t batches;
  if (threadIdx.x == 0) {
    batches = num_batches_tracked != nullptr ? ++*num_batches_tracked : 0;
  }
  __syncthreads();
  if (count == 0) return;  // an empty batch: nn.BatchNorm3d counts it, the statistics stay
  const RunningStatsUpdate<acc_t> update(cumulative, momentum, batches, count);
  for (int64_t c = threadIdx.x; c < channels; c += blockDim.x) {
    param_t& rm = running_mean[c * mean_stride];
    param_t& rv = running_var[c * var_stride];
    rm = static_cast<param_t>(update.mean(mean[c], static_cast<acc_t>(rm)));
    rv = static_cast<param_t>(update.var(var[c], static_cast<acc_t>(rv)));
  }
}

// How the kernels read x: in place, or from a contiguous copy where its
// strides spread a plane over 2^31 elements or more; flat planes read in
// vectors of vec elements.
struct PlaneAccess {
  at::Tensor x;
  Planes planes;
  bool flat;
  int vec;
};

template <typename scalar_t>
PlaneAccess plane_access(const at::Tensor& x_in) {
  auto strides = in_plane_strides(x_in);
  const at::Tensor x = strides ? x_in : x_in.contiguous();
  const InputStrides xs = strides ? *strides : *in_plane_strides(x);
  const int64_t B = x.size(0), C = x.size(1), D = x.size(2), H = x.size(3), W = x.size(4);
  const bool flat = (D == 1 || xs.d == H * W) && (H == 1 || xs.h == W) && (W == 1 || xs.w == 1);
  const int64_t S = D * H * W;
  const int vec = flat ? aligned_vector_width<scalar_t>(x.const_data_ptr(),
                                                        {S, B > 1 ? xs.b : 0, C > 1 ? xs.c : 0})
                       : 1;
  return {x, Planes{xs, static_cast<int>(C), static_cast<int>(S), static_cast<int>(H * W), static_cast<int>(W)},
          flat, vec};
}

// Calls f(VEC, FLAT) (integral constants) for how x is read.
template <typename scalar_t, typename F>
void dispatch_plane_access(const PlaneAccess& a, F&& f) {
  if (!a.flat) return f(std::integral_constant<int, 1>{}, std::false_type{});
  dispatch_vector_width<scalar_t>(a.vec, [&](auto VEC) { f(VEC, std::true_type{}); });
}

// The items of the forward's and grad_x's grid-stride loops: (b, c, chunk).
template <typename scalar_t, int VEC>
int plane_chunks(int64_t plane_size) {
  return static_cast<int>((plane_size + chunk_elements<scalar_t, VEC>() - 1) / chunk_elements<scalar_t, VEC>());
}

int pow2_at_least(int n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

// How the channels-last kernels read a channels_last_3d x (is_channels_last_3d):
// VEC channels a lane (the widest vector x's data and C allow), `lanes` lanes
// a row of the item's channels.
template <typename scalar_t>
ChannelsLast channels_last_access(const at::Tensor& x) {
  const int64_t C = x.size(1), S = x.size(2) * x.size(3) * x.size(4);
  const int vec = aligned_vector_width<scalar_t>(x.const_data_ptr(), {C});
  const int64_t vectors = (C + vec - 1) / vec;
  const int lanes = pow2_at_least(static_cast<int>(std::min<int64_t>(vectors, 32)));
  const int groups = static_cast<int>((vectors + lanes - 1) / lanes);
  const int chunks = static_cast<int>((S + kChunkPositions - 1) / kChunkPositions);
  return {S * C, static_cast<int>(C), static_cast<int>(S), lanes, groups, chunks, vec};
}

// The kernels index a plane's elements (up to its size plus a chunk) and the
// channels with int.
void check_sizes(const char* what, int64_t channels, int64_t plane_size) {
  TORCH_CHECK_VALUE(plane_size <= std::numeric_limits<int>::max() / 2 &&
                        channels <= std::numeric_limits<int>::max(),
                    what, ": planes (depth x height x width) of 2^30 elements or more are not "
                    "supported by the CUDA kernels");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_norm_gap_cuda(
    const at::Tensor& x, double scale, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, double eps, std::optional<at::ScalarType> dtype) {
  const auto f = batch_norm_gap_setup(x, weight, bias, running_mean, running_var, eps, dtype);
  const int64_t B = x.size(0), C = x.size(1);
  check_sizes("batch_norm_gap", C, x.size(2) * x.size(3) * x.size(4));
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor w = channel_values(weight), beta = channel_values(bias);
  const at::Tensor rm = channel_values(running_mean), rv = channel_values(running_var);
  FUSED_OPS_DISPATCH_FLOATING_TYPES(x.scalar_type(), "batch_norm_gap_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const Multiply<scalar_t> multiply(scale);
    at::Tensor plane_mean = at::empty({B * C}, f.mean.options().dtype(at::kDouble));
    // The channel statistics from the planes' chunk moments (chunks of chunk_size elements a plane)
    auto channel_stats = [&](const at::Tensor& partial, const scalar_t* x_data, int64_t x_stride_c, int chunks,
                             int chunk_size, int plane_size) {
      dispatch_scalar_or_acc<scalar_t>(f.param_dtype, [&](auto* param_tag) {
        dispatch_scalar_or_acc<scalar_t>(f.out.scalar_type(), [&](auto* out_tag) {
          using param_t = std::remove_pointer_t<decltype(param_tag)>;
          using out_t = std::remove_pointer_t<decltype(out_tag)>;
          auto data = [](const at::Tensor& t) { return t.defined() ? t.const_data_ptr<param_t>() : nullptr; };
          channel_stats_kernel<scalar_t, param_t, out_t><<<static_cast<unsigned>(C), kThreads, 0, stream>>>(
              reinterpret_cast<const MeanM2<acc_t>*>(partial.const_data_ptr<acc_t>()), x_data, x_stride_c, multiply,
              B, chunks, chunk_size, plane_size, std::min(pow2_at_least(chunks), 32), f.batch_stats, data(w),
              data(beta), data(rm), data(rv), eps, plane_mean.mutable_data_ptr<double>(),
              f.out.mutable_data_ptr<out_t>(), f.plane_dev.mutable_data_ptr<acc_t>(),
              f.mean.mutable_data_ptr<acc_t>(), f.rstd.mutable_data_ptr<acc_t>(), f.var.mutable_data_ptr<acc_t>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      });
    };
    if (is_channels_last_3d(x)) {
      const ChannelsLast l = channels_last_access<scalar_t>(x);
      const int64_t items = B * l.chunks * l.groups;
      at::Tensor partial = at::empty({B * C * l.chunks * 2}, f.mean.options());
      if (items > 0) {
        dispatch_vector_width<scalar_t>(l.vec, [&](auto VEC) {
          auto kernel = plane_moments_channels_last_kernel<scalar_t, VEC>;
          kernel<<<grid_stride_blocks(kernel, kThreads, 0, items, kWarps), dim3(32, kWarps), 0, stream>>>(
              x.const_data_ptr<scalar_t>(), l, multiply, items,
              reinterpret_cast<MeanM2<acc_t>*>(partial.mutable_data_ptr<acc_t>()));
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      }
      channel_stats(partial, x.const_data_ptr<scalar_t>(), x.stride(1), l.chunks, kChunkPositions, l.positions);
      return;
    }
    const PlaneAccess a = plane_access<scalar_t>(x);
    dispatch_plane_access<scalar_t>(a, [&](auto VEC, auto FLAT) {
      const int chunks = plane_chunks<scalar_t, VEC>(a.planes.size);
      const int64_t items = B * C * chunks;
      at::Tensor partial = at::empty({items * 2}, f.mean.options());
      // 1 / the element count of a plane's last chunk
      const int64_t tail = a.planes.size - int64_t{chunks - 1} * chunk_elements<scalar_t, VEC>();
      if (items > 0) {
        auto kernel = plane_moments_kernel<scalar_t, VEC, FLAT>;
        kernel<<<grid_stride_blocks(kernel, kThreads, 0, items, kWarps), dim3(32, kWarps), 0, stream>>>(
            a.x.const_data_ptr<scalar_t>(), a.planes, multiply, chunks, items,
            acc_t(1) / static_cast<acc_t>(tail), reinterpret_cast<MeanM2<acc_t>*>(partial.mutable_data_ptr<acc_t>()));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      channel_stats(partial, a.x.const_data_ptr<scalar_t>(), a.planes.xs.c, chunks, chunk_elements<scalar_t, VEC>(),
                    a.planes.size);
    });
  });
  return {f.out, f.plane_dev, f.mean, f.rstd, f.var};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_gap_backward_cuda(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& x, at::IntArrayRef input_size,
    double scale, const std::optional<at::Tensor>& weight, const at::Tensor& plane_dev,
    const at::Tensor& mean, const at::Tensor& rstd, bool batch_stats, bool grad_input) {
  // A channels_last_3d x's gradient through batch statistics is laid out as x (the channels-last kernels)
  const bool channels_last = batch_stats && grad_input && is_given(x) && is_channels_last_3d(*x);
  auto args = batch_norm_gap_backward_setup(grad_out, x, input_size, weight, plane_dev, mean, rstd, batch_stats,
                                            grad_input,
                                            channels_last ? at::MemoryFormat::ChannelsLast3d : at::MemoryFormat::Contiguous);
  const int64_t B = plane_dev.size(0), C = plane_dev.size(1), S = args.plane_size;
  check_sizes("batch_norm_gap_backward", C, S);
  const c10::cuda::CUDAGuard guard(grad_out.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor dev = plane_dev.contiguous(), rstd_values = rstd.contiguous(),
                   mean_values = mean.contiguous(), w = channel_values(weight);
  FUSED_OPS_DISPATCH_FLOATING_TYPES(grad_out.scalar_type(), "batch_norm_gap_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    dispatch_scalar_or_acc<scalar_t>(args.param_dtype, [&](auto* tag) {
      using param_t = std::remove_pointer_t<decltype(tag)>;
      const ChannelGradArgs<scalar_t, param_t> cga{
          grad_out.const_data_ptr<scalar_t>(), grad_out.stride(0), grad_out.stride(1), dev.const_data_ptr<acc_t>(),
          rstd_values.const_data_ptr<acc_t>(), w.defined() ? w.const_data_ptr<param_t>() : nullptr, B,
          static_cast<int>(C), static_cast<int>(S), static_cast<acc_t>(scale), batch_stats,
          args.grad_weight.mutable_data_ptr<param_t>(), args.grad_bias.mutable_data_ptr<param_t>()};
      const unsigned channel_blocks = static_cast<unsigned>((C + kWarps - 1) / kWarps);
      if (!grad_input || B * S == 0) {  // no grad_x elements: the channel sums alone
        channel_grad_kernel<scalar_t, param_t><<<channel_blocks, dim3(32, kWarps), 0, stream>>>(cga, nullptr, nullptr);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        return;
      }
      if (channels_last) {  // the coefficients, then grad_x
        at::Tensor plane_term = at::empty({B * C}, mean.options()), slope = at::empty({C}, mean.options());
        channel_grad_kernel<scalar_t, param_t><<<channel_blocks, dim3(32, kWarps), 0, stream>>>(
            cga, plane_term.mutable_data_ptr<acc_t>(), slope.mutable_data_ptr<acc_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        const ChannelsLast l = channels_last_access<scalar_t>(*x);
        const int64_t items = B * l.chunks * l.groups;
        dispatch_vector_width<scalar_t>(l.vec, [&](auto VEC) {
          auto kernel = grad_x_channels_last_kernel<scalar_t, VEC>;
          kernel<<<grid_stride_blocks(kernel, kThreads, 0, items, kWarps), dim3(32, kWarps), 0, stream>>>(
              x->const_data_ptr<scalar_t>(), l, Multiply<scalar_t>(scale), plane_term.const_data_ptr<acc_t>(),
              slope.const_data_ptr<acc_t>(), mean_values.const_data_ptr<acc_t>(), items,
              args.grad_x.mutable_data_ptr<scalar_t>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
        return;
      }
      auto launch = [&](const PlaneAccess& a, auto VEC, auto FLAT, auto BATCH_STATS) {
        const int chunks = plane_chunks<scalar_t, VEC>(S);
        const int64_t items = B * C * chunks;
        auto kernel = grad_x_kernel<scalar_t, param_t, VEC, FLAT, BATCH_STATS>;
        kernel<<<grid_stride_blocks(kernel, kThreads, 0, items, kWarps), dim3(32, kWarps), 0, stream>>>(
            BATCH_STATS ? a.x.const_data_ptr<scalar_t>() : nullptr, a.planes, Multiply<scalar_t>(scale), cga,
            mean_values.const_data_ptr<acc_t>(), chunks, items, args.grad_x.mutable_data_ptr<scalar_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      if (batch_stats) {
        // grad_x is contiguous and freshly allocated: x's vector width suits it too.
        const PlaneAccess a = plane_access<scalar_t>(*x);
        dispatch_plane_access<scalar_t>(a, [&](auto VEC, auto FLAT) { launch(a, VEC, FLAT, std::true_type{}); });
      } else {
        // Only grad_x (contiguous) is written.
        PlaneAccess a = plane_access<scalar_t>(args.grad_x);
        dispatch_vector_width<scalar_t>(a.vec, [&](auto VEC) {
          launch(a, VEC, std::true_type{}, std::false_type{});
        });
      }
    });
  });
  return {args.grad_x, args.grad_weight, args.grad_bias};
}

void batch_norm_update_running_stats_cuda(at::Tensor& running_mean, at::Tensor& running_var,
                                          const std::optional<at::Tensor>& num_batches_tracked,
                                          const at::Tensor& mean, const at::Tensor& var, int64_t count,
                                          std::optional<double> momentum) {
  batch_norm_update_running_stats_check(running_mean, running_var, num_batches_tracked, mean, var, count);
  const c10::cuda::CUDAGuard guard(running_mean.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor mean_values = mean.contiguous(), var_values = var.contiguous();
  FUSED_OPS_DISPATCH_FLOATING_TYPES(running_mean.scalar_type(), "batch_norm_update_running_stats_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    update_running_stats_kernel<scalar_t><<<1, kThreads, 0, stream>>>(
        running_mean.mutable_data_ptr<scalar_t>(), running_mean.stride(0),
        running_var.mutable_data_ptr<scalar_t>(), running_var.stride(0),
        is_given(num_batches_tracked) ? num_batches_tracked->mutable_data_ptr<int64_t>() : nullptr,
        mean_values.const_data_ptr<acc_t>(), var_values.const_data_ptr<acc_t>(), running_mean.size(0),
        count, !momentum.has_value(), momentum.value_or(0.0));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("batch_norm_gap", &batch_norm_gap_cuda);
  m.impl("batch_norm_gap_backward", &batch_norm_gap_backward_cuda);
  m.impl("batch_norm_update_running_stats", &batch_norm_update_running_stats_cuda);
}

}  // namespace fused_ops
