// Helpers shared by the ops' C++ autograd kernels (one file per op beside
// this one, each registered under the Autograd dispatch key). A kernel calls
// its op's forward through the dispatcher below autograd, in a
// torch::autograd::Function where an input requires grad, and its backward op
// through the dispatcher again, so that torch.compile and torch.export trace
// both as the ops they are.
#pragma once

#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>

#include "../memory_format.h"
#include "../op_handle.h"

#include <array>
#include <cstddef>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>

namespace fused_ops::autograd {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

inline std::optional<at::Tensor> defined_or_none(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// Whether autograd records a call on these inputs: under grad mode, where a
// tensor among them requires grad (the others are not tensors).
inline bool requires_grad(const at::Tensor& t) {
  return t.requires_grad();
}
inline bool requires_grad(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->requires_grad();
}
template <typename T>
bool requires_grad(const T&) {
  return false;
}
template <typename... Args>
bool records_grad(const Args&... inputs) {
  return at::GradMode::is_enabled() && (requires_grad(inputs) || ...);
}

template <typename Tuple, size_t... I>
Tuple as_tuple(const variable_list& outputs, std::index_sequence<I...>) {
  return Tuple(outputs[I]...);
}

// The Autograd kernel of an op whose forward, `call` (through the dispatcher),
// returns a tensor or a tuple of tensors: Function::apply where autograd records the call,
// else `call` alone below autograd (as torch.library's autograd kernels do).
// Registered as m.impl("op", &AutogradKernel<OpFunction, &call_op>::kernel).
template <typename Function, auto call>
struct AutogradKernel;

template <typename Function, typename Result, typename... Args, Result (*call)(Args...)>
struct AutogradKernel<Function, call> {
  static Result kernel(Args... args) {
    if (!records_grad(args...)) {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      return call(args...);
    }
    if constexpr (std::is_same_v<Result, at::Tensor>) {
      return Function::apply(args...)[0];
    } else {
      return as_tuple<Result>(Function::apply(args...), std::make_index_sequence<std::tuple_size_v<Result>>());
    }
  }
};

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

// The memory format a max-pool's kernels lay x's gradient out in (memory_format.h:
// channels_last_3d for such an x on the CPU). The backward op takes it from the
// picks' layout, which cannot show it where a plane's picks are one element (their
// strides then say contiguous and channels_last_3d alike): a copy there only.
inline void save_input_format(AutogradContext* ctx, const at::Tensor& x) {
  ctx->saved_data["x_channels_last_3d"] = x.is_cpu() && is_channels_last_3d(x);
}

inline at::Tensor grad_in_input_format(AutogradContext* ctx, const at::Tensor& grad_x) {
  const auto format = ctx->saved_data["x_channels_last_3d"].toBool() ? at::MemoryFormat::ChannelsLast3d
                                                                     : at::MemoryFormat::Contiguous;
  return grad_x.is_contiguous(format) ? grad_x : grad_x.contiguous(format);
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

// A fused convolution's backward (x, weight, bias first among the forward's
// arguments; saved_data["has_bias"]): which of their gradients autograd asks
// for, and the backward op's (grad_x, grad_weight, grad_bias) as the `inputs`
// gradients apply() returns (undefined where not asked for).
inline std::array<bool, 3> convolution_grad_mask(AutogradContext* ctx) {
  return {ctx->needs_input_grad(0), ctx->needs_input_grad(1),
          ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2)};
}

inline variable_list convolution_grad_inputs(size_t inputs, std::array<bool, 3> mask,
                                             const std::tuple<at::Tensor, at::Tensor, at::Tensor>& grads) {
  variable_list grad_inputs(inputs);
  grad_inputs[0] = mask[0] ? std::get<0>(grads) : at::Tensor();
  grad_inputs[1] = mask[1] ? std::get<1>(grads) : at::Tensor();
  grad_inputs[2] = mask[2] ? std::get<2>(grads) : at::Tensor();
  return grad_inputs;
}

// Second-order gradients. A backward made with create_graph=True runs with grad
// mode on (records_graph): there each op's backward computes its gradients by
// PyTorch's differentiable ops, whose graph autograd records, instead of its
// backward op (which has no derivatives of its own): its reference composite
// recomputed from what the forward saved and differentiated (recorded_grads), or
// its gradient's formula in ATen ops. The plain backward is unchanged.
inline bool records_graph() {
  return at::GradMode::is_enabled();
}

// Within its scope PyTorch's ops run without autocast: a recomputation in a
// backward computes in the dtypes the forward saved, whatever the backward runs under.
struct WithoutAutocast {
  c10::impl::ExcludeDispatchKeyGuard guard{c10::autocast_dispatch_keyset};
};

// The gradients of `out` (a forward recomputed by PyTorch's ops from the tensors it
// saved) to `inputs` for the output gradient `grad`, their own graph recorded;
// undefined for an input `out` does not depend on.
inline variable_list recorded_grads(const at::Tensor& out, const variable_list& inputs, const at::Tensor& grad) {
  return torch::autograd::grad({out}, inputs, {grad.to(out.scalar_type())}, /*retain_graph=*/true,
                               /*create_graph=*/true, /*allow_unused=*/true);
}

// The gradients of `out` (a forward recomputed by PyTorch's ops) to the `operands` that
// `mask` asks for, at their `positions` among the `inputs` gradients apply() returns.
template <size_t N>
variable_list recorded_operand_grads(size_t inputs, const std::array<bool, N>& mask,
                                     const std::array<size_t, N>& positions, const at::Tensor& out,
                                     const std::array<at::Tensor, N>& operands, const at::Tensor& grad) {
  variable_list wrt;
  for (size_t i = 0; i < N; ++i) {
    if (mask[i]) wrt.push_back(operands[i]);
  }
  variable_list grad_inputs(inputs);
  if (wrt.empty()) return grad_inputs;
  const variable_list grads = recorded_grads(out, wrt, grad);
  for (size_t i = 0, k = 0; i < N; ++i) {
    if (mask[i]) grad_inputs[positions[i]] = grads[k++];
  }
  return grad_inputs;
}

// A fused convolution's gradients where its backward records a graph: those of `out`
// (its forward recomputed from x, the weight and the bias by PyTorch's ops) to the
// `operands` (x, weight, bias) `mask` asks for, as the `inputs` gradients apply() returns.
inline variable_list recorded_convolution_grads(size_t inputs, std::array<bool, 3> mask, const at::Tensor& out,
                                                const std::array<at::Tensor, 3>& operands, const at::Tensor& grad) {
  return recorded_operand_grads<3>(inputs, mask, {0, 1, 2}, out, operands, grad);
}

// The backward of an op differentiable in its first input only, x, with
// num_inputs inputs: grad_x(the result's gradient in x's dtype), or where the
// backward records a graph recorded_grad_x of it, then none; no gradient at all
// where the graph after the result gave it none.
template <typename GradX, typename RecordedGradX>
variable_list first_input_backward(AutogradContext* ctx, const variable_list& grads, size_t num_inputs,
                                   GradX grad_x, RecordedGradX recorded_grad_x) {
  variable_list grad_inputs(num_inputs);
  if (!grads[0].defined()) return grad_inputs;
  const at::Tensor grad = grad_in_input_dtype(ctx, grads[0]);
  grad_inputs[0] = records_graph() ? recorded_grad_x(grad) : grad_x(grad);
  return grad_inputs;
}

}  // namespace fused_ops::autograd
