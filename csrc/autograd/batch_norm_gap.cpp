// Autograd of batch_norm_gap, in C++: the op's forward through the dispatcher
// below autograd, its backward through batch_norm_gap_backward. (Its forward
// and backward take about 0.07 and 0.11 ms on a GPU at architecture D's size,
// less than a Python autograd wrapper's host time, so that path bounded them;
// the other ops' autograd kernels are beside it, for the same reason.)
#include <torch/library.h>

#include "autograd_util.h"

#include "../memory_format.h"

namespace fused_ops::autograd {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> call_batch_norm_gap(
    const at::Tensor& x, double scale, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, double eps, std::optional<at::ScalarType> dtype) {
  static const auto op = typed_op<decltype(call_batch_norm_gap)>("fused_ops::batch_norm_gap");
  return op.call(x, scale, weight, bias, running_mean, running_var, eps, dtype);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_batch_norm_gap_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& x, c10::SymIntArrayRef input_size, double scale,
    const std::optional<at::Tensor>& weight, const at::Tensor& plane_dev, const at::Tensor& mean,
    const at::Tensor& rstd, bool batch_stats, bool grad_input) {
  static const auto op = typed_op<decltype(call_batch_norm_gap_backward)>("fused_ops::batch_norm_gap_backward");
  return op.call(grad_out, x, input_size, scale, weight, plane_dev, mean, rstd, batch_stats, grad_input);
}

// Differentiable in x, weight and bias (the statistics outputs are not):
// the backward op gives their gradients (the math: ../batch_norm_gap.h).
class BatchNormGapFunction : public torch::autograd::Function<BatchNormGapFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, double scale,
                               const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                               const std::optional<at::Tensor>& running_mean,
                               const std::optional<at::Tensor>& running_var, double eps,
                               std::optional<at::ScalarType> dtype) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, plane_dev, mean, rstd, var] =
        call_batch_norm_gap(x, scale, weight, bias, running_mean, running_var, eps, dtype);
    // (no zero gradients filled for them before each backward: four small launches)
    mark_non_differentiable(ctx, {plane_dev, mean, rstd, var});
    const bool batch_stats = !running_mean.has_value();
    ctx->saved_data["batch_stats"] = batch_stats;
    ctx->saved_data["scale"] = scale;
    save_input_dtype(ctx, x);
    ctx->saved_data["input_size"] = x.sym_sizes().slice(2);
    // Whether bias is an input (its gradient's edge follows x's and weight's, when given).
    ctx->saved_data["has_bias"] = bias.has_value();
    // x only where grad_x goes through the batch statistics (with running
    // statistics grad_x does not depend on its values), or where the CPU
    // kernel lays grad_x out as a channels_last_3d x (memory_format.h).
    const bool save_x = x.requires_grad() && (batch_stats || (x.is_cpu() && is_channels_last_3d(x)));
    ctx->save_for_backward({save_x ? x : at::Tensor(), weight.value_or(at::Tensor()), plane_dev, mean, rstd});
    return {out, plane_dev, mean, rstd, var};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return variable_list(8);  // no gradient for any input
    check_first_order("batch_norm_gap", Curvature::kSmooth, grads[0]);
    const auto saved = ctx->get_saved_variables();
    const bool has_weight = saved[1].defined();  // saved whenever given
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const bool grad_input = ctx->needs_input_grad(0);
    const bool grad_weight_needed = has_weight && ctx->needs_input_grad(1);
    const bool grad_bias_needed = has_bias && ctx->needs_input_grad(has_weight ? 2 : 1);
    const at::Tensor grad_out = grad_in_input_dtype(ctx, grads[0]);
    auto [grad_x, grad_weight, grad_bias] = call_batch_norm_gap_backward(
        grad_out, defined_or_none(saved[0]), ctx->saved_data["input_size"].toSymIntVector(),
        ctx->saved_data["scale"].toDouble(), defined_or_none(saved[1]), saved[2], saved[3], saved[4],
        ctx->saved_data["batch_stats"].toBool(), grad_input);
    return {grad_input ? grad_x : at::Tensor(), at::Tensor(), grad_weight_needed ? grad_weight : at::Tensor(),
            grad_bias_needed ? grad_bias : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, Autograd, m) {
  m.impl("batch_norm_gap", &AutogradKernel<BatchNormGapFunction, &call_batch_norm_gap>::kernel);
}

}  // namespace fused_ops::autograd
