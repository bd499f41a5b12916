// conv2d_sigmoid_sum: out[n] = sum over (o, oh, ow) of sigmoid(y[n, o, oh, ow]),
//   y = conv2d(x, weight, bias, stride, padding)   (dilation 1, one group).
// Architecture C's tail after its pool is folded into the convolution
// (fused_ops/rewrites.py: avg_pool2d(k, stride k) after a stride-1 conv2d is one
// conv2d with the kernel convolved with the k x k box over the divisor, stride k).
// A float32 x may come with a 16-bit weight and bias (as autocast passes them):
// the convolution is then x.to(weight.dtype)'s, x rounded as it is read.
//
// On a GPU (cuda/conv2d_sigmoid_sum.cu) the convolution runs on tensor cores and
// the sigmoid and sum are its epilogue: y never reaches memory. Elsewhere, and
// for what that kernel does not cover, PyTorch's convolution, sigmoid and sum
// (conv2d_sigmoid_sum_composite).
//
// Backward (autograd/conv2d_sigmoid_sum.cpp), with s = sigmoid(y) recomputed:
//   grad_y[n, o, oh, ow] = grad_out[n] * s * (1 - s),
// then the convolution's own backward for x, weight and bias.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "dispatch.h"
#include "pool_geometry.h"

namespace fused_ops {

struct Conv2dGeometry {
  std::array<int64_t, 2> stride, padding;
};

inline Conv2dGeometry conv2d_sigmoid_sum_geometry(const at::Tensor& x, const at::Tensor& weight,
                                                  const std::optional<at::Tensor>& bias,
                                                  c10::IntArrayRef stride, c10::IntArrayRef padding) {
  constexpr const char* what = "conv2d_sigmoid_sum";
  TORCH_CHECK_VALUE(x.dim() == 4, what, ": expected a 4-D input (batch, channels, height, width), got ",
                    x.dim(), "-D input of shape ", x.sizes());
  TORCH_CHECK_VALUE(weight.dim() == 4, what, ": expected a 4-D weight (out_channels, in_channels, kh, kw), got ",
                    weight.dim(), "-D weight of shape ", weight.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(x.scalar_type()), what,
                   ": input must be a floating-point tensor (float64, float32, float16 or bfloat16), got ",
                   x.scalar_type());
  const bool rounded_input = x.scalar_type() == at::kFloat &&
                             (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kHalf);
  TORCH_CHECK_TYPE(weight.scalar_type() == x.scalar_type() || rounded_input, what, ": weight (",
                   weight.scalar_type(), ") must have the input's dtype (", x.scalar_type(),
                   "), or be float16 or bfloat16 for a float32 input");
  TORCH_CHECK_VALUE(weight.device() == x.device(), what, ": weight is on ", weight.device(),
                    ", the input on ", x.device());
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(0), what,
                      ": bias must have shape (out_channels,) = (", weight.size(0), ",), got ", bias->sizes());
    TORCH_CHECK_TYPE(bias->scalar_type() == weight.scalar_type(), what, ": bias (", bias->scalar_type(),
                     ") must have the weight's dtype (", weight.scalar_type(), ")");
    TORCH_CHECK_VALUE(bias->device() == x.device(), what, ": bias is on ", bias->device(), ", the input on ",
                      x.device());
  }
  TORCH_CHECK_VALUE(weight.size(1) == x.size(1), what, ": the input has ", x.size(1),
                    " channels, the weight expects ", weight.size(1));
  TORCH_CHECK_VALUE(x.size(0) > 0 && weight.size(0) > 0 && x.size(1) > 0, what,
                    ": batch, channels and out_channels must be non-zero, got input ", x.sizes(), " and weight ",
                    weight.sizes());
  Conv2dGeometry g;
  const auto s = expand_param<2>(what, "stride", stride);
  const auto p = expand_param<2>(what, "padding", padding);
  for (int d = 0; d < 2; ++d) {
    TORCH_CHECK_VALUE(s[d] > 0, what, ": stride must be positive, got ", stride);
    TORCH_CHECK_VALUE(p[d] >= 0, what, ": padding must be non-negative, got ", padding);
    TORCH_CHECK_VALUE(x.size(2 + d) + 2 * p[d] >= weight.size(2 + d), what, ": the padded input (",
                      x.size(2), " x ", x.size(3), ", padding ", padding, ") is smaller than the kernel (",
                      weight.size(2), " x ", weight.size(3), ")");
    g.stride[d] = s[d];
    g.padding[d] = p[d];
  }
  return g;
}

// PyTorch's ops: the CPU kernel, and the GPU's where the fused kernel does not apply.
inline at::Tensor conv2d_sigmoid_sum_composite(const at::Tensor& x, const at::Tensor& weight,
                                               const std::optional<at::Tensor>& bias, const Conv2dGeometry& g,
                                               at::ScalarType dtype) {
  const at::Tensor y = at::conv2d(x.to(weight.scalar_type()), weight, bias, g.stride, g.padding);
  return at::sum(at::sigmoid(y), {1, 2, 3}, false, dtype);
}

}  // namespace fused_ops
