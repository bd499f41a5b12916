// Autograd of max_pool3d_mean, in C++ (was torch.library.register_autograd in
// fused_ops/ops/: ~10 us of Python host time per call, even under no_grad).
// Backward, with N = D' H' W' (the math: ../max_pool3d_mean.h):
//   grad_x[b, c, e] = grad_mean[b, c] / N / divisor times the number of windows
//   picking e, the picks read from the saved indices or recomputed from x.
// A backward that records a graph (create_graph=True) computes it as grad_mean[b, c]
// times that routing of a 1, a product autograd differentiates (autograd_util.h).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "autograd_util.h"

namespace fused_ops::autograd {
namespace {

std::tuple<at::Tensor, at::Tensor> call_max_pool3d_mean(const at::Tensor& x, at::IntArrayRef kernel_size,
                                                        at::IntArrayRef stride, at::IntArrayRef padding,
                                                        bool ceil_mode, double divisor, bool save_indices,
                                                        std::optional<at::ScalarType> dtype) {
  static const auto op = typed_op<decltype(call_max_pool3d_mean)>("fused_ops::max_pool3d_mean");
  return op.call(x, kernel_size, stride, padding, ceil_mode, divisor, save_indices, dtype);
}

at::Tensor call_max_pool3d_mean_backward(const at::Tensor& grad_mean, const std::optional<at::Tensor>& indices,
                                         const std::optional<at::Tensor>& x, c10::SymIntArrayRef input_size,
                                         at::IntArrayRef kernel_size, at::IntArrayRef stride,
                                         at::IntArrayRef padding, bool ceil_mode, double divisor) {
  static const auto op = typed_op<decltype(call_max_pool3d_mean_backward)>("fused_ops::max_pool3d_mean_backward");
  return op.call(grad_mean, indices, x, input_size, kernel_size, stride, padding, ceil_mode, divisor);
}

// Differentiable in x (the indices output is not).
class MaxPool3dMeanFunction : public torch::autograd::Function<MaxPool3dMeanFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, at::IntArrayRef kernel_size,
                               at::IntArrayRef stride, at::IntArrayRef padding, bool ceil_mode, double divisor,
                               bool save_indices, std::optional<at::ScalarType> dtype) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [mean, indices] =
        call_max_pool3d_mean(x, kernel_size, stride, padding, ceil_mode, divisor, save_indices, dtype);
    mark_non_differentiable(ctx, {indices});
    save_input_dtype(ctx, x);
    save_input_format(ctx, x);
    ctx->saved_data["input_size"] = x.sym_sizes().slice(2);
    ctx->saved_data["kernel_size"] = kernel_size;
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["ceil_mode"] = ceil_mode;
    ctx->saved_data["divisor"] = divisor;
    // The forward's picks, or x to recompute them from where it saved none.
    const bool saved = indices.dim() == 5;
    ctx->save_for_backward({saved ? indices : at::Tensor(), saved ? at::Tensor() : x});
    return {mean, indices};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto grad_x = [ctx](const at::Tensor& grad_mean) {
      const auto saved = ctx->get_saved_variables();
      auto& data = ctx->saved_data;
      const at::Tensor grad_x = call_max_pool3d_mean_backward(
          grad_mean, defined_or_none(saved[0]), defined_or_none(saved[1]), data["input_size"].toSymIntVector(),
          data["kernel_size"].toIntVector(), data["stride"].toIntVector(), data["padding"].toIntVector(),
          data["ceil_mode"].toBool(), data["divisor"].toDouble());
      return grad_in_input_format(ctx, grad_x);
    };
    // Recording a graph: each plane's gradient routed as grad_x routes a 1 (the picks fixed,
    // linear in grad_mean and constant in x), by a product autograd differentiates in grad_mean.
    const auto recorded_grad_x = [&grad_x](const at::Tensor& grad_mean) {
      const at::Tensor routing = [&] {
        const at::NoGradGuard no_grad;  // (constant: the picks)
        return grad_x(at::ones_like(grad_mean));
      }();
      return routing * grad_mean.reshape({grad_mean.size(0), grad_mean.size(1), 1, 1, 1});
    };
    return first_input_backward(ctx, grads, 8, grad_x, recorded_grad_x);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, Autograd, m) {
  m.impl("max_pool3d_mean", &AutogradKernel<MaxPool3dMeanFunction, &call_max_pool3d_mean>::kernel);
}

}  // namespace fused_ops::autograd
