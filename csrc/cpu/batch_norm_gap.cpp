// CPU kernels of batch_norm_gap and batch_norm_update_running_stats (the
// math: ../batch_norm_gap.h). The planes' moments: a channels_last_3d x in
// vectors over channels, parallel over (b, block of channels); a contiguous
// plane in vectors along it, parallel over planes; any other strides element
// by element. Then per channel; grad_x in x's layout, vectorized likewise.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../batch_norm_gap.h"
#include "../dispatch.h"
#include "vectorized.h"

namespace fused_ops {
namespace {

// Count, mean and sum of squared deviations from the mean of a set of values.
template <typename acc_t>
struct Moments {
  acc_t count = 0, mean = 0, m2 = 0;

  // Adds another set: Chan et al.'s combination of two sets' moments (merge_moments).
  void merge(const Moments& other) {
    merge_moments(count, mean, m2, other.count, other.mean, other.m2);
    count += other.count;
  }
};

// The moments of values[0, n), by two passes: the mean, then the squared
// deviations from it (each sum in lanes, then the lanes added).
template <typename acc_t>
Moments<acc_t> two_pass_moments(const acc_t* values, int n) {
  using Vec = at::vec::Vectorized<acc_t>;
  auto add = [](const Vec& a, const Vec& b) { return a + b; };
  Moments<acc_t> m;
  if (n == 0) return m;
  m.count = static_cast<acc_t>(n);
  m.mean = at::vec::reduce_all<acc_t>(add, values, n) / m.count;
  const Vec mean(m.mean);
  Vec squares(acc_t(0));
  int i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec deviation = Vec::loadu(values + i) - mean;
    squares = squares + deviation * deviation;
  }
  m.m2 = at::vec::vec_reduce_all<acc_t>(add, squares);
  for (; i < n; ++i) m.m2 += (values[i] - m.mean) * (values[i] - m.mean);
  return m;
}

// The moments of a block of n values per lane, values[i] lane l holding value
// i of lane l's set: two_pass_moments per lane, the values added in order.
template <typename acc_t>
void two_pass_moments_lanes(const at::vec::Vectorized<acc_t>* values, int n, Moments<acc_t>* lanes) {
  using Vec = at::vec::Vectorized<acc_t>;
  Vec sum(acc_t(0));
  for (int i = 0; i < n; ++i) sum = sum + values[i];
  const Vec count(static_cast<acc_t>(n));
  const Vec mean = sum / count;
  Vec squares(acc_t(0));
  for (int i = 0; i < n; ++i) squares = squares + (values[i] - mean) * (values[i] - mean);
  __at_align__ acc_t mean_lanes[Vec::size()], square_lanes[Vec::size()];
  mean.store(mean_lanes);
  squares.store(square_lanes);
  for (int l = 0; l < Vec::size(); ++l) lanes[l] = {static_cast<acc_t>(n), mean_lanes[l], square_lanes[l]};
}

// Values per block of a plane's two-pass moments.
constexpr int kBlock = 64;

// Calls f(e, offset) for the elements of one (b, c) plane of x in (d, h, w)
// order: e counts them, offset is the element's offset from the plane's start.
template <typename F>
void for_each_in_plane(const at::Tensor& x, F&& f) {
  const auto xs = x.strides();
  int64_t e = 0;
  for (int64_t d = 0; d < x.size(2); ++d) {
    for (int64_t h = 0; h < x.size(3); ++h) {
      for (int64_t w = 0; w < x.size(4); ++w) f(e++, d * xs[2] + h * xs[3] + w * xs[4]);
    }
  }
}

// The channel's shift: y[0, c, 0, 0, 0], or 0 where it is not finite (finite_shift, batch_norm_gap.h).
template <typename scalar_t>
at::opmath_type<scalar_t> channel_shift(const at::Tensor& x, int64_t c, const Multiply<scalar_t>& multiply) {
  using acc_t = at::opmath_type<scalar_t>;
  if (x.size(0) == 0) return 0;
  return finite_shift(
      static_cast<acc_t>(multiply(static_cast<acc_t>(x.const_data_ptr<scalar_t>()[c * x.stride(1)]))));
}

// Moments added block by block and combined pairwise, in float64 (a binary
// counter: level l holds the moments of 2^l blocks).
class PairwiseMoments {
 public:
  template <typename acc_t>
  void add(const Moments<acc_t>& block) {
    Moments<double> m{block.count, block.mean, block.m2};
    int l = 0;
    for (; held_[l]; ++l) {
      level_[l].merge(m);
      m = level_[l];
      held_[l] = false;
    }
    level_[l] = m;
    held_[l] = true;
  }
  Moments<double> total() const {
    Moments<double> m;
    for (int l = 0; l < kLevels; ++l) {
      if (held_[l]) m.merge(level_[l]);
    }
    return m;
  }

