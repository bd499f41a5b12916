// CUDA kernels of avg_pool2d_sigmoid_sum (the math: ../avg_pool2d_sigmoid_sum.h).
//
// Both kernels are grid-stride loops of warps, each warp working alone on
// its own items, so that the warps resident at any time work on neighbouring
// rows of the tensor (few pages in use at once) and no barrier stalls a block.
//
// Forward: an item is (batch, plane, pooled row, tile of pooled columns). The
// warp sums the window rows of every input column of the tile (vector loads,
// several vectors per lane in flight) into its shared-memory strip, then each
// pooled window's columns from there, applies the divisor and the sigmoid,
// and writes the item's sum to `partial`; each batch element's partials are
// then added in a fixed order (deterministic results). x is read once.
//
// Backward: an item is (batch, plane, row group) of one column tile, a row
// group being the rows that share their windows; grad_x is written once, in
// vectors, each lane's vectors computed from the saved factor of the windows
// holding them (a shared table gives, per column, the first pooled column
// whose window holds it and how many do) and stored to every row of the group.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>

#include "../avg_pool2d_sigmoid_sum.h"
#include "../dispatch.h"
#include "block_reduce.cuh"
#include "plane_rows.cuh"

namespace fused_ops {
namespace {

// Warps per block (each works alone), and the blocks per multiprocessor the
// register allocation must allow (without it nvcc 13 caps at full occupancy
// and spills).
constexpr int kWarps = 8;
constexpr int kMinBlocks = 4;
// Vectors per lane and row loaded before any is used: 32 bytes' worth, at most 4.
template <typename scalar_t, int VEC>
constexpr int kVectorsInFlight = std::clamp<int>(32 / sizeof(Vector<scalar_t, VEC>), 1, 4);
// Shared memory for one forward item's column sums, per warp: the size aimed
// at, and the most a block may take.
constexpr int kForwardStripBytes = 4096;
constexpr int kForwardSmemBytes = 48 * 1024;
// Columns per backward tile (its table holds one int2 per column).
constexpr int kBackwardTileCols = 4096;
// The aligned-runs backward writes grad_x in runs that begin and end on
// 512-byte blocks: HBM takes writes at full speed only when each such block
// is written whole by one warp (H200, 4.78 GB of stores: 1.11 ms so, against
// 1.21 ms for runs ending on 128-byte lines and 1.50 ms for 16-byte ones).
constexpr int kStoreBlockBytes = 512;
// Row groups per item of the aligned-runs backward, and the most shared
// memory a block of it may take (at least two blocks per multiprocessor).
constexpr int kGroupsPerItem = 8;
constexpr size_t kAlignedRunsSmemBytes = 96 * 1024;
// 16-byte stores per lane in flight in the aligned-runs backward (4 measured no faster).
constexpr int kStoresInFlight = 2;

// Vector `v` of a row (VEC contiguous elements, or one at col_stride).
template <typename scalar_t, int VEC>
__device__ __forceinline__ Vector<scalar_t, VEC> row_vector(const scalar_t* row, int v, int64_t col_stride) {
  if constexpr (VEC == 1) {
    return {row[v * col_stride]};
  } else {
    return load_vector<scalar_t, VEC>(row + v * VEC);
  }
}

// Items (b, p, oh, tile) numbered in that order; partial[item] gets the item's sum.
template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(32 * kWarps, kMinBlocks)
    forward_kernel(const scalar_t* __restrict__ x, PlaneRows xl, AvgPool2dGeometry g,
                   at::opmath_type<scalar_t>* __restrict__ grad_factor, PlaneRows gl,
                   at::opmath_type<scalar_t>* __restrict__ partial, int64_t items, int tiles_w,
                   int tile_ow, int span) {
  using acc_t = at::opmath_type<scalar_t>;
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  acc_t* colsum = reinterpret_cast<acc_t*>(smem_bytes) + threadIdx.y * span;
  const int lane = threadIdx.x, inner = xl.inner;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.y;
  ItemCursor<4> at(warp, warps, {static_cast<int>(xl.planes_per_batch), g.h.out, tiles_w});
  for (int64_t item = warp; item < items; item += warps, at.next()) {
    const int oh = at[2], ow0 = at[3] * tile_ow, ow1 = min(ow0 + tile_ow, g.w.out);
    // The tile's input columns, widened to whole vectors: [v0, v1) * VEC.
    const int v0 = g.w.begin(ow0) * inner / VEC;
    const int v1 = (g.w.end(ow1 - 1) * inner + VEC - 1) / VEC;
    const int base = v0 * VEC;
    const scalar_t* xp = x + xl.plane_offset(at.leading(), at[1]);
    const int r0 = g.h.begin(oh), r1 = g.h.end(oh);
    for (int v = v0 + lane; v < v1; v += 32 * kVectorsInFlight<scalar_t, VEC>) {
      acc_t sum[kVectorsInFlight<scalar_t, VEC>][VEC] = {};
#pragma unroll 2
      for (int r = r0; r < r1; ++r) {
        const scalar_t* row = xp + r * xl.row_stride;
        Vector<scalar_t, VEC> in[kVectorsInFlight<scalar_t, VEC>];
#pragma unroll
        for (int u = 0; u < kVectorsInFlight<scalar_t, VEC>; ++u) {
          in[u] = v + 32 * u < v1 ? row_vector<scalar_t, VEC>(row, v + 32 * u, xl.col_stride)
                                  : Vector<scalar_t, VEC>{};
        }
#pragma unroll
        for (int u = 0; u < kVectorsInFlight<scalar_t, VEC>; ++u) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) sum[u][e] += static_cast<acc_t>(in[u].v[e]);
        }
      }
#pragma unroll
      for (int u = 0; u < kVectorsInFlight<scalar_t, VEC>; ++u) {
        if (v + 32 * u < v1) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) colsum[(v + 32 * u) * VEC + e - base] = sum[u][e];
        }
      }
    }
    __syncwarp();
    const int outputs = (ow1 - ow0) * inner;
    acc_t* gf_row = grad_factor == nullptr
                        ? nullptr
                        : grad_factor + gl.plane_offset(at.leading(), at[1]) + oh * gl.row_stride;
    acc_t total = 0;
    for (int q = lane; q < outputs; q += 32) {
      const int ow = ow0 + q / inner, ci = q % inner;
      acc_t sum = 0;
      for (int w = g.w.begin(ow); w < g.w.end(ow); ++w) sum += colsum[w * inner + ci - base];
      const acc_t divisor = g.divisor<acc_t>(oh, ow);
      const acc_t s = sigmoid(sum / divisor);
      total += s;
      if (gf_row != nullptr) gf_row[ow * inner + ci] = s * (1 - s) / divisor;
    }
    total = warp_sum(total);
    if (lane == 0) partial[item] = total;
    __syncwarp();
  }
}

