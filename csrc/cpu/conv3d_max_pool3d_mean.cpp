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
                                                              std::optional<at::ScalarType> dtype,
                                                              const std::optional<at::Tensor>& channel_bias,
                                                              bool sum_channels,
                                                              std::optional<at::ScalarType> operand_dtype) {
  constexpr const char* what = "conv3d_max_pool3d_mean";
  const Conv3dPoolGeometry g = conv3d_max_pool3d_mean_geometry(x, weight, bias, padding, pool, divisor);
  check_channel_bias(what, x, weight, channel_bias);
  const at::ScalarType operand = operand_type(what, weight, operand_dtype);
  auto [mean, indices] = conv3d_max_pool3d_mean_composite(x, weight, bias, g, divisor, save_indices,
                                                          result_dtype(what, operand, dtype), operand);
  return {add_channel_bias_and_sum(mean, channel_bias, sum_channels), indices};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> conv3d_max_pool3d_mean_backward_cpu(
    const at::Tensor& grad_mean, const at::Tensor& indices, const at::Tensor& x, const at::Tensor& weight,
    at::IntArrayRef padding, at::IntArrayRef pool, double divisor, std::array<bool, 4> output_mask,
    std::optional<at::ScalarType> mean_dtype, std::optional<at::ScalarType> operand_dtype) {
  const Conv3dPoolGeometry g =
      check_conv3d_max_pool3d_mean_backward(grad_mean, indices, x, weight, padding, pool, divisor, mean_dtype);
  return conv3d_max_pool3d_mean_backward_composite(
      grad_mean, indices, x, weight, g, divisor, output_mask, mean_dtype,
      operand_type("conv3d_max_pool3d_mean_backward", weight, operand_dtype));
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("conv3d_max_pool3d_mean", &conv3d_max_pool3d_mean_cpu);
  m.impl("conv3d_max_pool3d_mean_backward", &conv3d_max_pool3d_mean_backward_cpu);
}

}  // namespace fused_ops
