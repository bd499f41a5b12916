// CUDA kernel of depth_stacked_channels_last (the math:
// ../depth_stacked_channels_last.h): a transpose, memory-bound. Each warp takes
// a tile of 32 consecutive output positions (n, m, h, w) and, 32 rows (a, i) at
// a time, stages them in shared memory: lane l loads row (a, i) of position
// l, so a warp's load is 32 consecutive w of one input plane (one 128-byte
// line where x is contiguous along w), 0 outside x, any strides; then the warp
// writes the tile's outputs, each position's rows contiguous, in aligned
// vectors of VEC in order (consecutive lanes, consecutive addresses). Only
// warp barriers; a grid-stride loop over tiles. (A gather, one vector of a
// position's rows per thread, loaded 8 planes x 4 w per warp load and ran at
// 59% of copy bandwidth; a block-wide tile between two block barriers at a
// quarter: NOTES.md.)
// The plain case, x contiguous copied whole (taps 1, stride 1, start 0, size
// x's) with a multiple of 32 channels: x (N, I, S) transposed to (N, S, I), S = D
// H W, by channels_last_kernel, whose loads along S are 16-byte vectors (SPEC's
// B's x on an H200, float32 -> bfloat16: 0.028 ms of kernel, 0.059 a call,
// against 0.073 a call for Tensor.to; float32 -> float32 0.042 of kernel:
// bench/results/profile-B-eval-nvidia-h200-session14.log).
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
constexpr int kWarp = 32;
constexpr int kWarps = kThreads / kWarp;

// Rows (a, i) a warp stages per pass, in the output's type (staging the
// loaded values in float and casting as they are written ran the bfloat16
// copies 15-25% slower): 32 x 33 elements per warp (a padded column: the
// writes' reads of one position's rows fall in distinct banks), half as many
// rows for 8-byte types (34 KB per block at most).
template <typename out_t>
constexpr int kStagedRows = sizeof(out_t) > 4 ? 16 : 32;

// x's strides, in elements.
struct XStrides {
  int64_t n, i, d, h, w;
};

// Run-time divisors: a position -> (n, m, h, w) by Ws, Hs and M; an index of
// (a, i) -> (a, i) by I.
struct StackDividers {
  IntDivider<unsigned> width, height, depth, channels;
};

// Writes `count` positions' staged rows [r0, r0 + vectors_per_position * VEC)
// to out (R per position), in aligned vectors of VEC taken by consecutive
// lanes.
template <typename out_t, int VEC, int ROWS>
__device__ __forceinline__ void write_staged(const out_t (&staged)[ROWS][kWarp + 1], int vectors_per_position,
                                             int count, int lane, out_t* __restrict__ out, int64_t R, int r0) {
  for (int v = lane; v < count * vectors_per_position; v += kWarp) {
    const int p = v / vectors_per_position, row = (v - p * vectors_per_position) * VEC;
    Vector<out_t, VEC> values;
#pragma unroll
    for (int e = 0; e < VEC; ++e) values.v[e] = staged[row + e][p];
    *reinterpret_cast<Vector<out_t, VEC>*>(out + p * R + r0 + row) = values;
  }
}

template <typename in_t, typename out_t, int VEC>
__global__ void __launch_bounds__(kThreads) depth_stack_kernel(const in_t* __restrict__ x, XStrides xs, DepthStack s,
                                                              StackDividers div, int64_t tiles,
                                                              out_t* __restrict__ out) {
  constexpr int ROWS = kStagedRows<out_t>;
  __shared__ out_t stage[kWarps][ROWS][kWarp + 1];
  auto& staged = stage[threadIdx.x / kWarp];
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const int R = static_cast<int>(s.rows()), I = static_cast<int>(s.channels);
  const int64_t positions = s.batch * s.size[0] * s.size[1] * s.size[2];
  for (int64_t tile = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarp; tile < tiles;
       tile += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t first = tile * kWarp;
    const int count = static_cast<int>(std::min<int64_t>(kWarp, positions - first));
    // this lane's position: its column of x, its first depth, whether its (h, w) lies inside x
    const in_t* column = x;
    int64_t d0 = 0;
    bool inside = false;
    if (lane < count) {
      const auto w = div.width.divmod(static_cast<unsigned>(first + lane));  // positions < 2^31 (host check)
      const auto h = div.height.divmod(w.div);
      const auto m = div.depth.divmod(h.div);
      const int64_t hh = s.start[1] + h.mod, ww = s.start[2] + w.mod;
      d0 = s.start[0] + s.stride * static_cast<int64_t>(m.mod);
      inside = index_inside(hh, s.input[1]) && index_inside(ww, s.input[2]);
      column = x + static_cast<int64_t>(m.div) * xs.n + hh * xs.h + ww * xs.w;
    }
    out_t* const tile_out = out + first * R;
    for (int r0 = 0; r0 < R; r0 += ROWS) {
      const int rows = std::min(ROWS, R - r0);
      const auto ai = div.channels.divmod(static_cast<unsigned>(r0));
      int a = static_cast<int>(ai.div), i = static_cast<int>(ai.mod);
#pragma unroll 8
      for (int row = 0; row < rows; ++row) {
        const int64_t d = d0 + a;
        staged[row][lane] = inside && index_inside(d, s.input[0]) ? c10::convert<out_t>(column[d * xs.d + i * xs.i])
                                                                  : out_t(0);
        if (++i == I) {
          i = 0;
          ++a;
        }
      }
      __syncwarp();
      if (rows == ROWS) {  // (a whole pass: the division by a constant)
        write_staged<out_t, VEC>(staged, ROWS / VEC, count, lane, tile_out, R, r0);
      } else {
        write_staged<out_t, VEC>(staged, rows / VEC, count, lane, tile_out, R, r0);
      }
      __syncwarp();
    }
  }
}