// grad_x[b, c, h, w] = grad_out[b] * sum over windows (oh, ow) containing
// (h, w) of grad_factor[b, c, oh, ow]. Block column blockIdx.x takes column
// tile blockIdx.x; its warps take (b, p, row group) items in a grid-stride loop.
// OVERLAP: windows may overlap (kernel > stride in some dim); a row group is
// then one row, each element a sum over the windows holding it. Without it
// row group j is the rows [j*stride - pad, (j+1)*stride - pad): window j's rows
// (if j < out), then rows in no window; every element lies in at most one
// window, so each lane loads its columns' factors once and stores them to all
// the group's window rows.
template <typename scalar_t, int VEC, bool OVERLAP>
__global__ void __launch_bounds__(32 * kWarps, kMinBlocks)
    backward_kernel(const scalar_t* __restrict__ grad_out, int64_t grad_out_stride,
                    const at::opmath_type<scalar_t>* __restrict__ grad_factor, PlaneRows gl,
                    AvgPool2dGeometry g, scalar_t* __restrict__ grad_x, PlaneRows xl,
                    int row_groups, int64_t items) {
  using acc_t = at::opmath_type<scalar_t>;
  using vector_t = Vector<scalar_t, VEC>;
  constexpr int kUnroll = kVectorsInFlight<scalar_t, VEC>;
  // Per column of this block's tile: {offset in a grad_factor row of the
  // first window holding it, number of windows holding it}.
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  int2* windows = reinterpret_cast<int2*>(smem_bytes);
  const int inner = xl.inner;
  const int c0 = blockIdx.x * kBackwardTileCols;
  const int tile_vectors = min(kBackwardTileCols, xl.cols - c0) / VEC;
  const int lane = threadIdx.x;
  for (int i = threadIdx.y * 32 + lane; i < tile_vectors * VEC; i += 32 * blockDim.y) {
    const int w = (c0 + i) / inner, ci = (c0 + i) % inner;
    const int first = g.w.first_window(w), last = g.w.last_window(w);
    windows[i] = make_int2(first * inner + ci, max(last - first, 0));
  }
  __syncthreads();

  const int64_t warp = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y;
  const int64_t warps = static_cast<int64_t>(gridDim.y) * blockDim.y;
  ItemCursor<3> at(warp, warps, {static_cast<int>(xl.planes_per_batch), row_groups});
  for (int64_t item = warp; item < items; item += warps, at.next()) {
    const int64_t b = at.leading();
    const acc_t grad = static_cast<acc_t>(grad_out[b * grad_out_stride]);
    const acc_t* gf_plane = grad_factor + gl.plane_offset(b, at[1]);
    scalar_t* gx_plane = grad_x + xl.plane_offset(b, at[1]) + c0;
    if constexpr (OVERLAP) {
      const int h = at[2];
      const int oh0 = g.h.first_window(h), oh1 = g.h.last_window(h);
      vector_t* gx = reinterpret_cast<vector_t*>(gx_plane + h * xl.row_stride);
      for (int v = lane; v < tile_vectors; v += 32) {
        vector_t result;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const int2 win = windows[v * VEC + e];
          acc_t sum = 0;
          for (int oh = oh0; oh < oh1; ++oh) {
            for (int k = 0; k < win.y; ++k) sum += gf_plane[oh * gl.row_stride + win.x + k * inner];
          }
          result.v[e] = static_cast<scalar_t>(grad * sum);
        }
        gx[v] = result;
      }
    } else {
      const int j = at[2];
      const int r0 = max(g.h.origin(j), 0), r1 = min(g.h.origin(j) + g.h.stride, g.h.in);
      const int window_end = j < g.h.out ? g.h.end(j) : r0;
      const acc_t* gf = gf_plane + min(j, g.h.out - 1) * gl.row_stride;
      for (int v0 = lane; v0 < tile_vectors; v0 += 32 * kUnroll) {
        vector_t value[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int v = min(v0 + 32 * u, tile_vectors - 1);
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            const int2 win = windows[v * VEC + e];
            value[u].v[e] = static_cast<scalar_t>(win.y > 0 ? grad * gf[win.x] : acc_t(0));
          }
        }
        for (int h = r0; h < r1; ++h) {
          vector_t* gx = reinterpret_cast<vector_t*>(gx_plane + h * xl.row_stride);
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            if (v0 + 32 * u < tile_vectors) gx[v0 + 32 * u] = h < window_end ? value[u] : vector_t{};
          }
        }
      }
    }
  }
}

