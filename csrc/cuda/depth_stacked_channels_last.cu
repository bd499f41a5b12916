// CUDA kernel of depth_stacked_channels_last (the math:
// ../depth_stacked_channels_last.h): a gather, memory-bound. Each thread
// writes one aligned vector of VEC consecutive outputs of one position
// (n, m, h, w) (VEC consecutive (a, i); R = taps * I of them per position) and
// reads its VEC inputs x[n, i, d(m, a), h', w'] where they are (0 outside x,
// any strides). A block's threads cover positions_per_block consecutive
// positions, so a warp's stores are one contiguous run of out and its loads
// touch VEC channel planes at a few neighbouring w: the sectors they fetch
// serve the neighbouring threads' loads from L1/L2, and x comes from HBM about
// once. No shared memory, no barriers; a grid-stride loop over position
// groups. (A version staging a tile of rows in shared memory between two
// barriers ran at a quarter of copy bandwidth: NOTES.md.)
#include <ATen/core/Tensor.h>
#include <ATen/cuda/detail/IntegerDivider.cuh>
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

using at::cuda::detail::IntDivider;

constexpr int kThreads = 256;

// x's strides, in elements.
struct XStrides {
  int64_t n, i, d, h, w;
};

// Run-time divisors: a thread's slot j in the block -> (position, vector) by
// `vectors` (R / VEC); a position -> (n, m, h, w) by Ws, Hs and M; an index of
// (a, i) -> (a, i) by I.
struct StackDividers {
  IntDivider<unsigned> vectors, width, height, depth, channels;
};

template <typename in_t, typename out_t, int VEC>
__global__ void __launch_bounds__(kThreads) depth_stack_kernel(const in_t* __restrict__ x, XStrides xs, DepthStack s,
                                                              StackDividers div, int positions_per_block,
                                                              int64_t groups, out_t* __restrict__ out) {
  const int R = static_cast<int>(s.rows()), I = static_cast<int>(s.channels);
  const int64_t positions = s.batch * s.size[0] * s.size[1] * s.size[2];
  const int slots = positions_per_block * static_cast<int>(div.vectors.divisor);
  for (int64_t group = blockIdx.x; group < groups; group += gridDim.x) {
    for (int j = threadIdx.x; j < slots; j += kThreads) {
      const auto slot = div.vectors.divmod(static_cast<unsigned>(j));  // (position in the group, vector)
      const int64_t position = group * positions_per_block + slot.div;
      if (position >= positions) break;  // (later slots lie further on)
      const auto w = div.width.divmod(static_cast<unsigned>(position));  // positions < 2^31 (host check)
      const auto h = div.height.divmod(w.div);
      const auto m = div.depth.divmod(h.div);
      const int64_t d0 = s.start[0] + s.stride * static_cast<int64_t>(m.mod);
      const int64_t hh = s.start[1] + h.mod, ww = s.start[2] + w.mod;
      const bool row_inside = index_inside(hh, s.input[1]) && index_inside(ww, s.input[2]);
      const in_t* const column = x + static_cast<int64_t>(m.div) * xs.n + hh * xs.h + ww * xs.w;
      const int first = static_cast<int>(slot.mod) * VEC;  // (a, i) of the vector's first element
      const auto ai = div.channels.divmod(static_cast<unsigned>(first));
      int a = static_cast<int>(ai.div), i = static_cast<int>(ai.mod);
      Vector<out_t, VEC> values;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const int64_t d = d0 + a;
        values.v[e] = row_inside && index_inside(d, s.input[0]) ? c10::convert<out_t>(column[d * xs.d + i * xs.i])
                                                                 : out_t(0);
        if (++i == I) {
          i = 0;
          ++a;
        }
      }
      *reinterpret_cast<Vector<out_t, VEC>*>(out + position * R + first) = values;
    }
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
  const int64_t positions = s.batch * s.size[0] * s.size[1] * s.size[2];
  // (IntDivider<unsigned> divides numbers below 2^31)
  constexpr int64_t kLimit = std::numeric_limits<int32_t>::max();
  TORCH_CHECK_VALUE(positions <= kLimit && s.rows() <= kLimit, what,
                    ": the CUDA kernel takes at most 2^31 - 1 output positions (N * M * Hs * Ws) and taps * "
                    "channels, got ", positions, " and ", s.rows());
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const XStrides xs{x.stride(0), x.stride(1), x.stride(2), x.stride(3), x.stride(4)};
  FUSED_OPS_DISPATCH_FLOATING_TYPES(x.scalar_type(), "depth_stacked_channels_last_cuda", [&] {
    using in_t = scalar_t;
    FUSED_OPS_DISPATCH_FLOATING_TYPES(out.scalar_type(), "depth_stacked_channels_last_cuda", [&] {
      using out_t = scalar_t;
      // vectors: whole positions' rows of out (R a multiple of VEC) from an aligned out
      const int vec = aligned_vector_width<out_t>(out.const_data_ptr(), {s.rows()});
      const int64_t vectors = s.rows() / vec;
      // a group: as many whole positions as the block's threads cover, at least one
      const int positions_per_block = static_cast<int>(std::max<int64_t>(kThreads / vectors, 1));
      const int64_t groups = (positions + positions_per_block - 1) / positions_per_block;
      auto divider = [](int64_t d) { return IntDivider<unsigned>(static_cast<unsigned>(d)); };
      const StackDividers div{divider(vectors), divider(s.size[2]), divider(s.size[1]), divider(s.size[0]),
                              divider(s.channels)};
      dispatch_vector_width<out_t>(vec, [&](auto VEC) {
        const auto kernel = depth_stack_kernel<in_t, out_t, VEC>;
        kernel<<<grid_stride_blocks(kernel, kThreads, 0, groups, 1), kThreads, 0, stream>>>(
            x.const_data_ptr<in_t>(), xs, s, div, positions_per_block, groups, out.mutable_data_ptr<out_t>());
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
