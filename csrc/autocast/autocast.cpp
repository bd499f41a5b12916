// Autocast kernels of the forward ops (AutocastCPU and AutocastCUDA).
//
// The policy: under autocast the fused tails read their input in the dtype it
// arrives in, with no cast (a cast would be a second pass over a
// convolution-sized tensor): a 16-bit input is read as it is, a float32 one
// stays float32. They return their result in float32, the accumulation type,
// as autocast's float32 ops do (torch.sum on CUDA, the pools on the CPU): with
// dtype None and a float16, bfloat16 or float32 input the op runs with dtype
// float32, which the kernels write unrounded. A dtype given explicitly is
// kept, and a float64 input is left alone (autocast never touches float64).
// batch_norm_gap's weight, bias and running statistics are passed as they are
// (its kernels take float32 ones with a 16-bit x).
//
// One boxed kernel serves every forward: each takes its input first and its
// result's dtype last (ScalarType? dtype=None, ../ops.cpp). It sets the dtype,
// then calls the op again with the autocast key excluded, as ATen's autocast
// wrappers do (ATen/autocast_mode.h), which runs the op's kernels below autocast.
#include <ATen/autocast_mode.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/ScalarType.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

namespace fused_ops {
namespace {

constexpr const char* kForwardOps[] = {
    "avg_pool2d_sigmoid_sum", "max_pool3d_mean",        "max_pool3d_cascade_sum",
    "parity_max_pool3d_mean", "parity_max_pool3d_cascade_sum", "batch_norm_gap",
};

// Whether autocast casts a tensor of dtype t (floating point, not float64).
bool autocast_casts(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat; }

template <c10::DispatchKey autocast_key>
void float32_result(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  TORCH_INTERNAL_ASSERT(arguments.back().name() == "dtype", op.schema().name(),
                        ": the autocast kernel needs the result's dtype as the last argument");
  c10::IValue& dtype = stack->back();
  const at::ScalarType input = (*stack)[stack->size() - arguments.size()].toTensor().scalar_type();
  if (dtype.isNone() && autocast_casts(input)) {
    dtype = at::kFloat;
  }
  c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key);
  op.callBoxed(stack);
}

template <c10::DispatchKey autocast_key>
void register_float32_results(torch::Library& m) {
  for (const char* name : kForwardOps) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&float32_result<autocast_key>>());
  }
}

template <c10::DispatchKey autocast_key>
at::ScalarType autocast_dtype() {
  return at::autocast::get_autocast_dtype(autocast_key == c10::DispatchKey::AutocastCUDA ? at::kCUDA : at::kCPU);
}

// Casts the tensors among (*stack)[begin, end) to autocast's dtype.
template <c10::DispatchKey autocast_key>
void cast_to_autocast_dtype(torch::jit::Stack* stack, size_t begin, size_t end) {
  const at::ScalarType cast = autocast_dtype<autocast_key>();
  for (size_t i = begin; i < end; ++i) {
    if ((*stack)[i].isTensor()) (*stack)[i] = (*stack)[i].toTensor().to(cast);
  }
}