// The aligned-runs backward's view of one row group (the non-overlapping
// backward kernel's doc comment) of a contiguous (B, C, H, W) grad_x, row
// groups numbered plane by plane: group g = plane * row_groups + j.
template <typename acc_t>
struct RowGroup {
  int64_t start = 0;              // flat offset of its first element
  int rows = 0;                   // its rows
  int window_rows = 0;            // its first rows, those in window j (0: none)
  const acc_t* factors = nullptr;  // grad_factor's row j of its plane
  acc_t grad = 0;                 // grad_out of its batch element
};

template <typename scalar_t>
struct AlignedRunsArgs {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* grad_out;
  int64_t grad_out_stride;
  const acc_t* grad_factor;
  PlaneRows gl;
  AvgPool2dGeometry g;
  int channels, row_groups;
  int64_t groups, numel;

  __device__ RowGroup<acc_t> group(int64_t index) const {
    RowGroup<acc_t> r;
    if (index >= groups) return r;
    const int64_t plane = index / row_groups;
    const int j = static_cast<int>(index - plane * row_groups);
    const int64_t b = plane / channels;
    const PoolDim& h = g.h;
    const int r0 = max(h.origin(j), 0);
    r.rows = min(h.origin(j) + h.stride, h.in) - r0;
    r.window_rows = j < h.out ? h.end(j) - r0 : 0;
    r.start = (plane * h.in + r0) * static_cast<int64_t>(g.w.in);
    r.factors = grad_factor + gl.plane_offset(b, plane - b * channels) + j * gl.row_stride;
    r.grad = static_cast<acc_t>(grad_out[b * grad_out_stride]);
    return r;
  }
};

