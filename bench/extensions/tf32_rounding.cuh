// Float32 values rounded to TF32 to nearest (ties away from zero, as cvt.rna rounds; cuDNN's TF32 rounds so,
// where wgmma on raw float32 bits truncates): for the benchmarks' prototypes, on the host (a tensor) and on the
// device (a value). The integer form: add half of the dropped 13 bits' unit, then clear them.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace fused_ops {

constexpr int32_t kTf32Half = 0x1000;
constexpr uint32_t kTf32Mask = 0xffffe000u;

inline at::Tensor rounded_to_tf32(const at::Tensor& t) {
  return t.view(at::kInt).add(kTf32Half).bitwise_and(static_cast<int32_t>(kTf32Mask)).view(at::kFloat);
}

__device__ __forceinline__ float rounded_to_tf32(float v) {
  return __uint_as_float((__float_as_uint(v) + kTf32Half) & kTf32Mask);
}

}  // namespace fused_ops
