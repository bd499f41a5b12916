// CUDA kernels of max_pool3d_cascade_sum (the math: ../max_pool3d_cascade_sum.h).
//
// Forward. Every kernel adds a group of kChannelsPerItem channels per output
// into partial[b, group, p] (channels in order), and sum_channel_groups_kernel
// adds the groups in order: deterministic sums, without atomics.
//  - tiled_pick_kernel, for tiled cascades of cubic kernels (K1, K2) with
//    (K1 K2) <= 32 (architecture B's 2 then 3 among them): a grid-stride loop
//    of warps, each working alone on its own items (b, channel group, od,
//    oh, segment of 32 / (K1 K2) output columns), so that resident warps read
//    neighbouring rows and no barrier stalls a block. Lanes run along w: a
//    segment's output columns are K1 K2 adjacent lanes each, so a warp reads
//    a contiguous run of up to 32 elements of each row. Per channel a lane
//    loads its column of the output's box, (K1 K2)^2 scalars (unclipped:
//    every box lies inside x), the next channel's while it compares these,
//    keeps their pick (in the order of the pick numbers, WindowPick::update),
//    then the box's lanes
//    merge their picks in log2(K1 K2) shuffles (WindowPick::merge). Only the
//    boxes are read: nothing of x outside them, nothing of the first pool's
//    output size is stored.
//  - cascade_pick_kernel, any other cascade: a thread per (b, channel group,
//    output), cascade_pick per channel. It also recomputes the picks for the
//    backward when none were saved (int32 when they do not fit a byte).
//
// Backward: grad_x (contiguous) written once, by a gather. In a tiled
// cascade each element lies in at most one output's box, so grad_x[e] =
// grad_out[p] if the pick of p is e, else 0.
//  - aligned_tiled_gather_kernel, tiled cascades of at most 32 output
//    columns: flat chunks of whole 512-byte blocks, built in shared memory
//    from the picks of the rows they touch and their outputs' gradients,
//    loaded together (see the kernel).
//  - tiled_gather_kernel, other tiled cascades: items (b, c, d, band of
//    kGatherRows rows), warps alone; lane = column w (w += 32 across the
//    row), so the stores of a row are coalesced; a lane loads the picks and
//    grads of its kGatherRows elements, then stores them.
//  - cascade_gather_kernel, any other cascade: a thread per element, summing
//    over every output whose pick it is (cascade_grad).
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

#include <ATen/cuda/detail/IntegerDivider.cuh>

#include "../dispatch.h"
#include "../max_pool3d_cascade_sum.h"
#include "plane_rows.cuh"

namespace fused_ops {
namespace {

using at::cuda::detail::IntDivider;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Channels per forward item, whose picked values one partial sum adds.
constexpr int kChannelsPerItem = 8;
// The blocks per multiprocessor the register allocation of the warp kernels
// must allow (nvcc 13 otherwise aims at full occupancy and interleaves the
// loads of a box with the compares). tiled_pick_kernel holds two channels'
// boxes (K1 2, K2 3: 128 registers; at 3 blocks it spills).
constexpr int kTiledPickMinBlocks = 2;
constexpr int kGatherMinBlocks = 2;
// The same for the thread-per-item kernels of any cascade.
constexpr int kAnyCascadeMinBlocks = 2;
// Rows of one depth per tiled_gather_kernel item.
constexpr int kGatherRows = 12;
// 512-byte blocks per aligned_tiled_gather_kernel item, and its blocks per
// multiprocessor: 64 registers, 32 warps per multiprocessor (with 84, 16;
// that and a gradient load waiting on its pick's held it at 0.42 ms on the
// H200 against 0.28 now).
constexpr int kChunkBlocks = 8;
constexpr int kAlignedGatherMinBlocks = 4;
// Rows per lane whose picks aligned_tiled_gather_kernel loads before testing any.
constexpr int kGatherPasses = 6;

__host__ __device__ int channel_groups(int64_t channels) {
  return static_cast<int>((channels + kChannelsPerItem - 1) / kChannelsPerItem);
}

// The picks and partial sums of a tiled cascade of cubic kernels K1 then K2
// (see the top of the file). picks: (B, C, D'', H'', W'') or null; partial:
// (B, channel groups, D'', H'', W'') or null.
template <typename scalar_t, int K1, int K2>
__global__ void __launch_bounds__(kThreads, kTiledPickMinBlocks)
    tiled_pick_kernel(const scalar_t* __restrict__ x, InputStrides xs, int channels,
                      MaxPool3dCascade g, int segments, int64_t items,
                      uint8_t* __restrict__ picks, at::opmath_type<scalar_t>* __restrict__ partial) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int kBox = K1 * K2;         // the edge of an output's box in x
  constexpr int kColumns = 32 / kBox;   // output columns per segment
  constexpr int kVolume1 = K1 * K1 * K1;
  static_assert(kColumns >= 1, "an output's box must fit a warp");
  const MaxPool3dGeometry& s = g.second;
  const int groups = channel_groups(channels);
  const int64_t outputs = g.outputs();

