// A 4-D (B, C, H, W) tensor seen by the CUDA kernels as planes of H rows of
// `cols` columns, so that one kernel reads either layout in place:
//   plain strides:  plane = (b, c), column = w (at any stride);
//   channels_last:  plane = b, column = w * C + c (contiguous, C channels
//                   interleaved in each row).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace fused_ops {

struct PlaneRows {
  int64_t planes_per_batch;  // C, or 1 for channels_last
  int inner;                 // channels interleaved in a row: 1, or C
  int cols;                  // columns per row: W, or W * C
  int64_t batch_stride, channel_stride, row_stride, col_stride;

  // Offset of plane `p` of batch element `b` (p < planes_per_batch).
  __host__ __device__ int64_t plane_offset(int64_t b, int64_t p) const {
    return b * batch_stride + p * channel_stride;
  }
};

inline PlaneRows plane_rows(const at::Tensor& t, bool channels_last) {
  const int64_t C = t.size(1), W = t.size(3);
  TORCH_CHECK_VALUE(W * (channels_last ? C : 1) < (int64_t{1} << 31),
                    "fused_ops: rows of 2^31 elements or more are not supported");
  if (channels_last) {
    return {1, static_cast<int>(C), static_cast<int>(W * C), t.stride(0), 0, t.stride(2), 1};
  }
  return {C, 1, static_cast<int>(W), t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

// Work items numbered in (outer, mid, inner) order, stepped through one at a
// time without divisions (a block takes a contiguous range of them).
struct ItemCursor {
  int64_t outer;
  int mid, inner;
  int mids, inners;

  __device__ ItemCursor(int64_t item, int mids_, int inners_) : mids(mids_), inners(inners_) {
    inner = static_cast<int>(item % inners);
    item /= inners;
    mid = static_cast<int>(item % mids);
    outer = item / mids;
  }
  __device__ void next() {
    if (++inner == inners) {
      inner = 0;
      if (++mid == mids) {
        mid = 0;
        ++outer;
      }
    }
  }
};

// The contiguous share [first, last) of `items` that block `block` of `blocks` takes.
__device__ inline void block_share(int64_t items, int block, int blocks, int64_t& first,
                                   int64_t& last) {
  first = items * block / blocks;
  last = items * (block + 1) / blocks;
}

// The widest vector (in elements, at most 16 bytes) in which every row of t
// can be read or written: contiguous columns, aligned row starts.
template <typename scalar_t>
int vector_width(const PlaneRows& l, const void* data) {
  if (l.col_stride != 1) return 1;
  int v = 16 / static_cast<int>(sizeof(scalar_t));
  auto aligned = [&](int64_t n) { return n % v == 0; };
  while (v > 1 && !(aligned(l.cols) && aligned(l.row_stride) && aligned(l.batch_stride) &&
                    aligned(l.channel_stride) &&
                    reinterpret_cast<uintptr_t>(data) % (v * sizeof(scalar_t)) == 0)) {
    v /= 2;
  }
  return v;
}

// Calls f(std::integral_constant<int, VEC>{}) for the run-time width `vec`,
// instantiating only widths of at most 16 bytes of scalar_t.
template <typename scalar_t, typename F>
void dispatch_vector_width(int vec, F&& f) {
  constexpr int kMax = 16 / sizeof(scalar_t);
  switch (vec) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: if constexpr (kMax >= 2) return f(std::integral_constant<int, 2>{}); break;
    case 4: if constexpr (kMax >= 4) return f(std::integral_constant<int, 4>{}); break;
    case 8: if constexpr (kMax >= 8) return f(std::integral_constant<int, 8>{}); break;
  }
  TORCH_CHECK(false, "fused_ops: unsupported vector width ", vec);
}

// VEC elements moved as one aligned access.
template <typename scalar_t, int VEC>
struct alignas(sizeof(scalar_t) * VEC) Vector {
  scalar_t v[VEC];
};

}  // namespace fused_ops