 private:
  static constexpr int kLevels = 64;
  Moments<double> level_[kLevels];
  bool held_[kLevels] = {};
};

// Each (b, c) plane of x is contiguous: D * H * W adjacent elements.
inline bool planes_contiguous(const at::Tensor& x) {
  return x.stride(4) == 1 && x.stride(3) == x.size(4) && x.stride(2) == x.size(3) * x.size(4);
}

// Each plane's mean of y - shift (into plane_mean) and sum of squared
// deviations (into plane_m2), (B, C) contiguous: blocks of kBlock values by
// two passes, combined pairwise in float64.
template <typename scalar_t>
void plane_moments(const at::Tensor& x, const Multiply<scalar_t>& multiply, double* plane_mean,
                   double* plane_m2) {
  using acc_t = at::opmath_type<scalar_t>;
  using CV = ChannelVec<scalar_t>;
  using Vec = typename CV::Vec;
  constexpr int kLanes = CV::kLanes;
  const int64_t B = x.size(0), C = x.size(1), S = x.size(2) * x.size(3) * x.size(4);
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  const MultiplyVec<scalar_t> multiply_lanes(multiply.factor);
  if (is_channels_last_3d(x)) {
    // per (b, block of kLanes channels): the plane's elements s = 0, 1, ... are
    // C apart, each block of kBlock of them two passes per lane
    const int64_t blocks = (C + kLanes - 1) / kLanes;
    at::parallel_for(0, B * blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<PairwiseMoments> moments(kLanes);
      Vec block[kBlock];
      Moments<acc_t> lanes[kLanes];
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / blocks, c = item % blocks * kLanes;
        const int count = static_cast<int>(std::min<int64_t>(kLanes, C - c));
        __at_align__ acc_t shifts[kLanes] = {};  // y[0, c + l, 0, 0, 0] (channel_shift)
        for (int l = 0; l < count; ++l) shifts[l] = channel_shift(x, c + l, multiply);
        const Vec shift = Vec::loadu(shifts);
        const scalar_t* xb = xp + b * x.stride(0) + c;
        std::fill(moments.begin(), moments.end(), PairwiseMoments());
        for (int64_t s0 = 0; s0 < S; s0 += kBlock) {
          const int n = static_cast<int>(std::min<int64_t>(kBlock, S - s0));
          for (int i = 0; i < n; ++i) block[i] = multiply_lanes(CV::load(xb + (s0 + i) * C, count)) - shift;
          two_pass_moments_lanes(block, n, lanes);
          for (int l = 0; l < count; ++l) moments[l].add(lanes[l]);
        }
        for (int l = 0; l < count; ++l) {
          const Moments<double> m = moments[l].total();
          plane_mean[b * C + c + l] = m.mean;
          plane_m2[b * C + c + l] = m.m2;
        }
      }
    });
    return;
  }
  const bool contiguous = planes_contiguous(x);
  at::parallel_for(0, B * C, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const scalar_t* plane = xp + n / C * x.stride(0) + n % C * x.stride(1);
      const acc_t shift = channel_shift(x, n % C, multiply);
      PairwiseMoments moments;
      __at_align__ acc_t block[kBlock];
      if (contiguous) {  // kLanes adjacent elements at a time
        const Vec shift_lanes(shift);
        for (int64_t s0 = 0; s0 < S; s0 += kBlock) {
          const int n_block = static_cast<int>(std::min<int64_t>(kBlock, S - s0));
          for (int i = 0; i < n_block; i += kLanes) {
            const int count = std::min(kLanes, n_block - i);
            (multiply_lanes(CV::load(plane + s0 + i, count)) - shift_lanes).store(block + i, count);
          }
          moments.add(two_pass_moments(block, n_block));
        }
      } else {
        int filled = 0;
        for_each_in_plane(x, [&](int64_t, int64_t offset) {
          block[filled++] = static_cast<acc_t>(multiply(static_cast<acc_t>(plane[offset]))) - shift;
          if (filled == kBlock) {
            moments.add(two_pass_moments(block, kBlock));
            filled = 0;
          }
        });
        moments.add(two_pass_moments(block, filled));
      }
      const Moments<double> m = moments.total();
      plane_mean[n] = m.mean;
      plane_m2[n] = m.m2;
    }
  });
}

