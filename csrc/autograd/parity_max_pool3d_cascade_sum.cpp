// Autograd of parity_max_pool3d_cascade_sum, in C++ (was torch.library.register_autograd
// in fused_ops/ops/: ~10 us of Python host time per call, even under no_grad).
// Backward (the math: ../parity_max_pool3d.h): each output's gradient goes, per channel, to its saved pick,
//   grad_y[n, m, c, q] = grad_out[n, 0, o] where (off, q) is (n, o, c)'s pick, m = k2 o + off; else 0.
// A backward that records a graph (create_graph=True) computes it as the picks' 0/1 mask times
// grad_out spread over its windows, ops autograd differentiates (autograd_util.h).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "autograd_util.h"

namespace fused_ops::autograd {
namespace {

std::tuple<at::Tensor, at::Tensor> call_parity_max_pool3d_cascade_sum(const at::Tensor& y, at::IntArrayRef kernel2,
                                                                      bool save_indices,
                                                                      std::optional<at::ScalarType> dtype) {
  static const auto op =
      typed_op<decltype(call_parity_max_pool3d_cascade_sum)>("fused_ops::parity_max_pool3d_cascade_sum");
  return op.call(y, kernel2, save_indices, dtype);
}

at::Tensor call_parity_max_pool3d_cascade_sum_backward(const at::Tensor& grad_out, const at::Tensor& picks,
                                                       c10::SymIntArrayRef stage1_size, at::IntArrayRef kernel2,
                                                       int64_t parity_classes) {
  static const auto op = typed_op<decltype(call_parity_max_pool3d_cascade_sum_backward)>(
      "fused_ops::parity_max_pool3d_cascade_sum_backward");
  return op.call(grad_out, picks, stage1_size, kernel2, parity_classes);
}

// Differentiable in y (the picks output is not).
class ParityMaxPool3dCascadeSumFunction : public torch::autograd::Function<ParityMaxPool3dCascadeSumFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& y, at::IntArrayRef kernel2,
                               bool save_indices, std::optional<at::ScalarType> dtype) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, picks] = call_parity_max_pool3d_cascade_sum(y, kernel2, save_indices, dtype);
    mark_non_differentiable(ctx, {picks});
    save_input_dtype(ctx, y);
    ctx->saved_data["stage1_size"] = y.sym_sizes().slice(1, 3);
    ctx->saved_data["kernel2"] = kernel2;
    // an int in the backward op's schema
    ctx->saved_data["parity_classes"] = y.sym_size(5).guard_int(__FILE__, __LINE__);
    ctx->save_for_backward({picks});
    return {out, picks};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto grad_y = [ctx](const at::Tensor& grad_out) {
      const at::Tensor picks = ctx->get_saved_variables()[0];
      check_saved(picks, 5, "parity_max_pool3d_cascade_sum", "save_indices", "y");
      auto& data = ctx->saved_data;
      return call_parity_max_pool3d_cascade_sum_backward(grad_out, picks, data["stage1_size"].toSymIntVector(),
                                                         data["kernel2"].toIntVector(),
                                                         data["parity_classes"].toInt());
    };
    // Recording a graph: every y element lies in at most one window of each stage, so
    // grad_y = picked * grad_out[n, 0, m / k2] with picked = grad_y of ones (1 where (n, m, c, q)
    // is a pick, 0 elsewhere: also where m lies in no stage-2 window): grad_out spread over its
    // windows' k2 positions a dim, zero-padded to y's, by ops autograd differentiates.
    const auto recorded_grad_y = [ctx, &grad_y](const at::Tensor& grad_out) {
      const at::Tensor picked = [&] {
        const at::NoGradGuard no_grad;  // (constant: the picks)
        return grad_y(at::ones_like(grad_out));
      }();
      const std::vector<int64_t> k2 = ctx->saved_data["kernel2"].toIntVector();
      const int64_t n = grad_out.size(0), o[3] = {grad_out.size(2), grad_out.size(3), grad_out.size(4)};
      const at::Tensor spread = grad_out.reshape({n, o[0], 1, o[1], 1, o[2], 1})
                                    .expand({n, o[0], k2[0], o[1], k2[1], o[2], k2[2]})
                                    .reshape({n, o[0] * k2[0], o[1] * k2[1], o[2] * k2[2]});
      const at::Tensor padded = at::constant_pad_nd(
          spread, {0, picked.size(3) - o[2] * k2[2], 0, picked.size(2) - o[1] * k2[1], 0,
                   picked.size(1) - o[0] * k2[0]});
      return picked * padded.reshape({n, picked.size(1), picked.size(2), picked.size(3), 1, 1});
    };
    return first_input_backward(ctx, grads, 4, grad_y, recorded_grad_y);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, Autograd, m) {
  m.impl("parity_max_pool3d_cascade_sum",
         &AutogradKernel<ParityMaxPool3dCascadeSumFunction, &call_parity_max_pool3d_cascade_sum>::kernel);
}

}  // namespace fused_ops::autograd
