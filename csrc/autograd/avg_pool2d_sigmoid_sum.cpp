// Autograd of avg_pool2d_sigmoid_sum, in C++ (was torch.library.register_autograd
// in fused_ops/ops/: ~10 us of Python host time per call, even under no_grad).
// Backward (the math: ../avg_pool2d_sigmoid_sum.h), from the saved s = sigmoid(p), p = avg_pool2d(x):
//   grad_x[b, c, h, w] = grad_out[b] * sum of s (1 - s) / divisor over the windows holding (h, w).
// s is a differentiable output (ds / dx = avg_pool2d's adjoint of s (1 - s)), so that a backward
// that records a graph (create_graph=True) can differentiate through it: there, and wherever s
// itself gets a gradient, the backward is PyTorch's own ops on s,
//   grad_x = avg_pool2d_backward(sigmoid_backward(grad_out[b] + grad_s, s)),
// which autograd differentiates again (sigmoid'' = s (1 - s) (1 - 2 s), to x through s).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../avg_pool2d_sigmoid_sum.h"
#include "autograd_util.h"

namespace fused_ops::autograd {
namespace {

std::tuple<at::Tensor, at::Tensor> call_avg_pool2d_sigmoid_sum(const at::Tensor& x, at::IntArrayRef kernel_size,
                                                               at::IntArrayRef stride, at::IntArrayRef padding,
                                                               bool ceil_mode, bool count_include_pad,
                                                               std::optional<int64_t> divisor_override,
                                                               bool save_sigmoid,
                                                               std::optional<at::ScalarType> dtype) {
  static const auto op = typed_op<decltype(call_avg_pool2d_sigmoid_sum)>("fused_ops::avg_pool2d_sigmoid_sum");
  return op.call(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, save_sigmoid, dtype);
}

at::Tensor call_avg_pool2d_sigmoid_sum_backward(const at::Tensor& grad_out, const at::Tensor& sigmoid,
                                                c10::SymIntArrayRef input_hw, at::IntArrayRef kernel_size,
                                                at::IntArrayRef stride, at::IntArrayRef padding,
                                                bool count_include_pad, std::optional<int64_t> divisor_override,
                                                bool channels_last) {
  static const auto op =
      typed_op<decltype(call_avg_pool2d_sigmoid_sum_backward)>("fused_ops::avg_pool2d_sigmoid_sum_backward");
  return op.call(grad_out, sigmoid, input_hw, kernel_size, stride, padding, count_include_pad, divisor_override,
                 channels_last);
}

// Differentiable in x; its outputs out and (where saved) the sigmoid.
class AvgPool2dSigmoidSumFunction : public torch::autograd::Function<AvgPool2dSigmoidSumFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, at::IntArrayRef kernel_size,
                               at::IntArrayRef stride, at::IntArrayRef padding, bool ceil_mode,
                               bool count_include_pad, std::optional<int64_t> divisor_override,
                               bool save_sigmoid, std::optional<at::ScalarType> dtype) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, sigmoid] = call_avg_pool2d_sigmoid_sum(x, kernel_size, stride, padding, ceil_mode,
                                                      count_include_pad, divisor_override, save_sigmoid, dtype);
    // (no zero gradient filled for the sigmoid before each backward; an empty one, not saved, carries none)
    mark_non_differentiable(ctx, sigmoid.dim() == 4 ? variable_list{} : variable_list{sigmoid});
    save_input_dtype(ctx, x);
    ctx->saved_data["input_hw"] = x.sym_sizes().slice(2);
    ctx->saved_data["kernel_size"] = kernel_size;
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["ceil_mode"] = ceil_mode;
    ctx->saved_data["count_include_pad"] = count_include_pad;
    ctx->saved_data["divisor_override"] = divisor_override;
    ctx->saved_data["channels_last"] = is_channels_last(x);
    ctx->save_for_backward({sigmoid});
    return {out, sigmoid};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list grad_inputs(9);
    if (!grads[0].defined() && !grads[1].defined()) return grad_inputs;
    const at::Tensor sigmoid = ctx->get_saved_variables()[0];
    check_saved(sigmoid, 4, "avg_pool2d_sigmoid_sum", "save_sigmoid", "x");
    auto& data = ctx->saved_data;
    const auto divisor_override = data["divisor_override"].toOptional<int64_t>();
    if (!records_graph() && !grads[1].defined()) {
      grad_inputs[0] = call_avg_pool2d_sigmoid_sum_backward(
          grad_in_input_dtype(ctx, grads[0]), sigmoid, data["input_hw"].toSymIntVector(),
          data["kernel_size"].toIntVector(), data["stride"].toIntVector(), data["padding"].toIntVector(),
          data["count_include_pad"].toBool(), divisor_override, data["channels_last"].toBool());
      return grad_inputs;
    }
    // The gradient of each pooled element's s, then PyTorch's sigmoid and avg_pool2d backwards.
    // (sizes as SymInts: torch.compile traces this where s gets a gradient)
    at::Tensor grad_sigmoid = grads[1].defined() ? grads[1] : at::zeros_like(sigmoid);
    if (grads[0].defined()) {
      const at::Tensor grad_out = grads[0].to(sigmoid.scalar_type());
      grad_sigmoid = grad_sigmoid + grad_out.reshape_symint({sigmoid.sym_size(0), 1, 1, 1});
    }
    const auto input_hw = data["input_hw"].toSymIntVector();
    // (avg_pool2d_backward reads its input's shape alone)
    const at::Tensor input_shape = at::zeros({1, 1, 1, 1}, sigmoid.options())
                                       .expand_symint({sigmoid.sym_size(0), sigmoid.sym_size(1), input_hw[0], input_hw[1]});
    const at::Tensor grad_x = at::avg_pool2d_backward(
        at::sigmoid_backward(grad_sigmoid, sigmoid), input_shape, data["kernel_size"].toIntVector(),
        data["stride"].toIntVector(), data["padding"].toIntVector(), data["ceil_mode"].toBool(),
        data["count_include_pad"].toBool(), divisor_override);
    const auto format = data["channels_last"].toBool() ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
    grad_inputs[0] = grad_x.to(data["x_dtype"].toScalarType()).contiguous(format);
    return grad_inputs;
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, Autograd, m) {
  m.impl("avg_pool2d_sigmoid_sum",
         &AutogradKernel<AvgPool2dSigmoidSumFunction, &call_avg_pool2d_sigmoid_sum>::kernel);
}

}  // namespace fused_ops::autograd
