// conv3d_max_pool3d_mean: mean[n, o] = mean over (D', H', W') of max_pool3d(y)[n, o],
//   y = conv3d(x, weight, bias, stride 1, padding) / divisor   (dilation 1, one group),
//   max_pool3d with kernel = stride = pool (no padding, floor mode).
// Architecture A's tail with its convolution. The convolution's operands are
// rounded to operand_dtype as they are read: the weight's dtype by default (a
// float32 x with a 16-bit weight and bias: x.to(weight.dtype)'s convolution), or a
// 16-bit dtype for a float32 weight and bias, as autocast's casts would round them
// (x.to(T), weight.to(T), bias.to(T), without the casts' copies and launches). y / divisor is PyTorch's
// `tensor / number` (dispatch.h), and each window picks by PyTorch's rule
// (max_pool3d.h); with save_indices the picks are saved as max_pool3d_mean
// saves them: one byte per window, its scan-order offset, (N, O, D', H', W').
// With a channel bias b (O) and sum_channels (architecture A's module):
//   out[n] = sum over o of (mean[n, o] + b[o]),
// the addition in the dtype PyTorch's `mean + b` promotes to, the sum accumulated in
// float32 and rounded to it, as `torch.sum` does: the module's bias and sum in the op
// (its training step one forward op and one backward node).
//
// On a GPU (cuda/conv3d_max_pool3d_mean.cu) the convolution runs on tensor
// cores and the division, pool and mean are its epilogue: y never reaches
// memory. Elsewhere, and for what that kernel does not cover, PyTorch's
// convolution then max_pool3d_mean (conv3d_max_pool3d_mean_composite).
//
// Backward, with P = D' H' W' windows: a window's gradient grad_mean[n, o] / P
// reaches its pick, divided by the divisor as PyTorch divides (max_pool3d_mean's
// backward gives grad_y from the saved picks), then the convolution's backward
// (PyTorch's) gives the gradients of x, the weight and the bias. With a channel bias
// and sum_channels, grad_mean[n, o] = grad_out[n] (rounded to the mean's dtype, as
// autograd casts a gradient to its input's dtype) and grad_b[o] = sum over n of grad_out[n].
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <tuple>

#include "convolution_checks.h"
#include "dispatch.h"
#include "max_pool3d_mean.h"
#include "op_handle.h"
#include "pool_geometry.h"

namespace fused_ops {

struct Conv3dPoolGeometry {
  std::array<int64_t, 3> padding, pool;
  std::array<int64_t, 3> conv;    // the convolution's output size (D, H, W)
  std::array<int64_t, 3> pooled;  // windows per dimension (D', H', W')

  int64_t pool_volume() const { return pool[0] * pool[1] * pool[2]; }  // (a window's elements: its picks' range)
};

// The checks of a call's arguments (errors named after the op `what`), and its geometry.
inline Conv3dPoolGeometry conv3d_max_pool3d_mean_geometry(const at::Tensor& x, const at::Tensor& weight,
                                                          const std::optional<at::Tensor>& bias,
                                                          c10::IntArrayRef padding, c10::IntArrayRef pool,
                                                          double divisor,
                                                          const char* what = "conv3d_max_pool3d_mean") {
  check_convolution_operands(what, 3, x, weight, bias);
  check_divisor(what, divisor);
  Conv3dPoolGeometry g;
  const auto p = expand_param<3>(what, "padding", padding);
  const auto k = expand_param<3>(what, "pool", pool);
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK_VALUE(p[d] >= 0, what, ": padding must be non-negative, got ", padding);
    TORCH_CHECK_VALUE(k[d] > 0, what, ": pool must be positive, got ", pool);
    g.padding[d] = p[d];
    g.pool[d] = k[d];
    g.conv[d] = x.size(2 + d) + 2 * p[d] - weight.size(2 + d) + 1;
    TORCH_CHECK_VALUE(g.conv[d] >= 1, what, ": the padded input (", x.sizes().slice(2), ", padding ", padding,
                      ") is smaller than the kernel (", weight.sizes().slice(2), ")");
  }
  for (int d = 0; d < 3; ++d) {  // (after every dimension's output size: the message names all three)
    g.pooled[d] = g.conv[d] / k[d];
    TORCH_CHECK_VALUE(g.pooled[d] >= 1, what, ": the pool ", pool, " is larger than the convolution's output (",
                      g.conv[0], " x ", g.conv[1], " x ", g.conv[2], ")");
  }
  TORCH_CHECK_VALUE(g.pool_volume() <= kMaxSavedKernelVolume, what, ": the pool's volume must be at most ",
                    kMaxSavedKernelVolume, " (one byte per pick), got ", pool);
  return g;
}