// The plain case (module comment): a block takes kPlainPositions positions of one batch element
// (blockIdx.y), 32 channels at a time: loaded along S as 16-byte vectors (a warp's 512 consecutive
// bytes of one channel), staged in shared memory as out_t (a padded row: conflict-free reads across
// channels), then written as 16-byte vectors of one position's consecutive channels.
constexpr int kPlainPositions = 128;

template <typename in_t, typename out_t>
__global__ void __launch_bounds__(kThreads) channels_last_kernel(const in_t* __restrict__ x, int64_t positions,
                                                                 int channels, out_t* __restrict__ out) {
  constexpr int VEC = 16 / sizeof(out_t), kVectors = 32 / VEC;  // per position and 32 channels
  constexpr int VEC_IN = 16 / sizeof(in_t), kRowVectors = kPlainPositions / VEC_IN;  // per channel
  __shared__ out_t tile[32][kPlainPositions + 1];
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kPlainPositions;
  const int count = static_cast<int>(std::min<int64_t>(kPlainPositions, positions - first));
  const in_t* const planes = x + static_cast<int64_t>(blockIdx.y) * channels * positions + first;
  out_t* const rows = out + (static_cast<int64_t>(blockIdx.y) * positions + first) * channels;
  for (int c0 = 0; c0 < channels; c0 += 32) {
    for (int k = threadIdx.x; k < 32 * kRowVectors; k += kThreads) {
      const int c = k / kRowVectors, p = k % kRowVectors * VEC_IN;
      if (p < count) {  // (count a multiple of VEC_IN: plain_channels_last)
        const auto values = load_vector<in_t, VEC_IN>(planes + (c0 + c) * positions + p);
#pragma unroll
        for (int e = 0; e < VEC_IN; ++e) tile[c][p + e] = c10::convert<out_t>(values.v[e]);
      }
    }
    __syncthreads();
    for (int v = threadIdx.x; v < count * kVectors; v += kThreads) {
      const int p = v / kVectors, c = (v % kVectors) * VEC;
      Vector<out_t, VEC> values;
#pragma unroll
      for (int e = 0; e < VEC; ++e) values.v[e] = tile[c + e][p];
      *reinterpret_cast<Vector<out_t, VEC>*>(rows + p * channels + c0 + c) = values;
    }
    __syncthreads();
  }
}

// Whether the call is the plain case channels_last_kernel takes: 16-byte vectors of x's planes and
// of out's rows, the batch its grid's y.
bool plain_channels_last(const at::Tensor& x, const DepthStack& s, const at::Tensor& out) {
  const int64_t plane_bytes = s.input[0] * s.input[1] * s.input[2] * static_cast<int64_t>(x.element_size());
  return s.taps == 1 && s.stride == 1 && s.start == std::array<int64_t, 3>{0, 0, 0} && s.size == s.input &&
         x.is_contiguous() && s.channels % 32 == 0 && s.batch <= 65535 && plane_bytes % 16 == 0 &&
         reinterpret_cast<uintptr_t>(x.const_data_ptr()) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(out.const_data_ptr()) % 16 == 0;
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
  if (plain_channels_last(x, s, out)) {
    const int64_t plane = s.input[0] * s.input[1] * s.input[2];
    FUSED_OPS_DISPATCH_FLOATING_TYPES(x.scalar_type(), "depth_stacked_channels_last_cuda", [&] {
      using in_t = scalar_t;
      FUSED_OPS_DISPATCH_FLOATING_TYPES(out.scalar_type(), "depth_stacked_channels_last_cuda", [&] {
        const dim3 grid(static_cast<unsigned>((plane + kPlainPositions - 1) / kPlainPositions),
                        static_cast<unsigned>(s.batch));
        channels_last_kernel<in_t, scalar_t><<<grid, kThreads, 0, stream>>>(
            x.const_data_ptr<in_t>(), plane, static_cast<int>(s.channels), out.mutable_data_ptr<scalar_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
    return out;
  }
  const XStrides xs{x.stride(0), x.stride(1), x.stride(2), x.stride(3), x.stride(4)};
  FUSED_OPS_DISPATCH_FLOATING_TYPES(x.scalar_type(), "depth_stacked_channels_last_cuda", [&] {
    using in_t = scalar_t;
    FUSED_OPS_DISPATCH_FLOATING_TYPES(out.scalar_type(), "depth_stacked_channels_last_cuda", [&] {
      using out_t = scalar_t;
      // vectors of a position's rows (R a multiple of VEC) from an aligned out
      const int vec = aligned_vector_width<out_t>(out.const_data_ptr(), {s.rows()});
      const int64_t tiles = (positions + kWarp - 1) / kWarp;
      auto divider = [](int64_t d) { return IntDivider<unsigned>(static_cast<unsigned>(d)); };
      const StackDividers div{divider(s.size[2]), divider(s.size[1]), divider(s.size[0]), divider(s.channels)};
      dispatch_vector_width<out_t>(vec, [&](auto VEC) {
        const auto kernel = depth_stack_kernel<in_t, out_t, VEC>;
        kernel<<<grid_stride_blocks(kernel, kThreads, 0, tiles, kWarps), kThreads, 0, stream>>>(
            x.const_data_ptr<in_t>(), xs, s, div, tiles, out.mutable_data_ptr<out_t>());
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
