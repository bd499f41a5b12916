// An op of the library called through the dispatcher (its registered kernels
// for the call's device, autograd and autocast as they apply): by the autograd
// kernels (csrc/autograd/) and by composites that call another op.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

namespace fused_ops {

// The op `name` (its overload "") as a typed handle. Each caller finds it
// once, keeping it in a static of its own:
//   static const auto op = typed_op<decltype(call_foo)>("fused_ops::foo");
//   return op.call(...);
template <typename Signature>
c10::TypedOperatorHandle<Signature> typed_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").template typed<Signature>();
}

}  // namespace fused_ops
