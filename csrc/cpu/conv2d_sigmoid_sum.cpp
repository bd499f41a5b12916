// CPU kernel of conv2d_sigmoid_sum (the math: ../conv2d_sigmoid_sum.h): PyTorch's
// convolution (oneDNN's where it takes it), sigmoid and sum.
#include <torch/library.h>

#include "../conv2d_sigmoid_sum.h"

namespace fused_ops {
namespace {

at::Tensor conv2d_sigmoid_sum_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                  at::IntArrayRef stride, at::IntArrayRef padding,
                                  std::optional<at::ScalarType> dtype) {
  const Conv2dGeometry g = conv2d_sigmoid_sum_geometry(x, weight, bias, stride, padding);
  return conv2d_sigmoid_sum_composite(x, weight, bias, g, result_dtype("conv2d_sigmoid_sum", weight.scalar_type(), dtype));
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("conv2d_sigmoid_sum", &conv2d_sigmoid_sum_cpu);
}

}  // namespace fused_ops
