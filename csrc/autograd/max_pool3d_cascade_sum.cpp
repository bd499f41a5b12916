// Autograd of max_pool3d_cascade_sum, in C++ (was torch.library.register_autograd
// in fused_ops/ops.py: ~10 us of Python host time per call, even under no_grad).
// Backward (the math: ../max_pool3d_cascade_sum.h): each output's gradient goes,
// per channel, to that channel's cascade pick,
//   grad_x[b, c, e] = sum of grad_out[b, 0, p] over the outputs p picking e for c,
// the picks read from the saved indices or recomputed from x.
#include <torch/library.h>

#include "autograd_util.h"

namespace fused_ops::autograd {
namespace {

std::tuple<at::Tensor, at::Tensor> call_max_pool3d_cascade_sum(
    const at::Tensor& x, at::IntArrayRef kernel1, at::IntArrayRef stride1, at::IntArrayRef padding1,
    at::IntArrayRef kernel2, at::IntArrayRef stride2, at::IntArrayRef padding2, bool save_indices,
    std::optional<at::ScalarType> dtype) {
  static const auto op = typed_op<decltype(call_max_pool3d_cascade_sum)>("fused_ops::max_pool3d_cascade_sum");
  return op.call(x, kernel1, stride1, padding1, kernel2, stride2, padding2, save_indices, dtype);
}

at::Tensor call_max_pool3d_cascade_sum_backward(const at::Tensor& grad_out, const std::optional<at::Tensor>& indices,
                                                const std::optional<at::Tensor>& x, c10::SymIntArrayRef input_size,
                                                at::IntArrayRef kernel1, at::IntArrayRef stride1,
                                                at::IntArrayRef padding1, at::IntArrayRef kernel2,
                                                at::IntArrayRef stride2, at::IntArrayRef padding2) {
  static const auto op =
      typed_op<decltype(call_max_pool3d_cascade_sum_backward)>("fused_ops::max_pool3d_cascade_sum_backward");
  return op.call(grad_out, indices, x, input_size, kernel1, stride1, padding1, kernel2, stride2, padding2);
}

// The keys of the two stages' pooling arguments in saved_data, in the schema's order.
constexpr const char* kPoolArgs[6] = {"kernel1", "stride1", "padding1", "kernel2", "stride2", "padding2"};

// Differentiable in x (the indices output is not).
class MaxPool3dCascadeSumFunction : public torch::autograd::Function<MaxPool3dCascadeSumFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, at::IntArrayRef kernel1,
                               at::IntArrayRef stride1, at::IntArrayRef padding1, at::IntArrayRef kernel2,
                               at::IntArrayRef stride2, at::IntArrayRef padding2, bool save_indices,
                               std::optional<at::ScalarType> dtype) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, indices] =
        call_max_pool3d_cascade_sum(x, kernel1, stride1, padding1, kernel2, stride2, padding2, save_indices, dtype);
    mark_non_differentiable(ctx, {indices});
    save_input_dtype(ctx, x);
    save_input_format(ctx, x);
    ctx->saved_data["input_size"] = x.sym_sizes().slice(2);
    const at::IntArrayRef pools[6] = {kernel1, stride1, padding1, kernel2, stride2, padding2};
    for (int i = 0; i < 6; ++i) ctx->saved_data[kPoolArgs[i]] = pools[i];
    // The forward's picks, or x to recompute them from where it saved none.
    const bool saved = indices.dim() == 5;
    ctx->save_for_backward({saved ? indices : at::Tensor(), saved ? at::Tensor() : x});
    return {out, indices};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return first_input_backward(ctx, grads, 9, "max_pool3d_cascade_sum", Curvature::kPiecewiseLinear, [ctx](const at::Tensor& grad_out) {
      const auto saved = ctx->get_saved_variables();
      std::vector<int64_t> pools[6];
      for (int i = 0; i < 6; ++i) pools[i] = ctx->saved_data[kPoolArgs[i]].toIntVector();
      const at::Tensor grad_x = call_max_pool3d_cascade_sum_backward(
          grad_out, defined_or_none(saved[0]), defined_or_none(saved[1]),
          ctx->saved_data["input_size"].toSymIntVector(), pools[0], pools[1], pools[2], pools[3], pools[4], pools[5]);
      return grad_in_input_format(ctx, grad_x);
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, Autograd, m) {
  m.impl("max_pool3d_cascade_sum",
         &AutogradKernel<MaxPool3dCascadeSumFunction, &call_max_pool3d_cascade_sum>::kernel);
}

}  // namespace fused_ops::autograd
