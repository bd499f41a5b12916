// CUDA kernels of max_pool3d_mean (the math: ../max_pool3d_mean.h).
//
// Forward (pick_kernel): a grid-stride loop of warps, each working alone on
// its own items (plane, pooled depth od, group of kForwardRows pooled rows),
// so that the resident warps read neighbouring rows and no barrier stalls a
// block; lane = pooled column ow. A thread scans its kForwardRows windows
// together in chunks of window positions: all the chunk's loads first
// (branch-free, from clamped addresses), then the compares. For the 2x2x2
// kernel a chunk is the whole window, 16 loads of a vector of 2 along w per
// thread where the layout and the pooling allow, else 32 scalar loads; other
// kernels take chunks of 2 positions (8 loads). x is read once, in place, at
// any strides. Each item's
// picked values, divided by D'H'W', go to partial[item]; sum_rows_kernel
// then adds each plane's partials in a fixed order (deterministic means).
// The same kernel, without partial sums, recomputes the picks for the
// backward.
//
// Backward (gather_kernel): grad_x (contiguous) is written once, in vectors
// along w. Block = (plane, band of input rows (d, h)); thread = a column
// vector (x) walking the band in batches of gather_rows<VEC>() rows
// threadIdx.y + j * blockDim.y (y). A shared table gives, per row of the
// band, the row of picks of the window holding it and the row's scan offset
// inside that window; each thread knows its columns' windows. A thread loads
// the picks of a whole batch (16 elements) before it stores the batch.
// Overlapping windows: each element counts the windows that pick it.
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
#include "../max_pool3d_mean.h"
#include "block_reduce.cuh"
#include "plane_rows.cuh"

