// conv_transpose3d_cascade_sum: architecture B's forward less the convolution's bias, a transposed
// 3-D convolution and its tail in one op (fused_ops/rewrites/conv_transpose3d_max_pool.py, B's rewrite):
//   y = conv_transpose3d(x, w, stride P, padding pad, output_padding)   (no bias, dilation, groups)
//   out[n, 0, c] = sum over o of max_pool3d(max_pool3d(y, P), k2)[n, o, c]
// at the stage-1 positions stage 2 reads, M = (y's size // P) // k2 * k2 per dim: that is
// parity_max_pool3d_cascade_sum (parity_max_pool3d.h) of y's windows side by side,
//   windows[n, m, o, q] = y[n, o, P m + q]   (q a parity class, in scan order),
// and with save_indices its picks (stage-2 offset * P^3 + q, uint8 (N, D2, H2, W2, O)), which
// conv_transpose3d_cascade_weight_grad takes for the weight's gradient. The CPU kernel, and the
// CUDA one wherever its TF32 kernel does not apply (cuda/conv_transpose3d_cascade_sum.cu), compute
// it so: aten.conv_transpose3d, then parity_max_pool3d_cascade_sum through the dispatcher.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/conv_transpose3d.h>
#include <c10/util/Exception.h>

#include <array>
#include <cstdint>
#include <optional>
#include <tuple>

#include "convolution_checks.h"
#include "op_handle.h"
#include "parity_max_pool3d.h"
#include "pool_geometry.h"

namespace fused_ops {

// What conv_transpose3d_cascade_sum_path names for the composite path.
constexpr const char* kCascadeSumByAten = "aten.conv_transpose3d + parity_max_pool3d_cascade_sum";

struct TransposedCascadeSum {
  int64_t batch, in_channels, out_channels;  // N, I, O
  std::array<int64_t, 3> in, kernel, stride, padding, output_padding, kernel2;

  int64_t out(int d) const {  // y's size along d
    return (in[d] - 1) * stride[d] - 2 * padding[d] + kernel[d] + output_padding[d];
  }
  int64_t positions(int d) const { return out(d) / stride[d] / kernel2[d] * kernel2[d]; }  // M
  int64_t cells(int d) const { return positions(d) / kernel2[d]; }
  int64_t classes() const { return stride[0] * stride[1] * stride[2]; }
};

// The checked arguments: x and weight 5-D, floating point, of one dtype, on one device, x's
// channels the weight's first dim; stride, kernel2 >= 1, 0 <= padding, 0 <= output_padding <
// stride; y at least one stage-2 window along each dim; with save_indices, P^3 k2^3 <= 256 (a pick
// is one byte).
inline TransposedCascadeSum transposed_cascade_sum_setup(const at::Tensor& x, const at::Tensor& weight,
                                                         at::IntArrayRef stride, at::IntArrayRef padding,
                                                         at::IntArrayRef output_padding, at::IntArrayRef kernel2,
                                                         bool save_indices) {
  constexpr const char* what = "conv_transpose3d_cascade_sum";
  check_transposed_convolution_operands(what, x, weight);
  TORCH_CHECK_VALUE(x.numel() > 0 && weight.numel() > 0, what, ": x and weight must not be empty, got shapes ",
                    x.sizes(), " and ", weight.sizes());
  const TransposedCascadeSum g{x.size(0),
                               x.size(1),
                               weight.size(1),
                               {x.size(2), x.size(3), x.size(4)},
                               {weight.size(2), weight.size(3), weight.size(4)},
                               expand_param<3>(what, "stride", stride),
                               expand_param<3>(what, "padding", padding),
                               expand_param<3>(what, "output_padding", output_padding),
                               expand_param<3>(what, "kernel2", kernel2)};
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK_VALUE(g.stride[d] >= 1 && g.kernel2[d] >= 1, what, ": stride and kernel2 must be positive, got ",
                      stride, " and ", kernel2);
    TORCH_CHECK_VALUE(g.padding[d] >= 0, what, ": padding must be non-negative, got ", padding);
    TORCH_CHECK_VALUE(g.output_padding[d] >= 0 && g.output_padding[d] < g.stride[d], what,
                      ": output_padding must lie in [0, stride), got ", output_padding, " for stride ", stride);
    TORCH_CHECK_VALUE(g.out(d) >= 1 && g.cells(d) >= 1, what,
                      ": the input is too small for a second-stage window: y would be ", g.out(d), " along dim ",
                      d + 2, ", under stride ", g.stride[d], " x kernel2 ", g.kernel2[d]);
  }
  TORCH_CHECK_VALUE(!save_indices || g.classes() * g.kernel2[0] * g.kernel2[1] * g.kernel2[2] <= kMaxSavedKernelVolume,
                    what, ": save_indices needs stride's volume times kernel2's to be at most ", kMaxSavedKernelVolume,
                    " (a pick is one byte), got ", g.classes(), " * ", g.kernel2[0] * g.kernel2[1] * g.kernel2[2]);
  return g;
}

// aten.conv_transpose3d, its windows at the positions stage 2 reads (N, Md, Mh, Mw, O, P^3), then
// parity_max_pool3d_cascade_sum through the dispatcher: the CPU kernel, and the GPU's where its
// kernel does not apply.
inline std::tuple<at::Tensor, at::Tensor> transposed_cascade_sum_composite(const at::Tensor& x,
                                                                           const at::Tensor& weight,
                                                                           const TransposedCascadeSum& g,
                                                                           bool save_indices,
                                                                           std::optional<at::ScalarType> dtype) {
  const at::Tensor y = at::conv_transpose3d(x, weight, std::nullopt, g.stride, g.padding, g.output_padding);
  const int64_t m[3] = {g.positions(0), g.positions(1), g.positions(2)};
  const at::Tensor windows = y.slice(2, 0, g.stride[0] * m[0])
                                 .slice(3, 0, g.stride[1] * m[1])
                                 .slice(4, 0, g.stride[2] * m[2])
                                 .reshape({g.batch, g.out_channels, m[0], g.stride[0], m[1], g.stride[1], m[2],
                                           g.stride[2]})
                                 .permute({0, 2, 4, 6, 1, 3, 5, 7})
                                 .reshape({g.batch, m[0], m[1], m[2], g.out_channels, g.classes()});
  static const auto cascade =
      typed_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, at::IntArrayRef, bool,
                                                  std::optional<at::ScalarType>)>(
          "fused_ops::parity_max_pool3d_cascade_sum");
  return cascade.call(windows, g.kernel2, save_indices, dtype);
}

}  // namespace fused_ops
