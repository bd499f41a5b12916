// conv2d_sigmoid_sum: out[n] = sum over (o, oh, ow) of sigmoid(y[n, o, oh, ow]),
//   y = conv2d(x, weight, bias, stride, padding)   (dilation 1, one group).
// Architecture C's tail after its pool is folded into the convolution
// (fused_ops/rewrites/: avg_pool2d(k, stride k) after a stride-1 conv2d is one
// conv2d with the kernel convolved with the k x k box over the divisor, stride k).
// A float32 x may come with a 16-bit weight and bias (as autocast passes them):
// the convolution is then x.to(weight.dtype)'s, x rounded as it is read.
//
// On a GPU (cuda/conv2d_sigmoid_sum.cu) the convolution runs on tensor cores and
// the sigmoid and sum are its epilogue: y never reaches memory. Elsewhere, and
// for what that kernel does not cover, PyTorch's convolution, sigmoid and sum
// (conv2d_sigmoid_sum_composite).
//
// Backward, from the factor the forward saves (save_grad_factor), sigmoid'(y) = s (1 - s):
//   grad_y[n, o, oh, ow] = grad_out[n] * s (1 - s),
//   grad_weight[o, c, i, j] = sum over (n, oh, ow) of grad_y * x_padded[n, c, oh*sh + i, ow*sw + j],
//   grad_bias[o] = sum of grad_y over (n, oh, ow); grad_x by the convolution's transpose.
// On Hopper, for what its kernel covers (cuda/conv2d_sigmoid_sum_backward.cu), the weight's
// and bias's gradients are one tensor-core kernel over x and the factor (grad_y never in
// memory); elsewhere, and x's gradient, PyTorch's convolution backward on grad_y
// (conv2d_sigmoid_sum_backward_composite).
//
// The factor's layout, the GPU kernels' (the same on every device, so that its
// shape is the inputs'): (N, OH, T, G, 3072), T = ceil(OW / 48), G = ceil(O / 64);
// each (n, oh, 48 columns, 64 channels) block is 3072 words in the order the
// weight-gradient kernel reads its B fragments, word ((kk * 4 + P) * 32 + 4 g + t) * 4 + q
// holding column 16 (kk / 2) + 4 (kk % 2) + t + 8 (q % 2) and channel 16 P + 8 (q / 2) + g
// of the block (kk < 6 k8 groups of columns, P < 4 pairs of n8 tiles, lane (g, t),
// q < 4); zero past OW and O. float32 (float64 for a float64 convolution); the
// tensor-core forward rounds it to TF32, which the backward's operation takes.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "convolution_checks.h"
#include "dispatch.h"
#include "pool_geometry.h"