// The convolution's operand dtype: operand_dtype where given (the weight's, or a 16-bit one for a float32
// weight), else the weight's.
inline at::ScalarType operand_type(const char* what, const at::Tensor& weight,
                                   std::optional<at::ScalarType> operand_dtype) {
  if (!operand_dtype.has_value() || *operand_dtype == weight.scalar_type()) return weight.scalar_type();
  TORCH_CHECK_VALUE(weight.scalar_type() == at::kFloat &&
                        (*operand_dtype == at::kBFloat16 || *operand_dtype == at::kHalf),
                    what, ": operand_dtype must be the weight's dtype, or bfloat16 or float16 for a float32 weight, "
                    "got ", *operand_dtype, " for a ", weight.scalar_type(), " weight");
  return *operand_dtype;
}

// The checks of a channel bias: (O) floating point on x's device.
inline void check_channel_bias(const char* what, const at::Tensor& x, const at::Tensor& weight,
                               const std::optional<at::Tensor>& channel_bias) {
  if (!channel_bias.has_value()) return;
  TORCH_CHECK_VALUE(channel_bias->dim() == 1 && channel_bias->size(0) == weight.size(0), what,
                    ": channel_bias must have shape (out_channels,) = (", weight.size(0), ",), got ",
                    channel_bias->sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(channel_bias->scalar_type()), what,
                   ": channel_bias must be a floating-point tensor, got ", channel_bias->scalar_type());
  TORCH_CHECK_VALUE(channel_bias->device() == x.device(), what, ": channel_bias must be on x's device (",
                    x.device(), "), got ", channel_bias->device());
}

// The result's dtype: the mean's, or with a channel bias the dtype `mean + channel_bias` promotes to.
inline at::ScalarType channel_bias_result_dtype(at::ScalarType mean_dtype,
                                                const std::optional<at::Tensor>& channel_bias) {
  return channel_bias.has_value() ? at::promote_types(mean_dtype, channel_bias->scalar_type()) : mean_dtype;
}

// mean (+ channel_bias) (summed over channels) by PyTorch's ops: the CPU's, and the GPU's
// where its kernel does not apply.
inline at::Tensor add_channel_bias_and_sum(const at::Tensor& mean, const std::optional<at::Tensor>& channel_bias,
                                           bool sum_channels) {
  const at::Tensor biased = channel_bias.has_value() ? mean + *channel_bias : mean;
  return sum_channels ? biased.sum(1) : biased;
}

namespace detail {
inline std::tuple<at::Tensor, at::Tensor> call_max_pool3d_mean(const at::Tensor& y, at::IntArrayRef kernel,
                                                               double divisor, bool save_indices,
                                                               std::optional<at::ScalarType> dtype) {
  static const auto op =
      typed_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef,
                                                  bool, double, bool, std::optional<at::ScalarType>)>(
          "fused_ops::max_pool3d_mean");
  return op.call(y, kernel, kernel, {0, 0, 0}, false, divisor, save_indices, dtype);
}

inline at::Tensor call_max_pool3d_mean_backward(const at::Tensor& grad_mean, const at::Tensor& indices,
                                                c10::SymIntArrayRef input_size, at::IntArrayRef kernel,
                                                double divisor) {
  static const auto op =
      typed_op<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                          c10::SymIntArrayRef, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, bool, double)>(
          "fused_ops::max_pool3d_mean_backward");
  return op.call(grad_mean, indices, std::nullopt, input_size, kernel, kernel, {0, 0, 0}, false, divisor);
}
}  // namespace detail

// PyTorch's convolution, then max_pool3d_mean (its kernels, through the
// dispatcher): the CPU kernel, and the GPU's where the fused kernel does not apply.
inline std::tuple<at::Tensor, at::Tensor> conv3d_max_pool3d_mean_composite(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, const Conv3dPoolGeometry& g,
    double divisor, bool save_indices, at::ScalarType dtype, at::ScalarType operand) {
  const std::optional<at::Tensor> rounded_bias = bias.has_value() ? std::optional(bias->to(operand)) : std::nullopt;
  const at::Tensor y = at::conv3d(x.to(operand), weight.to(operand), rounded_bias, 1, g.padding).contiguous();
  return detail::call_max_pool3d_mean(y, g.pool, divisor, save_indices, dtype);
}

