// CPU kernel of conv_transpose3d_weight_grad (the math: ../conv_transpose3d_weight_grad.h):
// aten.convolution_backward's weight gradient (oneDNN's, or PyTorch's own).
#include <torch/library.h>

#include <string>

#include "../conv_transpose3d_weight_grad.h"

namespace fused_ops {
namespace {

at::Tensor conv_transpose3d_weight_grad_cpu(const at::Tensor& grad_y, const at::Tensor& x,
                                            at::IntArrayRef kernel_size) {
  return transposed_conv_weight_grad_by_aten(grad_y, x, transposed_conv_weight_grad_setup(grad_y, x, kernel_size));
}

std::string conv_transpose3d_weight_grad_path_cpu(const at::Tensor& grad_y, const at::Tensor& x,
                                                  at::IntArrayRef kernel_size) {
  transposed_conv_weight_grad_setup(grad_y, x, kernel_size);
  return kWeightGradByAten;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("conv_transpose3d_weight_grad", &conv_transpose3d_weight_grad_cpu);
  m.impl("conv_transpose3d_weight_grad_path", &conv_transpose3d_weight_grad_path_cpu);
}

}  // namespace fused_ops