  const int lane = threadIdx.x;  // blockDim.x == 32
  const int column = lane / kBox, kw = lane % kBox;
  // The lane's part of the pick number: its stage-2 and stage-1 w offsets.
  const int key_w = kw / K1 * kVolume1 + kw % K1;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.y;
  ItemCursor<5> at(warp, warps, {groups, s.d.out, s.h.out, segments});
  for (int64_t item = warp; item < items; item += warps, at.next()) {
    const int64_t b = at.leading();
    const int group = at[1], od = at[2], oh = at[3];
    const int ow = at[4] * kColumns + column;
    const bool in_output = column < kColumns && ow < s.w.out;
    const bool writes = in_output && kw == 0;
    // (a lane past the last output column reads column 0, unused)
    const scalar_t* box = x + b * xs.b +
                          (od * kBox * xs.d + oh * kBox * xs.h + (in_output ? ow * kBox + kw : 0) * xs.w);
    const int64_t out_index = (static_cast<int64_t>(od) * s.h.out + oh) * s.w.out + ow;
    const int c0 = group * kChannelsPerItem, c1 = ::min(c0 + kChannelsPerItem, channels);
    // The lane's column of the box as K2 slabs of K1 depth rows (one per
    // stage-2 depth offset: the pick numbers' order takes them in turn), each
    // reloaded with the next channel's as soon as it is used, so that loads
    // are in flight while the picks are compared.
    scalar_t v[K2][K1][kBox];
    auto load_slab = [&](int c, int d2) {
      const scalar_t* xc = box + c * xs.c;
#pragma unroll
      for (int d1 = 0; d1 < K1; ++d1) {
#pragma unroll
        for (int kh = 0; kh < kBox; ++kh) v[d2][d1][kh] = xc[(d2 * K1 + d1) * xs.d + kh * xs.h];
      }
    };
#pragma unroll
    for (int d2 = 0; d2 < K2; ++d2) load_slab(c0, d2);
    acc_t total = 0;
    for (int c = c0; c < c1; ++c) {
      // The lane's column in the order of the pick numbers: stage-2 (d, h)
      // offsets, then stage-1 (d, h) offsets.
      WindowPick<acc_t> pick;
#pragma unroll
      for (int d2 = 0; d2 < K2; ++d2) {
#pragma unroll
        for (int h2 = 0; h2 < K2; ++h2) {
#pragma unroll
          for (int d1 = 0; d1 < K1; ++d1) {
#pragma unroll
            for (int h1 = 0; h1 < K1; ++h1) {
              const int key = (d2 * K2 + h2) * K2 * kVolume1 + (d1 * K1 + h1) * K1 + key_w;
              pick.update(static_cast<acc_t>(v[d2][d1][h2 * K1 + h1]), key);
            }
          }
        }
        if (c + 1 < c1) load_slab(c + 1, d2);
      }
      // The box's lanes: lane kw takes lanes kw + 1, kw + 2..3, kw + 4..7, ...
#pragma unroll
      for (int step = 1; step < kBox; step *= 2) {
        const acc_t value = __shfl_down_sync(0xffffffffu, pick.value, step);
        const int offset = __shfl_down_sync(0xffffffffu, pick.offset, step);
        if (kw + step < kBox) pick.merge(value, offset);
      }
      if (writes) {
        total += pick.value;
        if (picks != nullptr) {
          picks[(b * channels + c) * outputs + out_index] = static_cast<uint8_t>(pick.offset);
        }
      }
    }
    if (writes && partial != nullptr) partial[(b * groups + group) * outputs + out_index] = total;
  }
}

// The same for any cascade: a thread per (b, channel group, output).
template <typename scalar_t, typename index_t>
__global__ void __launch_bounds__(kThreads, kAnyCascadeMinBlocks)
    cascade_pick_kernel(const scalar_t* __restrict__ x, InputStrides xs, int channels,
                        MaxPool3dCascade g, int64_t items, index_t* __restrict__ picks,
                        at::opmath_type<scalar_t>* __restrict__ partial) {
  using acc_t = at::opmath_type<scalar_t>;
  const MaxPool3dGeometry& s = g.second;
  const int groups = channel_groups(channels);
  const int64_t outputs = g.outputs();
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  ItemCursor<5> at(first, stride, {groups, s.d.out, s.h.out, s.w.out});
  for (int64_t item = first; item < items; item += stride, at.next()) {
    const int64_t b = at.leading();
    const int group = at[1], od = at[2], oh = at[3], ow = at[4];
    const int64_t out_index = (static_cast<int64_t>(od) * s.h.out + oh) * s.w.out + ow;
    const int c0 = group * kChannelsPerItem, c1 = ::min(c0 + kChannelsPerItem, channels);
    acc_t total = 0;
    for (int c = c0; c < c1; ++c) {
      const scalar_t* xc = x + b * xs.b + c * xs.c;
      auto value_at = [&](int d, int h, int w) {
        return static_cast<acc_t>(xc[d * xs.d + h * xs.h + w * xs.w]);
      };
      const auto pick = cascade_pick<acc_t>(g, od, oh, ow, value_at);
      total += pick.value;
      if (picks != nullptr) picks[(b * channels + c) * outputs + out_index] = static_cast<index_t>(pick.offset);
    }
    if (partial != nullptr) partial[item] = total;  // items are numbered as partial is laid out
  }
}

// out[b, p] = sum of partial[b, 0:groups, p], in order, written as out_t (the result's dtype).
template <typename acc_t, typename out_t>
__global__ void __launch_bounds__(kThreads)
    sum_channel_groups_kernel(const acc_t* __restrict__ partial, int groups, int outputs,
                              int64_t items, out_t* __restrict__ out) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  ItemCursor<2> at(first, stride, {outputs});
  for (int64_t item = first; item < items; item += stride, at.next()) {
    const acc_t* p = partial + at.leading() * groups * outputs + at[1];
    acc_t sum = 0;
    for (int group = 0; group < groups; ++group) sum += p[static_cast<int64_t>(group) * outputs];
    out[item] = static_cast<out_t>(sum);
  }
}

