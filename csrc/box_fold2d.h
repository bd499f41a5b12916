// box_fold2d: a 2-D convolution kernel followed by an average pool's box, as
// one kernel (architecture C's pool fold, fused_ops/rewrites/): conv2d with
// `weight`, then avg_pool2d with kernel `box` and a divisor, equals conv2d with
// the folded kernel (stride the pool's). For weight (..., kh, kw):
//   out[..., u, v] = sum over taps (a, b) with 0 <= u - a < bh, 0 <= v - b < bw
//                    of w[..., a, b] / divisor,              out (..., kh + bh - 1, kw + bw - 1).
// Backward (the adjoint, linear too):
//   grad_w[..., a, b] = sum over p < bh, q < bw of grad[..., a + p, b + q] / divisor.
// Each sum in float64 (at most bh bw terms: exact for a power-of-two divisor
// where the taps span fewer than ~29 binary orders of magnitude),
// then converted to the result's dtype as .to() converts a float64 tensor. One
// kernel launch each way on a GPU.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace fused_ops {

struct BoxFold {
  int64_t kh, kw, bh, bw;
  double inverse;  // 1 / divisor

  C10_HOST_DEVICE int64_t folded_h() const { return kh + bh - 1; }
  C10_HOST_DEVICE int64_t folded_w() const { return kw + bw - 1; }

  // out[u, v] of one plane, from the plane's kernel w (kh x kw, contiguous)
  template <typename T>
  C10_HOST_DEVICE double folded_tap(const T* w, int64_t u, int64_t v) const {
    double sum = 0;
    for (int64_t a = u - bh + 1 > 0 ? u - bh + 1 : 0; a <= u && a < kh; ++a) {
      for (int64_t b = v - bw + 1 > 0 ? v - bw + 1 : 0; b <= v && b < kw; ++b) {
        sum += static_cast<double>(w[a * kw + b]) * inverse;
      }
    }
    return sum;
  }

  // grad_w[a, b] of one plane, from the plane's grad (folded_h x folded_w, contiguous)
  template <typename T>
  C10_HOST_DEVICE double unfolded_tap(const T* grad, int64_t a, int64_t b) const {
    double sum = 0;
    for (int64_t p = 0; p < bh; ++p) {
      for (int64_t q = 0; q < bw; ++q) sum += static_cast<double>(grad[(a + p) * folded_w() + b + q]) * inverse;
    }
    return sum;
  }
};

// The two maps as functors of (plane, i, j) for the CPU and CUDA loops: one
// result element from its plane of the input.
struct FoldTap {
  BoxFold fold;
  template <typename T>
  C10_HOST_DEVICE double operator()(const T* plane, int64_t u, int64_t v) const {
    return fold.folded_tap(plane, u, v);
  }
};

struct UnfoldTap {
  BoxFold fold;
  template <typename T>
  C10_HOST_DEVICE double operator()(const T* plane, int64_t a, int64_t b) const {
    return fold.unfolded_tap(plane, a, b);
  }
};

inline void check_box_fold_args(const char* what, at::IntArrayRef box, double divisor) {
  TORCH_CHECK(box.size() == 2 && box[0] > 0 && box[1] > 0, what, ": box must be two positive sizes, got ", box);
  TORCH_CHECK(std::isfinite(divisor) && divisor != 0, what, ": divisor must be finite and non-zero, got ", divisor);
}

// The forward's checks and geometry: weight (..., kh, kw) floating point.
inline BoxFold box_fold2d_setup(const at::Tensor& weight, at::IntArrayRef box, double divisor,
                                std::optional<at::ScalarType> dtype) {
  TORCH_CHECK(weight.dim() >= 2, "box_fold2d: weight must have at least 2 dims (..., kh, kw), got ", weight.dim(),
              "-D");
  TORCH_CHECK_TYPE(at::isFloatingType(weight.scalar_type()), "box_fold2d: weight must be floating point, got ",
                   weight.scalar_type());
  TORCH_CHECK_TYPE(!dtype.has_value() || at::isFloatingType(*dtype), "box_fold2d: dtype must be floating point, got ",
                   *dtype);
  TORCH_CHECK(weight.size(-2) > 0 && weight.size(-1) > 0, "box_fold2d: the kernel (weight's last two dims) must "
              "not be empty, got ", weight.sizes());
  check_box_fold_args("box_fold2d", box, divisor);
  return {weight.size(-2), weight.size(-1), box[0], box[1], 1.0 / divisor};
}

// The backward's: grad (..., kh + bh - 1, kw + bw - 1) floating point.
inline BoxFold box_fold2d_backward_setup(const at::Tensor& grad, at::IntArrayRef kernel_size, at::IntArrayRef box,
                                         double divisor, at::ScalarType dtype) {
  TORCH_CHECK(kernel_size.size() == 2 && kernel_size[0] > 0 && kernel_size[1] > 0,
              "box_fold2d_backward: kernel_size must be two positive sizes, got ", kernel_size);
  check_box_fold_args("box_fold2d_backward", box, divisor);
  TORCH_CHECK_TYPE(at::isFloatingType(grad.scalar_type()) && at::isFloatingType(dtype),
                   "box_fold2d_backward: grad and dtype must be floating point, got ", grad.scalar_type(), ", ",
                   dtype);
  const BoxFold f{kernel_size[0], kernel_size[1], box[0], box[1], 1.0 / divisor};
  TORCH_CHECK(grad.dim() >= 2 && grad.size(-2) == f.folded_h() && grad.size(-1) == f.folded_w(),
              "box_fold2d_backward: grad must be (..., ", f.folded_h(), ", ", f.folded_w(),
              ") for a kernel of ", kernel_size, " and a box of ", box, ", got ", grad.sizes());
  return f;
}

// The result's shape: `sizes` with its last two dims replaced by (h, w).
inline std::vector<int64_t> with_last_two(at::IntArrayRef sizes, int64_t h, int64_t w) {
  std::vector<int64_t> shape(sizes.begin(), sizes.end());
  shape[shape.size() - 2] = h;
  shape[shape.size() - 1] = w;
  return shape;
}

// The op and its backward on a device whose map_planes(in, shape, dtype, tap)
// writes out (shape, dtype) with out[plane, i, j] = tap(in's plane, i, j).
template <typename MapPlanes>
at::Tensor box_fold2d_with(MapPlanes map_planes, const at::Tensor& weight, at::IntArrayRef box, double divisor,
                           std::optional<at::ScalarType> dtype) {
  const BoxFold f = box_fold2d_setup(weight, box, divisor, dtype);
  return map_planes(weight, with_last_two(weight.sizes(), f.folded_h(), f.folded_w()),
                    dtype.value_or(weight.scalar_type()), FoldTap{f});
}

template <typename MapPlanes>
at::Tensor box_fold2d_backward_with(MapPlanes map_planes, const at::Tensor& grad, at::IntArrayRef kernel_size,
                                    at::IntArrayRef box, double divisor, at::ScalarType dtype) {
  const BoxFold f = box_fold2d_backward_setup(grad, kernel_size, box, divisor, dtype);
  return map_planes(grad, with_last_two(grad.sizes(), f.kh, f.kw), dtype, UnfoldTap{f});
}

}  // namespace fused_ops
