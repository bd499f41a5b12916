// batch_norm_gap: out[b, c] = mean over (D, H, W) of batch_norm(x * scale)[b, c],
// nn.AdaptiveAvgPool3d(1)(nn.BatchNorm3d(x * scale)) -> (B, C, 1, 1, 1); and
// batch_norm_update_running_stats, nn.BatchNorm3d's update of its running
// statistics from the statistics the forward returns.
//
// Host-side pieces shared by the CPU and CUDA kernels: argument checks, the
// tensors the ops create, and the per-channel arithmetic (host and device).
//
// y = x * scale is rounded to x's dtype as PyTorch multiplies a tensor by a
// number (dispatch.h, Multiply). The average of a normalized plane is affine
// in the plane's mean m[b] = mean over its S = D * H * W elements of y[b, c]:
//   out[b, c] = (m[b] - mean[c]) * rstd[c] * weight[c] + bias[c],
// with mean[c] and var[c] the batch statistics of y over (B, D, H, W), N = B * S
// values, the biased variance (or the running statistics), and
// rstd = 1 / sqrt(var + eps). So the forward needs each plane's mean and
// moments, and nothing of x's size.
//
// No cancellation: every sum is taken of y - shift[c], shift[c] = y[0, c, 0, 0, 0]
// (an element of the channel: the shifted values have the size of the spread,
// not of the mean), or 0 where that element is NaN or infinite (finite_shift).
// A chunk of a plane gives its moments (count, mean, M2) by
// two passes over its values (in registers on the GPU); chunks and planes
// combine by Chan's formula, in float64 (a plane's mean is never rounded to
// float32 before its difference from the channel's is taken; a non-finite
// mean combines weighted by the counts: merge_moments). With
// D[b] = m[b] - shift and M2[b] the plane's moments,
//   d = mean_b D[b],  M2 = sum_b M2[b] + S * sum_b (D[b] - d)^2,  var = M2 / N.
// The saved mean is shift + d rounded to the accumulation type; the saved
// plane deviations dev[b] = m[b] - mean = D[b] - (mean - shift) keep the
// precision of the spread, and mean_b dev[b] is what the rounding of the mean
// dropped ("lo" below). Inputs of mean 1e4 and standard deviation 1 in float32
// lose nothing to the mean's size.
//
// Backward, with g[b] = grad_out[b, c], G = sum_b g[b], mu the exact batch mean,
// P = sum_b g[b] (m[b] - mu) = sum_b g[b] (dev[b] - lo):
//   batch statistics: d rstd / d y[b', s] = -rstd^3 (y[b', s] - mu) / N (mu's own
//   derivative drops out, as sum (y - mu) = 0), so
//     grad_y[b, s] = w rstd (g[b] / S - G / N) - w rstd^3 P (y[b, s] - mu) / N,
//     grad_weight = rstd P,  grad_bias = G;
//   running statistics: grad_y[b, s] = w rstd g[b] / S (no read of x),
//     grad_weight = rstd sum_b g[b] dev[b],  grad_bias = G;
// and grad_x = scale * grad_y (the rounding of y ignored, as autograd does).
// Per channel that is grad_x[b, c, s] = plane_term[b] + slope * (y[b, c, s] - mean),
// with (y - mu) = (y - mean) - lo (ChannelGrad).
#pragma once

#include <ATen/NumericUtils.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/macros/Macros.h>

#include <cmath>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>

#include "dispatch.h"
#include "max_pool3d.h"

