// Scalar helpers shared by every op and by the CPU and CUDA kernels.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/macros/Macros.h>

#include <cmath>

// The dtypes every op takes: float64, float32, float16, bfloat16. Kernels
// accumulate in at::opmath_type<scalar_t> (float, or double for float64).
#define FUSED_OPS_DISPATCH_FLOATING_TYPES(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)

namespace fused_ops {

template <typename acc_t>
C10_HOST_DEVICE inline acc_t sigmoid(acc_t x) {
  return acc_t(1) / (acc_t(1) + std::exp(-x));
}

}  // namespace fused_ops