// grad_x of a tiled cascade (see the top of the file). grad_out (B, 1, D'',
// H'', W'') and picks (B, C, D'', H'', W'') contiguous.
template <typename scalar_t, typename index_t>
__global__ void __launch_bounds__(kThreads, kGatherMinBlocks)
    tiled_gather_kernel(const scalar_t* __restrict__ grad_out, int channels,
                        const index_t* __restrict__ picks, MaxPool3dCascade g, TiledCascade t,
                        int bands, int64_t items, scalar_t* __restrict__ grad_x) {
  const MaxPool3dGeometry& s = g.second;
  const int D = g.first.d.in, H = g.first.h.in, W = g.first.w.in;
  const int64_t outputs = g.outputs();
  const int lane = threadIdx.x;  // blockDim.x == 32
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.y;
  ItemCursor<4> at(warp, warps, {channels, D, bands});
  for (int64_t item = warp; item < items; item += warps, at.next()) {
    const int64_t b = at.leading(), plane = b * channels + at[1];
    const int d = at[2], h0 = at[3] * kGatherRows;
    const int od = d / t.d.box;
    const int key_d = t.d.key(d - od * t.d.box);
    // Per row: the offset of its outputs' row in a plane of outputs (-1: in
    // no box) and its part of the pick number (d and h offsets).
    int row_outputs[kGatherRows], row_key[kGatherRows];
    int oh = h0 / t.h.box, kh = h0 - oh * t.h.box;
    int kh2 = kh / t.h.kernel1, kh1 = kh - kh2 * t.h.kernel1;
#pragma unroll
    for (int r = 0; r < kGatherRows; ++r) {
      const bool in_box = od < s.d.out && oh < s.h.out && h0 + r < H;
      row_outputs[r] = in_box ? (od * s.h.out + oh) * s.w.out : -1;
      row_key[r] = key_d + kh2 * t.h.weight2 + kh1 * t.h.weight1;
      if (++kh1 == t.h.kernel1) {
        kh1 = 0;
        if (++kh2 == t.h.kernel2) {
          kh2 = 0;
          ++oh;
        }
      }
    }
    const index_t* plane_picks = picks + plane * outputs;
    const scalar_t* batch_grad = grad_out + b * outputs;
    scalar_t* rows = grad_x + (plane * D + d) * H * W + static_cast<int64_t>(h0) * W;
    for (int w = lane; w < W; w += 32) {
      const int ow = w / t.w.box;
      const int key_w = t.w.key(w - ow * t.w.box);
      // Loads are unconditional (an element in no box reads the plane's
      // first output, and misses), so that they form one run.
      index_t pick[kGatherRows];
      scalar_t grad[kGatherRows];
#pragma unroll
      for (int r = 0; r < kGatherRows; ++r) {
        const int o = ow < s.w.out && row_outputs[r] >= 0 ? row_outputs[r] + ow : 0;
        pick[r] = plane_picks[o];
        grad[r] = batch_grad[o];
      }
#pragma unroll
      for (int r = 0; r < kGatherRows; ++r) {
        const bool hit = ow < s.w.out && row_outputs[r] >= 0 &&
                         static_cast<int>(pick[r]) == row_key[r] + key_w;
        if (h0 + r < H) rows[r * W + w] = hit ? grad[r] : scalar_t(0);
      }
    }
  }
}

