// Autograd kernel of depth_stacked_channels_last, which has no gradient: it
// refuses an x that requires grad (under grad mode), else runs the op below
// autograd. Without a kernel of its own the op went through autograd's boxed
// fallback on every call (one that would give x a gradient-less graph, not an error).
#include <torch/library.h>

#include "autograd_util.h"

namespace fused_ops::autograd {
namespace {

at::Tensor call_depth_stacked_channels_last(const at::Tensor& x, int64_t taps, int64_t stride,
                                            at::IntArrayRef start, c10::SymIntArrayRef size,
                                            std::optional<at::ScalarType> dtype) {
  static const auto op =
      typed_op<decltype(call_depth_stacked_channels_last)>("fused_ops::depth_stacked_channels_last");
  return op.call(x, taps, stride, start, size, dtype);
}

at::Tensor depth_stacked_channels_last_autograd(const at::Tensor& x, int64_t taps, int64_t stride,
                                                at::IntArrayRef start, c10::SymIntArrayRef size,
                                                std::optional<at::ScalarType> dtype) {
  TORCH_CHECK(!records_grad(x), "depth_stacked_channels_last: not differentiable, and x requires grad "
              "(run it under torch.no_grad() or on a detached x)");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return call_depth_stacked_channels_last(x, taps, stride, start, size, dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, Autograd, m) {
  m.impl("depth_stacked_channels_last", &depth_stacked_channels_last_autograd);
}

}  // namespace fused_ops::autograd