// A warp's row of grad_x values for one row group, in shared memory: value w
// at byte w * sizeof(scalar_t), plus one padding unit after every 128 bytes,
// so that lanes reading 16 bytes apart hit different banks.
template <typename scalar_t>
struct ValueStrip {
  static constexpr int kPad = sizeof(scalar_t) > 4 ? sizeof(scalar_t) : 4;
  unsigned char* bytes;

  __host__ __device__ static int size_bytes(int cols) {
    const int data = cols * static_cast<int>(sizeof(scalar_t));
    return (data + (data / 128 + 1) * kPad + 15) / 16 * 16;
  }
  __device__ scalar_t& operator[](int w) const {
    const int at = w * static_cast<int>(sizeof(scalar_t));
    return *reinterpret_cast<scalar_t*>(bytes + at + (at >> 7) * kPad);
  }
};

// grad_x as the non-overlapping backward kernel computes it, for a contiguous
// grad_x whose rows span at least one store block. An item is kGroupsPerItem
// consecutive row groups; the warp writes each group g from the first block
// boundary at or after its start to the first at or after the next group's
// start (its own elements but the head, then the next group's head), so every
// block is written whole by one warp, lane l the 16 bytes at 16 * l of each.
// Each group's row of values (grad * factor of each column's window, or 0)
// is computed once into the warp's strip; the rows of a group in its window
// are that row, the others 0. Factor rows are prefetched into L1 two groups ahead.
template <typename scalar_t>
__global__ void __launch_bounds__(32 * kWarps, kMinBlocks)
    backward_aligned_runs_kernel(AlignedRunsArgs<scalar_t> a, scalar_t* __restrict__ grad_x,
                                 int64_t items) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int EPL = 16 / sizeof(scalar_t);  // elements per lane and store
  constexpr int kBlock = kStoreBlockBytes / sizeof(scalar_t);
  constexpr int kStep = 32 * EPL;
  static_assert(kStep == kBlock);
  using pack_t = Vector<scalar_t, EPL>;
  const int W = a.g.w.in;
  // Per column: its window (non-overlapping windows: at most one), or -1;
  // then two value strips per warp (this group's and the next's).
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  int* column_window = reinterpret_cast<int*>(smem_bytes);
  const int strip_bytes = ValueStrip<scalar_t>::size_bytes(W);
  unsigned char* strips = smem_bytes + (W * sizeof(int) + 15) / 16 * 16 + threadIdx.y * 2 * strip_bytes;
  ValueStrip<scalar_t> cur_values{strips}, next_values{strips + strip_bytes};
  for (int w = threadIdx.y * 32 + threadIdx.x; w < W; w += 32 * blockDim.y) {
    const int q = a.g.w.first_window(w);
    column_window[w] = q < a.g.w.last_window(w) ? q : -1;
  }
  __syncthreads();

  const int lane = threadIdx.x;
  auto fill_strip = [&](const RowGroup<acc_t>& group, const ValueStrip<scalar_t>& out) {
    if (group.window_rows == 0) return;
    for (int w = lane; w < W; w += 32) {
      const int q = column_window[w];
      out[w] = static_cast<scalar_t>(q >= 0 ? group.grad * group.factors[q] : acc_t(0));
    }
  };
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.y;
  auto block_up = [](int64_t o) { return (o + kBlock - 1) / kBlock * kBlock; };
  for (int64_t item = warp; item < items; item += warps) {
    const int64_t g0 = item * kGroupsPerItem;
    const int64_t g1 = min(g0 + kGroupsPerItem, a.groups);
    RowGroup<acc_t> cur = a.group(g0), next = a.group(g0 + 1);
    fill_strip(cur, cur_values);
    for (int64_t g = g0; g < g1; ++g) {
      const RowGroup<acc_t> after = g + 2 <= g0 + kGroupsPerItem ? a.group(g + 2) : RowGroup<acc_t>{};
      constexpr int kLine = 128 / sizeof(acc_t);  // factors per 128-byte line
      if (after.window_rows > 0 && lane * kLine < a.g.w.out + kLine) {
        asm volatile("prefetch.global.L1 [%0];" ::"l"(after.factors + min(lane * kLine, a.g.w.out - 1)));
      }
      fill_strip(next, next_values);
      __syncwarp();
      // This warp's run, as offsets from the group's start: [lo, hi).
      const int lo = static_cast<int>(block_up(cur.start) - cur.start);
      const int hi = static_cast<int>((g + 1 < a.groups ? block_up(next.start) : a.numel) - cur.start);
      int o = lo + EPL * lane, i = 0, w = o;
      while (w >= W) w -= W, ++i;
      scalar_t* gx = grad_x + cur.start;
      while (o < hi) {
        pack_t value[kStoresInFlight];
        int at[kStoresInFlight];
#pragma unroll
        for (int u = 0; u < kStoresInFlight; ++u) {
          at[u] = o;
          if (w + EPL <= W && i < cur.rows) {  // one row of this group
#pragma unroll
            for (int e = 0; e < EPL; ++e) value[u].v[e] = i < cur.window_rows ? cur_values[w + e] : scalar_t(0);
          } else {  // across a row end, or in the next group's first row
#pragma unroll
            for (int e = 0; e < EPL; ++e) {
              int ie = i, we = w + e;
              if (we >= W) we -= W, ++ie;
              const bool own = ie < cur.rows;
              const int row = own ? ie : ie - cur.rows;
              const ValueStrip<scalar_t> values{own ? cur_values.bytes : next_values.bytes};
              value[u].v[e] = row < (own ? cur.window_rows : next.window_rows) ? values[we] : scalar_t(0);
            }
          }
          o += kStep;
          w += kStep;
          while (w >= W) w -= W, ++i;
        }
#pragma unroll
        for (int u = 0; u < kStoresInFlight; ++u) {
          if (at[u] + EPL <= hi) {
            *reinterpret_cast<pack_t*>(gx + at[u]) = value[u];
          } else {
#pragma unroll
            for (int e = 0; e < EPL; ++e) {
              if (at[u] + e < hi) gx[at[u] + e] = value[u].v[e];
            }
          }
        }
      }
      __syncwarp();
      unsigned char* const filled = next_values.bytes;
      next_values.bytes = cur_values.bytes;
      cur_values.bytes = filled;
      cur = next;
      next = after;
    }
  }
}

