// A 4-D (B, C, H, W) tensor seen by the CUDA kernels as planes of H rows of
// `cols` columns, so that one kernel reads either layout in place:
//   plain strides:  plane = (b, c), column = w (at any stride);
//   channels_last:  plane = b, column = w * C + c (contiguous, C channels
//                   interleaved in each row).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <type_traits>

#include "launch_queries.cuh"

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

// Strides of a (B, C, D, H, W) tensor, in elements: 64-bit from plane to
// plane, 32-bit inside a plane (in_plane_strides says when they fit).
struct InputStrides {
  int64_t b, c;
  int d, h, w;
};

// A 5-D tensor's strides, if every offset inside one of its (b, c) planes fits an int.
inline std::optional<InputStrides> in_plane_strides(const at::Tensor& x) {
  int64_t extent = 0;
  for (int i = 2; i < 5; ++i) extent += (x.size(i) - 1) * x.stride(i);
  if (extent > std::numeric_limits<int>::max()) return std::nullopt;
  return InputStrides{x.stride(0), x.stride(1), static_cast<int>(x.stride(2)),
                      static_cast<int>(x.stride(3)), static_cast<int>(x.stride(4))};
}

// Work items numbered in mixed radix, item = ((digit[0] * size[1] + digit[1])
// * size[2] + digit[2]) ..., visited from `item` in steps of `stride` with
// additions only: a grid-stride loop over items without per-item divisions.
// digit 0 is unbounded; `sizes` are the radices of digits 1..N-1.
template <int N>
struct ItemCursor {
  int64_t digit0, step0;
  int digit[N], size[N], step[N];

  __device__ ItemCursor(int64_t item, int64_t stride, const int (&sizes)[N - 1]) {
    for (int i = N - 1; i > 0; --i) {
      size[i] = sizes[i - 1];
      digit[i] = static_cast<int>(item % size[i]);
      item /= size[i];
      step[i] = static_cast<int>(stride % size[i]);
      stride /= size[i];
    }
    digit0 = item;
    step0 = stride;
  }
  __device__ int64_t leading() const { return digit0; }
  __device__ int operator[](int i) const { return digit[i]; }
  __device__ void next() {
    int carry = 0;
#pragma unroll
    for (int i = N - 1; i > 0; --i) {
      digit[i] += step[i] + carry;
      carry = digit[i] >= size[i];
      if (carry) digit[i] -= size[i];
    }
    digit0 += step0 + carry;
  }
};

// The widest vector (in elements, at most 16 bytes) to which `data` is
// aligned and of which every count in `multiples` (row lengths, strides,
// offsets, in elements) is a multiple.
template <typename scalar_t>
int aligned_vector_width(const void* data, std::initializer_list<int64_t> multiples) {
  int v = 16 / static_cast<int>(sizeof(scalar_t));
  auto fits = [&] {
    if (reinterpret_cast<uintptr_t>(data) % (v * sizeof(scalar_t)) != 0) return false;
    for (int64_t n : multiples) {
      if (n % v != 0) return false;
    }
    return true;
  };
  while (v > 1 && !fits()) v /= 2;
  return v;
}

// The widest vector (in elements, at most 16 bytes) in which every row of t
// can be read or written: contiguous columns, aligned row starts.
template <typename scalar_t>
int vector_width(const PlaneRows& l, const void* data) {
  if (l.col_stride != 1) return 1;
  return aligned_vector_width<scalar_t>(
      data, {l.cols, l.row_stride, l.batch_stride, l.channel_stride});
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

template <typename scalar_t, int VEC>
__device__ __forceinline__ Vector<scalar_t, VEC> load_vector(const scalar_t* p) {
  return *reinterpret_cast<const Vector<scalar_t, VEC>*>(p);
}

}  // namespace fused_ops
