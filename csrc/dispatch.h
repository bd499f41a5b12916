// Scalar helpers shared by every op and by the CPU and CUDA kernels.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/core/ScalarType.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <optional>
#include <type_traits>

// The dtypes every op takes: float64, float32, float16, bfloat16. Kernels
// accumulate in at::opmath_type<scalar_t> (float, or double for float64).
#define FUSED_OPS_DISPATCH_FLOATING_TYPES(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)

namespace fused_ops {

// The dtype of an op's result (its `ScalarType? dtype` argument, checked):
// the input's where none is given, else the input's or its accumulation type
// (float32 for a float16 or bfloat16 input), the type the kernels add in, so
// that a 16-bit input's float32 result is never rounded to 16 bits. `what`
// names the op in the message.
inline at::ScalarType result_dtype(const char* what, at::ScalarType input,
                                   std::optional<at::ScalarType> dtype) {
  if (!dtype.has_value()) return input;
  const at::ScalarType acc = at::toOpMathType(input);
  TORCH_CHECK_TYPE(*dtype == input || *dtype == acc, what,
                   ": dtype must be the input's dtype (", input, ") or its accumulation type (",
                   acc, "), got ", *dtype);
  return *dtype;
}

// Calls f(static_cast<T*>(nullptr)) with T the C++ type of `dtype`, which is
// scalar_t's or its accumulation type's: an op's result (result_dtype) or
// batch_norm_gap's per-channel tensors (check_channel_tensors).
template <typename scalar_t, typename F>
void dispatch_scalar_or_acc(at::ScalarType dtype, F&& f) {
  using acc_t = at::opmath_type<scalar_t>;
  if constexpr (!std::is_same_v<scalar_t, acc_t>) {
    if (dtype == c10::CppTypeToScalarType<acc_t>::value) return f(static_cast<acc_t*>(nullptr));
  }
  f(static_cast<scalar_t*>(nullptr));
}

template <typename acc_t>
C10_HOST_DEVICE inline acc_t sigmoid(acc_t x) {
  return acc_t(1) / (acc_t(1) + std::exp(-x));
}

// `tensor / number` as PyTorch computes it for a tensor of scalar_t, rounded
// to scalar_t (the number is a Python float or int). Apply to a value already
// in the accumulation type. The CPU and CUDA kernels differ:
//
// CPU (BinaryOpsKernel.cpp, div_true_kernel): a true division in opmath by
// the number cast straight to opmath.
template <typename scalar_t>
struct TrueDivide {
  using acc_t = at::opmath_type<scalar_t>;
  acc_t divisor;

  explicit TrueDivide(double number) : divisor(static_cast<acc_t>(number)) {}
  C10_HOST_DEVICE scalar_t operator()(acc_t v) const { return static_cast<scalar_t>(v / divisor); }
};

// CUDA (BinaryDivTrueKernel.cu): a product with the reciprocal, in opmath, of
// the number cast straight to opmath (checked bit for bit on an H200, torch
// 2.11: float16 and bfloat16 tensors by 0.3 and 0.7, which differ if the
// number is first rounded to the tensor's dtype).
template <typename scalar_t>
struct ReciprocalMultiply {
  using acc_t = at::opmath_type<scalar_t>;
  acc_t reciprocal;

  explicit ReciprocalMultiply(double number)
      : reciprocal(acc_t(1) / static_cast<acc_t>(number)) {}
  C10_HOST_DEVICE scalar_t operator()(acc_t v) const {
    return static_cast<scalar_t>(v * reciprocal);
  }
};

// `tensor * number` as PyTorch computes it for a tensor of scalar_t, rounded
// to scalar_t: a product in opmath by the number cast straight to opmath, on
// the CPU (BinaryOpsKernel.cpp, mul_kernel) and CUDA (BinaryMulKernel.cu,
// opmath_symmetric_gpu_kernel_with_scalars) alike. Apply to a value already in
// the accumulation type. On the GPU the product is rounded on its own
// (__fmul_rn / __dmul_rn), so that nvcc cannot fuse it into a following
// addition and skip the rounding PyTorch does.
template <typename scalar_t>
struct Multiply {
  using acc_t = at::opmath_type<scalar_t>;
  acc_t factor;

  explicit Multiply(double number) : factor(static_cast<acc_t>(number)) {}
  C10_HOST_DEVICE scalar_t operator()(acc_t v) const {
#ifdef __CUDA_ARCH__
    if constexpr (std::is_same_v<acc_t, float>) {
      return static_cast<scalar_t>(__fmul_rn(v, factor));
    } else {
      return static_cast<scalar_t>(__dmul_rn(v, factor));
    }
#else
    return static_cast<scalar_t>(v * factor);
#endif
  }
};

}  // namespace fused_ops