// The divisors of aligned_tiled_gather_kernel, as multiply-shift dividers:
// a row index of contiguous (B, C, D, H, W) by H, D and C; a pick number by
// the stage-1 kernel volume, the pick's stage-2 w offset by kernel2's width
// and its stage-1 offset by kernel1's.
struct GatherDividers {
  IntDivider<unsigned> h, d, c, volume1, kernel2_w, kernel1_w;
};

// A row of a contiguous (B, C, D, H, W) tensor: its index and (b, c, d, h).
struct RowPosition {
  int row, h, d, c, b;

  __device__ RowPosition(int r, const GatherDividers& div) : row(r) {
    const auto hq = div.h.divmod(r), dq = div.d.divmod(hq.div), cq = div.c.divmod(dq.div);
    h = hq.mod, d = dq.mod, c = cq.mod, b = cq.div;
  }
  // Moves k rows on.
  __device__ void advance(int k, const GatherDividers& div) {
    row += k;
    for (h += k; h >= static_cast<int>(div.h.divisor); h -= div.h.divisor) {
      if (++d == static_cast<int>(div.d.divisor)) {
        d = 0;
        if (++c == static_cast<int>(div.c.divisor)) c = 0, ++b;
      }
    }
  }
};

// grad_x of a tiled cascade whose output rows fit a warp, written in runs
// that begin and end on 512-byte blocks (HBM takes writes at full speed only
// when each such block is written whole by one warp; rows of x are rarely
// whole blocks). An item is a chunk of kChunkBlocks blocks of grad_x
// (contiguous); its warp zeroes an image of the chunk in shared memory, puts
// each output's gradient where its pick falls inside the chunk, and stores
// the image, lane l the 16 bytes at 16 * l of each block. Picks: for every
// row of x the chunk touches and every output column, lane (row, ow) reads
// the pick of output (od, oh, ow) of the row's box and that output's
// gradient, kGatherPasses rows' worth before testing any; the pick lies in
// this row iff its d and h offsets are the row's (pick - its w part == the
// row's key).
template <typename scalar_t, typename index_t>
__global__ void __launch_bounds__(kThreads, kAlignedGatherMinBlocks)
    aligned_tiled_gather_kernel(const scalar_t* __restrict__ grad_out, const index_t* __restrict__ picks,
                                MaxPool3dCascade g, TiledCascade t, GatherDividers div, int64_t items,
                                int64_t numel, scalar_t* __restrict__ grad_x) {
  constexpr int EPL = 16 / sizeof(scalar_t);
  constexpr int kChunk = 32 * EPL * kChunkBlocks;
  using pack_t = Vector<scalar_t, EPL>;
  const MaxPool3dGeometry& s = g.second;
  const int D = g.first.d.in, H = g.first.h.in, W = g.first.w.in;
  const int channels = div.c.divisor;
  // Per depth, then per height: {offset of its outputs' row (d: in planes of
  // H'' W'' outputs, h: of W''), -1 in no box; its part of the pick number}.
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  int2* depth_info = reinterpret_cast<int2*>(smem_bytes);
  int2* height_info = depth_info + D;
  scalar_t* image = reinterpret_cast<scalar_t*>(smem_bytes + ((D + H) * sizeof(int2) + 15) / 16 * 16) +
                    threadIdx.y * kChunk;
  for (int i = threadIdx.y * 32 + threadIdx.x; i < D + H; i += blockDim.y * 32) {
    const bool depth = i < D;
    const int x = depth ? i : i - D;
    const TiledDim& td = depth ? t.d : t.h;
    const int o = x / td.box;
    const bool in_box = o < (depth ? s.d.out : s.h.out);
    const int row = depth ? o * s.h.out * s.w.out : o * s.w.out;
    (depth ? depth_info : height_info)[x] = make_int2(in_box ? row : -1, td.key(x - o * td.box));
  }
  __syncthreads();

  const int outputs = static_cast<int>(g.outputs());
  const int volume1 = div.volume1.divisor;
  const int lane = threadIdx.x;  // blockDim.x == 32
  // Lane (r, ow): output column ow of every rows_per_pass-th row.
  const int rows_per_pass = 32 / s.w.out;
  const int r = lane / s.w.out, ow = lane - r * s.w.out;
  const bool reads = r < rows_per_pass;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t item = warp; item < items; item += warps) {
    const int64_t c0 = item * kChunk;
    const int n = static_cast<int>(min(static_cast<int64_t>(kChunk), numel - c0));
    for (int k = lane; k < kChunk / EPL; k += 32) reinterpret_cast<pack_t*>(image)[k] = pack_t{};
    __syncwarp();
    const int row0 = static_cast<int>(c0 / W), row1 = static_cast<int>((c0 + n - 1) / W);
    const int row0_at = static_cast<int>(static_cast<int64_t>(row0) * W - c0);  // row0's start in the chunk
    RowPosition at(row0 + r, div);
    while (reads && at.row <= row1) {
      // The output of the row's box in column ow, -1 where it has none.
      auto output_of = [&](const RowPosition& p) {
        const int2 di = depth_info[p.d], hi = height_info[p.h];
        return p.row <= row1 && di.x >= 0 && hi.x >= 0 ? di.x + hi.x + ow : -1;
      };
      const RowPosition first = at;
      index_t pick[kGatherPasses];
      scalar_t grad[kGatherPasses];
#pragma unroll
      for (int p = 0; p < kGatherPasses; ++p) {
        const int o = output_of(at);
        pick[p] = o >= 0 ? picks[static_cast<int64_t>(at.b * channels + at.c) * outputs + o] : index_t(0);
        grad[p] = o >= 0 ? grad_out[static_cast<int64_t>(at.b) * outputs + o] : scalar_t(0);
        at.advance(rows_per_pass, div);
      }
      // The same rows again: their outputs and keys are recomputed (shared
      // memory reads) rather than held, which keeps the kernel at 64 registers.
      at = first;
#pragma unroll
      for (int p = 0; p < kGatherPasses; ++p) {
        // The pick's stage-2 and stage-1 w offsets in the box.
        const int number = static_cast<int>(pick[p]);
        const auto stage = div.volume1.divmod(number);
        const int w2 = div.kernel2_w.mod(stage.div), w1 = div.kernel1_w.mod(stage.mod);
        const int key = depth_info[at.d].y + height_info[at.h].y;
        const int e = row0_at + (at.row - row0) * W + ow * t.w.box + w2 * t.w.kernel1 + w1;
        // (a pick past the pick volume leaves a stage-2 part past every row key's: never a hit)
        if (output_of(at) >= 0 && number - (w2 * volume1 + w1) == key && e >= 0 && e < n) image[e] = grad[p];
        at.advance(rows_per_pass, div);
      }
    }
    __syncwarp();
    scalar_t* chunk = grad_x + c0;
    for (int k = lane; k * EPL < n; k += 32) {
      const pack_t value = reinterpret_cast<const pack_t*>(image)[k];
      if ((k + 1) * EPL <= n) {
        reinterpret_cast<pack_t*>(chunk)[k] = value;
      } else {
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
          if (k * EPL + e < n) chunk[k * EPL + e] = value.v[e];
        }
      }
    }
    __syncwarp();
  }
}

