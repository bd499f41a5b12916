// CUDA kernel of depth_stacked_channels_last (the math:
// ../depth_stacked_channels_last.h): a transposition through shared memory,
// memory-bound. Item = (n, m, h, tile of w): the block's 32 x 8 threads read
// the item's taps * I input rows x[n, i, d(a), h', w0 : w0 + cols] (threadIdx.x
// on consecutive w: coalesced where x's w stride is 1; x is read in place at
// any strides; 0 outside x), converted to the output's dtype, into a shared
// tile [w][a * I + i] (rows ld apart); then, after a barrier, write the item's
// cols * taps * I outputs, one contiguous run of out, in vectors of VEC
// elements read whole from the tile's rows; a second barrier before the next
// item's loads. No division per element: (a, i) is split once per row read,
// w once per vector written. A grid-stride loop over items.
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
// fewer); ld: the tile's row stride in elements, a multiple of VEC (rows
// read as whole vectors) and at least taps * I. Offsets inside the tile are int.
template <typename in_t, typename out_t, int VEC>
__global__ void __launch_bounds__(32 * kWarps) depth_stack_kernel(const in_t* __restrict__ x, XStrides xs,
                                                                  DepthStack s, int tile, int ld, int w_tiles,
                                                                  int64_t items, out_t* __restrict__ out) {
  extern __shared__ __align__(16) unsigned char smem[];
  out_t* const rows = reinterpret_cast<out_t*>(smem);  // [w][a * I + i], rows ld apart
  const int I = static_cast<int>(s.channels), R = static_cast<int>(s.rows());
  const int Ws = static_cast<int>(s.size[2]);
  const int vectors_per_row = R / VEC;
  int64_t item = blockIdx.x;
  ItemCursor<4> at(item, gridDim.x, {static_cast<int>(s.size[0]), static_cast<int>(s.size[1]), w_tiles});
  for (; item < items; item += gridDim.x, at.next()) {  // item (n, m, h, w tile)
    const int64_t n = at.leading();
    const int w0 = at[3] * tile, cols = min(tile, Ws - w0);
    const int64_t d0 = s.start[0] + s.stride * at[1], hh = s.start[1] + at[2], w_first = s.start[2] + w0;
    const bool h_inside = index_inside(hh, s.input[1]);
    for (int r = threadIdx.y; r < R; r += kWarps) {  // input row (a, i)
      const int a = r / I, i = r - a * I;
      const int64_t d = d0 + a;
      const bool row_inside = h_inside && index_inside(d, s.input[0]);
      const in_t* const row = x + n * xs.n + i * xs.i + d * xs.d + hh * xs.h;
      for (int w = threadIdx.x; w < cols; w += 32) {
        const int64_t ww = w_first + w;
        rows[w * ld + r] = row_inside && index_inside(ww, s.input[2]) ? c10::convert<out_t>(row[ww * xs.w]) : out_t(0);
      }
    }
    __syncthreads();
    // out[n, m, h, w0 + w, a, i] for w < cols: cols * R consecutive elements, VEC at a time
    out_t* const dst = out + (((n * s.size[0] + at[1]) * s.size[1] + at[2]) * Ws + w0) * R;
    for (int v = threadIdx.y * 32 + threadIdx.x; v < cols * vectors_per_row; v += 32 * kWarps) {
      const int w = v / vectors_per_row, r = (v - w * vectors_per_row) * VEC;
      *reinterpret_cast<Vector<out_t, VEC>*>(dst + w * R + r) = load_vector<out_t, VEC>(rows + w * ld + r);
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
      const size_t smem = static_cast<size_t>(tile * ld) * sizeof(out_t);
      const int64_t items = s.batch * s.size[0] * s.size[1] * w_tiles;
      dispatch_vector_width<out_t>(vec, [&](auto VEC) {
        const auto kernel = depth_stack_kernel<in_t, out_t, VEC>;
        kernel<<<grid_stride_blocks(kernel, 32 * kWarps, smem, items, 1), dim3(32, kWarps), smem, stream>>>(
            x.const_data_ptr<in_t>(), xs, s, tile, static_cast<int>(ld), w_tiles, items,
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
