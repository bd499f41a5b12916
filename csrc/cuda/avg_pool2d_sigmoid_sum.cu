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

std::tuple<at::Tensor, at::Tensor> avg_pool2d_sigmoid_sum_cuda(
    const at::Tensor& x, at::IntArrayRef kernel_size, at::IntArrayRef stride,
    at::IntArrayRef padding, bool ceil_mode, bool count_include_pad,
    std::optional<int64_t> divisor_override, bool save_grad_factor) {
  const auto g = avg_pool2d_sigmoid_sum_geometry(x, kernel_size, stride, padding, ceil_mode,
                                                 count_include_pad, divisor_override);
  auto [out, grad_factor] = avg_pool2d_sigmoid_sum_outputs(x, g, save_grad_factor);
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
      const int64_t blocks = std::min(resident_blocks(kernel, 32 * warps, smem), (B * parts + warps - 1) / warps);
      kernel<<<static_cast<unsigned>(blocks), dim3(32, warps), smem, stream>>>(
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