namespace fused_ops {
namespace {

constexpr int kThreads = 256;
// pick_kernel: warps per block, each working alone on its own items.
constexpr int kWarps = kThreads / 32;
// The blocks per multiprocessor pick_kernel's register allocation must
// allow: without it nvcc 13 aims at more and interleaves the loads of a chunk
// with the compares (a thread then stalls on its first loads before issuing
// its last); with it all 16 vector loads of the 2x2x2 scan go out first.
constexpr int kPickMinBlocks = 3;
// Pooled rows per pick_kernel thread.
constexpr int kForwardRows = 4;

int pick_row_groups(const MaxPool3dGeometry& g) { return (g.h.out + kForwardRows - 1) / kForwardRows; }
// gather_kernel: the same for its registers; a thread's batch of rows (about
// 16 elements, all their picks loaded before the stores).
constexpr int kGatherMinBlocks = 3;

template <int VEC>
constexpr int gather_rows() {
  return VEC == 1 ? 8 : 16 / VEC;
}

// Input rows per gather_kernel block (one RowWindow of shared memory each):
// 512, or one batch of the block's threads where that is more (a power of two
// either way, at most 256 * 8 rows: 32 KB).
__host__ __device__ constexpr int gather_band_rows(int batch_rows) {
  return batch_rows > 512 ? batch_rows : 512;
}

int pow2_at_least(int n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

// Steps through a window's positions in scan order, a vector of VEC columns
// at a time: (t, r, c) = (depth, row, column) from the window's origin.
struct WindowCursor {
  int t = 0, r = 0, c = 0;

  __device__ void next(int kernel_h, int kernel_w, int vec) {
    c += vec;
    if (c == kernel_w) {
      c = 0;
      if (++r == kernel_h) {
        r = 0;
        ++t;
      }
    }
  }
};

// Every window's pick of x / divisor into picks (when not null; (B, C, D',
// H', W') contiguous) and, per item, the sum of the picked values divided by
// D'H'W' into partial[item] (when not null). KD, KH, KW: the kernel size when
// known at compile time, else 0. VEC > 1: vector loads along w (the host
// checked that every window row starts and ends on a vector boundary, so a
// vector lies wholly inside the input or wholly outside). CLIPPED: windows
// may reach outside the input; without it no load needs a bounds check.
//
// A thread scans its kForwardRows windows in chunks of kChunk positions: it
// loads the chunk's vectors of all its windows, then offers them to the picks
// in scan order. Loads are unconditional, from addresses clamped into the
// input (a position outside it is loaded from its nearest neighbour inside
// and not offered), so that the loads of a chunk form one run.
template <typename scalar_t, typename index_t, int VEC, int KD, int KH, int KW, bool CLIPPED>
__global__ void __launch_bounds__(kThreads, kPickMinBlocks)
    pick_kernel(const scalar_t* __restrict__ x, InputStrides xs, int channels, MaxPool3dGeometry g,
                ReciprocalMultiply<scalar_t> divide, int row_groups, int64_t items,
                index_t* __restrict__ picks, at::opmath_type<scalar_t>* __restrict__ partial) {
  using acc_t = at::opmath_type<scalar_t>;
  // The whole window per chunk where its size is known, else two positions.
  constexpr int kChunk = KD > 0 ? KD * KH * (KW / VEC) : 2;
  const int kh = KH > 0 ? KH : g.h.kernel;
  const int kw = KW > 0 ? KW : g.w.kernel;
  const int positions = (KD > 0 ? KD : g.d.kernel) * kh * (kw / VEC);

  const int lane = threadIdx.x;  // blockDim.x == 32
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.y;
  ItemCursor<4> at(warp, warps, {channels, g.d.out, row_groups});
  for (int64_t item = warp; item < items; item += warps, at.next()) {
    const int od = at[2];
    const scalar_t* xp = x + at.leading() * xs.b + at[1] * xs.c;
    const int64_t plane_od = (at.leading() * channels + at[1]) * g.d.out + od;
    index_t* slice = picks == nullptr ? nullptr : picks + plane_od * g.h.out * g.w.out;
    const int d0 = g.d.origin(od);
    int oh[kForwardRows], h0[kForwardRows];
#pragma unroll
    for (int j = 0; j < kForwardRows; ++j) {
      oh[j] = at[3] * kForwardRows + j;
      // (a row past the last pooled row scans the last one's window, unused)
      h0[j] = g.h.origin(CLIPPED ? oh[j] : ::min(oh[j], g.h.out - 1));
    }

    acc_t total = 0;
    for (int ow = lane; ow < g.w.out; ow += 32) {
      const int w0 = g.w.origin(ow);
      WindowPick<acc_t> pick[kForwardRows];
      WindowCursor cursor;
      for (int p0 = 0; p0 < positions; p0 += kChunk) {
        Vector<scalar_t, VEC> in[kChunk][kForwardRows];
        bool inside[kChunk][kForwardRows];
        int element[kChunk];
#pragma unroll
        for (int q = 0; q < kChunk; ++q) {
          const int d = d0 + cursor.t, w = w0 + cursor.c;
          element[q] = scan_offset(cursor.t, cursor.r, cursor.c, kh, kw);
          if constexpr (CLIPPED) {
            const bool dw_inside =
                p0 + q < positions && d >= 0 && d < g.d.in && w >= 0 && w < g.w.in;
            const int column_offset = ::min(::max(d, 0), g.d.in - 1) * xs.d +
                                      ::min(::max(w, 0), g.w.in - VEC) * xs.w;
#pragma unroll
            for (int j = 0; j < kForwardRows; ++j) {
              const int h = h0[j] + cursor.r;
              inside[q][j] = dw_inside && oh[j] < g.h.out && h >= 0 && h < g.h.in;
              in[q][j] = load_vector<scalar_t, VEC>(
                  xp + (column_offset + ::min(::max(h, 0), g.h.in - 1) * xs.h));
            }
          } else {
#pragma unroll
            for (int j = 0; j < kForwardRows; ++j) {
              inside[q][j] = p0 + q < positions;
              in[q][j] = load_vector<scalar_t, VEC>(xp + (d * xs.d + (h0[j] + cursor.r) * xs.h + w * xs.w));
            }
          }
          cursor.next(kh, kw, VEC);
        }
#pragma unroll
        for (int q = 0; q < kChunk; ++q) {
#pragma unroll
          for (int j = 0; j < kForwardRows; ++j) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              pick[j].update(static_cast<acc_t>(divide(static_cast<acc_t>(in[q][j].v[e]))),
                             element[q] + e, inside[q][j]);
            }
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kForwardRows; ++j) {
        if (oh[j] >= g.h.out) continue;
        total += pick[j].value;
        if (slice != nullptr) slice[oh[j] * g.w.out + ow] = static_cast<index_t>(pick[j].offset);
      }
    }
    if (partial != nullptr) {
      total = warp_sum(total);
      if (lane == 0) partial[item] = total / static_cast<acc_t>(g.pooled_plane());
    }
  }
}

// One row of a gather band: its position, and where its window's picks are.
struct RowWindow {
  int d, h;
  int picks_row;  // offset of the window's row of picks in the plane, or -1: no window
  int offset;     // scan offset of the row's first column inside the window
};

// grad_x[b, c, e] = divide(count(e) * grad_mean[b, c] / N), count(e) the
// windows that pick e, N = D'H'W'. DISJOINT: no element lies in two windows,
// so count(e) is 0 or 1 and one load of picks per element decides it.
// Block: (plane, band of input rows); a thread keeps its column vector and
// walks the band in batches of gather_rows<VEC>() rows.
template <typename scalar_t, typename index_t, int VEC, bool DISJOINT>
__global__ void __launch_bounds__(kThreads, kGatherMinBlocks)
    gather_kernel(const scalar_t* __restrict__ grad_mean, int64_t grad_stride_b,
                  int64_t grad_stride_c, int channels, const index_t* __restrict__ picks,
                  MaxPool3dGeometry g, ReciprocalMultiply<scalar_t> divide, int bands,
                  scalar_t* __restrict__ grad_x) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int kRows = gather_rows<VEC>();
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  RowWindow* rows = reinterpret_cast<RowWindow*>(smem_bytes);
  const int batch_rows = blockDim.y * kRows;
  const int plane_rows = g.d.in * g.h.in;
  const int band = blockIdx.x % bands;
  const int64_t plane = blockIdx.x / bands;
  const int row0 = band * gather_band_rows(batch_rows);
  const int band_rows = min(gather_band_rows(batch_rows), plane_rows - row0);
  // Loaded first: its latency overlaps the table's set-up.
  const acc_t window_grad =
      static_cast<acc_t>(grad_mean[plane / channels * grad_stride_b + plane % channels * grad_stride_c]) /
      static_cast<acc_t>(g.pooled_plane());

  for (int i = threadIdx.y * blockDim.x + threadIdx.x; i < band_rows;
       i += blockDim.x * blockDim.y) {
    RowWindow rw{(row0 + i) / g.h.in, (row0 + i) % g.h.in, -1, 0};
    if (DISJOINT) {
      const int od = g.d.first_window(rw.d), oh = g.h.first_window(rw.h);
      if (od < g.d.last_window(rw.d) && oh < g.h.last_window(rw.h)) {
        rw.picks_row = (od * g.h.out + oh) * g.w.out;
        rw.offset = scan_offset(rw.d - g.d.origin(od), rw.h - g.h.origin(oh), 0, g.h.kernel,
                                g.w.kernel);
      }
    }
    rows[i] = rw;
  }
  __syncthreads();

  const index_t* plane_picks = picks + plane * g.pooled_plane();
  scalar_t* gx = grad_x + (plane * plane_rows + row0) * g.w.in;
  const scalar_t hit = divide(window_grad), miss = divide(acc_t(0));
  for (int v = threadIdx.x; v * VEC < g.w.in; v += blockDim.x) {
    // Per column: its window's column (or -1) and its scan offset inside it.
    int window_col[VEC], col_offset[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const int w = v * VEC + e, ow = g.w.first_window(w);
      window_col[e] = DISJOINT && ow < g.w.last_window(w) ? ow : -1;
      col_offset[e] = w - g.w.origin(ow);
    }
    for (int batch = 0; batch < band_rows; batch += batch_rows) {
      Vector<scalar_t, VEC> out[kRows];
      if constexpr (DISJOINT) {
        // Each element's window's pick, and the pick it would have to be.
        // Loads are unconditional (an element outside every window reads
        // the plane's first pick, and misses), so that they form one run.
        int pick[kRows][VEC], element[kRows][VEC];
#pragma unroll
        for (int j = 0; j < kRows; ++j) {
          const int i = batch + threadIdx.y + j * blockDim.y;
          const RowWindow rw = rows[min(i, band_rows - 1)];
          const bool row_in = i < band_rows && rw.picks_row >= 0;
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            const bool in_window = row_in && window_col[e] >= 0;
            pick[j][e] = plane_picks[in_window ? rw.picks_row + window_col[e] : 0];
            element[j][e] = in_window ? rw.offset + col_offset[e] : -1;
          }
        }
#pragma unroll
        for (int j = 0; j < kRows; ++j) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) out[j].v[e] = pick[j][e] == element[j][e] ? hit : miss;
        }
      } else {
#pragma unroll
        for (int j = 0; j < kRows; ++j) {
          const int i = batch + threadIdx.y + j * blockDim.y;
          if (i >= band_rows) continue;
          const RowWindow rw = rows[i];
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            const int count = pick_count(g, plane_picks, rw.d, rw.h, v * VEC + e);
            out[j].v[e] = count == 0 ? miss : divide(count * window_grad);
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const int i = batch + threadIdx.y + j * blockDim.y;
        if (i < band_rows) {
          *reinterpret_cast<Vector<scalar_t, VEC>*>(gx + static_cast<int64_t>(i) * g.w.in + v * VEC) =
              out[j];
        }
      }
    }
  }
}

