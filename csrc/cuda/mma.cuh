// The tensor-core operations of the implicit-GEMM convolution kernels
// (conv2d_sigmoid_sum.cu, conv2d_sigmoid_sum_backward.cu): one warp-wide
// mma.sync each, f32 accumulators, operands rounded to the operation's type.
#pragma once

#include <ATen/Context.h>
#include <c10/core/ScalarType.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace fused_ops {

// v rounded to TF32 (round to nearest, ties away), as float: the tensor cores read only
// the 19 bits kept and would otherwise truncate, a bias that grows with a sum's length.
__device__ __forceinline__ float round_to_tf32(float v) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
  return __uint_as_float(r);
}

// c += a b by one mma.sync of the shape and types PTX spells as `shape_and_types`.
#define FUSED_OPS_MMA_SYNC(shape_and_types, c, a, b0, b1)                                                       \
  asm volatile("mma.sync.aligned." shape_and_types " {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n" \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                               \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))

// TF32 m16n8k8 (one k per operand register) on float32 values rounded to
// TF32 (round to nearest, ties away; the tensor cores ignore the 13 bits below).
// For m16n8 tiles of a row-major A (rows r, k) and a column-major B (k, columns n),
// lane (g, t) = (lane / 4, lane % 4) holds a0 = A[g][t], a1 = A[g + 8][t],
// a2 = A[g][t + 4], a3 = A[g + 8][t + 4]; b0 = B[t][g], b1 = B[t + 4][g]; and
// the accumulators c0, c1 = C[g][2t, 2t + 1], c2, c3 = C[g + 8][2t, 2t + 1].
struct Tf32Mma {
  using Input = float;  // the type the convolution's input is rounded to (TF32's values: float's, rounded here)
  static constexpr int kStepK = 8, kPerRegister = 1;
  static constexpr uint32_t kOne = 0x3f800000u;  // 1.0 (exact in TF32)
  __device__ static uint32_t pack(float v, float) { return __float_as_uint(round_to_tf32(v)); }
  __device__ static void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    FUSED_OPS_MMA_SYNC("m16n8k8.row.col.f32.tf32.tf32.f32", c, a, b0, b1);
  }
};

// m16n8k16 on bfloat16 (kBf16) or float16, each rounded to nearest even as
// .to() rounds: two adjacent k per operand register (k = 2t, 2t + 1 where
// Tf32Mma's layout has t; + 8 where it has + 4).
template <bool kBf16>
struct Mma16 {
  using Input = std::conditional_t<kBf16, __nv_bfloat16, __half>;
  static constexpr int kStepK = 16, kPerRegister = 2;
  __device__ static uint32_t pack(float lo, float hi) {
    uint32_t r;
    if constexpr (kBf16) {
      const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
      memcpy(&r, &v, sizeof(r));
    } else {
      const __half2 v = __floats2half2_rn(lo, hi);
      memcpy(&r, &v, sizeof(r));
    }
    return r;
  }
  __device__ static void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    if constexpr (kBf16) {
      FUSED_OPS_MMA_SYNC("m16n8k16.row.col.f32.bf16.bf16.f32", c, a, b0, b1);
    } else {
      FUSED_OPS_MMA_SYNC("m16n8k16.row.col.f32.f16.f16.f32", c, a, b0, b1);
    }
  }
};
using Bf16Mma = Mma16<true>;
using F16Mma = Mma16<false>;

// The tensor-core operation of a fused convolution with a weight of `dtype`, as
// PyTorch's own convolution would compute: TF32 for a float32 weight where
// torch.backends.cudnn.allow_tf32 allows it, bf16 / f16 for a 16-bit weight (x
// rounded to it: what autocast passes). f(Mma{}) is called with it; false if none.
template <typename F>
bool with_weight_operation(c10::ScalarType dtype, F&& f) {
  switch (dtype) {
    case c10::kFloat:
      if (!at::globalContext().allowTF32CuDNN()) return false;
      return f(Tf32Mma{}), true;
    case c10::kBFloat16:
      return f(Bf16Mma{}), true;
    case c10::kHalf:
      return f(F16Mma{}), true;
    default:
      return false;
  }
}

// v (float, bfloat16 or float16) as a float: exact.
template <typename T>
__device__ __forceinline__ float widened(T v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(v);
  } else if constexpr (std::is_same_v<T, __half>) {
    return __half2float(v);
  } else {
    static_assert(std::is_same_v<T, float>);
    return v;
  }
}

// v as T (float, or bfloat16 / float16 rounded to nearest even, as .to() rounds).
template <typename T>
__device__ __forceinline__ T narrowed(float v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(v);
  } else if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(v);
  } else {
    static_assert(std::is_same_v<T, float>);
    return v;
  }
}

// v rounded to T (float, or bfloat16 / float16 to nearest even, as .to() rounds), as a float.
template <typename T>
__device__ __forceinline__ float rounded_to(float v) {
  return widened(narrowed<T>(v));
}

// a and b each rounded_to<T>, by one conversion of the pair (half rounded_to's instructions twice over).
template <typename T>
__device__ __forceinline__ void round_pair_to(float& a, float& b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    // (a bfloat16 is a float's upper half: widened by a shift and a mask, exactly)
    const uint32_t bits = Mma16<true>::pack(a, b);
    a = __uint_as_float(bits << 16);
    b = __uint_as_float(bits & 0xffff0000u);
  } else if constexpr (std::is_same_v<T, __half>) {
    const float2 r = __half22float2(__floats2half2_rn(a, b));
    a = r.x;
    b = r.y;
  } else {
    static_assert(std::is_same_v<T, float>);
  }
}

}  // namespace fused_ops
