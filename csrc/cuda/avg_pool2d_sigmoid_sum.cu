// CUDA kernels of avg_pool2d_sigmoid_sum (the math: ../avg_pool2d_sigmoid_sum.h).
//
// The forward and the general backward are grid-stride loops of warps, each
// warp working alone on its own items, so that the warps resident at any time
// work on neighbouring rows of the tensor (few pages in use at once) and no
// barrier stalls a block.
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
// vectors, each lane's vectors computed from the saved sigmoid s of the windows
// holding them, each window's factor s (1 - s) / divisor (a shared table gives, per
// column, the first pooled column whose window holds it and how many do), and stored
// to every row of the group.
// Where rows are not whole 512-byte blocks (382 floats, say), the aligned-runs
// backward writes contiguous grad_x instead, in runs of whole blocks, with the
// saved sigmoids bulk-copied into shared memory (its doc comment).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>

#include "../avg_pool2d_sigmoid_sum.h"
#include "../dispatch.h"
#include "block_reduce.cuh"
#include "bulk_copy.cuh"
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
// The aligned-runs backward: one block of kAlignedWarps warps per
// multiprocessor, taking up to kAlignedRunsSmemBytes of shared memory (the
// device's limit if lower), most of it for sigmoid rows (larger bulk reads:
// 64-register warps, 32 of them, leave no room for a second block); 16-byte
// stores per lane in flight (4 measured no faster; 2-byte types: 1, which
// fits the registers).
constexpr int kAlignedWarps = 32;
constexpr size_t kAlignedRunsSmemBytes = 224 * 1024;
template <typename scalar_t>
constexpr int kStoresInFlight = sizeof(scalar_t) >= 4 ? 2 : 1;

// The aligned-runs backward's grad_x stores are streaming (evict-first): on an
// H200 at 382 columns 1.47 against 1.50 ms with plain stores.
template <typename pack_t>
__device__ __forceinline__ void store_streaming(pack_t* p, const pack_t& v) {
  static_assert(sizeof(pack_t) == sizeof(int4));
  __stcs(reinterpret_cast<int4*>(p), *reinterpret_cast<const int4*>(&v));
}

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
                   at::opmath_type<scalar_t>* __restrict__ sigmoid_saved, PlaneRows gl,
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
    acc_t* s_row = sigmoid_saved == nullptr
                       ? nullptr
                       : sigmoid_saved + gl.plane_offset(at.leading(), at[1]) + oh * gl.row_stride;
    acc_t total = 0;
    for (int q = lane; q < outputs; q += 32) {
      const int ow = ow0 + q / inner, ci = q % inner;
      acc_t sum = 0;
      for (int w = g.w.begin(ow); w < g.w.end(ow); ++w) sum += colsum[w * inner + ci - base];
      const acc_t divisor = g.divisor<acc_t>(oh, ow);
      const acc_t s = sigmoid(sum / divisor);
      total += s;
      if (s_row != nullptr) s_row[ow * inner + ci] = s;
    }
    total = warp_sum(total);
    if (lane == 0) partial[item] = total;
    __syncwarp();
  }
}

