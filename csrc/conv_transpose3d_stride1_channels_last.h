// conv_transpose3d_stride1_channels_last: a stride-1 transposed 3-D convolution
// (architecture D's), y = conv_transpose3d(x, w, bias, stride 1, padding p),
// no dilation or groups, x (N, I, D, H, W), w (I, O, kt, kr, ks), bias (O) or
// None, 0 <= p < k per dim:
//   y[n, o, z, h, w] = bias[o] + sum over i, t, r, s of
//                      x[n, i, z + p_d - t, h + p_h - r, w + p_w - s] * w[i, o, t, r, s]
// (x zero outside), y (N, O, D + kt - 1 - 2 p_d, ...): the convolution of x
// with the kernel flipped and transposed, w'[o, t, r, s, i] = w[i, o, kt - 1 -
// t, kr - 1 - r, ks - 1 - s], padded by k - 1 - p. Returned channels_last_3d
// (memory (N, D', H', W', O)) in x's dtype. The CPU kernel, and the CUDA one
// wherever its CUTLASS path does not apply
// (cuda/conv_transpose3d_stride1_channels_last.cu), compute it by
// aten.conv_transpose3d.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/conv_transpose3d.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <array>
#include <cstdint>
#include <optional>

#include "convolution_checks.h"
#include "pool_geometry.h"

namespace fused_ops {

// What conv_transpose3d_stride1_channels_last_path names for the aten.conv_transpose3d path.
constexpr const char* kStride1ByAten = "aten.conv_transpose3d";

struct TransposedConvStride1 {
  int64_t batch, in_channels, out_channels;  // N, I, O
  std::array<int64_t, 3> in, kernel, padding;

  int64_t out(int d) const { return in[d] + kernel[d] - 1 - 2 * padding[d]; }  // y's size along d
};

// The checked arguments: x and weight 5-D, floating point, of one dtype, on one
// device, x's channels the weight's first dim, bias (O) of that dtype or None,
// 0 <= padding < kernel, y not empty along any spatial dim.
inline TransposedConvStride1 transposed_conv_stride1_setup(const at::Tensor& x, const at::Tensor& weight,
                                                           const std::optional<at::Tensor>& bias,
                                                           at::IntArrayRef padding) {
  constexpr const char* what = "conv_transpose3d_stride1_channels_last";
  check_transposed_convolution_operands(what, x, weight);
  if (bias) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(1), what, ": bias must be (",
                      weight.size(1), ",), got shape ", bias->sizes());
    TORCH_CHECK_TYPE(bias->scalar_type() == x.scalar_type(), what, ": bias (", bias->scalar_type(),
                     ") must have x's dtype (", x.scalar_type(), ")");
    TORCH_CHECK_VALUE(bias->device() == x.device(), what, ": bias is on ", bias->device(), ", x on ", x.device());
  }
  const TransposedConvStride1 g{x.size(0),
                                x.size(1),
                                weight.size(1),
                                {x.size(2), x.size(3), x.size(4)},
                                {weight.size(2), weight.size(3), weight.size(4)},
                                expand_param<3>(what, "padding", padding)};
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK_VALUE(g.kernel[d] > 0, what, ": the weight's kernel size must be positive, got ", weight.sizes());
    TORCH_CHECK_VALUE(g.padding[d] >= 0 && g.padding[d] < g.kernel[d], what,
                      ": padding must lie in [0, kernel size), got ", padding, " for a kernel of ",
                      weight.sizes().slice(2));
    TORCH_CHECK_VALUE(g.out(d) > 0, what, ": the output would be empty: x ", x.sizes(), ", kernel ",
                      weight.sizes().slice(2), ", padding ", padding);
  }
  return g;
}

// y's tensor, channels_last_3d: (N, O, D', H', W') over memory (N, D', H', W', O).
inline at::Tensor transposed_conv_stride1_output(const at::Tensor& x, const TransposedConvStride1& g) {
  return at::empty({g.batch, g.out(0), g.out(1), g.out(2), g.out_channels}, x.options()).permute({0, 4, 1, 2, 3});
}

// y by aten.conv_transpose3d, written into the channels_last_3d output; an x with no elements
// (which aten refuses for empty channels or spatial sizes) gives the bias alone, or zeros. On the
// CPU 16-bit operands are convolved in float32, y rounded once: the op accumulates in float32, and
// aten's own CPU float16 convolution does not everywhere (SPEC-like sizes on an AVX-512 CPU, torch
// 2.13: 3.1e-3 normwise from the exact result, against 3.6e-4 rounded from float32).
inline at::Tensor transposed_conv_stride1_by_aten(const at::Tensor& x, const at::Tensor& weight,
                                                  const std::optional<at::Tensor>& bias,
                                                  const TransposedConvStride1& g) {
  at::Tensor out = transposed_conv_stride1_output(x, g);
  if (x.numel() == 0) return bias ? out.copy_(bias->view({1, -1, 1, 1, 1})) : out.zero_();
  if (x.is_cpu() && at::isReducedFloatingType(x.scalar_type())) {
    const std::optional<at::Tensor> bias_float = bias ? std::optional<at::Tensor>(bias->to(at::kFloat)) : std::nullopt;
    return out.copy_(at::conv_transpose3d(x.to(at::kFloat), weight.to(at::kFloat), bias_float, /*stride=*/1,
                                          g.padding));
  }
  return out.copy_(at::conv_transpose3d(x, weight, bias, /*stride=*/1, g.padding));
}

}  // namespace fused_ops
