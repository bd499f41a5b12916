// CPU kernel of conv_transpose3d_cascade_sum (the math: ../conv_transpose3d_cascade_sum.h): the
// composite, aten.conv_transpose3d then parity_max_pool3d_cascade_sum's CPU kernel.
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

#include "../conv_transpose3d_cascade_sum.h"

namespace fused_ops {
namespace {

std::tuple<at::Tensor, at::Tensor> conv_transpose3d_cascade_sum_cpu(const at::Tensor& x, const at::Tensor& weight,
                                                                    at::IntArrayRef stride, at::IntArrayRef padding,
                                                                    at::IntArrayRef output_padding,
                                                                    at::IntArrayRef kernel2, bool save_indices,
                                                                    std::optional<at::ScalarType> dtype) {
  const TransposedCascadeSum g =
      transposed_cascade_sum_setup(x, weight, stride, padding, output_padding, kernel2, save_indices);
  return transposed_cascade_sum_composite(x, weight, g, save_indices, dtype);
}

std::string conv_transpose3d_cascade_sum_path_cpu(const at::Tensor& x, const at::Tensor& weight,
                                                  at::IntArrayRef stride, at::IntArrayRef padding,
                                                  at::IntArrayRef output_padding, at::IntArrayRef kernel2) {
  transposed_cascade_sum_setup(x, weight, stride, padding, output_padding, kernel2, false);
  return kCascadeSumByAten;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("conv_transpose3d_cascade_sum", &conv_transpose3d_cascade_sum_cpu);
  m.impl("conv_transpose3d_cascade_sum_path", &conv_transpose3d_cascade_sum_path_cpu);
}

}  // namespace fused_ops
