// CPU kernel of conv_transpose3d_stride1_channels_last (the math:
// ../conv_transpose3d_stride1_channels_last.h): aten.conv_transpose3d (oneDNN's, or PyTorch's own).
#include <torch/library.h>

#include <optional>
#include <string>

#include "../conv_transpose3d_stride1_channels_last.h"

namespace fused_ops {
namespace {

at::Tensor conv_transpose3d_stride1_channels_last_cpu(const at::Tensor& x, const at::Tensor& weight,
                                                      const std::optional<at::Tensor>& bias,
                                                      at::IntArrayRef padding) {
  return transposed_conv_stride1_by_aten(x, weight, bias, transposed_conv_stride1_setup(x, weight, bias, padding));
}

std::string conv_transpose3d_stride1_channels_last_path_cpu(const at::Tensor& x, const at::Tensor& weight,
                                                            const std::optional<at::Tensor>& bias,
                                                            at::IntArrayRef padding) {
  transposed_conv_stride1_setup(x, weight, bias, padding);
  return kStride1ByAten;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("conv_transpose3d_stride1_channels_last", &conv_transpose3d_stride1_channels_last_cpu);
  m.impl("conv_transpose3d_stride1_channels_last_path", &conv_transpose3d_stride1_channels_last_path_cpu);
}

}  // namespace fused_ops
