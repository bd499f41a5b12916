// Autograd of box_fold2d and of its backward (the math: ../box_fold2d.h). Both
// are linear and each is the other's adjoint: box_fold2d's gradient is
// box_fold2d_backward of the result's gradient, and box_fold2d_backward's is
// box_fold2d of its result's gradient. Each backward calls the other op through
// the dispatcher, autograd included: a backward with create_graph=True records
// it, and second-order gradients are right.
#include <torch/library.h>

#include "autograd_util.h"

namespace fused_ops::autograd {
namespace {

at::Tensor call_box_fold2d(const at::Tensor& weight, at::IntArrayRef box, double divisor,
                           std::optional<at::ScalarType> dtype) {
  static const auto op = typed_op<decltype(call_box_fold2d)>("fused_ops::box_fold2d");
  return op.call(weight, box, divisor, dtype);
}

at::Tensor call_box_fold2d_backward(const at::Tensor& grad, at::IntArrayRef kernel_size, at::IntArrayRef box,
                                    double divisor, at::ScalarType dtype) {
  static const auto op = typed_op<decltype(call_box_fold2d_backward)>("fused_ops::box_fold2d_backward");
  return op.call(grad, kernel_size, box, divisor, dtype);
}

class BoxFold2dFunction : public torch::autograd::Function<BoxFold2dFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& weight, at::IntArrayRef box, double divisor,
                               std::optional<at::ScalarType> dtype) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->saved_data["kernel_size"] = weight.sizes().slice(weight.dim() - 2).vec();
    ctx->saved_data["box"] = box;
    ctx->saved_data["divisor"] = divisor;
    ctx->saved_data["weight_dtype"] = weight.scalar_type();
    return {call_box_fold2d(weight, box, divisor, dtype)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return variable_list(4);
    auto& data = ctx->saved_data;
    return {call_box_fold2d_backward(grads[0], data["kernel_size"].toIntVector(), data["box"].toIntVector(),
                                     data["divisor"].toDouble(), data["weight_dtype"].toScalarType()),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

class BoxFold2dBackwardFunction : public torch::autograd::Function<BoxFold2dBackwardFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& grad, at::IntArrayRef kernel_size,
                               at::IntArrayRef box, double divisor, at::ScalarType dtype) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->saved_data["box"] = box;
    ctx->saved_data["divisor"] = divisor;
    ctx->saved_data["grad_dtype"] = grad.scalar_type();
    return {call_box_fold2d_backward(grad, kernel_size, box, divisor, dtype)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return variable_list(5);
    auto& data = ctx->saved_data;
    return {call_box_fold2d(grads[0], data["box"].toIntVector(), data["divisor"].toDouble(),
                            data["grad_dtype"].toScalarType()),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, Autograd, m) {
  m.impl("box_fold2d", &AutogradKernel<BoxFold2dFunction, &call_box_fold2d>::kernel);
  m.impl("box_fold2d_backward", &AutogradKernel<BoxFold2dBackwardFunction, &call_box_fold2d_backward>::kernel);
}

}  // namespace fused_ops::autograd
