// channel_sums: t (N, C, ...) summed over every dim but C,
//   out[c] = sum over n and the positions p of t[n, c, p],    out (C) in t's dtype,
// each sum accumulated in at::opmath_type (float, or double for float64) and rounded once. Architecture
// D's transposed-convolution bias gradient from a channels-last grad_y (fused_ops/rewrites/
// conv_transpose3d_batch_norm.py): cuBLAS's gemv did it as fast, but its first use in a process took 85 ms
// of D's first training step (H200), which the original never pays. Not differentiable.
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <vector>

namespace fused_ops {

inline void channel_sums_check(const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.dim() >= 2, "channel_sums: t must be (N, C, ...), got ", t.sizes());
  const at::ScalarType s = t.scalar_type();
  TORCH_CHECK_TYPE(s == at::kDouble || s == at::kFloat || s == at::kHalf || s == at::kBFloat16,
                   "channel_sums: t must be float64, float32, float16 or bfloat16, got ", s);
}

// The sums by ATen's reduction over every dim but the channels' (1), in the accumulation type, rounded to
// t's: the CPU kernel, and the CUDA kernel's for a t whose memory is not rows of its channels.
inline at::Tensor channel_sums_by_reduction(const at::Tensor& t) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < t.dim(); ++d) dims.push_back(d);
  return at::sum(t, dims, false, at::toOpMathType(t.scalar_type())).to(t.scalar_type());
}

}  // namespace fused_ops
