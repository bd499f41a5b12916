// depth_stacked_channels_last: the input of a 2-D convolution that computes a
// 3-D one's depth taps as input channels (fused_ops/rewrites/). For x
// (N, I, D, H, W), out (N, M, Hs, Ws, taps, I) = (N, size[0], size[1],
// size[2], taps, I), contiguous, with
//   out[n, m, h, w, a, i] = x[n, i, start[0] + stride * m + a, start[1] + h, start[2] + w]
// where that index lies inside x, else 0: x cropped and zero-padded on every
// side (start may be negative, the window may run past the end), channels
// last, the `taps` depths of output depth m side by side. A copy with a cast
// to the output's dtype (any floating type), as Tensor.to casts.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/safe_numerics.h>

#include <array>
#include <cstdint>
#include <optional>

#include "pool_geometry.h"

namespace fused_ops {

struct DepthStack {
  int64_t batch, channels, taps, stride;
  std::array<int64_t, 3> start, size;  // out's (M, Hs, Ws) and where each starts in x
  std::array<int64_t, 3> input;        // x's (D, H, W)

  C10_HOST_DEVICE int64_t rows() const { return taps * channels; }  // (a, i) per output position
};

// Whether an index along a dimension of `extent` lies inside x (else it reads 0).
C10_HOST_DEVICE inline bool index_inside(int64_t index, int64_t extent) { return index >= 0 && index < extent; }

// The checked arguments and the output to fill.
struct DepthStackArgs {
  DepthStack stack;
  at::Tensor out;
};

// The dtypes the kernels are instantiated for (FUSED_OPS_DISPATCH_FLOATING_TYPES).
inline bool is_kernel_floating_type(at::ScalarType t) {
  return t == at::kDouble || t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

inline DepthStackArgs depth_stack_setup(const at::Tensor& x, int64_t taps, int64_t stride,
                                        at::IntArrayRef start, at::IntArrayRef size,
                                        std::optional<at::ScalarType> dtype) {
  constexpr const char* what = "depth_stacked_channels_last";
  TORCH_CHECK_VALUE(x.dim() == 5, what,
                    ": expected a 5-D input x (batch, channels, depth, height, width), got ", x.dim(),
                    "-D input of shape ", x.sizes());
  TORCH_CHECK_TYPE(is_kernel_floating_type(x.scalar_type()), what,
                   ": x must be a floating-point tensor (float64, float32, float16 or bfloat16), got ",
                   x.scalar_type());
  TORCH_CHECK_VALUE(taps >= 1, what, ": taps must be at least 1, got ", taps);
  TORCH_CHECK_VALUE(stride >= 1, what, ": stride must be at least 1, got ", stride);
  const at::ScalarType out_dtype = dtype.value_or(x.scalar_type());
  TORCH_CHECK_TYPE(is_kernel_floating_type(out_dtype), what,
                   ": dtype must be a floating-point type (float64, float32, float16 or bfloat16), got ",
                   out_dtype);
  DepthStack s{x.size(0), x.size(1), taps, stride, expand_param<3>(what, "start", start),
               expand_param<3>(what, "size", size), {x.size(2), x.size(3), x.size(4)}};
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK_VALUE(s.size[d] >= 0, what, ": size must be non-negative, got ", size);
  }
  // (the last positions out reads, start[0] + stride (M - 1) + taps - 1 and start[d] + size[d] - 1, in int64)
  int64_t last = 0;
  bool overflows = s.size[0] > 0 && (c10::mul_overflows(stride, s.size[0] - 1, &last) ||
                                     c10::add_overflows(last, s.start[0], &last) ||
                                     c10::add_overflows(last, taps - 1, &last));
  for (int d = 1; d < 3; ++d) {
    overflows = overflows || (s.size[d] > 0 && c10::add_overflows(s.start[d], s.size[d] - 1, &last));
  }
  TORCH_CHECK_VALUE(!overflows, what, ": start ", start, ", size ", size, ", stride ", stride, " and taps ", taps,
                    " reach positions past int64");
  at::Tensor out = at::empty({s.batch, s.size[0], s.size[1], s.size[2], taps, s.channels},
                             x.options().dtype(out_dtype));
  return {s, out};
}

}  // namespace fused_ops