// pick_kernel's work items: (plane, od, group of kForwardRows pooled rows),
// each adding a partial mean.
int64_t pick_items_per_plane(const MaxPool3dGeometry& g) {
  return int64_t{g.d.out} * pick_row_groups(g);
}

// x is read in place, unless its strides spread a plane over 2^31 elements or
// more: then from a contiguous copy (whose planes check_plane_size bounds).
template <typename scalar_t, typename index_t>
void launch_pick_kernel(const at::Tensor& x_in, const MaxPool3dGeometry& g, double divisor,
                        index_t* picks, at::opmath_type<scalar_t>* partial, cudaStream_t stream) {
  auto strides = in_plane_strides(x_in);
  const at::Tensor x = strides ? x_in : x_in.contiguous();
  const InputStrides xs = strides ? *strides : *in_plane_strides(x);
  const int64_t items = x.size(0) * x.size(1) * pick_items_per_plane(g);
  auto launch = [&](auto kernel) {
    kernel<<<grid_stride_blocks(kernel, kThreads, 0, items, kWarps), dim3(32, kWarps), 0, stream>>>(
        x.const_data_ptr<scalar_t>(), xs, static_cast<int>(x.size(1)), g,
        ReciprocalMultiply<scalar_t>(divisor), pick_row_groups(g), items, picks, partial);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  // The 2x2x2 kernel (and only it: its picks are bytes) gets an unrolled scan,
  // with vectors of 2 where every window row is an aligned pair.
  if constexpr (sizeof(index_t) == 1) {
    if (g.d.kernel == 2 && g.h.kernel == 2 && g.w.kernel == 2) {
      const bool pairs = xs.w == 1 && aligned_vector_width<scalar_t>(
                                          x.const_data_ptr(), {g.w.in, g.w.stride, g.w.pad, xs.h,
                                                               xs.d, xs.c, xs.b}) >= 2;
      // Windows wholly inside the input need no clipping of their loads.
      const bool clipped = !g.windows_inside();
      if (pairs) {
        launch(clipped ? pick_kernel<scalar_t, index_t, 2, 2, 2, 2, true>
                       : pick_kernel<scalar_t, index_t, 2, 2, 2, 2, false>);
      } else {
        launch(clipped ? pick_kernel<scalar_t, index_t, 1, 2, 2, 2, true>
                       : pick_kernel<scalar_t, index_t, 1, 2, 2, 2, false>);
      }
      return;
    }
  }
  launch(pick_kernel<scalar_t, index_t, 1, 0, 0, 0, true>);
}

template <typename scalar_t, typename index_t>
void launch_gather_kernel(const at::Tensor& grad_mean, const index_t* picks,
                          const MaxPool3dGeometry& g, double divisor, at::Tensor& grad_x,
                          cudaStream_t stream) {
  const int64_t planes = grad_x.size(0) * grad_x.size(1);
  const bool disjoint = g.windows_disjoint();
  const int vec = disjoint ? aligned_vector_width<scalar_t>(grad_x.const_data_ptr(), {g.w.in}) : 1;
  const int block_x = std::min(pow2_at_least((g.w.in + vec - 1) / vec), kThreads);
  const int block_y = kThreads / block_x;
  auto launch = [&](auto kernel, auto VEC) {
    const int band_rows = gather_band_rows(block_y * gather_rows<VEC>());
    const int bands = (g.d.in * g.h.in + band_rows - 1) / band_rows;
    const int64_t blocks = planes * bands;
    TORCH_CHECK_VALUE(blocks <= std::numeric_limits<int>::max(),
                      "max_pool3d_mean_backward: input too large for the CUDA kernel's grid");
    const size_t smem = band_rows * sizeof(RowWindow);
    kernel<<<static_cast<unsigned>(blocks), dim3(block_x, block_y), smem, stream>>>(
        grad_mean.const_data_ptr<scalar_t>(), grad_mean.stride(0), grad_mean.stride(1),
        static_cast<int>(grad_x.size(1)), picks, g, ReciprocalMultiply<scalar_t>(divisor), bands,
        grad_x.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (!disjoint) {
    launch(gather_kernel<scalar_t, index_t, 1, false>, std::integral_constant<int, 1>{});
    return;
  }
  dispatch_vector_width<scalar_t>(vec, [&](auto VEC) {
    launch(gather_kernel<scalar_t, index_t, VEC, true>, VEC);
  });
}

// The kernels index a plane's rows, and a row's elements, with int.
void check_plane_size(const char* what, const MaxPool3dGeometry& g) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(g.d.in) * g.h.in * g.w.in <= std::numeric_limits<int>::max() &&
                        g.pooled_plane() <= std::numeric_limits<int>::max(),
                    what, ": planes (depth x height x width) of 2^31 elements or more are not "
                    "supported by the CUDA kernels");
}

std::tuple<at::Tensor, at::Tensor> max_pool3d_mean_cuda(const at::Tensor& x,
                                                        at::IntArrayRef kernel_size,
                                                        at::IntArrayRef stride,
                                                        at::IntArrayRef padding, bool ceil_mode,
                                                        double divisor, bool save_indices,
                                                        std::optional<at::ScalarType> dtype) {
  const auto g = max_pool3d_mean_geometry(x, kernel_size, stride, padding, ceil_mode, divisor,
                                          save_indices);
  check_plane_size("max_pool3d_mean", g);
  at::Tensor mean, indices;  // (no structured binding: lambdas capture them, C++20 only)
  std::tie(mean, indices) = max_pool3d_mean_outputs(x, g, save_indices, dtype);
  const int64_t planes = x.size(0) * x.size(1);
  if (planes == 0) return {mean, indices};
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  FUSED_OPS_DISPATCH_FLOATING_TYPES(x.scalar_type(), "max_pool3d_mean_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    // One partial mean per pick_kernel item, added per plane by sum_rows_kernel.
    const int64_t parts = pick_items_per_plane(g);
    at::Tensor partial =
        at::empty({planes * parts}, x.options().dtype(at::toOpMathType(x.scalar_type())));
    launch_pick_kernel<scalar_t, uint8_t>(
        x, g, divisor, save_indices ? indices.mutable_data_ptr<uint8_t>() : nullptr,
        partial.mutable_data_ptr<acc_t>(), stream);
    dispatch_scalar_or_acc<scalar_t>(mean.scalar_type(), [&](auto* tag) {
      using out_t = std::remove_pointer_t<decltype(tag)>;
      sum_rows_kernel<acc_t, out_t><<<static_cast<unsigned>(planes), 32, 0, stream>>>(
          partial.const_data_ptr<acc_t>(), parts, mean.mutable_data_ptr<out_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {mean, indices};
}

at::Tensor max_pool3d_mean_backward_cuda(const at::Tensor& grad_mean,
                                         const std::optional<at::Tensor>& indices,
                                         const std::optional<at::Tensor>& x,
                                         at::IntArrayRef input_size, at::IntArrayRef kernel_size,
                                         at::IntArrayRef stride, at::IntArrayRef padding,
                                         bool ceil_mode, double divisor) {
  auto args = max_pool3d_mean_backward_setup(grad_mean, indices, x, input_size, kernel_size,
                                             stride, padding, ceil_mode, divisor);
  const MaxPool3dGeometry& g = args.g;
  check_plane_size("max_pool3d_mean_backward", g);
  if (args.grad_x.numel() == 0) return args.grad_x;
  const c10::cuda::CUDAGuard guard(grad_mean.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  FUSED_OPS_DISPATCH_FLOATING_TYPES(grad_mean.scalar_type(), "max_pool3d_mean_backward_cuda", [&] {
    dispatch_picks(args.picks, [&](auto* picks) {
      if (args.recompute) launch_pick_kernel<scalar_t>(args.x, g, divisor, picks, nullptr, stream);
      launch_gather_kernel<scalar_t>(grad_mean, picks, g, divisor, args.grad_x, stream);
    });
  });
  return args.grad_x;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("max_pool3d_mean", &max_pool3d_mean_cuda);
  m.impl("max_pool3d_mean_backward", &max_pool3d_mean_backward_cuda);
}

}  // namespace fused_ops