// Per channel: its statistics (ChannelNorm) from the planes' moments, the
// saved mean, var and rstd, and per plane out (of out_t, the result's dtype)
// and the saved deviation.
template <typename scalar_t, typename param_t, typename out_t>
void normalize_channels(const at::Tensor& x, const Multiply<scalar_t>& multiply,
                        const std::vector<double>& plane_mean, const std::vector<double>& plane_m2,
                        const at::Tensor& weight, const at::Tensor& bias,
                        const at::Tensor& running_mean, const at::Tensor& running_var, double eps,
                        const BatchNormGapForward& f) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t B = x.size(0), C = x.size(1), S = x.size(2) * x.size(3) * x.size(4);
  auto value = [](const at::Tensor& t, int64_t c, acc_t otherwise) {
    return t.defined() ? static_cast<acc_t>(t.const_data_ptr<param_t>()[c]) : otherwise;
  };
  out_t* out = f.out.mutable_data_ptr<out_t>();
  acc_t* dev = f.plane_dev.mutable_data_ptr<acc_t>();
  at::parallel_for(0, C, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const double shift = channel_shift(x, c, multiply);
      ChannelNorm<acc_t> norm;
      if (f.batch_stats) {
        double sum = 0, m2 = 0, squares = 0;
        for (int64_t b = 0; b < B; ++b) {
          sum += plane_mean[b * C + c];
          m2 += plane_m2[b * C + c];
        }
        const double d = B > 0 ? sum / static_cast<double>(B) : 0.0;
        for (int64_t b = 0; b < B; ++b) {
          const double delta = plane_mean[b * C + c] - d;
          squares += delta * delta;
        }
        norm = ChannelNorm<acc_t>::batch(shift, d, m2 + static_cast<double>(S) * squares,
                                         static_cast<double>(B * S), eps);
      } else {
        norm = ChannelNorm<acc_t>::running(shift, value(running_mean, c, 0), value(running_var, c, 0), eps);
      }
      f.mean.mutable_data_ptr<acc_t>()[c] = norm.mean;
      f.var.mutable_data_ptr<acc_t>()[c] = norm.var;
      f.rstd.mutable_data_ptr<acc_t>()[c] = norm.rstd;
      const double w = value(weight, c, 1), beta = value(bias, c, 0);
      for (int64_t b = 0; b < B; ++b) {
        const double D = plane_mean[b * C + c];
        dev[b * C + c] = static_cast<acc_t>(D - norm.dev_offset);
        out[b * C + c] = static_cast<out_t>(norm.output(D, w, beta));
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_norm_gap_cpu(
    const at::Tensor& x, double scale, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, double eps, std::optional<at::ScalarType> dtype) {
  const auto f = batch_norm_gap_setup(x, weight, bias, running_mean, running_var, eps, dtype);
  FUSED_OPS_DISPATCH_FLOATING_TYPES(x.scalar_type(), "batch_norm_gap_cpu", [&] {
    const Multiply<scalar_t> multiply(scale);
    std::vector<double> plane_mean(x.size(0) * x.size(1)), plane_m2(plane_mean.size());
    plane_moments<scalar_t>(x, multiply, plane_mean.data(), plane_m2.data());
    dispatch_scalar_or_acc<scalar_t>(f.param_dtype, [&](auto* param_tag) {
      dispatch_scalar_or_acc<scalar_t>(f.out.scalar_type(), [&](auto* out_tag) {
        using param_t = std::remove_pointer_t<decltype(param_tag)>;
        using out_t = std::remove_pointer_t<decltype(out_tag)>;
        normalize_channels<scalar_t, param_t, out_t>(x, multiply, plane_mean, plane_m2, channel_values(weight),
                                                     channel_values(bias), channel_values(running_mean),
                                                     channel_values(running_var), eps, f);
      });
    });
  });
  return {f.out, f.plane_dev, f.mean, f.rstd, f.var};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_gap_backward_cpu(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& x, at::IntArrayRef input_size,
    double scale, const std::optional<at::Tensor>& weight, const at::Tensor& plane_dev,
    const at::Tensor& mean, const at::Tensor& rstd, bool batch_stats, bool grad_input) {
  // grad_x laid out as x, where given
  const auto format = is_given(x) ? grad_memory_format(*x) : at::MemoryFormat::Contiguous;
  auto args = batch_norm_gap_backward_setup(grad_out, x, input_size, weight, plane_dev, mean, rstd,
                                            batch_stats, grad_input, format);
  const int64_t B = plane_dev.size(0), C = plane_dev.size(1), S = args.plane_size;
  FUSED_OPS_DISPATCH_FLOATING_TYPES(grad_out.scalar_type(), "batch_norm_gap_backward_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* g = grad_out.const_data_ptr<scalar_t>();
    const int64_t gs0 = grad_out.stride(0), gs1 = grad_out.stride(1);
    const at::Tensor dev_values = plane_dev.contiguous(), rstd_values = rstd.contiguous(),
                     mean_values = mean.contiguous(), w_values = channel_values(weight);
    const acc_t* dev = dev_values.const_data_ptr<acc_t>();
    // Per channel: grad_weight = rstd P, P = sum_b g[b] (m[b] - mu) (d out[b] /
    // d weight = (m[b] - mu) rstd), grad_bias = G = sum_b g[b], and grad_x's
    // coefficients, slope and per plane plane_term (ChannelGrad).
    std::vector<acc_t> plane_term(B * C), slope(C);
    dispatch_scalar_or_acc<scalar_t>(args.param_dtype, [&](auto* tag) {
      using param_t = std::remove_pointer_t<decltype(tag)>;
      at::parallel_for(0, C, 1, [&](int64_t begin, int64_t end) {
        for (int64_t c = begin; c < end; ++c) {
          acc_t sum_g = 0, sum_dev = 0, sum_g_dev = 0;
          for (int64_t b = 0; b < B; ++b) {
            const acc_t gb = static_cast<acc_t>(g[b * gs0 + c * gs1]);
            sum_g += gb;
            sum_dev += dev[b * C + c];
            sum_g_dev += gb * dev[b * C + c];
          }
          const acc_t w = w_values.defined() ? static_cast<acc_t>(w_values.const_data_ptr<param_t>()[c]) : acc_t(1);
          const auto cg = ChannelGrad<acc_t>::make(sum_g, sum_dev, sum_g_dev, B, S, w,
                                                   rstd_values.const_data_ptr<acc_t>()[c],
                                                   static_cast<acc_t>(scale), batch_stats);
          args.grad_weight.mutable_data_ptr<param_t>()[c] = static_cast<param_t>(cg.grad_weight);
          args.grad_bias.mutable_data_ptr<param_t>()[c] = static_cast<param_t>(cg.grad_bias);
          slope[c] = cg.slope;
          for (int64_t b = 0; b < B; ++b) {
            plane_term[b * C + c] = cg.plane_term(static_cast<acc_t>(g[b * gs0 + c * gs1]));
          }
        }
      });
    });
    if (!grad_input) return;
    // grad_y = w rstd (g[b] / S - G / N) - w rstd^3 P (y - mu) / N (through m[b],
    // mu and rstd), times scale: grad_x[b, c, s] = plane_term[b, c] + slope[c] *
    // (y[b, c, s] - mean[c]); without batch statistics slope is 0 and x is not read.
    scalar_t* gx = args.grad_x.mutable_data_ptr<scalar_t>();
    const acc_t* center = mean_values.const_data_ptr<acc_t>();
    const Multiply<scalar_t> multiply(scale);
    using CV = ChannelVec<scalar_t>;
    using Vec = typename CV::Vec;
    constexpr int kLanes = CV::kLanes;
    const MultiplyVec<scalar_t> multiply_lanes(scale);
    if (is_channels_last_3d(args.grad_x)) {
      // per element (b, s), the C channels adjacent in x and grad_x, kLanes at a time
      const scalar_t* xp = is_given(x) ? x->const_data_ptr<scalar_t>() : nullptr;
      at::parallel_for(0, B * S, 256, [&](int64_t begin, int64_t end) {
        for (int64_t q = begin; q < end; ++q) {
          const int64_t b = q / S;
          scalar_t* out = gx + q * C;
          for (int64_t c = 0; c < C; c += kLanes) {
            const int count = static_cast<int>(std::min<int64_t>(kLanes, C - c));
            const Vec a = Vec::loadu(plane_term.data() + b * C + c, count);
            if (!batch_stats) {
              CV::store(out + c, a, count);
              continue;
            }
            const Vec y = multiply_lanes(CV::load(xp + q * C + c, count));
            const Vec k = Vec::loadu(slope.data() + c, count), m = Vec::loadu(center + c, count);
            CV::store(out + c, a + k * (y - m), count);
          }
        }
      });
      return;
    }
    const bool contiguous = !batch_stats || planes_contiguous(*x);
    at::parallel_for(0, B * C, 1, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        scalar_t* out = gx + n * S;
        if (!batch_stats) {
          std::fill(out, out + S, static_cast<scalar_t>(plane_term[n]));
          continue;
        }
        const scalar_t* plane = x->const_data_ptr<scalar_t>() + n / C * x->stride(0) + n % C * x->stride(1);
        const acc_t a = plane_term[n], k = slope[n % C], m = center[n % C];
        if (contiguous) {  // kLanes adjacent elements at a time
          const Vec a_lanes(a), k_lanes(k), m_lanes(m);
          for (int64_t e = 0; e < S; e += kLanes) {
            const int count = static_cast<int>(std::min<int64_t>(kLanes, S - e));
            const Vec y = multiply_lanes(CV::load(plane + e, count));
            CV::store(out + e, a_lanes + k_lanes * (y - m_lanes), count);
          }
          continue;
        }
        for_each_in_plane(*x, [&](int64_t e, int64_t offset) {
          const acc_t y = static_cast<acc_t>(multiply(static_cast<acc_t>(plane[offset])));
          out[e] = static_cast<scalar_t>(a + k * (y - m));
        });
      }
    });
  });
  return {args.grad_x, args.grad_weight, args.grad_bias};
}

