// CPU kernels of max_pool3d_mean (the math: ../max_pool3d_mean.h).
// Parallel over (batch, channel) planes; any input strides, read in place.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../dispatch.h"
#include "../max_pool3d_mean.h"

namespace fused_ops {
namespace {

// Every window's pick of x / divisor: its offset into picks (when defined,
// (B, C, D', H', W') contiguous of index_t) and the sum of the picked values
// per plane into plane_sum (when not null).
template <typename scalar_t, typename index_t>
void pick_windows(const at::Tensor& x, const MaxPool3dGeometry& g, double divisor,
                  index_t* picks, at::opmath_type<scalar_t>* plane_sum) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t C = x.size(1);
  const auto xs = x.strides();
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  const TrueDivide<scalar_t> divide(divisor);
  const int64_t pooled = g.pooled_plane();
  at::parallel_for(0, x.size(0) * C, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const scalar_t* xn = xp + n / C * xs[0] + n % C * xs[1];
      auto value_at = [&](int d, int h, int w) {
        return static_cast<acc_t>(divide(static_cast<acc_t>(xn[d * xs[2] + h * xs[3] + w * xs[4]])));
      };
      index_t* pn = picks == nullptr ? nullptr : picks + n * pooled;
      acc_t total = 0;
      for (int od = 0; od < g.d.out; ++od) {
        for (int oh = 0; oh < g.h.out; ++oh) {
          for (int ow = 0; ow < g.w.out; ++ow) {
            const auto pick = pick_in_window<acc_t>(g, od, oh, ow, value_at);
            total += pick.value;
            if (pn != nullptr) *pn++ = static_cast<index_t>(pick.offset);
          }
        }
      }
      if (plane_sum != nullptr) plane_sum[n] = total;
    }
  });
}

// grad_x[b, c, e] = divide(count(e) * grad_mean[b, c] / N): count(e) windows
// pick e, N = D' * H' * W'. Scattered per plane: a window's gradient goes to
// its pick (PickPositions), the rest of the plane is divide(0) (-0 for a
// negative divisor, as PyTorch's). With disjoint windows each element is
// picked at most once: the plane is filled, then the picks stored over it.
// Overlapping windows count their picks per element first (a plane of ints
// per thread) and write the plane from the counts, once per element.
template <typename scalar_t, typename index_t>
void scatter_grad(const at::Tensor& grad_mean, const index_t* picks, const MaxPool3dGeometry& g,
                  double divisor, at::Tensor& grad_x) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t C = grad_x.size(1);
  const scalar_t* gm = grad_mean.const_data_ptr<scalar_t>();
  const auto gs = grad_mean.strides();
  scalar_t* gx = grad_x.mutable_data_ptr<scalar_t>();
  const TrueDivide<scalar_t> divide(divisor);
  const int64_t pooled = g.pooled_plane();
  const int64_t plane = static_cast<int64_t>(g.d.in) * g.h.in * g.w.in;
  const PickPositions where({&g}, g.d.in, g.h.in, g.w.in);
  const bool disjoint = g.windows_disjoint();
  const scalar_t zero = divide(acc_t(0));
  at::parallel_for(0, grad_x.size(0) * C, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> counts(disjoint ? 0 : plane);
    for (int64_t n = begin; n < end; ++n) {
      const acc_t window_grad =
          static_cast<acc_t>(gm[n / C * gs[0] + n % C * gs[1]]) / static_cast<acc_t>(pooled);
      const index_t* pn = picks + n * pooled;
      scalar_t* out = gx + n * plane;
      if (disjoint) {
        std::fill(out, out + plane, zero);
        const scalar_t picked = divide(window_grad);
        where.for_each(pn, [&](int64_t, int64_t e) { out[e] = picked; });
      } else {
        std::fill(counts.begin(), counts.end(), 0);
        where.for_each(pn, [&](int64_t, int64_t e) { ++counts[e]; });
        for (int64_t e = 0; e < plane; ++e) {
          out[e] = counts[e] == 0 ? zero : divide(counts[e] * window_grad);
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> max_pool3d_mean_cpu(const at::Tensor& x,
                                                       at::IntArrayRef kernel_size,
                                                       at::IntArrayRef stride,
                                                       at::IntArrayRef padding, bool ceil_mode,
                                                       double divisor, bool save_indices,
                                                       std::optional<at::ScalarType> dtype) {
  const auto g = max_pool3d_mean_geometry(x, kernel_size, stride, padding, ceil_mode, divisor,
                                          save_indices);
  auto [mean, indices] = max_pool3d_mean_outputs(x, g, save_indices, dtype);
  FUSED_OPS_DISPATCH_FLOATING_TYPES(x.scalar_type(), "max_pool3d_mean_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    std::vector<acc_t> plane_sum(x.size(0) * x.size(1));
    pick_windows<scalar_t, uint8_t>(x, g, divisor,
                                    save_indices ? indices.mutable_data_ptr<uint8_t>() : nullptr,
                                    plane_sum.data());
    const auto pooled = static_cast<acc_t>(g.pooled_plane());
    dispatch_scalar_or_acc<scalar_t>(mean.scalar_type(), [&](auto* tag) {
      using out_t = std::remove_pointer_t<decltype(tag)>;
      out_t* out = mean.mutable_data_ptr<out_t>();
      for (size_t n = 0; n < plane_sum.size(); ++n) out[n] = static_cast<out_t>(plane_sum[n] / pooled);
    });
  });
  return {mean, indices};
}

at::Tensor max_pool3d_mean_backward_cpu(const at::Tensor& grad_mean,
                                        const std::optional<at::Tensor>& indices,
                                        const std::optional<at::Tensor>& x,
                                        at::IntArrayRef input_size, at::IntArrayRef kernel_size,
                                        at::IntArrayRef stride, at::IntArrayRef padding,
                                        bool ceil_mode, double divisor) {
  auto args = max_pool3d_mean_backward_setup(grad_mean, indices, x, input_size, kernel_size,
                                             stride, padding, ceil_mode, divisor);
  const MaxPool3dGeometry& g = args.g;
  FUSED_OPS_DISPATCH_FLOATING_TYPES(grad_mean.scalar_type(), "max_pool3d_mean_backward_cpu", [&] {
    dispatch_picks(args.picks, [&](auto* picks) {
      if (args.recompute) pick_windows<scalar_t>(args.x, g, divisor, picks, nullptr);
      scatter_grad<scalar_t>(grad_mean, picks, g, divisor, args.grad_x);
    });
  });
  return args.grad_x;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("max_pool3d_mean", &max_pool3d_mean_cpu);
  m.impl("max_pool3d_mean_backward", &max_pool3d_mean_backward_cpu);
}

}  // namespace fused_ops