// grad_x[b, c, h, w] = grad_out[b] * sum over windows (oh, ow) containing
// (h, w) of g.factor(sigmoid[b, c, oh, ow], oh, ow). Block column blockIdx.x takes column
// tile blockIdx.x; its warps take (b, p, row group) items in a grid-stride loop.
// OVERLAP: windows may overlap (kernel > stride in some dim); a row group is
// then one row, each element a sum over the windows holding it. Without it
// row group j is the rows [j*stride - pad, (j+1)*stride - pad): window j's rows
// (if j < out), then rows in no window; every element lies in at most one
// window, so each lane computes its columns' factors once and stores them to all
// the group's window rows.
template <typename scalar_t, int VEC, bool OVERLAP>
__global__ void __launch_bounds__(32 * kWarps, kMinBlocks)
    backward_kernel(const scalar_t* __restrict__ grad_out, int64_t grad_out_stride,
                    const at::opmath_type<scalar_t>* __restrict__ sigmoid_saved, PlaneRows gl,
                    AvgPool2dGeometry g, scalar_t* __restrict__ grad_x, PlaneRows xl,
                    int row_groups, int64_t items) {
  using acc_t = at::opmath_type<scalar_t>;
  using vector_t = Vector<scalar_t, VEC>;
  constexpr int kUnroll = kVectorsInFlight<scalar_t, VEC>;
  // Per column of this block's tile: {offset in a sigmoid row of the
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
    const acc_t* s_plane = sigmoid_saved + gl.plane_offset(b, at[1]);
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
            for (int k = 0; k < win.y; ++k) {
              sum += g.factor(s_plane[oh * gl.row_stride + win.x + k * inner], oh, win.x / inner + k);
            }
          }
          result.v[e] = static_cast<scalar_t>(grad * sum);
        }
        gx[v] = result;
      }
    } else {
      const int j = at[2];
      const int r0 = max(g.h.origin(j), 0), r1 = min(g.h.origin(j) + g.h.stride, g.h.in);
      const int window_end = j < g.h.out ? g.h.end(j) : r0;
      const int oh = min(j, g.h.out - 1);
      const acc_t* s_row = s_plane + oh * gl.row_stride;
      for (int v0 = lane; v0 < tile_vectors; v0 += 32 * kUnroll) {
        vector_t value[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int v = min(v0 + 32 * u, tile_vectors - 1);
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            const int2 win = windows[v * VEC + e];
            value[u].v[e] =
                static_cast<scalar_t>(win.y > 0 ? grad * g.factor(s_row[win.x], oh, win.x / inner) : acc_t(0));
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
// groups numbered plane by plane: group g = (b * C + c) * row_groups + j.
template <typename acc_t>
struct RowGroup {
  int64_t start = 0;                // flat offset of its first element
  int rows = 0;                     // its rows
  int window_rows = 0;              // its first rows, those in window j (0: none)
  const acc_t* sigmoids = nullptr;  // the saved sigmoid's row j of its plane
  acc_t grad = 0;                   // grad_out of its batch element
};

template <typename scalar_t>
struct AlignedRunsArgs {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* grad_out;
  int64_t grad_out_stride;
  const acc_t* sigmoid_saved;
  PlaneRows gl;
  AvgPool2dGeometry g;
  int channels, row_groups;
  int64_t batch, numel;

  // Group j of plane (b, c); none (no rows) past the last batch element.
  __device__ RowGroup<acc_t> group(int64_t b, int c, int j) const {
    RowGroup<acc_t> r;
    if (b >= batch) return r;
    const PoolDim& h = g.h;
    const int r0 = max(h.origin(j), 0);
    r.rows = min(h.origin(j) + h.stride, h.in) - r0;
    r.window_rows = j < h.out ? h.end(j) - r0 : 0;
    r.start = ((b * channels + c) * h.in + r0) * static_cast<int64_t>(g.w.in);
    r.sigmoids = sigmoid_saved + gl.plane_offset(b, c) + j * gl.row_stride;
    r.grad = static_cast<acc_t>(grad_out[b * grad_out_stride]);
    return r;
  }
  // Elements of a warp's value row: one per window, a 0, rounded up to 8 (16-byte aligned rows).
  __host__ __device__ int value_row_elements() const { return (g.w.out + 8) / 8 * 8; }
  // The group after group j of plane (b, c).
  __device__ RowGroup<acc_t> group_after(int64_t b, int c, int j) const {
    if (j + 1 < row_groups) return group(b, c, j + 1);
    return c + 1 < channels ? group(b, c + 1, 0) : group(b + 1, 0, 0);
  }
};

// A row of per-column entries in shared memory, laid out so that the EPL
// entries from any column w that a 16-byte pack of EPL grad_x elements can
// start at are one aligned load. Pack starts are multiples of `unit` =
// gcd(W, EPL) (a row starts at a multiple of W, a pack at a multiple of EPL),
// so the row is held in EPL / unit copies, copy c shifted left by c * unit:
// entry w + k of the pack is copy (w % EPL) / unit at (w - w % EPL) + k. Each
// copy runs EPL - 1 entries past the row's end with its first entries again,
// for packs that run on into the next row.
template <typename T, int EPL>
struct ShiftedRow {
  int W, unit_log2, copy_bytes;

  __host__ __device__ explicit ShiftedRow(int cols) : W(cols), unit_log2(0) {
    while ((cols >> unit_log2) % 2 == 0 && (2 << unit_log2) <= EPL) ++unit_log2;
    // (whole 16-byte units, so that what follows the copies stays aligned)
    copy_bytes = ((W + 2 * EPL - 1) / EPL * EPL * static_cast<int>(sizeof(T)) + 15) / 16 * 16;
  }
  __host__ __device__ int copies() const { return EPL >> unit_log2; }
  __host__ __device__ int bytes() const { return copies() * copy_bytes; }
  // Stores entry `v` of column w (and, for w < EPL - 1, its repeat after the row's end).
  __device__ void store(unsigned char* row, int w, T v) const {
    for (int c = 0; c < copies(); ++c) {
      T* copy = reinterpret_cast<T*>(row + c * copy_bytes) - (c << unit_log2);
      if (w >= (c << unit_log2)) copy[w] = v;
      if (w < EPL - 1) copy[W + w] = v;
    }
  }
  // The EPL entries from column w (a multiple of the unit, below W).
  __device__ Vector<T, EPL> pack(const unsigned char* row, int w) const {
    const int shift = w & (EPL - 1);
    return *reinterpret_cast<const Vector<T, EPL>*>(row + (shift >> unit_log2) * copy_bytes +
                                                    (w - shift) * static_cast<int>(sizeof(T)));
  }
  // Entry w alone (copy 0).
  __device__ T at(const unsigned char* row, int w) const { return reinterpret_cast<const T*>(row)[w]; }
};

// grad_x as the non-overlapping backward kernel computes it, for a contiguous
// grad_x whose rows span at least one store block. Row groups are numbered
// plane by plane (group g = (b * C + c) * row_groups + j), and block i takes
// the groups [G * i / n, G * (i + 1) / n) of G, n blocks: equal shares, each
// written front to back, in units of `unit_groups` groups. A unit's sigmoid
// rows (rows follow groups: one per group in a window) and the next group's
// are bulk-copied into shared memory two units ahead, a large read among the
// writes instead of one per group (H200, 382 columns: 1.335 ms against 1.426
// with warps in a grid-stride loop loading their groups' rows). The warps
// take the unit's groups in turn and write each from the first block boundary
// at or after its start to the first at or after the next group's start (its
// own elements but the head, then the next group's head, less than a block),
// so every block is written whole by one warp, lane l the 16 bytes at 16 * l
// of each.
// The block's column table gives each column's window (W.out where it has
// none), as a byte offset into a row of values: the warp's holds grad *
// factor of each window of its group (from its saved sigmoid), then a 0. The
// rows of a group in its window read that row, the others the block's row of
// zeros.
template <typename scalar_t>
__global__ void __launch_bounds__(32 * kAlignedWarps, 1)
    backward_aligned_runs_kernel(AlignedRunsArgs<scalar_t> a, scalar_t* __restrict__ grad_x,
                                 int64_t groups, int unit_groups, int sigmoid_buffer_bytes) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int EPL = 16 / sizeof(scalar_t);  // elements per lane and store
  constexpr int kBlock = kStoreBlockBytes / sizeof(scalar_t);
  constexpr int kStep = 32 * EPL;
  static_assert(kStep == kBlock);
  using pack_t = Vector<scalar_t, EPL>;
  const PoolDim& gw = a.g.w;
  const int W = gw.in, OW = gw.out, OH = a.g.h.out;
  const ShiftedRow<int, EPL> table(W);
  constexpr int kSize = sizeof(scalar_t);
  // Shared memory: two barriers, the column table, the zero row, a value row
  // per warp, two sigmoid buffers.
  extern __shared__ __align__(16) unsigned char smem[];
  uint64_t* const loaded = reinterpret_cast<uint64_t*>(smem);
  unsigned char* const window = smem + 16;
  const int row_bytes = a.value_row_elements() * kSize;
  // The rows as byte offsets in smem.
  const int zero_row = 16 + table.bytes();
  const int value_row = zero_row + (threadIdx.y + 1) * row_bytes;
  scalar_t* const values = reinterpret_cast<scalar_t*>(smem + value_row);
  acc_t* const buffers = reinterpret_cast<acc_t*>(smem + zero_row + (kAlignedWarps + 1) * row_bytes);
  const int buffer_elements = sigmoid_buffer_bytes / sizeof(acc_t);
  const int tid = threadIdx.y * 32 + threadIdx.x;
  for (int w = tid; w < W; w += 32 * blockDim.y) {
    const int q = gw.first_window(w);
    table.store(window, w, (q < gw.last_window(w) ? q : gw.out) * kSize);
  }
  for (int i = tid; i < row_bytes / 16; i += 32 * blockDim.y) {
    reinterpret_cast<int4*>(smem + zero_row)[i] = int4{0, 0, 0, 0};
  }
  if (threadIdx.x == 0) values[gw.out] = scalar_t(0);
  if (tid == 0) {
    barrier_init(&loaded[0]);
    barrier_init(&loaded[1]);
  }
  __syncthreads();

  // Sigmoid row of group g (of the group after it if g is in no window): the
  // rows of a run of groups are consecutive, at most one per group.
  auto sigmoid_row = [&](int64_t g) {
    const int64_t plane = g / a.row_groups;
    return plane * OH + min(static_cast<int>(g - plane * a.row_groups), OH);
  };
  const int64_t total_rows = a.batch * a.channels * OH;
  const int64_t first = groups * blockIdx.x / gridDim.x, last = groups * (blockIdx.x + 1) / gridDim.x;
  // Unit k: groups [g0, g1), sigmoid rows [r0, r1) (the next group's row too).
  struct Unit {
    int64_t g0, g1, r0, r1;
  };
  auto unit = [&](int k) {
    Unit t;
    t.g0 = first + static_cast<int64_t>(k) * unit_groups;
    t.g1 = min(t.g0 + unit_groups, last);
    t.r0 = sigmoid_row(t.g0);
    t.r1 = min(sigmoid_row(t.g1) + 1, total_rows);
    return t;
  };
  const int units = static_cast<int>((last - first + unit_groups - 1) / unit_groups);
  auto issue = [&](int k) {  // warp 0: unit k's sigmoid rows into buffer k % 2
    if (k < units) {
      const Unit t = unit(k);
      bulk_load_async(buffers + (k & 1) * buffer_elements, a.sigmoid_saved + t.r0 * OW,
                      static_cast<int>(t.r1 - t.r0) * OW, &loaded[k & 1]);
    }
  };
  if (threadIdx.y == 0) {
    issue(0);
    issue(1);
  }

  const int lane = threadIdx.x;
  auto block_up = [](int64_t o) { return (o + kBlock - 1) / kBlock * kBlock; };
  for (int k = 0; k < units; ++k) {
    const Unit t = unit(k);
    const acc_t* const sigmoids =
        bulk_load_destination(buffers + (k & 1) * buffer_elements, a.sigmoid_saved + t.r0 * OW);
    barrier_wait(&loaded[k & 1], (k >> 1) & 1);
    // The warp's first group of the unit as (plane, j), then stepping kAlignedWarps.
    int64_t plane = (t.g0 + threadIdx.y) / a.row_groups;
    int j = static_cast<int>(t.g0 + threadIdx.y - plane * a.row_groups);
    for (int64_t g = t.g0 + threadIdx.y; g < t.g1; g += kAlignedWarps) {
      const int64_t b = plane / a.channels;
      const int c = static_cast<int>(plane - b * a.channels);
      const RowGroup<acc_t> cur = a.group(b, c, j);
      const RowGroup<acc_t> next = a.group_after(b, c, j);
      // Rows of cur and next (in shared memory if below r1).
      const int64_t row = plane * OH + min(j, OH);
      const int64_t next_row = j + 1 < a.row_groups ? row + (j + 1 <= OH) : (plane + 1) * OH;
      if (cur.window_rows > 0) {
        const acc_t* const s_row = sigmoids + (row - t.r0) * OW;
        for (int q = lane; q < OW; q += 32) values[q] = static_cast<scalar_t>(cur.grad * a.g.factor(s_row[q], j, q));
      }
      __syncwarp();
      // This warp's run, as offsets from the group's start: [lo, hi); the
      // group's own elements end at own_end, the next group's head follows.
      const int own_end = cur.rows * W;
      const int lo = static_cast<int>(block_up(cur.start) - cur.start);
      const int hi = static_cast<int>((next.rows > 0 ? block_up(next.start) : a.numel) - cur.start);
      // The lane's pack that reaches past own_end (if below hi): the factors of
      // the head's elements in it (0 outside the windows), used at the run's end.
      const int o0 = lo + EPL * lane;
      const int o_head = o0 + max(own_end - EPL + 1 - o0 + kStep - 1, 0) / kStep * kStep;
      const acc_t* const next_sigmoids = next_row < t.r1 ? sigmoids + (next_row - t.r0) * OW : next.sigmoids;
      const int next_j = j + 1 < a.row_groups ? j + 1 : 0;  // (its window row, where it has one)
      acc_t head[EPL];
#pragma unroll
      for (int e = 0; e < EPL; ++e) {
        const int col = o_head + e - own_end;
        const int q = col >= 0 && o_head + e < hi && next.window_rows > 0 ? table.at(window, col) / kSize : gw.out;
        head[e] = q < gw.out ? a.g.factor(next_sigmoids[q], next_j, q) : acc_t(0);
      }
      int o = o0, i = 0, w = o;
      while (w >= W) w -= W, ++i;
      scalar_t* gx = grad_x + cur.start;
      while (o < hi) {
        pack_t value[kStoresInFlight<scalar_t>];
        int store_at[kStoresInFlight<scalar_t>];
#pragma unroll
        for (int u = 0; u < kStoresInFlight<scalar_t>; ++u) {
          store_at[u] = o;
          // Row i's values (the window's rows: the value row, then the zero row);
          // a pack running on into row i + 1 of the group reads that row's
          // windows from the table's extension.
          const int row = i < cur.window_rows ? value_row : zero_row;
          const int row_after = i + 1 < cur.window_rows ? value_row : zero_row;
          const Vector<int, EPL> offset = table.pack(window, w);
          auto value_at = [&](int r, int off) { return *reinterpret_cast<const scalar_t*>(smem + r + off); };
          if (o + EPL <= own_end && (w <= W - EPL || row == row_after)) {
#pragma unroll
            for (int e = 0; e < EPL; ++e) value[u].v[e] = value_at(row, offset.v[e]);
          } else {  // across a row end between a window row and a zero row, or into the head
#pragma unroll
            for (int e = 0; e < EPL; ++e) {
              value[u].v[e] = o + e >= own_end ? static_cast<scalar_t>(next.grad * head[e])
                                               : value_at(w + e < W ? row : row_after, offset.v[e]);
            }
          }
          o += kStep;
          w += kStep;
          if (w >= W) w -= W, ++i;  // kStep < W: at most one row end per step
        }
#pragma unroll
        for (int u = 0; u < kStoresInFlight<scalar_t>; ++u) {
          if (store_at[u] + EPL <= hi) {
            store_streaming(reinterpret_cast<pack_t*>(gx + store_at[u]), value[u]);
          } else {
#pragma unroll
            for (int e = 0; e < EPL; ++e) {
              if (store_at[u] + e < hi) gx[store_at[u] + e] = value[u].v[e];
            }
          }
        }
      }
      __syncwarp();
      j += kAlignedWarps;
      while (j >= a.row_groups) j -= a.row_groups, ++plane;
    }
    __syncthreads();  // buffer k % 2 is read: load unit k + 2 into it
    if (threadIdx.y == 0) issue(k + 2);
  }
}

std::tuple<at::Tensor, at::Tensor> avg_pool2d_sigmoid_sum_cuda(
    const at::Tensor& x, at::IntArrayRef kernel_size, at::IntArrayRef stride,
    at::IntArrayRef padding, bool ceil_mode, bool count_include_pad,
    std::optional<int64_t> divisor_override, bool save_sigmoid,
    std::optional<at::ScalarType> dtype) {
  const auto g = avg_pool2d_sigmoid_sum_geometry(x, kernel_size, stride, padding, ceil_mode,
                                                 count_include_pad, divisor_override);
  at::Tensor out, sigmoid_saved;  // (no structured binding: lambdas capture them, C++20 only)
  std::tie(out, sigmoid_saved) = avg_pool2d_sigmoid_sum_outputs(x, g, save_sigmoid, dtype);
  const int64_t B = x.size(0);
  if (B == 0) return {out, sigmoid_saved};
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
    const PlaneRows gl = save_sigmoid ? plane_rows(sigmoid_saved, channels_last) : xl;
    dispatch_vector_width<scalar_t>(vec, [&](auto VEC) {
      const auto kernel = forward_kernel<scalar_t, VEC>;
      kernel<<<grid_stride_blocks(kernel, 32 * warps, smem, B * parts, warps), dim3(32, warps), smem, stream>>>(
          x.const_data_ptr<scalar_t>(), xl, g,
          save_sigmoid ? sigmoid_saved.mutable_data_ptr<acc_t>() : nullptr, gl,
          partial.mutable_data_ptr<acc_t>(), B * parts, tiles_w, tile_ow, span);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    dispatch_scalar_or_acc<scalar_t>(out.scalar_type(), [&](auto* tag) {
      using out_t = std::remove_pointer_t<decltype(tag)>;
      sum_rows_kernel<acc_t, out_t><<<static_cast<unsigned>(B), 256, 0, stream>>>(
          partial.const_data_ptr<acc_t>(), parts, out.mutable_data_ptr<out_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {out, sigmoid_saved};
}

at::Tensor avg_pool2d_sigmoid_sum_backward_cuda(const at::Tensor& grad_out,
                                                const at::Tensor& sigmoid_saved,
                                                at::IntArrayRef input_hw,
                                                at::IntArrayRef kernel_size,
                                                at::IntArrayRef stride, at::IntArrayRef padding,
                                                bool count_include_pad,
                                                std::optional<int64_t> divisor_override,
                                                bool channels_last) {
  auto args = avg_pool2d_sigmoid_sum_backward_setup(grad_out, sigmoid_saved, input_hw, kernel_size, stride,
                                                    padding, count_include_pad, divisor_override, channels_last);
  at::Tensor& grad_x = args.grad_x;
  const AvgPool2dGeometry& g = args.g;
  if (grad_x.numel() == 0) return grad_x;
  const c10::cuda::CUDAGuard guard(grad_x.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const PlaneRows xl = plane_rows(grad_x, channels_last);
  const PlaneRows gl = plane_rows(args.sigmoid, channels_last);
  const bool overlap = g.h.kernel > g.h.stride || g.w.kernel > g.w.stride;
  // Row groups (the kernel's doc comment), enough to cover the input.
  const int row_groups = overlap ? g.h.in : (g.h.in + g.h.pad + g.h.stride - 1) / g.h.stride;
  const int64_t items = grad_x.size(0) * xl.planes_per_batch * row_groups;

  FUSED_OPS_DISPATCH_FLOATING_TYPES(grad_out.scalar_type(), "avg_pool2d_sigmoid_sum_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    // Contiguous grad_x whose rows span a store block but not whole blocks
    // (whole-block rows the row-group kernel writes aligned already, and
    // faster: 1.48 against 1.61 ms at 384 columns; at 382 1.87 against 1.61),
    // on a device with the bulk copy engine, with room in shared memory for
    // two sigmoid rows per buffer: the aligned-runs kernel (the saved sigmoid's rows
    // follow its row groups, one after another).
    const AlignedRunsArgs<scalar_t> a{grad_out.const_data_ptr<scalar_t>(), grad_out.stride(0),
                                      args.sigmoid.const_data_ptr<acc_t>(), gl, g,
                                      static_cast<int>(grad_x.size(1)), row_groups, grad_x.size(0),
                                      grad_x.numel()};
    const size_t row_bytes = xl.cols * sizeof(scalar_t);
    const bool aligned_runs = !overlap && grad_x.is_contiguous() && args.sigmoid.is_contiguous() &&
                              row_bytes > kStoreBlockBytes &&
                              row_bytes % kStoreBlockBytes != 0 &&
                              reinterpret_cast<uintptr_t>(grad_x.const_data_ptr()) % kStoreBlockBytes == 0;
    if (aligned_runs) {
      // Shared memory: the table and value rows, then two sigmoid buffers of
      // unit_groups + 1 rows and 16 bytes each, as large as the device allows.
      const auto kernel = backward_aligned_runs_kernel<scalar_t>;
      const int64_t budget = std::min<int64_t>(
          kAlignedRunsSmemBytes, device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, current_device()));
      const int64_t fixed = 16 + ShiftedRow<int, 16 / sizeof(scalar_t)>(xl.cols).bytes() +
                            (kAlignedWarps + 1) * a.value_row_elements() * sizeof(scalar_t);
      const int64_t sigmoid_row_bytes = g.w.out * sizeof(acc_t);
      const int64_t unit_groups = ((budget - fixed) / 2 / 16 * 16 - 16) / sigmoid_row_bytes - 1;
      if (unit_groups >= 1 && runs_bulk_copy(kernel)) {
        const int buffer_bytes = static_cast<int>((budget - fixed) / 2 / 16 * 16);
        const size_t smem = fixed + 2 * buffer_bytes;
        const int64_t groups = grad_x.size(0) * xl.planes_per_batch * row_groups;
        allow_dynamic_shared_memory(kernel, smem);
        const unsigned blocks = grid_stride_blocks(kernel, 32 * kAlignedWarps, smem, groups, 1);
        kernel<<<blocks, dim3(32, kAlignedWarps), smem, stream>>>(
            a, grad_x.mutable_data_ptr<scalar_t>(), groups,
            static_cast<int>(std::min<int64_t>(unit_groups, groups)), buffer_bytes);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        return;
      }
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
            args.sigmoid.const_data_ptr<acc_t>(), gl, g, grad_x.mutable_data_ptr<scalar_t>(),
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