namespace fused_ops {

// Non-finite values (NaN, +-inf in y) give PyTorch's statistics: a plane's mean
// is NaN or infinite as the sum of its values is, and only where they are (in eval
// mode its own output alone; with batch statistics its channel's mean and variance).
// Two rules keep them there: the shift is finite, and means combine as sums do.

template <typename acc_t>
C10_HOST_DEVICE inline bool is_finite(acc_t v) {
  return !at::_isnan(v) && !at::_isinf(v);
}

// The shift of a channel's sums: y[0, c, 0, 0, 0] where it is finite, else 0 (a
// NaN or infinite shift would make every shifted value of the channel NaN).
template <typename acc_t>
C10_HOST_DEVICE inline acc_t finite_shift(acc_t y0) {
  return is_finite(y0) ? y0 : acc_t(0);
}

// (count, mean, m2) merged with another set's (count_b, mean_b, m2_b) by Chan et
// al.'s formula, mean + (mean_b - mean) * count_b / total; where either mean is not
// finite, the mean weighted by the counts (count mean + count_b mean_b) / total,
// which keeps an infinity where Chan's makes inf - inf = NaN (and gives NaN for
// +inf with -inf, as a sum does). The caller adds count_b to count; an empty other
// set leaves the moments.
template <typename acc_t>
C10_HOST_DEVICE inline void merge_moments(acc_t count, acc_t& mean, acc_t& m2, acc_t count_b, acc_t mean_b,
                                          acc_t m2_b) {
  if (count_b == acc_t(0)) return;
  const acc_t total = count + count_b, delta = mean_b - mean, share = count_b / total;
  m2 += m2_b + delta * delta * count * share;
  mean = is_finite(mean) && is_finite(mean_b) ? mean + delta * share : (count * mean + count_b * mean_b) / total;
}

// How channel c is normalized, from its planes' shifted means D[b] = m[b] -
// shift, combined in float64.
template <typename acc_t>
struct ChannelNorm {
  acc_t mean;         // saved: the batch mean rounded to acc_t, or the running mean
  acc_t var;          // saved: the biased batch variance, or the running variance
  acc_t rstd;         // saved: 1 / sqrt(var + eps)
  double dev_offset;  // dev[b] = m[b] - mean = D[b] - dev_offset
  double out_offset;  // out[b] = (D[b] - out_offset) * rstd * weight + bias

  // d = mean_b D[b]; m2: the channel's sum of squared deviations over its
  // `count` values (an empty batch normalizes with mean 0 and variance 0).
  static C10_HOST_DEVICE ChannelNorm batch(double shift, double d, double m2, double count, double eps) {
    ChannelNorm n;
    n.mean = static_cast<acc_t>(shift + d);
    n.dev_offset = static_cast<double>(n.mean) - shift;
    n.out_offset = d;
    const double var = count > 0 ? m2 / count : 0.0;
    n.var = static_cast<acc_t>(var);
    n.rstd = static_cast<acc_t>(1.0 / std::sqrt(var + eps));
    return n;
  }
  static C10_HOST_DEVICE ChannelNorm running(double shift, acc_t running_mean, acc_t running_var, double eps) {
    ChannelNorm n;
    n.mean = running_mean;
    n.var = running_var;
    n.rstd = static_cast<acc_t>(1.0 / std::sqrt(static_cast<double>(running_var) + eps));
    n.dev_offset = n.out_offset = static_cast<double>(running_mean) - shift;
    return n;
  }
  // out[b] for a plane of shifted mean D
  C10_HOST_DEVICE double output(double D, double weight, double bias) const {
    return (D - out_offset) * static_cast<double>(rstd) * weight + bias;
  }
};

// Channel c's gradients and the coefficients of
//   grad_x[b, c, s] = plane_term(g[b]) + slope * (y[b, c, s] - mean[c])
// (see the top of this file), from sums over the batch of g[b], dev[b] and
// g[b] * dev[b]; batch_stats: the forward normalized with batch statistics.
template <typename acc_t>
struct ChannelGrad {
  acc_t grad_weight, grad_bias;
  acc_t slope;
  acc_t gain;        // scale * w * rstd
  acc_t batch_mean;  // G / N with batch statistics, else 0
  acc_t lo;          // exact batch mean - saved mean, with batch statistics, else 0
  acc_t plane_size;  // S

  static C10_HOST_DEVICE ChannelGrad make(acc_t sum_g, acc_t sum_dev, acc_t sum_g_dev, int64_t batch,
                                          int64_t plane_size, acc_t w, acc_t rstd, acc_t scale,
                                          bool batch_stats) {
    ChannelGrad cg;
    const acc_t count = static_cast<acc_t>(batch) * static_cast<acc_t>(plane_size);
    cg.lo = batch_stats && batch > 0 ? sum_dev / static_cast<acc_t>(batch) : acc_t(0);
    const acc_t p = sum_g_dev - cg.lo * sum_g;
    cg.grad_weight = rstd * p;
    cg.grad_bias = sum_g;
    cg.gain = scale * w * rstd;
    cg.batch_mean = batch_stats && batch > 0 ? sum_g / count : acc_t(0);
    cg.slope = batch_stats && batch > 0 ? -cg.gain * rstd * rstd * p / count : acc_t(0);
    cg.plane_size = static_cast<acc_t>(plane_size);
    return cg;
  }
  C10_HOST_DEVICE acc_t plane_term(acc_t g) const {
    return gain * (g / plane_size - batch_mean) - slope * lo;
  }
};

// nn.BatchNorm3d's running-statistics update (as PyTorch's CUDA
// batch_norm_update_stats computes it): factor = momentum, or with momentum
// None 1 / num_batches_tracked after its increment (0 without a counter).
template <typename acc_t>
struct RunningStatsUpdate {
  acc_t factor, bessel;  // bessel = N / (N - 1): the unbiased variance

