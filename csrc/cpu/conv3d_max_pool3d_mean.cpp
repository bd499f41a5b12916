// CPU kernels of conv3d_max_pool3d_mean and its backward (the math:
// ../conv3d_max_pool3d_mean.h): PyTorch's convolution then max_pool3d_mean's
// kernel; max_pool3d_mean's backward then PyTorch's convolution backward.
#include <torch/library.h>

#include "../conv3d_max_pool3d_mean.h"

namespace fused_ops {
namespace {

std::tuple<at::Tensor, at::Tensor> conv3d_max_pool3d_mean_cpu(const at::Tensor& x, const at::Tensor& weight,
                                                              const std::optional<at::Tensor>& bias,
                                                              at::IntArrayRef padding, at::IntArrayRef pool,
                                                              double divisor, bool save_indices,
                                                              std::optional<at::ScalarType> dtype) {
  const Conv3dPoolGeometry g = conv3d_max_pool3d_mean_geometry(x, weight, bias, padding, pool, divisor);
  return conv3d_max_pool3d_mean_composite(x, weight, bias, g, divisor, save_indices,
                                          result_dtype("conv3d_max_pool3d_mean", weight.scalar_type(), dtype));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv3d_max_pool3d_mean_backward_cpu(
    const at::Tensor& grad_mean, const at::Tensor& indices, const at::Tensor& x, const at::Tensor& weight,
    at::IntArrayRef padding, at::IntArrayRef pool, double divisor, std::array<bool, 3> output_mask) {
  const Conv3dPoolGeometry g =
      check_conv3d_max_pool3d_mean_backward(grad_mean, indices, x, weight, padding, pool, divisor);
  return conv3d_max_pool3d_mean_backward_composite(grad_mean, indices, x, weight, g, divisor, output_mask);
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("conv3d_max_pool3d_mean", &conv3d_max_pool3d_mean_cpu);
  m.impl("conv3d_max_pool3d_mean_backward", &conv3d_max_pool3d_mean_backward_cpu);
}

}  // namespace fused_ops