namespace fused_ops {

struct Conv2dGeometry {
  std::array<int64_t, 2> stride, padding;
};

// The checks of a call's arguments (errors named after the op `what`), and its geometry.
inline Conv2dGeometry conv2d_sigmoid_sum_geometry(const at::Tensor& x, const at::Tensor& weight,
                                                  const std::optional<at::Tensor>& bias,
                                                  c10::IntArrayRef stride, c10::IntArrayRef padding,
                                                  const char* what = "conv2d_sigmoid_sum") {
  check_convolution_operands(what, 2, x, weight, bias);
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

// (OH, OW) of a checked call's convolution.
inline std::array<int64_t, 2> conv2d_output_size(const at::Tensor& x, const at::Tensor& weight,
                                                 const Conv2dGeometry& g) {
  return {(x.size(2) + 2 * g.padding[0] - weight.size(2)) / g.stride[0] + 1,
          (x.size(3) + 2 * g.padding[1] - weight.size(3)) / g.stride[1] + 1};
}

constexpr int64_t kFactorColumns = 48, kFactorChannels = 64, kFactorWords = kFactorColumns * kFactorChannels;

inline std::vector<int64_t> grad_factor_shape(int64_t n, int64_t o, int64_t oh, int64_t ow) {
  return {n, oh, (ow + kFactorColumns - 1) / kFactorColumns, (o + kFactorChannels - 1) / kFactorChannels,
          kFactorWords};
}

// f (N, O, OH, OW) in the factor's layout (above), as a contiguous tensor of f's dtype.
inline at::Tensor to_factor_layout(const at::Tensor& f) {
  const int64_t n = f.size(0), o = f.size(1), oh = f.size(2), ow = f.size(3);
  const auto shape = grad_factor_shape(n, o, oh, ow);
  const int64_t t = shape[2], g = shape[3];
  const at::Tensor padded = at::constant_pad_nd(f, {0, t * kFactorColumns - ow, 0, 0, 0, g * kFactorChannels - o});
  // (N, G, P, q / 2, g, OH, T, kk / 2, q % 2, kk % 2, t) -> (N, OH, T, G, kk / 2, kk % 2, P, g, t, q / 2, q % 2)
  return padded.reshape({n, g, 4, 2, 8, oh, t, 3, 2, 2, 4})
      .permute({0, 5, 6, 1, 7, 9, 2, 4, 10, 3, 8})
      .reshape(shape);
}

// The factor (its layout) back as (N, O, OH, OW) (a copy: the permutation is no view).
inline at::Tensor from_factor_layout(const at::Tensor& factor, int64_t o, int64_t ow) {
  const int64_t n = factor.size(0), oh = factor.size(1), t = factor.size(2), g = factor.size(3);
  return factor.view({n, oh, t, g, 3, 2, 4, 8, 4, 2, 2})
      .permute({0, 3, 6, 9, 7, 1, 2, 4, 10, 5, 8})
      .reshape({n, g * kFactorChannels, oh, t * kFactorColumns})
      .slice(1, 0, o)
      .slice(3, 0, ow);
}

// The factor's dtype for a convolution in `dtype`: its accumulation type.
inline at::ScalarType grad_factor_dtype(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
}

// PyTorch's ops: the CPU kernel, and the GPU's where the fused kernel does not
// apply. The factor where asked for (save_grad_factor), else an empty tensor.
inline std::tuple<at::Tensor, at::Tensor> conv2d_sigmoid_sum_composite(const at::Tensor& x, const at::Tensor& weight,
                                                                       const std::optional<at::Tensor>& bias,
                                                                       const Conv2dGeometry& g, bool save_grad_factor,
                                                                       at::ScalarType dtype) {
  const at::Tensor s = at::sigmoid(at::conv2d(x.to(weight.scalar_type()), weight, bias, g.stride, g.padding));
  at::Tensor factor = x.new_empty({0}, grad_factor_dtype(weight.scalar_type()));
  if (save_grad_factor) {
    const at::Tensor wide = s.to(factor.scalar_type());
    factor = to_factor_layout(wide * (1 - wide));
  }
  return {at::sum(s, {1, 2, 3}, false, dtype), factor};
}

// The backward's checks (the forward's of x, the weight and the geometry; a
// factor of the forward's shape and dtype; one floating-point grad_out value
// per item), and its geometry.
inline Conv2dGeometry check_conv2d_sigmoid_sum_backward(const at::Tensor& grad_out, const at::Tensor& factor,
                                                        const at::Tensor& x, const at::Tensor& weight,
                                                        c10::IntArrayRef stride, c10::IntArrayRef padding) {
  constexpr const char* what = "conv2d_sigmoid_sum_backward";
  const Conv2dGeometry g = conv2d_sigmoid_sum_geometry(x, weight, std::nullopt, stride, padding, what);
  TORCH_CHECK_VALUE(grad_out.dim() == 1 && grad_out.size(0) == x.size(0), what,
                    ": grad_out must have shape (batch,) = (", x.size(0), ",), got ", grad_out.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(grad_out.scalar_type()), what,
                   ": grad_out must be a floating-point tensor, got ", grad_out.scalar_type());
  const auto [oh, ow] = conv2d_output_size(x, weight, g);
  const auto shape = grad_factor_shape(x.size(0), weight.size(0), oh, ow);
  TORCH_CHECK_VALUE(factor.sizes() == at::IntArrayRef(shape), what, ": grad_factor must have shape ",
                    at::IntArrayRef(shape), " (the forward's, with save_grad_factor=True), got ", factor.sizes());
  TORCH_CHECK_TYPE(factor.scalar_type() == grad_factor_dtype(weight.scalar_type()), what, ": grad_factor must be ",
                   grad_factor_dtype(weight.scalar_type()), ", got ", factor.scalar_type());
  TORCH_CHECK_VALUE(grad_out.device() == x.device() && factor.device() == x.device(), what,
                    ": grad_out, grad_factor and x must be on one device, got ", grad_out.device(), ", ",
                    factor.device(), " and ", x.device());
  return g;
}

// grad_x, grad_weight, grad_bias (each where output_mask asks for it, else an
// empty tensor; contiguous) by PyTorch's convolution backward on grad_y = grad_out * factor:
// x's gradient in x's dtype (the rounding of a float32 x to a 16-bit weight's
// dtype has the identity's gradient), the others in the weight's.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_sigmoid_sum_backward_composite(
    const at::Tensor& grad_out, const at::Tensor& factor, const at::Tensor& x, const at::Tensor& weight,
    const Conv2dGeometry& g, std::array<bool, 3> output_mask) {
  const at::Tensor f = from_factor_layout(factor, weight.size(0), conv2d_output_size(x, weight, g)[1]);
  const at::Tensor grad_y = (f * grad_out.to(f.scalar_type()).view({-1, 1, 1, 1})).to(weight.scalar_type());
  auto [grad_x, grad_weight, grad_bias] = at::convolution_backward(
      grad_y, x.to(weight.scalar_type()), weight, at::IntArrayRef({weight.size(0)}), g.stride, g.padding, {1, 1},
      false, {0, 0}, 1, output_mask);
  return {output_mask[0] ? grad_x.to(x.scalar_type()).contiguous() : x.new_empty({0}),
          output_mask[1] ? grad_weight.contiguous() : x.new_empty({0}),
          output_mask[2] ? grad_bias : x.new_empty({0})};
}

}  // namespace fused_ops