void batch_norm_update_running_stats_cpu(at::Tensor& running_mean, at::Tensor& running_var,
                                         const std::optional<at::Tensor>& num_batches_tracked,
                                         const at::Tensor& mean, const at::Tensor& var, int64_t count,
                                         std::optional<double> momentum) {
  batch_norm_update_running_stats_check(running_mean, running_var, num_batches_tracked, mean, var, count);
  int64_t batches = 0;
  if (is_given(num_batches_tracked)) {
    batches = num_batches_tracked->mutable_data_ptr<int64_t>()[0] += 1;
  }
  if (count == 0) return;  // an empty batch: nn.BatchNorm3d counts it, the statistics stay
  FUSED_OPS_DISPATCH_FLOATING_TYPES(running_mean.scalar_type(), "batch_norm_update_running_stats_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const RunningStatsUpdate<acc_t> update(!momentum.has_value(), momentum.value_or(0.0), batches, count);
    scalar_t* rm = running_mean.mutable_data_ptr<scalar_t>();
    scalar_t* rv = running_var.mutable_data_ptr<scalar_t>();
    const int64_t rms = running_mean.stride(0), rvs = running_var.stride(0);
    for (int64_t c = 0; c < running_mean.size(0); ++c) {
      rm[c * rms] = static_cast<scalar_t>(update.mean(mean.const_data_ptr<acc_t>()[c * mean.stride(0)],
                                                      static_cast<acc_t>(rm[c * rms])));
      rv[c * rvs] = static_cast<scalar_t>(update.var(var.const_data_ptr<acc_t>()[c * var.stride(0)],
                                                     static_cast<acc_t>(rv[c * rvs])));
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("batch_norm_gap", &batch_norm_gap_cpu);
  m.impl("batch_norm_gap_backward", &batch_norm_gap_backward_cpu);
  m.impl("batch_norm_update_running_stats", &batch_norm_update_running_stats_cpu);
}

}  // namespace fused_ops
