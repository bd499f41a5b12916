// conv_transpose3d_weight_grad: the weight gradient of a transposed 3-D
// convolution of stride 1, no padding, dilation or groups (architecture D's),
// y = conv_transpose3d(x, w), x (N, I, D, H, W), w (I, O, kt, kr, ks),
// y (N, O, D + kt - 1, H + kr - 1, W + ks - 1):
//   grad_w[i, o, t, r, s] = sum over n, z, h, w of x[n, i, z, h, w] * grad_y[n, o, z + t, h + r, w + s]
// returned (I, O, kt, kr, ks) contiguous in x's dtype (the weight's, as
// aten.convolution_backward returns it). An empty sum (no batch, no input
// positions) is zero. The CPU kernel, and the CUDA one wherever its CUTLASS
// path does not apply (cuda/conv_transpose3d_weight_grad.cu), compute it by
// aten.convolution_backward.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <array>
#include <cstdint>

#include "pool_geometry.h"

namespace fused_ops {

// What conv_transpose3d_weight_grad_path names for the aten.convolution_backward path.
constexpr const char* kWeightGradByAten = "aten.convolution_backward";

struct TransposedConvWeightGrad {
  int64_t batch, in_channels, out_channels;  // N, I, O
  std::array<int64_t, 3> in, kernel;         // x's (D, H, W); (kt, kr, ks)

  int64_t out(int d) const { return in[d] + kernel[d] - 1; }  // y's size along d
  int64_t filter_numel() const { return in_channels * out_channels * kernel[0] * kernel[1] * kernel[2]; }
};

// The checked arguments: grad_y and x 5-D, floating point, of one dtype, on
// one device, agreeing on the batch, y's size x's plus the kernel's less one.
inline TransposedConvWeightGrad transposed_conv_weight_grad_setup(const at::Tensor& grad_y, const at::Tensor& x,
                                                                  at::IntArrayRef kernel_size) {
  constexpr const char* what = "conv_transpose3d_weight_grad";
  TORCH_CHECK_VALUE(x.dim() == 5, what, ": x must be 5-D (batch, in_channels, depth, height, width), got shape ",
                    x.sizes());
  TORCH_CHECK_VALUE(grad_y.dim() == 5, what,
                    ": grad_y must be 5-D (batch, out_channels, depth, height, width), got shape ", grad_y.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(x.scalar_type()), what, ": x must be floating point, got ", x.scalar_type());
  TORCH_CHECK_TYPE(grad_y.scalar_type() == x.scalar_type(), what, ": grad_y (", grad_y.scalar_type(),
                   ") must have x's dtype (", x.scalar_type(), ")");
  TORCH_CHECK_VALUE(grad_y.device() == x.device(), what, ": grad_y is on ", grad_y.device(), ", x on ", x.device());
  const TransposedConvWeightGrad g{x.size(0), x.size(1), grad_y.size(1), {x.size(2), x.size(3), x.size(4)},
                                   expand_param<3>(what, "kernel_size", kernel_size)};
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK_VALUE(g.kernel[d] > 0, what, ": kernel_size must be positive, got ", kernel_size);
  }
  TORCH_CHECK_VALUE(grad_y.size(0) == g.batch, what, ": grad_y's batch (", grad_y.size(0), ") is not x's (", g.batch,
                    ")");
  TORCH_CHECK_VALUE(grad_y.size(2) == g.out(0) && grad_y.size(3) == g.out(1) && grad_y.size(4) == g.out(2), what,
                    ": grad_y's spatial size must be x's plus kernel_size less 1 (stride 1, no padding): x ",
                    x.sizes(), " and kernel_size ", kernel_size, " give (", g.out(0), ", ", g.out(1), ", ", g.out(2),
                    "), got grad_y ", grad_y.sizes());
  return g;
}

// The weight gradient by aten.convolution_backward (the transposed convolution's weight
// gradient alone), contiguous; zeros for an empty sum (which convolution_backward refuses
// for empty channels or spatial sizes).
inline at::Tensor transposed_conv_weight_grad_by_aten(const at::Tensor& grad_y, const at::Tensor& x,
                                                      const TransposedConvWeightGrad& g) {
  const std::array<int64_t, 5> shape{g.in_channels, g.out_channels, g.kernel[0], g.kernel[1], g.kernel[2]};
  if (x.numel() == 0 || grad_y.numel() == 0) return at::zeros(shape, x.options());
  const at::Tensor weight = at::empty(shape, x.options());  // (its shape and dtype: the weight's values are not read)
  const int64_t one[3] = {1, 1, 1}, zero[3] = {0, 0, 0};
  const at::Tensor grad_w = std::get<1>(at::convolution_backward(grad_y, x, weight, std::nullopt, one, zero, one,
                                                                 /*transposed=*/true, zero, /*groups=*/1,
                                                                 {false, true, false}));
  return grad_w.contiguous();
}

}  // namespace fused_ops
