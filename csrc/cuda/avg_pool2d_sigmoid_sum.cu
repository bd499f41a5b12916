// CUDA kernels of avg_pool2d_sigmoid_sum (the math: ../avg_pool2d_sigmoid_sum.h).
//
// Forward: each block takes work items of (plane, blockDim.y pooled rows, a
// tile of pooled columns). Phase 1 sums the window rows of every input column
// of the tile (vector loads along the row) into shared memory; phase 2 sums
// each pooled window's columns from there, applies the divisor and the
// sigmoid, and accumulates. x is read once; per (batch, block) partial sums
// are then added in a fixed order (deterministic results).
//
// Backward: grad_x is written once, in vectors: each thread keeps a column
// vector and walks a band of rows; a shared table gives, per column, the first
// pooled column whose window holds it and how many do.
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

constexpr int kForwardThreads = 512;
constexpr int kBackwardThreads = 256;
// Shared memory for the forward's column sums, per block, at most.
constexpr int kForwardSmemBytes = 32 * 1024;
// Columns per backward tile (its table holds one int2 per column).
constexpr int kBackwardTileCols = 4096;
// Input rows per backward work item.
constexpr int kBackwardBandRows = 64;

int multiprocessor_count() {
  int device = 0, count = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

// Work items of batch element blockIdx.y: (plane, group of blockDim.y pooled
// rows, tile of tile_ow pooled columns); block blockIdx.x takes a contiguous share.
template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kForwardThreads)
    forward_kernel(const scalar_t* __restrict__ x, PlaneRows xl, AvgPool2dGeometry g,
                   at::opmath_type<scalar_t>* __restrict__ grad_factor, PlaneRows gl,
                   at::opmath_type<scalar_t>* __restrict__ partial, int64_t batch,
                   int row_groups, int tiles_w, int tile_ow, int span) {
  using acc_t = at::opmath_type<scalar_t>;
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  acc_t* colsum = reinterpret_cast<acc_t*>(smem_bytes) + threadIdx.y * span;
  __shared__ acc_t scratch[32];

  const int inner = xl.inner;
  int64_t first, last;
  block_share(xl.planes_per_batch * row_groups * tiles_w, blockIdx.x, gridDim.x, first, last);
  for (int64_t b = blockIdx.y; b < batch; b += gridDim.y) {
    acc_t total = 0;
    ItemCursor at(first, row_groups, tiles_w);
    for (int64_t item = first; item < last; ++item, at.next()) {
      const int oh = at.mid * blockDim.y + threadIdx.y;
      const int ow0 = at.inner * tile_ow, ow1 = min(ow0 + tile_ow, g.w.out);
      // The tile's input columns, widened to whole vectors: [v0, v1) * VEC.
      const int v0 = g.w.begin(ow0) * inner / VEC;
      const int v1 = (g.w.end(ow1 - 1) * inner + VEC - 1) / VEC;
      const int base = v0 * VEC;

      if (oh < g.h.out) {
        const scalar_t* xp = x + xl.plane_offset(b, at.outer);
        const int r0 = g.h.begin(oh), r1 = g.h.end(oh);
        for (int v = v0 + threadIdx.x; v < v1; v += blockDim.x) {
          acc_t sum[VEC] = {};
#pragma unroll 4
          for (int r = r0; r < r1; ++r) {
            if constexpr (VEC == 1) {
              sum[0] += static_cast<acc_t>(xp[r * xl.row_stride + v * xl.col_stride]);
            } else {
              const auto in = *reinterpret_cast<const Vector<scalar_t, VEC>*>(
                  xp + r * xl.row_stride + v * VEC);
#pragma unroll
              for (int e = 0; e < VEC; ++e) sum[e] += static_cast<acc_t>(in.v[e]);
            }
          }
#pragma unroll
          for (int e = 0; e < VEC; ++e) colsum[v * VEC + e - base] = sum[e];
        }
      }
      __syncthreads();
      if (oh < g.h.out) {
        const int outputs = (ow1 - ow0) * inner;
        acc_t* gf_row = grad_factor == nullptr
                            ? nullptr
                            : grad_factor + gl.plane_offset(b, at.outer) + oh * gl.row_stride;
        for (int q = threadIdx.x; q < outputs; q += blockDim.x) {
          const int ow = ow0 + q / inner, ci = q % inner;
          acc_t sum = 0;
          for (int w = g.w.begin(ow); w < g.w.end(ow); ++w) sum += colsum[w * inner + ci - base];
          const acc_t divisor = g.divisor<acc_t>(oh, ow);
          const acc_t s = sigmoid(sum / divisor);
          total += s;
          if (gf_row != nullptr) gf_row[ow * inner + ci] = s * (1 - s) / divisor;
        }
      }
      __syncthreads();
    }
    total = block_sum(total, scratch);
    if (threadIdx.x == 0 && threadIdx.y == 0) partial[b * gridDim.x + blockIdx.x] = total;
    __syncthreads();
  }
}

