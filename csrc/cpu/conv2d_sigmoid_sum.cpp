// CPU kernels of conv2d_sigmoid_sum and its backward (the math: ../conv2d_sigmoid_sum.h):
// PyTorch's convolution (oneDNN's where it takes it), sigmoid and sum; its convolution backward.
#include <torch/library.h>

#include "../conv2d_sigmoid_sum.h"

namespace fused_ops {
namespace {

std::tuple<at::Tensor, at::Tensor> conv2d_sigmoid_sum_cpu(const at::Tensor& x, const at::Tensor& weight,
                                                          const std::optional<at::Tensor>& bias,
                                                          at::IntArrayRef stride, at::IntArrayRef padding,
                                                          bool save_grad_factor, std::optional<at::ScalarType> dtype) {
  const Conv2dGeometry g = conv2d_sigmoid_sum_geometry(x, weight, bias, stride, padding);
  return conv2d_sigmoid_sum_composite(x, weight, bias, g, save_grad_factor,
                                      result_dtype("conv2d_sigmoid_sum", weight.scalar_type(), dtype));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_sigmoid_sum_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& grad_factor, const at::Tensor& x, const at::Tensor& weight,
    at::IntArrayRef stride, at::IntArrayRef padding, std::array<bool, 3> output_mask) {
  const Conv2dGeometry g = check_conv2d_sigmoid_sum_backward(grad_out, grad_factor, x, weight, stride, padding);
  return conv2d_sigmoid_sum_backward_composite(grad_out, grad_factor, x, weight, g, output_mask);
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("conv2d_sigmoid_sum", &conv2d_sigmoid_sum_cpu);
  m.impl("conv2d_sigmoid_sum_backward", &conv2d_sigmoid_sum_backward_cpu);
}

}  // namespace fused_ops