// conv2d_sigmoid_sum, conv3d_max_pool3d_mean and conv_transpose3d_cascade_sum, as autocast runs
// their ops: the convolution's input, weight and bias cast to autocast's dtype (a float32 or 16-bit
// input; float64 is left alone), the tail in that dtype, the result float32 on CUDA (where autocast
// runs torch.sum in float32; A's module casts its own result) and, where kPoolsFirst (the tail's
// first op a max-pool, float32 under CPU autocast), on the CPU too, else autocast's dtype there.
// Where kRoundsInput, a float32 input is passed as it is, the op rounding it to the weight's dtype
// as it reads it (the same values, without the cast's copy); where kRoundsOperands too (an op with
// an `operand_dtype`: conv3d_max_pool3d_mean), a float32 weight and bias with it, operand_dtype set to
// autocast's dtype (their casts' copies and launches, and their gradients' casts back, saved), and
// operands with an explicit operand_dtype as they are (the caller's precision, as an explicit dtype is). Each
// takes (x, weight, bias or a non-tensor, ...) first and a `dtype` (conv3d_max_pool3d_mean's channel
// bias, after it, is added to the result in the promoted dtype, as the module's `pooled + bias` is: not
// cast).
template <c10::DispatchKey autocast_key, bool kRoundsInput, bool kPoolsFirst, bool kRoundsOperands = false>
void lower_precision_convolution(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t first = stack->size() - op.schema().arguments().size();  // x, weight, bias, ...
  const at::ScalarType input = (*stack)[first].toTensor().scalar_type();
  if (autocast_casts(input)) {
    bool cast_operands = true;
    if constexpr (kRoundsOperands) {
      c10::IValue& operand = (*stack)[first + op.schema().argumentIndexWithName("operand_dtype").value()];
      const c10::IValue& bias = (*stack)[first + 2];
      const bool float32_operands = input == at::kFloat &&
                                    (*stack)[first + 1].toTensor().scalar_type() == at::kFloat &&
                                    (!bias.isTensor() || bias.toTensor().scalar_type() == at::kFloat);
      if (!operand.isNone()) {
        cast_operands = false;  // (an explicit operand_dtype is the caller's, as an explicit dtype is)
      } else if (float32_operands) {
        operand = autocast_dtype<autocast_key>();
        cast_operands = false;
      }
    }
    if (cast_operands) {
      cast_to_autocast_dtype<autocast_key>(stack, kRoundsInput && input == at::kFloat ? first + 1 : first, first + 3);
    }
    c10::IValue& dtype = (*stack)[first + op.schema().argumentIndexWithName("dtype").value()];
    if ((kPoolsFirst || autocast_key == c10::DispatchKey::AutocastCUDA) && dtype.isNone()) {
      dtype = at::kFloat;
    }
  }
  c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key);
  op.callBoxed(stack);
}

// conv_transpose3d_stride1_channels_last as autocast runs aten.conv_transpose3d: x, weight and
// bias cast to autocast's dtype (where x is float32 or 16-bit; float64 is left alone), the result
// in that dtype; its _path op alike (the path of the call autocast would make), and
// conv_transpose3d_cascade_sum's (x and weight cast as its autocast kernel casts them).
template <c10::DispatchKey autocast_key>
void lower_precision_operands(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t first = stack->size() - op.schema().arguments().size();  // x, weight, bias, ...
  if (autocast_casts((*stack)[first].toTensor().scalar_type())) {
    cast_to_autocast_dtype<autocast_key>(stack, first, first + 3);
  }
  c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key);
  op.callBoxed(stack);
}

template <c10::DispatchKey autocast_key>
void register_autocast_kernels(torch::Library& m) {
  register_float32_results<autocast_key>(m);
  m.impl("conv2d_sigmoid_sum",
         torch::CppFunction::makeFromBoxedFunction<&lower_precision_convolution<autocast_key, true, false>>());
  m.impl("conv3d_max_pool3d_mean",
         torch::CppFunction::makeFromBoxedFunction<&lower_precision_convolution<autocast_key, true, true, true>>());
  m.impl("conv_transpose3d_cascade_sum",
         torch::CppFunction::makeFromBoxedFunction<&lower_precision_convolution<autocast_key, false, true>>());
  for (const char* name : {"conv_transpose3d_stride1_channels_last", "conv_transpose3d_stride1_channels_last_path",
                           "conv_transpose3d_cascade_sum_path"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&lower_precision_operands<autocast_key>>());
  }
}

}  // namespace

// depth_stacked_channels_last runs as called (a fallthrough, registered to say
// so): a copy with a cast to the dtype its caller always names (autocast's,
// where the copy feeds a convolution), with nothing for autocast to choose.
TORCH_LIBRARY_IMPL(fused_ops, AutocastCPU, m) {
  register_autocast_kernels<c10::DispatchKey::AutocastCPU>(m);
  m.impl("depth_stacked_channels_last", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(fused_ops, AutocastCUDA, m) {
  register_autocast_kernels<c10::DispatchKey::AutocastCUDA>(m);
  m.impl("depth_stacked_channels_last", torch::CppFunction::makeFallthrough());
}

}  // namespace fused_ops
