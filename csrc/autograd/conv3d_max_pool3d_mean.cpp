// Autograd of conv3d_max_pool3d_mean (the math: ../conv3d_max_pool3d_mean.h):
// the forward saves each window's pick (save_indices; x and the weight are
// saved as they are), the backward op routes grad_mean / P to the picks and
// gives x's, the weight's and the bias's gradients, those asked for. A backward that
// records a graph (create_graph=True) recomputes the forward by PyTorch's ops from x,
// the weight and the bias and differentiates it (autograd_util.h).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "autograd_util.h"

namespace fused_ops::autograd {
namespace {

std::tuple<at::Tensor, at::Tensor> call_conv3d_max_pool3d_mean(const at::Tensor& x, const at::Tensor& weight,
                                                               const std::optional<at::Tensor>& bias,
                                                               at::IntArrayRef padding, at::IntArrayRef pool,
                                                               double divisor, bool save_indices,
                                                               std::optional<at::ScalarType> dtype) {
  static const auto op = typed_op<decltype(call_conv3d_max_pool3d_mean)>("fused_ops::conv3d_max_pool3d_mean");
  return op.call(x, weight, bias, padding, pool, divisor, save_indices, dtype);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_conv3d_max_pool3d_mean_backward(
    const at::Tensor& grad_mean, const at::Tensor& indices, const at::Tensor& x, const at::Tensor& weight,
    at::IntArrayRef padding, at::IntArrayRef pool, double divisor, std::array<bool, 3> output_mask) {
  static const auto op =
      typed_op<decltype(call_conv3d_max_pool3d_mean_backward)>("fused_ops::conv3d_max_pool3d_mean_backward");
  return op.call(grad_mean, indices, x, weight, padding, pool, divisor, output_mask);
}

// Differentiable in x, weight and bias (the indices output is not).
class Conv3dMaxPool3dMeanFunction : public torch::autograd::Function<Conv3dMaxPool3dMeanFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, at::IntArrayRef padding, at::IntArrayRef pool,
                               double divisor, bool save_indices, std::optional<at::ScalarType> dtype) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [mean, indices] = call_conv3d_max_pool3d_mean(x, weight, bias, padding, pool, divisor, save_indices, dtype);
    mark_non_differentiable(ctx, {indices});
    // (the bias only for a backward that records a graph, which recomputes the forward)
    ctx->save_for_backward({x, weight, indices, bias.value_or(at::Tensor())});
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["pool"] = pool;
    ctx->saved_data["divisor"] = divisor;
    ctx->saved_data["has_bias"] = bias.has_value();
    return {mean, indices};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return variable_list(8);
    const auto saved = ctx->get_saved_variables();
    const std::array<bool, 3> mask = convolution_grad_mask(ctx);
    auto& data = ctx->saved_data;
    if (records_graph()) {
      // The forward recomputed by PyTorch's ops (x read in the weight's dtype, as the op reads
      // it) and differentiated: its picks PyTorch's, as the op's are (max_pool3d.h).
      const WithoutAutocast without_autocast;
      const at::Tensor& x = saved[0];
      const at::Tensor& weight = saved[1];
      const at::Tensor y = at::conv3d(x.to(weight.scalar_type()), weight, defined_or_none(saved[3]), 1,
                                      data["padding"].toIntVector());
      const std::vector<int64_t> pool = data["pool"].toIntVector();
      const at::Tensor mean = at::max_pool3d(y / data["divisor"].toDouble(), pool, pool).mean({2, 3, 4});
      return recorded_convolution_grads(8, mask, mean, {x, weight, saved[3]}, grads[0]);
    }
    const at::Tensor& indices =
        check_saved(saved[2], 5, "conv3d_max_pool3d_mean", "save_indices", "x, the weight or the bias");
    return convolution_grad_inputs(
        8, mask,
        call_conv3d_max_pool3d_mean_backward(grads[0], indices, saved[0], saved[1], data["padding"].toIntVector(),
                                             data["pool"].toIntVector(), data["divisor"].toDouble(), mask));
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, Autograd, m) {
  m.impl("conv3d_max_pool3d_mean",
         &AutogradKernel<Conv3dMaxPool3dMeanFunction, &call_conv3d_max_pool3d_mean>::kernel);
}

}  // namespace fused_ops::autograd