// The backward's checks (the forward's; the forward's picks; one gradient per
// (item, output channel)), and its geometry.
inline Conv3dPoolGeometry check_conv3d_max_pool3d_mean_backward(const at::Tensor& grad_mean,
                                                                const at::Tensor& indices, const at::Tensor& x,
                                                                const at::Tensor& weight, c10::IntArrayRef padding,
                                                                c10::IntArrayRef pool, double divisor,
                                                                std::optional<at::ScalarType> mean_dtype) {
  constexpr const char* what = "conv3d_max_pool3d_mean_backward";
  const Conv3dPoolGeometry g =
      conv3d_max_pool3d_mean_geometry(x, weight, std::nullopt, padding, pool, divisor, what);
  TORCH_CHECK_VALUE(grad_mean.dim() == 2 && grad_mean.size(0) == x.size(0) && grad_mean.size(1) == weight.size(0),
                    what, ": grad_mean must have shape (batch, out_channels) = (", x.size(0), ", ", weight.size(0),
                    "), got ", grad_mean.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(grad_mean.scalar_type()), what,
                   ": grad_mean must be a floating-point tensor, got ", grad_mean.scalar_type());
  TORCH_CHECK_TYPE(!mean_dtype.has_value() || at::isFloatingType(*mean_dtype), what,
                   ": mean_dtype must be a floating-point dtype, got ", *mean_dtype);
  const std::array<int64_t, 5> shape{x.size(0), weight.size(0), g.pooled[0], g.pooled[1], g.pooled[2]};
  TORCH_CHECK_VALUE(indices.sizes() == at::IntArrayRef(shape) && indices.scalar_type() == at::kByte, what,
                    ": indices must be the forward's (save_indices=True): uint8 of shape ", at::IntArrayRef(shape),
                    ", got ", indices.scalar_type(), " of shape ", indices.sizes());
  TORCH_CHECK_VALUE(grad_mean.device() == x.device() && indices.device() == x.device(), what,
                    ": grad_mean, indices and x must be on one device, got ", grad_mean.device(), ", ",
                    indices.device(), " and ", x.device());
  check_saved_picks(what, "indices", indices, g.pool_volume());
  return g;
}

// grad_x, grad_weight, grad_bias, grad_channel_bias (each where output_mask asks for
// it, else an empty tensor; contiguous): grad_y from the picks (max_pool3d_mean's
// backward on grad_mean rounded to mean_dtype), then PyTorch's convolution backward; x's
// gradient in x's dtype (the rounding of a float32 x to a 16-bit operand dtype has the
// identity's gradient), the weight's and the bias's in the operand dtype, stored in the weight's
// (as autograd casts them back through autocast's casts); the channel bias's, the sum over the
// batch of grad_mean, in grad_mean's.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> conv3d_max_pool3d_mean_backward_composite(
    const at::Tensor& grad_mean, const at::Tensor& indices, const at::Tensor& x, const at::Tensor& weight,
    const Conv3dPoolGeometry& g, double divisor, std::array<bool, 4> output_mask,
    std::optional<at::ScalarType> mean_dtype, at::ScalarType operand) {
  at::Tensor grad_x, grad_weight, grad_bias;
  if (output_mask[0] || output_mask[1] || output_mask[2]) {
    const std::array<c10::SymInt, 3> conv{c10::SymInt(g.conv[0]), c10::SymInt(g.conv[1]),
                                          c10::SymInt(g.conv[2])};
    const at::Tensor grad_y = detail::call_max_pool3d_mean_backward(
        grad_mean.to(mean_dtype.value_or(grad_mean.scalar_type())), indices.contiguous(), conv, g.pool, divisor);
    std::tie(grad_x, grad_weight, grad_bias) = at::convolution_backward(
        grad_y.to(operand), x.to(operand), weight.to(operand), at::IntArrayRef({weight.size(0)}),
        {1, 1, 1}, g.padding, {1, 1, 1}, false, {0, 0, 0}, 1, {output_mask[0], output_mask[1], output_mask[2]});
  }
  return {output_mask[0] ? grad_x.to(x.scalar_type()).contiguous() : x.new_empty({0}),
          output_mask[1] ? grad_weight.to(weight.scalar_type()).contiguous() : x.new_empty({0}),
          output_mask[2] ? grad_bias.to(weight.scalar_type()) : x.new_empty({0}),
          output_mask[3] ? grad_mean.sum(0) : x.new_empty({0})};
}

}  // namespace fused_ops
