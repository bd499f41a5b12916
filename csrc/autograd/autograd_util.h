// Helpers shared by the ops' C++ autograd kernels (one file per op beside
// this one, each registered under the Autograd dispatch key). A kernel calls
// its op's forward through the dispatcher below autograd, in a
// torch::autograd::Function where an input requires grad, and its backward op
// through the dispatcher again, so that torch.compile and torch.export trace
// both as the ops they are.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>

#include <optional>
#include <tuple>
#include <utility>

namespace fused_ops::autograd {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The op `name` (its overload "") as a typed handle, called through the
// dispatcher. Each caller finds it once, keeping it in a static of its own:
//   static const auto op = typed_op<decltype(call_foo)>("fused_ops::foo");
//   return op.call(...);
template <typename Signature>
c10::TypedOperatorHandle<Signature> typed_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").template typed<Signature>();
}

inline std::optional<at::Tensor> defined_or_none(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// Whether autograd records a call on these inputs (an input the op differentiates
// in requires grad, under grad mode): the Function where it does, else the
// forward alone, below autograd (as torch.library's autograd kernels do).
inline bool requires_grad(const at::Tensor& t) {
  return t.requires_grad();
}
inline bool requires_grad(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->requires_grad();
}
template <typename... Tensors>
bool records_grad(const Tensors&... inputs) {
  return at::GradMode::is_enabled() && (requires_grad(inputs) || ...);
}

// Marks the outputs that carry no gradient (saved picks, factors, statistics),
// and keeps autograd from filling zero gradients for them before each backward
// (it materializes one per output by default: for the avg-pool's saved
// factor, a 296 MB fill at architecture C's size). A backward then sees an
// undefined gradient for each, and for the differentiable output where the
// graph after it gave none.
inline void mark_non_differentiable(AutogradContext* ctx, const variable_list& outputs) {
  ctx->mark_non_differentiable(outputs);
  ctx->set_materialize_grads(false);
}

// The dtype of x, the forward's input: its backward op takes the result's
// gradient in it (the result, and so its gradient, may be in x's accumulation
// type: the ops' dtype argument).
inline void save_input_dtype(AutogradContext* ctx, const at::Tensor& x) {
  ctx->saved_data["x_dtype"] = x.scalar_type();
}

inline at::Tensor grad_in_input_dtype(AutogradContext* ctx, const at::Tensor& grad) {
  return grad.to(ctx->saved_data["x_dtype"].toScalarType());
}

// The tensor the forward saved for the backward, checked: an op that saves it
// only when asked to (a flag argument, which its wrapper sets when `input`
// requires grad) gives an empty tensor otherwise, and cannot be differentiated.
inline const at::Tensor& check_saved(const at::Tensor& saved, int64_t dim, const char* what, const char* flag,
                                     const char* input) {
  TORCH_CHECK(saved.dim() == dim, what, ": backward needs the forward to run with ", flag, "=True (the fused_ops.",
              what, " wrapper sets it when ", input, " requires grad)");
  return saved;
}

// The gradients of an op's num_inputs inputs, differentiable in its first
// only: grad_x (undefined for none), then none.
inline variable_list first_input_gradient(at::Tensor grad_x, size_t num_inputs) {
  variable_list grads(num_inputs);
  grads[0] = std::move(grad_x);
  return grads;
}

// A Function's two outputs as the op's schema returns them.
inline std::tuple<at::Tensor, at::Tensor> as_pair(const variable_list& outputs) {
  return {outputs[0], outputs[1]};
}

}  // namespace fused_ops::autograd
