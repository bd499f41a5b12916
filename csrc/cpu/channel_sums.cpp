// CPU kernel of channel_sums (the math: ../channel_sums.h): ATen's reduction in the accumulation type.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include "../channel_sums.h"

namespace fused_ops {
namespace {

at::Tensor channel_sums_cpu(const at::Tensor& t) {
  channel_sums_check(t);
  return at::sum(t, channel_sums_dims(t), false, at::toOpMathType(t.scalar_type())).to(t.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CPU, m) { m.impl("channel_sums", &channel_sums_cpu); }

}  // namespace fused_ops
