// Autograd of avg_pool2d_sigmoid_sum, in C++ (was torch.library.register_autograd
// in fused_ops/ops.py: ~10 us of Python host time per call, even under no_grad).
// Backward (the math: ../avg_pool2d_sigmoid_sum.h), from the saved factor sigmoid'(p) / divisor:
//   grad_x[b, c, h, w] = grad_out[b] * sum of grad_factor[b, c, oh, ow] over the windows holding (h, w).
#include <torch/library.h>

#include "../avg_pool2d_sigmoid_sum.h"
#include "autograd_util.h"

namespace fused_ops::autograd {
namespace {

std::tuple<at::Tensor, at::Tensor> call_avg_pool2d_sigmoid_sum(const at::Tensor& x, at::IntArrayRef kernel_size,
                                                               at::IntArrayRef stride, at::IntArrayRef padding,
                                                               bool ceil_mode, bool count_include_pad,
                                                               std::optional<int64_t> divisor_override,
                                                               bool save_grad_factor,
                                                               std::optional<at::ScalarType> dtype) {
  static const auto op = typed_op<decltype(call_avg_pool2d_sigmoid_sum)>("fused_ops::avg_pool2d_sigmoid_sum");
  return op.call(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, save_grad_factor,
                 dtype);
}

at::Tensor call_avg_pool2d_sigmoid_sum_backward(const at::Tensor& grad_out, const at::Tensor& grad_factor,
                                                c10::SymIntArrayRef input_hw, at::IntArrayRef kernel_size,
                                                at::IntArrayRef stride, at::IntArrayRef padding,
                                                bool channels_last) {
  static const auto op =
      typed_op<decltype(call_avg_pool2d_sigmoid_sum_backward)>("fused_ops::avg_pool2d_sigmoid_sum_backward");
  return op.call(grad_out, grad_factor, input_hw, kernel_size, stride, padding, channels_last);
}

// Differentiable in x (the grad_factor output is not).
class AvgPool2dSigmoidSumFunction : public torch::autograd::Function<AvgPool2dSigmoidSumFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, at::IntArrayRef kernel_size,
                               at::IntArrayRef stride, at::IntArrayRef padding, bool ceil_mode,
                               bool count_include_pad, std::optional<int64_t> divisor_override,
                               bool save_grad_factor, std::optional<at::ScalarType> dtype) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, grad_factor] = call_avg_pool2d_sigmoid_sum(x, kernel_size, stride, padding, ceil_mode,
                                                          count_include_pad, divisor_override, save_grad_factor, dtype);
    mark_non_differentiable(ctx, {grad_factor});
    save_input_dtype(ctx, x);
    ctx->saved_data["input_hw"] = x.sym_sizes().slice(2);
    ctx->saved_data["kernel_size"] = kernel_size;
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["channels_last"] = is_channels_last(x);
    ctx->save_for_backward({grad_factor});
    return {out, grad_factor};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return first_input_backward(ctx, grads, 9, "avg_pool2d_sigmoid_sum", Curvature::kSmooth, [ctx](const at::Tensor& grad_out) {
      const at::Tensor grad_factor = ctx->get_saved_variables()[0];
      check_saved(grad_factor, 4, "avg_pool2d_sigmoid_sum", "save_grad_factor", "x");
      auto& data = ctx->saved_data;
      return call_avg_pool2d_sigmoid_sum_backward(grad_out, grad_factor, data["input_hw"].toSymIntVector(),
                                                  data["kernel_size"].toIntVector(), data["stride"].toIntVector(),
                                                  data["padding"].toIntVector(), data["channels_last"].toBool());
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, Autograd, m) {
  m.impl("avg_pool2d_sigmoid_sum",
         &AutogradKernel<AvgPool2dSigmoidSumFunction, &call_avg_pool2d_sigmoid_sum>::kernel);
}

}  // namespace fused_ops::autograd