  C10_HOST_DEVICE RunningStatsUpdate(bool cumulative, double momentum, int64_t batches, int64_t count)
      : factor(static_cast<acc_t>(cumulative ? (batches > 0 ? 1.0 / static_cast<double>(batches) : 0.0)
                                             : momentum)),
        bessel(static_cast<acc_t>(static_cast<double>(count) / static_cast<double>(count - 1))) {}
  C10_HOST_DEVICE acc_t mean(acc_t batch_mean, acc_t running_mean) const {
    return batch_mean * factor + (1 - factor) * running_mean;
  }
  C10_HOST_DEVICE acc_t var(acc_t batch_var, acc_t running_var) const {
    return batch_var * bessel * factor + (1 - factor) * running_var;
  }
};

inline bool is_given(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

inline std::string batch_stats_error(at::IntArrayRef input_size) {
  std::ostringstream s;
  s << "Expected more than 1 value per channel when training, got input size " << input_size;
  return s.str();
}

// Checks the per-channel tensors (name, tensor) against x: 1-D with one
// element per channel, floating-point, on x's device, all of one dtype, which
// must be x's, or float32 for a float16 or bfloat16 x (PyTorch's mixed-type
// batch norm). Returns that dtype (x's when none is given).
inline at::ScalarType check_channel_tensors(
    const char* what, const char* x_name, const at::Tensor& x, int64_t channels,
    std::initializer_list<std::pair<const char*, const std::optional<at::Tensor>*>> tensors) {
  std::optional<at::ScalarType> dtype;
  const char* first = nullptr;
  for (const auto& [name, t] : tensors) {
    if (!is_given(*t)) continue;
    const at::Tensor& p = **t;
    TORCH_CHECK_VALUE(p.device() == x.device(), what, ": ", x_name, " and ", name,
                      " must be on the same device, got ", x.device(), " and ", p.device());
    TORCH_CHECK_TYPE(at::isFloatingType(p.scalar_type()), what, ": ", name,
                     " must be a floating-point tensor, got ", p.scalar_type());
    TORCH_CHECK_VALUE(p.dim() == 1 && p.size(0) == channels, what, ": ", name,
                      " must be 1-D with one element per channel (", channels, "), got shape ",
                      p.sizes());
    if (!dtype) {
      dtype = p.scalar_type();
      first = name;
    }
    TORCH_CHECK_TYPE(p.scalar_type() == *dtype, what, ": ", name, " must have ", first,
                     "'s dtype ", *dtype, ", got ", p.scalar_type());
  }
  if (!dtype) return x.scalar_type();
  const bool reduced = at::isReducedFloatingType(x.scalar_type());
  TORCH_CHECK_TYPE(*dtype == x.scalar_type() || (reduced && *dtype == at::kFloat), what, ": ",
                   first, " must have ", x_name, "'s dtype ", x.scalar_type(),
                   reduced ? " or float32" : "", ", got ", *dtype);
  return *dtype;
}

// A per-channel tensor's values, contiguous (a copy only where it is not), or
// an undefined tensor where none is given.
inline at::Tensor channel_values(const std::optional<at::Tensor>& t) {
  return is_given(t) ? t->contiguous() : at::Tensor();
}

// The forward's checked arguments and outputs: out (B, C, 1, 1, 1) in the
// result's dtype (x's, or its accumulation type: result_dtype); in the
// accumulation type plane_dev (B, C) and mean, rstd, var (C).
struct BatchNormGapForward {
  at::Tensor out, plane_dev, mean, rstd, var;
  bool batch_stats;  // no running statistics given: normalize with the batch's
  at::ScalarType param_dtype;
};

inline BatchNormGapForward batch_norm_gap_setup(const at::Tensor& x,
                                                const std::optional<at::Tensor>& weight,
                                                const std::optional<at::Tensor>& bias,
                                                const std::optional<at::Tensor>& running_mean,
                                                const std::optional<at::Tensor>& running_var, double eps,
                                                std::optional<at::ScalarType> dtype) {
  constexpr const char* what = "batch_norm_gap";
  check_pool3d_input(what, x);
  const auto out_options = x.options().dtype(result_dtype(what, x.scalar_type(), dtype));
  TORCH_CHECK_VALUE(is_given(running_mean) == is_given(running_var), what,
                    ": pass both running_mean and running_var (to normalize with them) or "
                    "neither (to normalize with the batch's statistics)");
  const int64_t B = x.size(0), C = x.size(1);
  const auto param_dtype = check_channel_tensors(
      what, "x", x, C,
      {{"weight", &weight}, {"bias", &bias}, {"running_mean", &running_mean}, {"running_var", &running_var}});
  const bool batch_stats = !is_given(running_mean);
  TORCH_CHECK_VALUE(!batch_stats || B * x.size(2) * x.size(3) * x.size(4) != 1, what, ": ",
                    batch_stats_error(x.sizes()));
  // (F.batch_norm's rule: a batch's variance may be 0, a running one is the caller's)
  TORCH_CHECK_VALUE(batch_stats ? eps > 0 : eps >= 0, what, ": eps must be ",
                    batch_stats ? "positive with the batch's statistics" : "non-negative", ", got ", eps);
  const auto acc = x.options().dtype(at::toOpMathType(x.scalar_type()));
  return {at::empty({B, C, 1, 1, 1}, out_options), at::empty({B, C}, acc), at::empty({C}, acc),
          at::empty({C}, acc), at::empty({C}, acc), batch_stats, param_dtype};
}

// The backward's checked arguments: grad_x (B, C, *input_size) in `format`
// (contiguous; the CPU kernels write a channels_last_3d x's gradient
// channels_last_3d, the CUDA ones where it goes through batch statistics),
// or an empty tensor without grad_input; grad_weight and grad_bias (C) in
// weight's dtype (grad_out's without a weight).
struct BatchNormGapBackward {
  at::Tensor grad_x, grad_weight, grad_bias;
  at::ScalarType param_dtype;
  int64_t plane_size;  // S
};

inline BatchNormGapBackward batch_norm_gap_backward_setup(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& x, c10::IntArrayRef input_size,
    const std::optional<at::Tensor>& weight, const at::Tensor& plane_dev, const at::Tensor& mean,
    const at::Tensor& rstd, bool batch_stats, bool grad_input,
    at::MemoryFormat format = at::MemoryFormat::Contiguous) {
  constexpr const char* what = "batch_norm_gap_backward";
  TORCH_CHECK_TYPE(at::isFloatingType(grad_out.scalar_type()), what,
                   ": grad_out must be a floating-point tensor, got ", grad_out.scalar_type());
  TORCH_CHECK_VALUE(plane_dev.dim() == 2, what, ": plane_dev must be 2-D (batch, channels), got shape ",
                    plane_dev.sizes());
  const int64_t B = plane_dev.size(0), C = plane_dev.size(1);
  TORCH_CHECK_VALUE(grad_out.sizes() == c10::IntArrayRef({B, C, 1, 1, 1}), what,
                    ": grad_out must have shape (", B, ", ", C, ", 1, 1, 1), got ", grad_out.sizes());
  TORCH_CHECK_VALUE(input_size.size() == 3 && input_size[0] > 0 && input_size[1] > 0 && input_size[2] > 0,
                    what, ": input_size must be 3 positive sizes (depth, height, width), got ", input_size);
  const auto acc = at::toOpMathType(grad_out.scalar_type());
  for (const auto& [name, t] : {std::pair{"plane_dev", &plane_dev}, {"mean", &mean}, {"rstd", &rstd}}) {
    TORCH_CHECK_VALUE(t->device() == grad_out.device(), what, ": grad_out and ", name,
                      " must be on the same device, got ", grad_out.device(), " and ", t->device());
    TORCH_CHECK_TYPE(t->scalar_type() == acc, what, ": ", name, " must be ", acc, " for a ",
                     grad_out.scalar_type(), " grad_out, got ", t->scalar_type());
  }
  TORCH_CHECK_VALUE(mean.dim() == 1 && mean.size(0) == C && rstd.dim() == 1 && rstd.size(0) == C,
                    what, ": mean and rstd must have shape (", C, ",), got ", mean.sizes(), " and ",
                    rstd.sizes());
  const bool read_x = batch_stats && grad_input;
  TORCH_CHECK_VALUE(!read_x || is_given(x), what,
                    ": x is needed for the input's gradient through batch statistics");
  if (is_given(x)) {
    TORCH_CHECK_VALUE(x->device() == grad_out.device(), what,
                      ": grad_out and x must be on the same device, got ", grad_out.device(),
                      " and ", x->device());
    TORCH_CHECK_TYPE(x->scalar_type() == grad_out.scalar_type(), what,
                     ": x must have grad_out's dtype ", grad_out.scalar_type(), ", got ",
                     x->scalar_type());
    TORCH_CHECK_VALUE(x->dim() == 5 && x->size(0) == B && x->size(1) == C &&
                          x->sizes().slice(2) == input_size,
                      what, ": x of shape ", x->sizes(), " does not match plane_dev's (", B, ", ",
                      C, ") and input_size ", input_size);
  }
  const auto param_dtype =
      check_channel_tensors(what, "grad_out", grad_out, C, {{"weight", &weight}});
  const int64_t S = input_size[0] * input_size[1] * input_size[2];
  at::Tensor grad_x =
      grad_input ? at::empty({B, C, input_size[0], input_size[1], input_size[2]},
                             grad_out.options().memory_format(format))
                 : at::empty({0}, grad_out.options());
  const auto param_options = grad_out.options().dtype(param_dtype);
  return {grad_x, at::empty({C}, param_options), at::empty({C}, param_options), param_dtype, S};
}

// The running-statistics update's checks: running_mean and running_var (C) of
// one floating dtype, mean and var (C) in its accumulation type, an int64
// counter of one element; `count` values per channel (not 1).
inline void batch_norm_update_running_stats_check(const at::Tensor& running_mean,
                                                  const at::Tensor& running_var,
                                                  const std::optional<at::Tensor>& num_batches_tracked,
                                                  const at::Tensor& mean, const at::Tensor& var,
                                                  int64_t count) {
  constexpr const char* what = "batch_norm_update_running_stats";
  TORCH_CHECK_TYPE(at::isFloatingType(running_mean.scalar_type()), what,
                   ": running_mean must be a floating-point tensor, got ", running_mean.scalar_type());
  TORCH_CHECK_VALUE(running_mean.dim() == 1, what, ": running_mean must be 1-D, got shape ",
                    running_mean.sizes());
  const int64_t C = running_mean.size(0);
  const auto acc = at::toOpMathType(running_mean.scalar_type());
  for (const auto& [name, t, dtype] : {std::tuple{"running_var", &running_var, running_mean.scalar_type()},
                                       {"mean", &mean, acc},
                                       {"var", &var, acc}}) {
    TORCH_CHECK_VALUE(t->device() == running_mean.device(), what, ": running_mean and ", name,
                      " must be on the same device, got ", running_mean.device(), " and ", t->device());
    TORCH_CHECK_TYPE(t->scalar_type() == dtype, what, ": ", name, " must be ", dtype, " for ",
                     running_mean.scalar_type(), " running statistics, got ", t->scalar_type());
    TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == C, what, ": ", name, " must have shape (", C,
                      ",), got ", t->sizes());
  }
  if (is_given(num_batches_tracked)) {
    TORCH_CHECK_VALUE(num_batches_tracked->device() == running_mean.device(), what,
                      ": running_mean and num_batches_tracked must be on the same device, got ",
                      running_mean.device(), " and ", num_batches_tracked->device());
    TORCH_CHECK_TYPE(num_batches_tracked->scalar_type() == at::kLong, what,
                     ": num_batches_tracked must be an int64 tensor, got ",
                     num_batches_tracked->scalar_type());
    TORCH_CHECK_VALUE(num_batches_tracked->numel() == 1, what,
                      ": num_batches_tracked must have one element, got shape ",
                      num_batches_tracked->sizes());
  }
  TORCH_CHECK_VALUE(count >= 0, what, ": count must be non-negative, got ", count);
  TORCH_CHECK_VALUE(count != 1, what, ": ", "Expected more than 1 value per channel when training");
}

}  // namespace fused_ops
