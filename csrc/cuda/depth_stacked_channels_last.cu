// CUDA kernel of depth_stacked_channels_last (the math:
// ../depth_stacked_channels_last.h): a transposition through shared memory,
// memory-bound. Item = (n, m, h, tile of w): the block reads the item's
// taps * I input rows x[n, i, d(a), h', w0 : w0 + cols] (consecutive threads
// on consecutive w: coalesced where x's w stride is 1; x is read in place at
// any strides) into a shared tile [a * I + i][w], converting to the output's
// dtype (0 outside x); then, after a barrier, writes the item's cols * taps * I
// output elements, one contiguous run of out (consecutive threads on
// consecutive (w, a, i)); a second barrier before the next item's loads.
// A grid-stride loop over items, one item per block at a time.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/TypeCast.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>

#include "../depth_stacked_channels_last.h"
#include "../dispatch.h"
#include "plane_rows.cuh"

namespace fused_ops {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kTileBytes = 32 * 1024;  // the shared tile's budget

// x's strides, in elements.
struct XStrides {
  int64_t n, i, d, h, w;
};

// tile: the w columns of a whole item (the last item of a row may have
// fewer); ld: the tile's row stride in shared memory, odd, so that the write
// phase's reads down a column (consecutive (a, i) at one w) fall in distinct
// banks. Offsets inside the tile (r * ld + w < taps * I * ld) are int.
template <typename in_t, typename out_t>
__global__ void __launch_bounds__(kThreads) depth_stack_kernel(const in_t* __restrict__ x, XStrides xs,
                                                               DepthStack s, int tile, int ld, int w_tiles,
                                                               int64_t items, out_t* __restrict__ out) {
  extern __shared__ __align__(16) unsigned char smem[];
  out_t* const rows = reinterpret_cast<out_t*>(smem);  // [a * I + i][w], rows ld apart
  const int I = static_cast<int>(s.channels), R = static_cast<int>(s.rows());
  const int Ws = static_cast<int>(s.size[2]);
  int64_t item = blockIdx.x;
  ItemCursor<4> at(item, gridDim.x, {static_cast<int>(s.size[0]), static_cast<int>(s.size[1]), w_tiles});
  for (; item < items; item += gridDim.x, at.next()) {  // item (n, m, h, w tile)
    const int64_t n = at.leading();
    const int w0 = at[3] * tile, cols = min(tile, Ws - w0);
    const int64_t d0 = s.start[0] + s.stride * at[1], hh = s.start[1] + at[2], w_first = s.start[2] + w0;
    const bool h_inside = index_inside(hh, s.input[1]);
    const int64_t row_offset = n * xs.n + hh * xs.h;
    for (int f = threadIdx.x; f < R * cols; f += kThreads) {
      const int r = f / cols, w = f - r * cols;
      const int a = r / I, i = r - a * I;
      const int64_t d = d0 + a, ww = w_first + w;
      out_t value(0);
      if (h_inside && index_inside(d, s.input[0]) && index_inside(ww, s.input[2])) {
        value = c10::convert<out_t>(x[row_offset + i * xs.i + d * xs.d + ww * xs.w]);
      }
      rows[r * ld + w] = value;
    }
    __syncthreads();
    // out[n, m, h, w0 + w, a, i] for w < cols: cols * R consecutive elements
    out_t* const dst = out + (((n * s.size[0] + at[1]) * s.size[1] + at[2]) * Ws + w0) * R;
    for (int f = threadIdx.x; f < cols * R; f += kThreads) {
      const int w = f / R, r = f - w * R;
      dst[f] = rows[r * ld + w];
    }
    __syncthreads();
  }
}

at::Tensor depth_stacked_channels_last_cuda(const at::Tensor& x, int64_t taps, int64_t stride,
                                            at::IntArrayRef start, at::IntArrayRef size,
                                            std::optional<at::ScalarType> dtype) {
  constexpr const char* what = "depth_stacked_channels_last";
  const auto args = depth_stack_setup(x, taps, stride, start, size, dtype);
  const DepthStack& s = args.stack;
  const at::Tensor& out = args.out;
  if (out.numel() == 0) return out;
  TORCH_CHECK_VALUE(*std::max_element(s.size.begin(), s.size.end()) <= std::numeric_limits<int>::max(), what,
                    ": sizes of 2^31 or more are not supported by the CUDA kernel, got ", size);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const XStrides xs{x.stride(0), x.stride(1), x.stride(2), x.stride(3), x.stride(4)};
  FUSED_OPS_DISPATCH_FLOATING_TYPES(x.scalar_type(), "depth_stacked_channels_last_cuda", [&] {
    using in_t = scalar_t;
    FUSED_OPS_DISPATCH_FLOATING_TYPES(out.scalar_type(), "depth_stacked_channels_last_cuda", [&] {
      using out_t = scalar_t;
      // columns: the most w columns of taps * I rows that fit the budget
      const int64_t columns = kTileBytes / (s.rows() * static_cast<int64_t>(sizeof(out_t)));
      TORCH_CHECK_VALUE(columns >= 1, what, ": the CUDA kernel needs taps * channels * the output's element size "
                        "to be at most ", kTileBytes, " bytes, got ", s.taps, " * ", s.channels, " * ",
                        sizeof(out_t));
      int tile = static_cast<int>(std::min(s.size[2], columns));
      if (tile % 2 == 0 && tile + 1 > columns) --tile;  // an even tile's rows are tile + 1 apart
      const int ld = tile | 1;
      const int w_tiles = static_cast<int>((s.size[2] + tile - 1) / tile);
      const size_t smem = static_cast<size_t>(s.rows() * ld) * sizeof(out_t);
      const int64_t items = s.batch * s.size[0] * s.size[1] * w_tiles;
      const auto kernel = depth_stack_kernel<in_t, out_t>;
      kernel<<<grid_stride_blocks(kernel, kThreads, smem, items, 1), kThreads, smem, stream>>>(
          x.const_data_ptr<in_t>(), xs, s, tile, ld, w_tiles, items, out.mutable_data_ptr<out_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("depth_stacked_channels_last", &depth_stacked_channels_last_cuda);
}

}  // namespace fused_ops
