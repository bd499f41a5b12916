// Autograd of batch_norm_gap, in C++: the op's forward through the dispatcher
// below autograd, its backward through batch_norm_gap_backward. (Its forward
// and backward take about 0.07 and 0.11 ms on a GPU at architecture D's size,
// less than a Python autograd wrapper's host time, so that path bounded them;
// the other ops' autograd kernels are beside it, for the same reason.) A backward
// that records a graph (create_graph=True) computes its gradients by PyTorch's ops
// (recorded_backward).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>

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
    const bool batch_stats = !running_mean.has_value();
    // (no zero gradients filled for them before each backward: small launches.) With running
    // statistics plane_dev is differentiable (d plane_dev[b, c] / d x[b, c, s] = scale / S): a
    // backward that records a graph computes the weight's gradient from it (recorded_backward).
    if (batch_stats) {
      mark_non_differentiable(ctx, {plane_dev, mean, rstd, var});
    } else {
      mark_non_differentiable(ctx, {mean, rstd, var});
    }
    ctx->saved_data["batch_stats"] = batch_stats;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["eps"] = eps;
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
    // grads[1]: plane_dev's, from a graph recorded_backward made (running statistics only)
    if (!grads[0].defined() && !grads[1].defined()) return variable_list(8);  // no gradient for any input
    const auto saved = ctx->get_saved_variables();
    const bool has_weight = saved[1].defined();  // saved whenever given
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const std::array<bool, 3> needed = {ctx->needs_input_grad(0), has_weight && ctx->needs_input_grad(1),
                                        has_bias && ctx->needs_input_grad(has_weight ? 2 : 1)};
    if (records_graph() || grads[1].defined()) {
      const auto [grad_x, grad_weight, grad_bias] = recorded_backward(ctx, grads, saved, needed);
      return {grad_x, at::Tensor(), grad_weight, grad_bias, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    const at::Tensor grad_out = grad_in_input_dtype(ctx, grads[0]);
    auto [grad_x, grad_weight, grad_bias] = call_batch_norm_gap_backward(
        grad_out, defined_or_none(saved[0]), ctx->saved_data["input_size"].toSymIntVector(),
        ctx->saved_data["scale"].toDouble(), defined_or_none(saved[1]), saved[2], saved[3], saved[4],
        ctx->saved_data["batch_stats"].toBool(), needed[0]);
    return {needed[0] ? grad_x : at::Tensor(), at::Tensor(), needed[1] ? grad_weight : at::Tensor(),
            needed[2] ? grad_bias : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }

 private:
  // (grad_x, grad_weight, grad_bias), those `needed`, by PyTorch's differentiable ops (a
  // backward that records a graph, or one through plane_dev), with g = grad_out[b, c]:
  //   batch statistics, x saved (x requires grad): the forward recomputed from x and
  //     differentiated (the statistics' derivatives in x: ../batch_norm_gap.h);
  //   batch statistics, no x: grad_weight = rstd sum_b g[b] (dev[b] - mean_b dev),
  //     grad_bias = sum_b g[b] (linear in g; the statistics are constants);
  //   running statistics: grad_x[b, c, s] = scale (w rstd g[b] + grad_plane_dev[b]) / S,
  //     grad_weight = rstd sum_b g[b] dev[b] (dev = plane_dev as an output, which records its
  //     dependence on x), grad_bias = sum_b g[b].
  static std::array<at::Tensor, 3> recorded_backward(AutogradContext* ctx, const variable_list& grads,
                                                     const variable_list& saved, std::array<bool, 3> needed) {
    auto& data = ctx->saved_data;
    const double scale = data["scale"].toDouble();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& plane_dev = saved[2];
    const at::Tensor& rstd = saved[4];
    const auto acc = rstd.scalar_type();
    // (sizes as SymInts: torch.compile traces this where plane_dev gets a gradient)
    const c10::SymInt batch = plane_dev.sym_size(0), channels = plane_dev.sym_size(1);
    const at::Tensor g = grads[0].defined() ? grads[0].reshape_symint({batch, channels}).to(acc) : at::Tensor();
    std::array<at::Tensor, 3> result;
    if (needed[2] && g.defined()) result[2] = g.sum(0);
    if (data["batch_stats"].toBool() && x.defined()) {
      const WithoutAutocast without_autocast;
      const at::Tensor normalized =
          at::batch_norm((x * scale).to(acc), defined_or_none(weight.defined() ? weight.to(acc) : weight), {}, {}, {},
                         true, 0.0, data["eps"].toDouble(), at::globalContext().userEnabledCuDNN());
      variable_list wrt;
      if (needed[0]) wrt.push_back(x);
      if (needed[1]) wrt.push_back(weight);
      if (wrt.empty()) return result;
      const variable_list recorded = recorded_grads(normalized.mean({2, 3, 4}, true), wrt, grads[0]);
      if (needed[0]) result[0] = recorded[0];
      if (needed[1]) result[1] = recorded.back();
      return result;
    }
    if (needed[1] && g.defined()) {
      const at::Tensor centered = data["batch_stats"].toBool() ? plane_dev - plane_dev.mean(0) : plane_dev;
      result[1] = (g * centered).sum(0) * rstd;
    }
    if (needed[0]) {  // (running statistics: with batch statistics x requiring grad is saved)
      at::Tensor per_plane = at::zeros_symint({batch, channels}, rstd.options());
      if (g.defined()) per_plane = per_plane + g * (weight.defined() ? weight.to(acc) * rstd : rstd);
      if (grads[1].defined()) per_plane = per_plane + grads[1].to(acc);
      const auto size = data["input_size"].toSymIntVector();
      result[0] = per_plane.mul(scale)
                      .div(size[0] * size[1] * size[2])
                      .reshape_symint({batch, channels, 1, 1, 1})
                      .expand_symint({batch, channels, size[0], size[1], size[2]})
                      .to(data["x_dtype"].toScalarType());
    }
    return result;
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, Autograd, m) {
  m.impl("batch_norm_gap", &AutogradKernel<BatchNormGapFunction, &call_batch_norm_gap>::kernel);
}

}  // namespace fused_ops::autograd
