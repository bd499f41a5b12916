// CPU kernel of conv_transpose3d_batch_norm_eval_mean (the math: ../conv_transpose3d_batch_norm_eval_mean.h):
// x's spatial sums by ATen's reduction, then the map from them in float64, an output element a step.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <vector>

#include "../conv_transpose3d_batch_norm_eval_mean.h"

namespace fused_ops {
namespace {

// t's values in float64 (a per-channel tensor), or `fill` repeated where t is not given.
std::vector<double> channel_values(const std::optional<at::Tensor>& t, int64_t channels, double fill) {
  if (!is_given(t)) return std::vector<double>(channels, fill);
  const at::Tensor values = t->to(at::kDouble).contiguous();
  return {values.const_data_ptr<double>(), values.const_data_ptr<double>() + channels};
}

at::Tensor conv_transpose3d_batch_norm_eval_mean_cpu(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& bn_weight, const std::optional<at::Tensor>& bn_bias,
    const at::Tensor& running_mean, const at::Tensor& running_var, at::IntArrayRef stride,
    at::IntArrayRef output_padding, double scale, double eps, std::optional<at::ScalarType> dtype) {
  const BatchNormEvalMean g = batch_norm_eval_mean_setup(x, weight, bias, bn_weight, bn_bias, running_mean,
                                                         running_var, stride, output_padding, dtype);
  const int64_t N = g.batch, I = g.in_channels, O = g.out_channels;
  const at::Tensor sums = spatial_sums(x).to(at::kDouble).contiguous();
  const double* s = sums.const_data_ptr<double>();
  std::vector<TapSum> taps(I * O);  // [i * O + o]
  const at::Tensor w = weight.contiguous();
  FUSED_OPS_DISPATCH_FLOATING_TYPES(w.scalar_type(), "conv_transpose3d_batch_norm_eval_mean_cpu", [&] {
    const scalar_t* data = w.const_data_ptr<scalar_t>();
    at::parallel_for(0, I * O, 64, [&](int64_t begin, int64_t end) {
      for (int64_t e = begin; e < end; ++e) taps[e] = tap_sum(data + e * g.taps, g.taps);
    });
  });
  const std::vector<double> conv_bias = channel_values(bias, O, 0), gamma = channel_values(bn_weight, O, 1),
                            beta = channel_values(bn_bias, O, 0), mean = channel_values(running_mean, O, 0),
                            var = channel_values(running_var, O, 0);
  at::Tensor out = at::empty({N, O}, x.options().dtype(at::kDouble));
  double* result = out.mutable_data_ptr<double>();
  at::parallel_for(0, N * O, 16, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      const int64_t n = e / O, o = e % O;
      double dot = 0;
      NonFiniteMean non_finite;
      for (int64_t i = 0; i < I; ++i) {
        const double value = s[n * I + i];
        const TapSum& tap = taps[i * O + o];
        if (std::isfinite(value)) {
          dot += value * tap.sum;
        } else {
          non_finite.meet(value, tap.sign);
        }
      }
      const double gain = gamma[o] / std::sqrt(var[o] + eps);
      result[e] = scaled_batch_norm(non_finite.mean(dot * g.inverse_volume + conv_bias[o]), scale, mean[o], gain, beta[o]);
    }
  });
  return out.to(g.result);
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("conv_transpose3d_batch_norm_eval_mean", &conv_transpose3d_batch_norm_eval_mean_cpu);
}

}  // namespace fused_ops
