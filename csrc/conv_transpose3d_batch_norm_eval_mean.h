// conv_transpose3d_batch_norm_eval_mean: architecture D's eval forward (fused_ops/nn.py, its rewrite
// with running statistics), the spatial mean of
//   batch_norm(scale * conv_transpose3d(x, weight, bias, stride, 0, output_padding))
// normalized with the running statistics, for a transposed convolution without padding, dilation or
// groups. There every input element meets every tap inside the output, so the output's spatial mean
// is affine in x's spatial sums s[n, i]:
//   mean[n, o] = bias[o] + (sum over i of s[n, i] * sum over taps t of w[i, o, t]) / |out|,
//   out[n, o] = (scale * mean[n, o] - running_mean[o]) * gamma[o] / sqrt(running_var[o] + eps) + beta[o]
// (gamma 1 and beta 0 where not given), |out| = the product over d of (in_d - 1) stride_d + k_d +
// output_padding_d. s is summed in x's accumulation type, the rest in float64, rounded once to the
// result's dtype. Nothing is kept between calls: the weights and statistics are read on each.
// Non-finite x: an infinite x[n, i, p] puts x * w[i, o, t] into the convolution's output at each tap t,
// so the mean is NaN where those meet infinities of both signs or a NaN (a zero tap: 0 * inf), else
// infinite of their one sign (NonFiniteMean); a NaN in x makes NaN. Not differentiable (D's module runs
// it where nothing records a gradient).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <c10/macros/Macros.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <optional>

#include "batch_norm_gap.h"
#include "convolution_checks.h"
#include "dispatch.h"
#include "pool_geometry.h"

namespace fused_ops {

struct BatchNormEvalMean {
  int64_t batch, in_channels, out_channels, taps;  // N, I, O, kt kr ks
  double inverse_volume;                           // 1 / |out|
  at::ScalarType result, param_dtype;              // the result's dtype; bias, gamma, beta's and the statistics'
};

// The checked arguments: x and weight as conv_transpose3d takes them (5-D, one floating dtype, x's
// channels the weight's first dim), bias (O) of the weight's dtype, the batch norm's per-channel
// tensors (O) of one dtype (batch_norm_gap's rule), stride >= 1, 0 <= output_padding < stride.
inline BatchNormEvalMean batch_norm_eval_mean_setup(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
    const at::Tensor& running_mean, const at::Tensor& running_var, at::IntArrayRef stride,
    at::IntArrayRef output_padding, std::optional<at::ScalarType> dtype) {
  constexpr const char* what = "conv_transpose3d_batch_norm_eval_mean";
  check_transposed_convolution_operands(what, x, weight);
  const int64_t out_channels = weight.size(1);
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == out_channels && bias->device() == x.device(), what,
                      ": bias must be 1-D with one element per output channel (", out_channels, ") on x's device, got ",
                      bias->sizes(), " on ", bias->device());
    TORCH_CHECK_TYPE(bias->scalar_type() == weight.scalar_type(), what, ": bias must have the weight's dtype ",
                     weight.scalar_type(), ", got ", bias->scalar_type());
  }
  const std::optional<at::Tensor> mean(running_mean), var(running_var);
  const at::ScalarType param_dtype = check_channel_tensors(
      what, "x", x, out_channels,
      {{"bn_weight", &bn_weight}, {"bn_bias", &bn_bias}, {"running_mean", &mean}, {"running_var", &var}});
  const auto s = expand_param<3>(what, "stride", stride), extra = expand_param<3>(what, "output_padding", output_padding);
  double volume = 1;
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK_VALUE(s[d] >= 1 && extra[d] >= 0 && extra[d] < s[d], what,
                      ": stride must be positive and output_padding in [0, stride), got ", stride, " and ",
                      output_padding);
    volume *= static_cast<double>((x.size(2 + d) - 1) * s[d] + weight.size(2 + d) + extra[d]);
  }
  return {x.size(0), x.size(1), out_channels, weight.size(2) * weight.size(3) * weight.size(4), 1 / volume,
          result_dtype(what, x.scalar_type(), dtype), param_dtype};
}

// The sign that taps share, met one value at a time: 1 where every one is positive, -1 where every one is
// negative, 0 where they differ or one is zero or NaN (the CUDA kernel meets a row's taps lane by lane and
// joins the lanes' flags by warp votes).
struct TapSign {
  bool positive = true, negative = true;

  C10_HOST_DEVICE void meet(double v) {
    positive = positive && v > 0;
    negative = negative && v < 0;
  }
  C10_HOST_DEVICE int sign() const { return positive ? 1 : (negative ? -1 : 0); }
};

// The taps w[i, o, 0 .. T) as the map takes them: their sum and their shared sign (TapSign).
struct TapSum {
  double sum;
  int sign;
};

template <typename T>
TapSum tap_sum(const T* w, int64_t taps) {
  double sum = 0;
  TapSign sign;
  for (int64_t t = 0; t < taps; ++t) {
    const double v = static_cast<double>(w[t]);
    sum += v;
    sign.meet(v);
  }
  return {sum, sign.sign()};
}

// A batch element's non-finite spatial sums met channel by channel (module comment): the signs of the
// infinite values they put into the convolution's output for one output channel, and whether one is NaN.
struct NonFiniteMean {
  bool positive = false, negative = false, nan = false;

  // the spatial sum s (non-finite) of an input channel whose taps share sign `sign`
  C10_HOST_DEVICE void meet(double s, int sign) {
    if (s != s || sign == 0) {
      nan = true;
    } else if ((s > 0) == (sign > 0)) {
      positive = true;
    } else {
      negative = true;
    }
  }

  // the output's spatial mean, given its finite channels' part
  C10_HOST_DEVICE double mean(double finite) const {
    if (nan || (positive && negative)) return static_cast<double>(NAN);
    if (positive) return static_cast<double>(INFINITY);
    return negative ? -static_cast<double>(INFINITY) : finite;
  }
};

// out[n, o] from its spatial mean of the convolution (bias included), by the scale and the batch norm.
C10_HOST_DEVICE inline double scaled_batch_norm(double mean, double scale, double running_mean, double gain,
                                                double beta) {
  return (scale * mean - running_mean) * gain + beta;
}

// x's spatial sums (N, I), in x's accumulation type.
inline at::Tensor spatial_sums(const at::Tensor& x) {
  return x.sum({2, 3, 4}, /*keepdim=*/false, at::toOpMathType(x.scalar_type()));
}

}  // namespace fused_ops