// grad_x of any cascade: a thread per element of grad_x (contiguous).
template <typename scalar_t, typename index_t>
__global__ void __launch_bounds__(kThreads, kAnyCascadeMinBlocks)
    cascade_gather_kernel(const scalar_t* __restrict__ grad_out, int channels,
                          const index_t* __restrict__ picks, MaxPool3dCascade g, int64_t items,
                          scalar_t* __restrict__ grad_x) {
  using acc_t = at::opmath_type<scalar_t>;
  const MaxPool3dGeometry &f = g.first, &s = g.second;
  const int64_t outputs = g.outputs();
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  ItemCursor<5> at(first, stride, {channels, f.d.in, f.h.in, f.w.in});
  for (int64_t item = first; item < items; item += stride, at.next()) {
    const int64_t b = at.leading();
    const scalar_t* batch_grad = grad_out + b * outputs;
    auto grad_at = [&](int od, int oh, int ow) {
      return static_cast<acc_t>(batch_grad[(static_cast<int64_t>(od) * s.h.out + oh) * s.w.out + ow]);
    };
    const index_t* plane_picks = picks + (b * channels + at[1]) * outputs;
    grad_x[item] = static_cast<scalar_t>(cascade_grad<acc_t>(g, plane_picks, at[2], at[3], at[4], grad_at));
  }
}

