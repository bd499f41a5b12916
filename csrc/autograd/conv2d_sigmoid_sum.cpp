// Autograd of conv2d_sigmoid_sum (the math: ../conv2d_sigmoid_sum.h): the forward
// saves sigmoid'(y) per output (save_grad_factor; x and the weight are saved as
// they are), the backward op forms grad_y = grad_out[n] * sigmoid'(y) from it and
// gives x's, the weight's and the bias's gradients, those asked for. A backward that
// records a graph (create_graph=True) recomputes the forward by PyTorch's ops from x,
// the weight and the bias and differentiates it (autograd_util.h).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "autograd_util.h"

#include "../conv2d_sigmoid_sum.h"

namespace fused_ops::autograd {
namespace {

std::tuple<at::Tensor, at::Tensor> call_conv2d_sigmoid_sum(const at::Tensor& x, const at::Tensor& weight,
                                                           const std::optional<at::Tensor>& bias,
                                                           at::IntArrayRef stride, at::IntArrayRef padding,
                                                           bool save_grad_factor, std::optional<at::ScalarType> dtype) {
  static const auto op = typed_op<decltype(call_conv2d_sigmoid_sum)>("fused_ops::conv2d_sigmoid_sum");
  return op.call(x, weight, bias, stride, padding, save_grad_factor, dtype);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_conv2d_sigmoid_sum_backward(
    const at::Tensor& grad_out, const at::Tensor& grad_factor, const at::Tensor& x, const at::Tensor& weight,
    at::IntArrayRef stride, at::IntArrayRef padding, std::array<bool, 3> output_mask) {
  static const auto op =
      typed_op<decltype(call_conv2d_sigmoid_sum_backward)>("fused_ops::conv2d_sigmoid_sum_backward");
  return op.call(grad_out, grad_factor, x, weight, stride, padding, output_mask);
}

// Differentiable in x, weight and bias (the grad_factor output is not).
class Conv2dSigmoidSumFunction : public torch::autograd::Function<Conv2dSigmoidSumFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                               at::IntArrayRef padding, bool save_grad_factor, std::optional<at::ScalarType> dtype) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, grad_factor] = call_conv2d_sigmoid_sum(x, weight, bias, stride, padding, save_grad_factor, dtype);
    mark_non_differentiable(ctx, {grad_factor});
    // (the bias only for a backward that records a graph, which recomputes the forward)
    ctx->save_for_backward({x, weight, grad_factor, bias.value_or(at::Tensor())});
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["has_bias"] = bias.has_value();
    return {out, grad_factor};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return variable_list(7);
    const auto saved = ctx->get_saved_variables();
    const std::array<bool, 3> mask = convolution_grad_mask(ctx);
    const std::vector<int64_t> stride = ctx->saved_data["stride"].toIntVector();
    const std::vector<int64_t> padding = ctx->saved_data["padding"].toIntVector();
    if (records_graph()) {
      // The forward recomputed by PyTorch's ops (x read in the weight's dtype, as the op reads
      // it; the tail in its accumulation type) and differentiated.
      const WithoutAutocast without_autocast;
      const at::Tensor& x = saved[0];
      const at::Tensor& weight = saved[1];
      const at::Tensor y = at::conv2d(x.to(weight.scalar_type()), weight, defined_or_none(saved[3]), stride, padding);
      const at::Tensor out = at::sigmoid(y.to(at::toOpMathType(weight.scalar_type()))).sum({1, 2, 3});
      return recorded_convolution_grads(7, mask, out, {x, weight, saved[3]}, grads[0]);
    }
    const at::Tensor& grad_factor = check_saved(saved[2], 5, "conv2d_sigmoid_sum", "save_grad_factor",
                                                "x, the weight or the bias");
    return convolution_grad_inputs(
        7, mask, call_conv2d_sigmoid_sum_backward(grads[0], grad_factor, saved[0], saved[1], stride, padding, mask));
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, Autograd, m) {
  m.impl("conv2d_sigmoid_sum", &AutogradKernel<Conv2dSigmoidSumFunction, &call_conv2d_sigmoid_sum>::kernel);
}

}  // namespace fused_ops::autograd