std::tuple<at::Tensor, at::Tensor> avg_pool2d_sigmoid_sum_cuda(
    const at::Tensor& x, at::IntArrayRef kernel_size, at::IntArrayRef stride,
    at::IntArrayRef padding, bool ceil_mode, bool count_include_pad,
    std::optional<int64_t> divisor_override, bool save_grad_factor) {
  const auto g = avg_pool2d_sigmoid_sum_geometry(x, kernel_size, stride, padding, ceil_mode,
                                                 count_include_pad, divisor_override);
  at::Tensor out, grad_factor;  // (no structured binding: lambdas capture them, C++20 only)
  std::tie(out, grad_factor) = avg_pool2d_sigmoid_sum_outputs(x, g, save_grad_factor);
  const int64_t B = x.size(0);
  if (B == 0) return {out, grad_factor};
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const bool channels_last = is_channels_last(x);
  const PlaneRows xl = plane_rows(x, channels_last);

  FUSED_OPS_DISPATCH_FLOATING_TYPES(x.scalar_type(), "avg_pool2d_sigmoid_sum_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int vec = vector_width<scalar_t>(xl, x.const_data_ptr());
    const int inner = xl.inner;
    // A warp's strip of column sums: the tile's input columns, widened to
    // whole vectors at both ends. Aim at kForwardStripBytes, at least one window.
    const int window_cols = inner * g.w.kernel + 2 * vec;
    const int strip_cap = std::max<int>(kForwardStripBytes / sizeof(acc_t), window_cols);
    TORCH_CHECK_VALUE(window_cols * sizeof(acc_t) <= kForwardSmemBytes, "avg_pool2d_sigmoid_sum: kernel width ",
                      g.w.kernel, (inner > 1 ? " times channels " : ""), (inner > 1 ? inner : 1),
                      " is too large for the CUDA kernel's shared memory");
    const int tile_ow = static_cast<int>(std::min<int64_t>(
        ((strip_cap - 2 * vec) / inner - g.w.kernel) / g.w.stride + 1, g.w.out));
    const int span = std::min(strip_cap, ((tile_ow - 1) * g.w.stride + g.w.kernel) * inner + 2 * vec);
    const int tiles_w = (g.w.out + tile_ow - 1) / tile_ow;
    const int warps = std::min<int>(kWarps, kForwardSmemBytes / (span * sizeof(acc_t)));
    const size_t smem = static_cast<size_t>(span) * warps * sizeof(acc_t);
    const int64_t parts = xl.planes_per_batch * g.h.out * tiles_w;
    auto partial = at::empty({B, parts}, x.options().dtype(at::toOpMathType(x.scalar_type())));
    const PlaneRows gl = save_grad_factor ? plane_rows(grad_factor, channels_last) : xl;
    dispatch_vector_width<scalar_t>(vec, [&](auto VEC) {
      const auto kernel = forward_kernel<scalar_t, VEC>;
      kernel<<<grid_stride_blocks(kernel, 32 * warps, smem, B * parts, warps), dim3(32, warps), smem, stream>>>(
          x.const_data_ptr<scalar_t>(), xl, g,
          save_grad_factor ? grad_factor.mutable_data_ptr<acc_t>() : nullptr, gl,
          partial.mutable_data_ptr<acc_t>(), B * parts, tiles_w, tile_ow, span);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    sum_rows_kernel<acc_t, scalar_t><<<static_cast<unsigned>(B), 256, 0, stream>>>(
        partial.const_data_ptr<acc_t>(), parts, out.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, grad_factor};
}

at::Tensor avg_pool2d_sigmoid_sum_backward_cuda(const at::Tensor& grad_out,
                                                const at::Tensor& grad_factor,
                                                at::IntArrayRef input_hw,
                                                at::IntArrayRef kernel_size,
                                                at::IntArrayRef stride, at::IntArrayRef padding,
                                                bool channels_last) {
  auto args = avg_pool2d_sigmoid_sum_backward_setup(grad_out, grad_factor, input_hw,
                                                    kernel_size, stride, padding, channels_last);
  at::Tensor& grad_x = args.grad_x;
  const AvgPool2dGeometry& g = args.g;
  if (grad_x.numel() == 0) return grad_x;
  const c10::cuda::CUDAGuard guard(grad_x.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const PlaneRows xl = plane_rows(grad_x, channels_last);
  const PlaneRows gl = plane_rows(args.grad_factor, channels_last);
  const bool overlap = g.h.kernel > g.h.stride || g.w.kernel > g.w.stride;
  // Row groups (the kernel's doc comment), enough to cover the input.
  const int row_groups = overlap ? g.h.in : (g.h.in + g.h.pad + g.h.stride - 1) / g.h.stride;
  const int64_t items = grad_x.size(0) * xl.planes_per_batch * row_groups;

  FUSED_OPS_DISPATCH_FLOATING_TYPES(grad_out.scalar_type(), "avg_pool2d_sigmoid_sum_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    // Contiguous grad_x whose rows span a store block but not whole blocks
    // (whole-block rows the row-group kernel writes aligned already, and
    // faster: 1.48 against 1.61 ms at 384 columns; at 382 1.87 against 1.61),
    // with its column table and value strips within kAlignedRunsSmemBytes:
    // the aligned-runs kernel.
    const size_t smem = (xl.cols * sizeof(int) + 15) / 16 * 16 + 2 * kWarps * ValueStrip<scalar_t>::size_bytes(xl.cols);
    const size_t row_bytes = xl.cols * sizeof(scalar_t);
    if (!overlap && grad_x.is_contiguous() && row_bytes > kStoreBlockBytes && row_bytes % kStoreBlockBytes != 0 &&
        smem <= kAlignedRunsSmemBytes &&
        reinterpret_cast<uintptr_t>(grad_x.const_data_ptr()) % kStoreBlockBytes == 0) {
      const int64_t groups = grad_x.size(0) * xl.planes_per_batch * row_groups;
      const int64_t run_items = (groups + kGroupsPerItem - 1) / kGroupsPerItem;
      const AlignedRunsArgs<scalar_t> a{grad_out.const_data_ptr<scalar_t>(), grad_out.stride(0),
                                        args.grad_factor.const_data_ptr<acc_t>(), gl, g,
                                        static_cast<int>(grad_x.size(1)), row_groups, groups,
                                        grad_x.numel()};
      const auto kernel = backward_aligned_runs_kernel<scalar_t>;
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
      kernel<<<grid_stride_blocks(kernel, 32 * kWarps, smem, run_items, kWarps), dim3(32, kWarps), smem, stream>>>(
          a, grad_x.mutable_data_ptr<scalar_t>(), run_items);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
    // The tile width is a multiple of every vector width, so tiles stay aligned.
    const int vec = vector_width<scalar_t>(xl, grad_x.const_data_ptr());
    const int tiles = (xl.cols + kBackwardTileCols - 1) / kBackwardTileCols;
    const size_t table_bytes = std::min(kBackwardTileCols, xl.cols) * sizeof(int2);
    dispatch_vector_width<scalar_t>(vec, [&](auto VEC) {
      auto launch = [&](auto kernel) {
        const int64_t row_blocks = std::clamp<int64_t>(
            resident_blocks(kernel, 32 * kWarps, table_bytes) / tiles, 1,
            std::min<int64_t>((items + kWarps - 1) / kWarps, 65535));
        kernel<<<dim3(tiles, static_cast<unsigned>(row_blocks)), dim3(32, kWarps), table_bytes, stream>>>(
            grad_out.const_data_ptr<scalar_t>(), grad_out.stride(0),
            args.grad_factor.const_data_ptr<acc_t>(), gl, g, grad_x.mutable_data_ptr<scalar_t>(),
            xl, row_groups, items);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      if (overlap) {
        launch(backward_kernel<scalar_t, VEC, true>);
      } else {
        launch(backward_kernel<scalar_t, VEC, false>);
      }
    });
  });
  return grad_x;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("avg_pool2d_sigmoid_sum", &avg_pool2d_sigmoid_sum_cuda);
  m.impl("avg_pool2d_sigmoid_sum_backward", &avg_pool2d_sigmoid_sum_backward_cuda);
}

}  // namespace fused_ops
