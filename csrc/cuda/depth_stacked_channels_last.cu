// CUDA kernel of depth_stacked_channels_last (the math:
// ../depth_stacked_channels_last.h): a transposition through shared memory,
// memory-bound. Item = (n, m, tile of h rows, tile of w): where a whole output
// row of w fits the shared budget an item takes as many h rows as fit (w tile
// = the row), else one h row and a tile of w. The block's 32 x 8 threads read
// the item's rows x[n, i, d(a), h', w0 : w0 + cols] for every (h row, a, i)
// (threadIdx.x on consecutive w: coalesced where x's w stride is 1; x is read
// in place at any strides; 0 outside x), converted to the output's dtype, into
// a shared tile [h row][w][a * I + i] (rows ld apart); then, after a barrier,
// write the item's rows * cols * taps * I outputs, one contiguous run of out
// (whole rows of w, or one row's tile), in vectors of VEC elements read whole
// from the tile's rows; a second barrier before the next item's loads. Many
// rows per item put more loads in flight per barrier and make the run long
// (HBM takes writes at full speed in whole 512-byte blocks). A grid-stride
// loop over items.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/TypeCast.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "../depth_stacked_channels_last.h"
#include "../dispatch.h"
#include "plane_rows.cuh"

namespace fused_ops {
namespace {

constexpr int kWarps = 8;
constexpr int64_t kTileBytes = 32 * 1024;  // the shared tile's budget

// x's strides, in elements.
struct XStrides {
  int64_t n, i, d, h, w;
};

// tile: the w columns of a whole item (the last item of a row may have
// fewer); h_tile: its h rows (more than one only where tile is the whole row);
// ld: the tile's row stride in elements, a multiple of VEC (rows read as whole
// vectors) and at least taps * I. Offsets inside the tile are int.
template <typename in_t, typename out_t, int VEC>
__global__ void __launch_bounds__(32 * kWarps) depth_stack_kernel(const in_t* __restrict__ x, XStrides xs,
                                                                  DepthStack s, int tile, int h_tile, int ld,
                                                                  int h_tiles, int w_tiles, int64_t items,
                                                                  out_t* __restrict__ out) {
  extern __shared__ __align__(16) unsigned char smem[];
  out_t* const rows = reinterpret_cast<out_t*>(smem);  // [h row][w][a * I + i], rows ld apart
  const int I = static_cast<int>(s.channels), R = static_cast<int>(s.rows());
  const int Hs = static_cast<int>(s.size[1]), Ws = static_cast<int>(s.size[2]);
  const int vectors_per_row = R / VEC;
  int64_t item = blockIdx.x;
  ItemCursor<4> at(item, gridDim.x, {static_cast<int>(s.size[0]), h_tiles, w_tiles});
  for (; item < items; item += gridDim.x, at.next()) {  // item (n, m, h tile, w tile)
    const int64_t n = at.leading();
    const int h0 = at[2] * h_tile, h_rows = min(h_tile, Hs - h0);
    const int w0 = at[3] * tile, cols = min(tile, Ws - w0);
    const int64_t d0 = s.start[0] + s.stride * at[1], w_first = s.start[2] + w0;
    for (int r = threadIdx.y; r < h_rows * R; r += kWarps) {  // input row (h row, a, i)
      const int hr = r / R, ar = r - hr * R, a = ar / I, i = ar - a * I;
      const int64_t d = d0 + a, hh = s.start[1] + h0 + hr;
      const bool row_inside = index_inside(hh, s.input[1]) && index_inside(d, s.input[0]);
      const in_t* const row = x + n * xs.n + i * xs.i + d * xs.d + hh * xs.h;
      out_t* const tile_row = rows + hr * cols * ld + ar;
      for (int w = threadIdx.x; w < cols; w += 32) {
        const int64_t ww = w_first + w;
        tile_row[w * ld] = row_inside && index_inside(ww, s.input[2]) ? c10::convert<out_t>(row[ww * xs.w]) : out_t(0);
      }
    }
    __syncthreads();
    // out[n, m, h0 + hr, w0 + w, a, i] for hr < h_rows, w < cols: h_rows * cols * R consecutive
    // elements (cols is the whole row where h_rows > 1), VEC at a time
    out_t* const dst = out + (((n * s.size[0] + at[1]) * Hs + h0) * Ws + w0) * R;
    for (int v = threadIdx.y * 32 + threadIdx.x; v < h_rows * cols * vectors_per_row; v += 32 * kWarps) {
      const int q = v / vectors_per_row, r = (v - q * vectors_per_row) * VEC;  // q: (h row, w)
      *reinterpret_cast<Vector<out_t, VEC>*>(dst + q * R + r) = load_vector<out_t, VEC>(rows + q * ld + r);
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
  // (ItemCursor steps its int digits by up to a size: sizes below 2^30 keep the sums in int)
  TORCH_CHECK_VALUE(*std::max_element(s.size.begin(), s.size.end()) < (int64_t{1} << 30), what,
                    ": sizes of 2^30 or more are not supported by the CUDA kernel, got ", size);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const XStrides xs{x.stride(0), x.stride(1), x.stride(2), x.stride(3), x.stride(4)};
  FUSED_OPS_DISPATCH_FLOATING_TYPES(x.scalar_type(), "depth_stacked_channels_last_cuda", [&] {
    using in_t = scalar_t;
    FUSED_OPS_DISPATCH_FLOATING_TYPES(out.scalar_type(), "depth_stacked_channels_last_cuda", [&] {
      using out_t = scalar_t;
      // vectors: whole rows of out (R a multiple of VEC) from an aligned out
      const int vec = aligned_vector_width<out_t>(out.const_data_ptr(), {s.rows()});
      // ld: R rounded up to whole vectors, then the rows an odd number of units apart (16
      // bytes with vectors, else a word or an element): the load phase's threads, on
      // consecutive w, then write to banks at most 4 apart in turn instead of one bank
      const int64_t unit = std::max<int64_t>(vec * sizeof(out_t), 4);
      int64_t ld = (s.rows() + vec - 1) / vec * vec;
      while (ld * static_cast<int64_t>(sizeof(out_t)) % (2 * unit) == 0) ld += vec;
      // tile: the most w columns that fit the budget (at least one: a row over the budget by
      // its padding alone still fits the 48 KB a block may take without opting in)
      TORCH_CHECK_VALUE(s.rows() * static_cast<int64_t>(sizeof(out_t)) <= kTileBytes, what,
                        ": the CUDA kernel needs taps * channels * the output's element size to be at most ",
                        kTileBytes, " bytes, got ", s.taps, " * ", s.channels, " * ", sizeof(out_t));
      const int64_t columns = std::max<int64_t>(kTileBytes / (ld * static_cast<int64_t>(sizeof(out_t))), 1);
      const int tile = static_cast<int>(std::min(s.size[2], columns));
      const int w_tiles = static_cast<int>((s.size[2] + tile - 1) / tile);
      // whole rows of w fit: as many h rows as fit the budget
      const int h_tile = w_tiles == 1 ? static_cast<int>(std::min(s.size[1], columns / tile)) : 1;
      const int h_tiles = static_cast<int>((s.size[1] + h_tile - 1) / h_tile);
      const size_t smem = static_cast<size_t>(h_tile) * tile * ld * sizeof(out_t);
      const int64_t items = s.batch * s.size[0] * h_tiles * w_tiles;
      dispatch_vector_width<out_t>(vec, [&](auto VEC) {
        const auto kernel = depth_stack_kernel<in_t, out_t, VEC>;
        kernel<<<grid_stride_blocks(kernel, 32 * kWarps, smem, items, 1), dim3(32, kWarps), smem, stream>>>(
            x.const_data_ptr<in_t>(), xs, s, tile, h_tile, static_cast<int>(ld), h_tiles, w_tiles, items,
            out.mutable_data_ptr<out_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("depth_stacked_channels_last", &depth_stacked_channels_last_cuda);
}

}  // namespace fused_ops