// out[b] = sum of partial[b, :], one warp per batch element, in a fixed order.
template <typename scalar_t>
__global__ void sum_partials_kernel(const at::opmath_type<scalar_t>* __restrict__ partial,
                                    int parts, int64_t batch, scalar_t* __restrict__ out) {
  const int64_t b = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (b >= batch) return;
  const int lane = threadIdx.x & 31;
  at::opmath_type<scalar_t> sum = 0;
  for (int i = lane; i < parts; i += 32) sum += partial[b * parts + i];
  sum = warp_sum(sum);
  if (lane == 0) out[b] = static_cast<scalar_t>(sum);
}

// grad_x[b, c, h, w] = grad_out[b] * sum over windows containing (h, w) of
// grad_factor. Block (blockIdx.x, blockIdx.y) takes column tile blockIdx.x of
// a contiguous share of the (plane, band of input rows) items; each thread
// keeps one column vector and walks the band's rows.
// OVERLAP: windows may overlap (kernel > stride in some dim). Without it each
// element lies in at most one window, and a thread loads grad_factor only when
// its rows enter a new window.
template <typename scalar_t, int VEC, bool OVERLAP>
__global__ void __launch_bounds__(kBackwardThreads)
    backward_kernel(const scalar_t* __restrict__ grad_out, int64_t grad_out_stride,
                    const at::opmath_type<scalar_t>* __restrict__ grad_factor, PlaneRows gl,
                    AvgPool2dGeometry g, scalar_t* __restrict__ grad_x, PlaneRows xl,
                    int64_t planes, int bands) {
  using acc_t = at::opmath_type<scalar_t>;
  // Per column of this block's tile: {offset in a grad_factor row of the
  // first window holding it, number of windows holding it}.
  __shared__ int2 windows[kBackwardTileCols];
  const int inner = xl.inner;
  const int c0 = blockIdx.x * kBackwardTileCols;
  const int tile_cols = min(kBackwardTileCols, xl.cols - c0);
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  for (int i = tid; i < tile_cols; i += blockDim.x * blockDim.y) {
    const int w = (c0 + i) / inner, ci = (c0 + i) % inner;
    const int first = g.w.first_window(w), last = g.w.last_window(w);
    windows[i] = make_int2(first * inner + ci, max(last - first, 0));
  }
  __syncthreads();

  int64_t first, last;
  block_share(planes * bands, blockIdx.y, gridDim.y, first, last);
  ItemCursor at(first, bands, 1);
  for (int64_t item = first; item < last; ++item, at.next()) {
    const int64_t b = at.outer / xl.planes_per_batch, p = at.outer % xl.planes_per_batch;
    const acc_t grad = static_cast<acc_t>(grad_out[b * grad_out_stride]);
    const acc_t* gf = grad_factor + gl.plane_offset(b, p);
    scalar_t* gx = grad_x + xl.plane_offset(b, p) + c0;
    const int h0 = at.mid * kBackwardBandRows + threadIdx.y;
    const int h1 = min((at.mid + 1) * kBackwardBandRows, g.h.in);
    for (int v = threadIdx.x; v * VEC < tile_cols; v += blockDim.x) {
      int2 win[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) win[e] = windows[v * VEC + e];
      Vector<scalar_t, VEC> result;
      if constexpr (OVERLAP) {
        for (int h = h0; h < h1; h += blockDim.y) {
          const int oh0 = g.h.first_window(h), oh1 = g.h.last_window(h);
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            acc_t sum = 0;
            for (int oh = oh0; oh < oh1; ++oh) {
              for (int k = 0; k < win[e].y; ++k) sum += gf[oh * gl.row_stride + win[e].x + k * inner];
            }
            result.v[e] = static_cast<scalar_t>(grad * sum);
          }
          *reinterpret_cast<Vector<scalar_t, VEC>*>(gx + h * xl.row_stride + v * VEC) = result;
        }
      } else {
        // The window holding row h, or the next one below it.
        int oh = g.h.first_window(h0);
        acc_t value[VEC];
        auto load = [&] {
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            value[e] = oh < g.h.out && win[e].y > 0 ? grad * gf[oh * gl.row_stride + win[e].x] : acc_t(0);
          }
        };
        load();
        for (int h = h0; h < h1; h += blockDim.y) {
          if (oh < g.h.out && h >= g.h.origin(oh) + g.h.kernel) {
            oh = g.h.first_window(h);
            load();
          }
          const bool inside = oh < g.h.out && h >= g.h.origin(oh);
#pragma unroll
          for (int e = 0; e < VEC; ++e) result.v[e] = static_cast<scalar_t>(inside ? value[e] : acc_t(0));
          *reinterpret_cast<Vector<scalar_t, VEC>*>(gx + h * xl.row_stride + v * VEC) = result;
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
    // Threads: x along a row's vectors, y over pooled rows.
    const int row_vectors = (xl.cols + vec - 1) / vec;
    const int block_x = std::min(kForwardThreads, (row_vectors + 31) / 32 * 32);
    const int block_y = std::max(1, std::min(kForwardThreads / block_x, g.h.out));
    // Pooled columns per tile so that a tile's input columns fit in shared memory.
    const int span_cap = kForwardSmemBytes / static_cast<int>(sizeof(acc_t)) / block_y;
    TORCH_CHECK_VALUE(span_cap - 2 * vec >= inner * g.w.kernel,
                      "avg_pool2d_sigmoid_sum: kernel width ", g.w.kernel,
                      (inner > 1 ? " times channels " : ""), (inner > 1 ? inner : 1),
                      " is too large for the CUDA kernel's shared memory");
    const int tile_ow = static_cast<int>(std::min<int64_t>(
        ((span_cap - 2 * vec) / inner - g.w.kernel) / g.w.stride + 1, g.w.out));
    const int span = std::min(span_cap, ((tile_ow - 1) * g.w.stride + g.w.kernel) * inner + 2 * vec);
    const int tiles_w = (g.w.out + tile_ow - 1) / tile_ow;
    const int row_groups = (g.h.out + block_y - 1) / block_y;
    const int64_t items_per_batch = xl.planes_per_batch * row_groups * tiles_w;
    // About four resident waves of blocks over the whole batch.
    const int64_t target = int64_t{4} * multiprocessor_count() * (2048 / (block_x * block_y));
    const int grid_x = static_cast<int>(std::clamp<int64_t>((target + B - 1) / B, 1, items_per_batch));
    const int grid_y = static_cast<int>(std::min<int64_t>(B, 65535));
    auto partial = at::empty({B, grid_x}, x.options().dtype(at::toOpMathType(x.scalar_type())));
    const PlaneRows gl = save_grad_factor ? plane_rows(grad_factor, channels_last) : xl;
    const size_t smem = static_cast<size_t>(span) * block_y * sizeof(acc_t);
    dispatch_vector_width<scalar_t>(vec, [&](auto VEC) {
      forward_kernel<scalar_t, VEC><<<dim3(grid_x, grid_y), dim3(block_x, block_y), smem, stream>>>(
          x.const_data_ptr<scalar_t>(), xl, g,
          save_grad_factor ? grad_factor.mutable_data_ptr<acc_t>() : nullptr, gl,
          partial.mutable_data_ptr<acc_t>(), B, row_groups, tiles_w, tile_ow, span);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    sum_partials_kernel<scalar_t><<<(B * 32 + 255) / 256, 256, 0, stream>>>(
        partial.const_data_ptr<acc_t>(), grid_x, B, out.mutable_data_ptr<scalar_t>());
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
  const int64_t planes = grad_x.size(0) * xl.planes_per_batch;
  const int bands = (g.h.in + kBackwardBandRows - 1) / kBackwardBandRows;
  const bool overlap = g.h.kernel > g.h.stride || g.w.kernel > g.w.stride;

  FUSED_OPS_DISPATCH_FLOATING_TYPES(grad_out.scalar_type(), "avg_pool2d_sigmoid_sum_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    // The tile width is a multiple of every vector width, so tiles stay aligned.
    const int vec = vector_width<scalar_t>(xl, grad_x.const_data_ptr());
    const int tile_cols = std::min(kBackwardTileCols, xl.cols);
    const int block_x = std::min(kBackwardThreads, (tile_cols / vec + 31) / 32 * 32);
    const int block_y = kBackwardThreads / block_x;
    const int tiles = (xl.cols + kBackwardTileCols - 1) / kBackwardTileCols;
    const int64_t target = int64_t{4} * multiprocessor_count() * (2048 / (block_x * block_y));
    const int grid_y = static_cast<int>(
        std::clamp<int64_t>((target + tiles - 1) / tiles, 1, std::min<int64_t>(planes * bands, 65535)));
    dispatch_vector_width<scalar_t>(vec, [&](auto VEC) {
      auto launch = [&](auto kernel) {
        kernel<<<dim3(tiles, grid_y), dim3(block_x, block_y), 0, stream>>>(
            grad_out.const_data_ptr<scalar_t>(), grad_out.stride(0),
            args.grad_factor.const_data_ptr<acc_t>(), gl, g, grad_x.mutable_data_ptr<scalar_t>(),
            xl, planes, bands);
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