// Calls f(std::integral_constant<int, K1>{}, std::integral_constant<int, K2>{})
// where the cascade is tiled with cubic kernels that tiled_pick_kernel is
// built for; returns whether it did.
template <typename F>
bool dispatch_tiled_kernels(const MaxPool3dCascade& g, F&& f) {
  auto cubic = [](const MaxPool3dGeometry& p, int k) {
    return p.d.kernel == k && p.h.kernel == k && p.w.kernel == k;
  };
  if (!g.tiled()) return false;
  if (cubic(g.first, 2) && cubic(g.second, 3)) {
    f(std::integral_constant<int, 2>{}, std::integral_constant<int, 3>{});
  } else if (cubic(g.first, 3) && cubic(g.second, 2)) {
    f(std::integral_constant<int, 3>{}, std::integral_constant<int, 2>{});
  } else if (cubic(g.first, 2) && cubic(g.second, 2)) {
    f(std::integral_constant<int, 2>{}, std::integral_constant<int, 2>{});
  } else {
    return false;
  }
  return true;
}

// The picks (when not null) and the partial channel sums (when not null) of
// x. x is read in place, unless its strides spread a plane over 2^31
// elements or more: then from a contiguous copy (whose planes
// check_plane_sizes bounds).
template <typename scalar_t, typename index_t>
void launch_pick_kernel(const at::Tensor& x_in, const MaxPool3dCascade& g, index_t* picks,
                        at::opmath_type<scalar_t>* partial, cudaStream_t stream) {
  auto strides = in_plane_strides(x_in);
  const at::Tensor x = strides ? x_in : x_in.contiguous();
  const InputStrides xs = strides ? *strides : *in_plane_strides(x);
  const int channels = static_cast<int>(x.size(1));
  const int64_t groups_items = x.size(0) * channel_groups(channels) * g.second.d.out * g.second.h.out;
  if constexpr (sizeof(index_t) == 1) {
    const bool tiled = dispatch_tiled_kernels(g, [&](auto K1, auto K2) {
      constexpr int kColumns = 32 / (K1 * K2);
      const int segments = (g.second.w.out + kColumns - 1) / kColumns;
      const int64_t items = groups_items * segments;
      auto kernel = tiled_pick_kernel<scalar_t, K1, K2>;
      kernel<<<grid_stride_blocks(kernel, kThreads, 0, items, kWarps), dim3(32, kWarps), 0, stream>>>(
          x.const_data_ptr<scalar_t>(), xs, channels, g, segments, items, picks, partial);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    if (tiled) return;
  }
  const int64_t items = groups_items * g.second.w.out;
  auto kernel = cascade_pick_kernel<scalar_t, index_t>;
  kernel<<<grid_stride_blocks(kernel, kThreads, 0, items, kThreads), kThreads, 0, stream>>>(
      x.const_data_ptr<scalar_t>(), xs, channels, g, items, picks, partial);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, typename index_t>
void launch_gather_kernel(const at::Tensor& grad_out, const index_t* picks,
                          const MaxPool3dCascade& g, at::Tensor& grad_x, cudaStream_t stream) {
  const int channels = static_cast<int>(grad_x.size(1));
  const int64_t rows = grad_x.numel() / std::max<int64_t>(g.first.w.in, 1);
  if (g.tiled() && g.second.w.out <= 32 && rows <= std::numeric_limits<int>::max() &&
      reinterpret_cast<uintptr_t>(grad_x.const_data_ptr()) % 512 == 0) {
    constexpr int kChunk = 32 * (16 / sizeof(scalar_t)) * kChunkBlocks;
    const size_t smem = ((g.first.d.in + g.first.h.in) * sizeof(int2) + 15) / 16 * 16 + kWarps * kChunk * sizeof(scalar_t);
    const int64_t items = (grad_x.numel() + kChunk - 1) / kChunk;
    auto kernel = aligned_tiled_gather_kernel<scalar_t, index_t>;
    auto divider = [](int64_t d) { return IntDivider<unsigned>(static_cast<unsigned>(d)); };
    const GatherDividers div{divider(g.first.h.in), divider(g.first.d.in), divider(channels),
                             divider(g.first.kernel_volume()), divider(g.second.w.kernel),
                             divider(g.first.w.kernel)};
    kernel<<<grid_stride_blocks(kernel, kThreads, smem, items, kWarps), dim3(32, kWarps), smem, stream>>>(
        grad_out.const_data_ptr<scalar_t>(), picks, g, tiled_cascade(g), div, items, grad_x.numel(),
        grad_x.mutable_data_ptr<scalar_t>());
  } else if (g.tiled()) {
    const int bands = (g.first.h.in + kGatherRows - 1) / kGatherRows;
    const int64_t items = grad_x.size(0) * channels * g.first.d.in * bands;
    auto kernel = tiled_gather_kernel<scalar_t, index_t>;
    kernel<<<grid_stride_blocks(kernel, kThreads, 0, items, kWarps), dim3(32, kWarps), 0, stream>>>(
        grad_out.const_data_ptr<scalar_t>(), channels, picks, g, tiled_cascade(g), bands, items,
        grad_x.mutable_data_ptr<scalar_t>());
  } else {
    const int64_t items = grad_x.numel();
    auto kernel = cascade_gather_kernel<scalar_t, index_t>;
    kernel<<<grid_stride_blocks(kernel, kThreads, 0, items, kThreads), kThreads, 0, stream>>>(
        grad_out.const_data_ptr<scalar_t>(), channels, picks, g, items,
        grad_x.mutable_data_ptr<scalar_t>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The kernels index a plane of x (and so a plane of outputs) with int.
void check_plane_sizes(const char* what, const MaxPool3dCascade& g) {
  const MaxPool3dGeometry& f = g.first;
  TORCH_CHECK_VALUE(static_cast<int64_t>(f.d.in) * f.h.in * f.w.in <= std::numeric_limits<int>::max(),
                    what, ": planes (depth x height x width) of 2^31 elements or more are not "
                    "supported by the CUDA kernels");
}

std::tuple<at::Tensor, at::Tensor> max_pool3d_cascade_sum_cuda(
    const at::Tensor& x, at::IntArrayRef kernel1, at::IntArrayRef stride1,
    at::IntArrayRef padding1, at::IntArrayRef kernel2, at::IntArrayRef stride2,
    at::IntArrayRef padding2, bool save_indices, std::optional<at::ScalarType> dtype) {
  const auto g = max_pool3d_cascade_sum_geometry(
      x, {kernel1, stride1, padding1, kernel2, stride2, padding2}, save_indices);
  check_plane_sizes("max_pool3d_cascade_sum", g);
  at::Tensor out, indices;  // (no structured binding: lambdas capture them, C++20 only)
  std::tie(out, indices) = max_pool3d_cascade_sum_outputs(x, g, save_indices, dtype);
  if (out.numel() == 0) return {out, indices};
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  FUSED_OPS_DISPATCH_FLOATING_TYPES(x.scalar_type(), "max_pool3d_cascade_sum_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int groups = channel_groups(x.size(1));
    at::Tensor partial = at::empty({x.size(0) * groups * g.outputs()},
                                   x.options().dtype(at::toOpMathType(x.scalar_type())));
    launch_pick_kernel<scalar_t, uint8_t>(
        x, g, save_indices ? indices.mutable_data_ptr<uint8_t>() : nullptr,
        partial.mutable_data_ptr<acc_t>(), stream);
    const int64_t items = out.numel();
    dispatch_scalar_or_acc<scalar_t>(out.scalar_type(), [&](auto* tag) {
      using out_t = std::remove_pointer_t<decltype(tag)>;
      auto kernel = sum_channel_groups_kernel<acc_t, out_t>;
      kernel<<<grid_stride_blocks(kernel, kThreads, 0, items, kThreads), kThreads, 0, stream>>>(
          partial.const_data_ptr<acc_t>(), groups, static_cast<int>(g.outputs()), items,
          out.mutable_data_ptr<out_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {out, indices};
}

at::Tensor max_pool3d_cascade_sum_backward_cuda(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& indices,
    const std::optional<at::Tensor>& x, at::IntArrayRef input_size, at::IntArrayRef kernel1,
    at::IntArrayRef stride1, at::IntArrayRef padding1, at::IntArrayRef kernel2,
    at::IntArrayRef stride2, at::IntArrayRef padding2) {
  auto args = max_pool3d_cascade_sum_backward_setup(
      grad_out, indices, x, input_size, {kernel1, stride1, padding1, kernel2, stride2, padding2});
  check_plane_sizes("max_pool3d_cascade_sum_backward", args.g);
  if (args.grad_x.numel() == 0) return args.grad_x;
  const c10::cuda::CUDAGuard guard(grad_out.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  FUSED_OPS_DISPATCH_FLOATING_TYPES(grad_out.scalar_type(), "max_pool3d_cascade_sum_backward_cuda", [&] {
    dispatch_picks(args.picks, [&](auto* picks) {
      if (args.recompute) {
        launch_pick_kernel<scalar_t>(args.x, args.g, picks, static_cast<at::opmath_type<scalar_t>*>(nullptr),
                                     stream);
      }
      launch_gather_kernel<scalar_t>(args.grad_out, picks, args.g, args.grad_x, stream);
    });
  });
  return args.grad_x;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("max_pool3d_cascade_sum", &max_pool3d_cascade_sum_cuda);
  m.impl("max_pool3d_cascade_sum_backward", &max_pool3d_cascade_sum_backward_cuda);
}

}  // namespace fused_ops
