// Autograd of conv3d_max_pool3d_mean (the math: ../conv3d_max_pool3d_mean.h):
// the forward saves each window's pick (save_indices; x and the weight are
// saved as they are), the backward op routes grad_mean / P to the picks and
// gives x's, the weight's, the bias's and the channel bias's gradients, those
// asked for. A backward that records a graph (create_graph=True) recomputes the
// forward by PyTorch's ops from x, the weight and the biases and differentiates
// it (autograd_util.h).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../conv3d_max_pool3d_mean.h"
#include "autograd_util.h"

namespace fused_ops::autograd {
namespace {

std::tuple<at::Tensor, at::Tensor> call_conv3d_max_pool3d_mean(const at::Tensor& x, const at::Tensor& weight,
                                                               const std::optional<at::Tensor>& bias,
                                                               at::IntArrayRef padding, at::IntArrayRef pool,
                                                               double divisor, bool save_indices,
                                                               std::optional<at::ScalarType> dtype,
                                                               const std::optional<at::Tensor>& channel_bias,
                                                               bool sum_channels,
                                                               std::optional<at::ScalarType> operand_dtype) {
  static const auto op = typed_op<decltype(call_conv3d_max_pool3d_mean)>("fused_ops::conv3d_max_pool3d_mean");
  return op.call(x, weight, bias, padding, pool, divisor, save_indices, dtype, channel_bias, sum_channels,
                 operand_dtype);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> call_conv3d_max_pool3d_mean_backward(
    const at::Tensor& grad_mean, const at::Tensor& indices, const at::Tensor& x, const at::Tensor& weight,
    at::IntArrayRef padding, at::IntArrayRef pool, double divisor, std::array<bool, 4> output_mask,
    std::optional<at::ScalarType> mean_dtype, std::optional<at::ScalarType> operand_dtype) {
  static const auto op =
      typed_op<decltype(call_conv3d_max_pool3d_mean_backward)>("fused_ops::conv3d_max_pool3d_mean_backward");
  return op.call(grad_mean, indices, x, weight, padding, pool, divisor, output_mask, mean_dtype, operand_dtype);
}

constexpr size_t kInputs = 11;      // the op's arguments: backward returns a gradient (or none) for each
constexpr size_t kChannelBias = 8;  // channel_bias's position among them

// Differentiable in x, weight, bias and channel_bias (the indices output is not).
class Conv3dMaxPool3dMeanFunction : public torch::autograd::Function<Conv3dMaxPool3dMeanFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, at::IntArrayRef padding, at::IntArrayRef pool,
                               double divisor, bool save_indices, std::optional<at::ScalarType> dtype,
                               const std::optional<at::Tensor>& channel_bias, bool sum_channels,
                               std::optional<at::ScalarType> operand_dtype) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, indices] = call_conv3d_max_pool3d_mean(x, weight, bias, padding, pool, divisor, save_indices, dtype,
                                                      channel_bias, sum_channels, operand_dtype);
    mark_non_differentiable(ctx, {indices});
    // (the biases only for a backward that records a graph, which recomputes the forward)
    ctx->save_for_backward({x, weight, indices, bias.value_or(at::Tensor()), channel_bias.value_or(at::Tensor())});
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["pool"] = pool;
    ctx->saved_data["divisor"] = divisor;
    ctx->saved_data["has_bias"] = bias.has_value();
    const at::ScalarType operand = operand_dtype.value_or(weight.scalar_type());  // (the op checked it)
    ctx->saved_data["operand_dtype"] = operand;
    ctx->saved_data["mean_dtype"] = dtype.value_or(operand);
    ctx->saved_data["sum_channels"] = sum_channels;
    return {out, indices};
  }

  // grad_mean[n, o] = grad_out[n] where the forward summed the channels (an expanded view), else
  // grad_out[n, o]; the backward op rounds it to the mean's dtype and sums it over n for the channel bias.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return variable_list(kInputs);
    const auto saved = ctx->get_saved_variables();
    const std::array<bool, 3> convolution_mask = convolution_grad_mask(ctx);
    const std::array<bool, 4> mask{convolution_mask[0], convolution_mask[1], convolution_mask[2],
                                   // (needs_input_grad counts the tensors given: the bias's slot only with one)
                                   saved[4].defined() && ctx->needs_input_grad(saved[3].defined() ? 3 : 2)};
    auto& data = ctx->saved_data;
    const bool sum_channels = data["sum_channels"].toBool();
    const at::ScalarType mean_dtype = data["mean_dtype"].toScalarType();
    const at::ScalarType operand = data["operand_dtype"].toScalarType();
    if (records_graph()) {
      // The forward recomputed by PyTorch's ops (x, the weight and the bias read in the operand
      // dtype, as the op reads them) and differentiated: its picks PyTorch's, as the op's are
      // (max_pool3d.h).
      const WithoutAutocast without_autocast;
      const at::Tensor& x = saved[0];
      const at::Tensor& weight = saved[1];
      const std::optional<at::Tensor> bias =
          saved[3].defined() ? std::optional(saved[3].to(operand)) : std::nullopt;
      const at::Tensor y = at::conv3d(x.to(operand), weight.to(operand), bias, 1, data["padding"].toIntVector());
      const std::vector<int64_t> pool = data["pool"].toIntVector();
      const at::Tensor mean =
          at::max_pool3d(y / data["divisor"].toDouble(), pool, pool).mean({2, 3, 4}).to(mean_dtype);
      const at::Tensor out = add_channel_bias_and_sum(mean, defined_or_none(saved[4]), sum_channels);
      return recorded_operand_grads<4>(kInputs, mask, {0, 1, 2, kChannelBias}, out,
                                       {x, weight, saved[3], saved[4]}, grads[0]);
    }
    const at::Tensor& grad = grads[0];
    const at::Tensor grad_mean = sum_channels ? grad.unsqueeze(1).expand({grad.size(0), saved[1].size(0)}) : grad;
    variable_list grad_inputs(kInputs);
    if (!mask[0] && !mask[1] && !mask[2]) {  // (the channel bias's alone: the forward saved no picks)
      if (mask[3]) grad_inputs[kChannelBias] = grad_mean.sum(0);
      return grad_inputs;
    }
    const at::Tensor& indices =
        check_saved(saved[2], 5, "conv3d_max_pool3d_mean", "save_indices", "x, the weight or the bias");
    const auto results =
        call_conv3d_max_pool3d_mean_backward(grad_mean, indices, saved[0], saved[1], data["padding"].toIntVector(),
                                             data["pool"].toIntVector(), data["divisor"].toDouble(), mask, mean_dtype,
                                             operand);
    grad_inputs[0] = mask[0] ? std::get<0>(results) : at::Tensor();
    grad_inputs[1] = mask[1] ? std::get<1>(results) : at::Tensor();
    grad_inputs[2] = mask[2] ? std::get<2>(results) : at::Tensor();
    grad_inputs[kChannelBias] = mask[3] ? std::get<3>(results) : at::Tensor();
    return grad_inputs;
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, Autograd, m) {
  m.impl("conv3d_max_pool3d_mean",
         &AutogradKernel<Conv3dMaxPool3dMeanFunction, &call_conv3d_max_pool3d_mean>::kernel);
}

}  // namespace fused_ops::autograd
