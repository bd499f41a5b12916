// Autograd of conv2d_sigmoid_sum (the math: ../conv2d_sigmoid_sum.h): the
// backward recomputes the convolution (the forward keeps nothing of its size),
//   s = sigmoid(conv2d(x, weight, bias)),  grad_y = grad_out[n] * s * (1 - s),
// then PyTorch's convolution backward gives x's, the weight's and the bias's
// gradients, those asked for (x's in its own dtype where it was rounded to the
// weight's: the rounding's gradient is the identity).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "autograd_util.h"

#include "../conv2d_sigmoid_sum.h"

namespace fused_ops::autograd {
namespace {

at::Tensor call_conv2d_sigmoid_sum(const at::Tensor& x, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                   at::IntArrayRef padding, std::optional<at::ScalarType> dtype) {
  static const auto op = typed_op<decltype(call_conv2d_sigmoid_sum)>("fused_ops::conv2d_sigmoid_sum");
  return op.call(x, weight, bias, stride, padding, dtype);
}

// Differentiable in x, weight and bias.
class Conv2dSigmoidSumFunction : public torch::autograd::Function<Conv2dSigmoidSumFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                               at::IntArrayRef padding, std::optional<at::ScalarType> dtype) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::Tensor out = call_conv2d_sigmoid_sum(x, weight, bias, stride, padding, dtype);
    ctx->save_for_backward({x, weight, bias.has_value() ? *bias : at::Tensor()});
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["padding"] = padding;
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list grad_inputs(6);
    if (!grads[0].defined()) return grad_inputs;
    check_first_order("conv2d_sigmoid_sum", Curvature::kSmooth, grads[0]);
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &bias = saved[2];
    const auto stride = ctx->saved_data["stride"].toIntVector();
    const auto padding = ctx->saved_data["padding"].toIntVector();
    const at::Tensor input = x.to(weight.scalar_type());
    const at::Tensor s = at::sigmoid(at::conv2d(input, weight, defined_or_none(bias), stride, padding));
    const at::Tensor grad_y = at::sigmoid_backward(grads[0].to(s.scalar_type()).view({-1, 1, 1, 1}).expand_as(s), s);
    const std::array<bool, 3> mask{ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                   bias.defined() && ctx->needs_input_grad(2)};
    auto [grad_x, grad_weight, grad_bias] = at::convolution_backward(
        grad_y, input, weight, bias.defined() ? std::optional<at::IntArrayRef>(bias.sizes()) : std::nullopt, stride,
        padding, {1, 1}, false, {0, 0}, 1, mask);
    grad_inputs[0] = grad_x.defined() ? grad_x.to(x.scalar_type()) : grad_x;
    grad_inputs[1] = grad_weight;
    grad_inputs[2] = grad_bias;
    return grad_inputs;
  }
};

at::Tensor conv2d_sigmoid_sum_autograd(const at::Tensor& x, const at::Tensor& weight,
                                       const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                       at::IntArrayRef padding, std::optional<at::ScalarType> dtype) {
  if (!records_grad(x, weight, bias)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_conv2d_sigmoid_sum(x, weight, bias, stride, padding, dtype);
  }
  return Conv2dSigmoidSumFunction::apply(x, weight, bias, stride, padding, dtype)[0];
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, Autograd, m) {
  m.impl("conv2d_sigmoid_sum", &conv2d_sigmoid_sum_autograd);
}

}  // namespace fused_ops::autograd
