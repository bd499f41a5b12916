// Autograd of parity_max_pool3d_mean, in C++ (was torch.library.register_autograd
// in fused_ops/ops/: ~10 us of Python host time per call, even under no_grad).
// Backward (the math: ../parity_max_pool3d.h): each window's gradient goes to its saved pick alone,
//   grad_y[n, m, c, q] = grad_mean[n, c] / (Md Mh Mw) where q is (n, m, c)'s pick, else 0.
// A backward that records a graph (create_graph=True) computes it as grad_mean[n, c] times that
// routing of a 1, a product autograd differentiates (autograd_util.h).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "autograd_util.h"

namespace fused_ops::autograd {
namespace {

std::tuple<at::Tensor, at::Tensor> call_parity_max_pool3d_mean(const at::Tensor& y, bool save_indices,
                                                               std::optional<at::ScalarType> dtype) {
  static const auto op = typed_op<decltype(call_parity_max_pool3d_mean)>("fused_ops::parity_max_pool3d_mean");
  return op.call(y, save_indices, dtype);
}

at::Tensor call_parity_max_pool3d_mean_backward(const at::Tensor& grad_mean, const at::Tensor& picks,
                                                int64_t parity_classes) {
  static const auto op =
      typed_op<decltype(call_parity_max_pool3d_mean_backward)>("fused_ops::parity_max_pool3d_mean_backward");
  return op.call(grad_mean, picks, parity_classes);
}

// Differentiable in y (the picks output is not).
class ParityMaxPool3dMeanFunction : public torch::autograd::Function<ParityMaxPool3dMeanFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& y, bool save_indices,
                               std::optional<at::ScalarType> dtype) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [mean, picks] = call_parity_max_pool3d_mean(y, save_indices, dtype);
    mark_non_differentiable(ctx, {picks});
    save_input_dtype(ctx, y);
    // an int in the backward op's schema
    ctx->saved_data["parity_classes"] = y.sym_size(5).guard_int(__FILE__, __LINE__);
    ctx->save_for_backward({picks});
    return {mean, picks};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto grad_y = [ctx](const at::Tensor& grad_mean) {
      const at::Tensor picks = ctx->get_saved_variables()[0];
      check_saved(picks, 5, "parity_max_pool3d_mean", "save_indices", "y");
      return call_parity_max_pool3d_mean_backward(grad_mean, picks, ctx->saved_data["parity_classes"].toInt());
    };
    // Recording a graph: each (n, c)'s gradient routed as grad_y routes a 1 (the picks fixed,
    // linear in grad_mean and constant in y), by a product autograd differentiates in grad_mean.
    const auto recorded_grad_y = [&grad_y](const at::Tensor& grad_mean) {
      const at::Tensor routing = [&] {
        const at::NoGradGuard no_grad;  // (constant: the picks)
        return grad_y(at::ones_like(grad_mean));
      }();
      return routing * grad_mean.reshape({grad_mean.size(0), 1, 1, 1, grad_mean.size(1), 1});
    };
    return first_input_backward(ctx, grads, 3, grad_y, recorded_grad_y);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, Autograd, m) {
  m.impl("parity_max_pool3d_mean",
         &AutogradKernel<ParityMaxPool3dMeanFunction, &call_parity_max_pool3d_mean>::kernel);
}

}  // namespace fused_ops::autograd
