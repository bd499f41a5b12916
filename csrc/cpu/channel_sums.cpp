// CPU kernel of channel_sums (the math: ../channel_sums.h): ATen's reduction in the accumulation type.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../channel_sums.h"

namespace fused_ops {
namespace {

at::Tensor channel_sums_cpu(const at::Tensor& t) {
  channel_sums_check(t);
  return channel_sums_by_reduction(t);
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CPU, m) { m.impl("channel_sums", &channel_sums_cpu); }

}  // namespace fused_ops
