// The checks the convolution ops make of their operands, errors named after the op `what`.
//
// check_convolution_operands, both fused convolutions' (conv2d_sigmoid_sum.h,
// conv3d_max_pool3d_mean.h): x (N, C, *spatial)
// and weight (O, C, *kernel) with `spatial` dimensions each, floating-point, the
// weight in x's dtype or 16-bit for a float32 x (as autocast passes them: x is
// rounded to it as it is read), a bias (O,) in the weight's dtype, one device,
// no empty batch or channel dimension.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace fused_ops {

inline void check_convolution_operands(const char* what, int spatial, const at::Tensor& x, const at::Tensor& weight,
                                       const std::optional<at::Tensor>& bias) {
  const bool three = spatial == 3;
  TORCH_CHECK_VALUE(x.dim() == spatial + 2, what, ": expected a ", spatial + 2, "-D input (batch, channels, ",
                    three ? "depth, " : "", "height, width), got ", x.dim(), "-D input of shape ", x.sizes());
  TORCH_CHECK_VALUE(weight.dim() == spatial + 2, what, ": expected a ", spatial + 2,
                    "-D weight (out_channels, in_channels, ", three ? "kd, " : "", "kh, kw), got ", weight.dim(),
                    "-D weight of shape ", weight.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(x.scalar_type()), what,
                   ": input must be a floating-point tensor (float64, float32, float16 or bfloat16), got ",
                   x.scalar_type());
  const bool rounded_input = x.scalar_type() == at::kFloat &&
                             (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kHalf);
  TORCH_CHECK_TYPE(weight.scalar_type() == x.scalar_type() || rounded_input, what, ": weight (",
                   weight.scalar_type(), ") must have the input's dtype (", x.scalar_type(),
                   "), or be float16 or bfloat16 for a float32 input");
  TORCH_CHECK_VALUE(weight.device() == x.device(), what, ": weight is on ", weight.device(), ", the input on ",
                    x.device());
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(0), what,
                      ": bias must have shape (out_channels,) = (", weight.size(0), ",), got ", bias->sizes());
    TORCH_CHECK_TYPE(bias->scalar_type() == weight.scalar_type(), what, ": bias (", bias->scalar_type(),
                     ") must have the weight's dtype (", weight.scalar_type(), ")");
    TORCH_CHECK_VALUE(bias->device() == x.device(), what, ": bias is on ", bias->device(), ", the input on ",
                      x.device());
  }
  TORCH_CHECK_VALUE(weight.size(1) == x.size(1), what, ": the input has ", x.size(1),
                    " channels, the weight expects ", weight.size(1));
  TORCH_CHECK_VALUE(x.size(0) > 0 && weight.size(0) > 0 && x.size(1) > 0, what,
                    ": batch, channels and out_channels must be non-zero, got input ", x.sizes(), " and weight ",
                    weight.sizes());
}

// The 3-D transposed convolutions' (conv_transpose3d_stride1_channels_last.h,
// conv_transpose3d_cascade_sum.h): x (N, I, D, H, W) and weight (I, O, kt, kr, ks), floating point, of
// one dtype, on one device.
inline void check_transposed_convolution_operands(const char* what, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK_VALUE(x.dim() == 5, what, ": x must be 5-D (batch, in_channels, depth, height, width), got shape ",
                    x.sizes());
  TORCH_CHECK_VALUE(weight.dim() == 5, what,
                    ": weight must be 5-D (in_channels, out_channels, kt, kr, ks), got shape ", weight.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(x.scalar_type()), what, ": x must be floating point, got ", x.scalar_type());
  TORCH_CHECK_TYPE(weight.scalar_type() == x.scalar_type(), what, ": weight (", weight.scalar_type(),
                   ") must have x's dtype (", x.scalar_type(), ")");
  TORCH_CHECK_VALUE(weight.device() == x.device(), what, ": weight is on ", weight.device(), ", x on ", x.device());
  TORCH_CHECK_VALUE(weight.size(0) == x.size(1), what, ": x has ", x.size(1),
                    " channels, the weight's first dim (in_channels) is ", weight.size(0));
}

}  // namespace fused_ops
