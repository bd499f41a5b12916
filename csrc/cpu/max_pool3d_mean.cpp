// CPU kernels of max_pool3d_mean (the math: ../max_pool3d_mean.h):
//   mean[b, c] = sum over windows of (the window's pick of x / divisor) / N,
//   grad_x[b, c, e] = divide(count(e) * grad_mean[b, c] / N).
// Three forward paths, one rule (vectorized.h, max_pool3d.h): a
// channels_last_3d x in vectors over channels, parallel over rows of windows
// (b, od, oh); an x whose w is adjacent (contiguous) in vectors along w,
// parallel over (b, c) planes; any other strides element by element. The
// picks are laid out as x is (channels_last_3d for such an x), and so is
// grad_x.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../dispatch.h"
#include "../max_pool3d_mean.h"
#include "vectorized.h"

namespace fused_ops {
namespace {

// Element by element, any strides: every window's pick of x / divisor, its
// offset into picks (when not null) and the sum of the picked values per
// plane into plane_sum (when not null).
template <typename scalar_t, typename index_t>
void pick_windows_strided(const at::Tensor& x, const MaxPool3dGeometry& g, double divisor,
                          index_t* picks, PickStrides ps, at::opmath_type<scalar_t>* plane_sum) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t C = x.size(1);
  const auto xs = x.strides();
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  const TrueDivide<scalar_t> divide(divisor);
  at::parallel_for(0, x.size(0) * C, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const scalar_t* xn = xp + n / C * xs[0] + n % C * xs[1];
      auto value_at = [&](int d, int h, int w) {
        return static_cast<acc_t>(divide(static_cast<acc_t>(xn[d * xs[2] + h * xs[3] + w * xs[4]])));
      };
      index_t* pn = picks == nullptr ? nullptr : picks + ps.plane(n, C);
      acc_t total = 0;
      int64_t p = 0;
      for (int od = 0; od < g.d.out; ++od) {
        for (int oh = 0; oh < g.h.out; ++oh) {
          for (int ow = 0; ow < g.w.out; ++ow, ++p) {
            const auto pick = pick_in_window<acc_t>(g, od, oh, ow, value_at);
            total += pick.value;
            if (pn != nullptr) pn[p * ps.position] = static_cast<index_t>(pick.offset);
          }
        }
      }
      if (plane_sum != nullptr) plane_sum[n] = total;
    }
  });
}

// x with w adjacent (x.stride(4) == 1): the same per plane, each row of
// windows picked in vectors along w (pick_row_along_w); the plane's sum added
// in the same order.
template <typename scalar_t, typename index_t, bool WithOffsets>
void pick_windows_along_w(const at::Tensor& x, const MaxPool3dGeometry& g, double divisor,
                          index_t* picks, PickStrides ps, at::opmath_type<scalar_t>* plane_sum) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t C = x.size(1);
  const auto xs = x.strides();
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  const TrueDivideVec<scalar_t> divide(divisor);
  at::parallel_for(0, x.size(0) * C, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> columns(2 * static_cast<size_t>(g.w.in));
    std::vector<WindowPick<acc_t>> row(g.w.out);
    for (int64_t n = begin; n < end; ++n) {
      const scalar_t* xn = xp + n / C * xs[0] + n % C * xs[1];
      index_t* pn = picks == nullptr ? nullptr : picks + ps.plane(n, C);
      acc_t total = 0;
      int64_t p = 0;
      for (int od = 0; od < g.d.out; ++od) {
        for (int oh = 0; oh < g.h.out; ++oh) {
          pick_row_along_w<scalar_t, WithOffsets>(g, od, oh, xn, xs[2], xs[3], divide, columns.data(), row.data());
          for (int ow = 0; ow < g.w.out; ++ow, ++p) {
            total += row[ow].value;
            if constexpr (WithOffsets) pn[p * ps.position] = static_cast<index_t>(row[ow].offset);
          }
        }
      }
      if (plane_sum != nullptr) plane_sum[n] = total;
    }
  });
}

// channels_last_3d x: rows of windows (b, od, oh) in parallel, each window
// picked in vectors over channels (pick_window_channels); picks (when
// WithOffsets) channels_last_3d. Each row's sums per channel go to a buffer,
// added per plane in row order (the same sum at any number of threads).
template <typename scalar_t, typename index_t, bool WithOffsets>
void pick_windows_channels_last(const at::Tensor& x, const MaxPool3dGeometry& g, double divisor,
                                index_t* picks, PickStrides ps, at::opmath_type<scalar_t>* plane_sum) {
  using acc_t = at::opmath_type<scalar_t>;
  using CV = ChannelVec<scalar_t>;
  using Vec = typename CV::Vec;
  constexpr int kLanes = CV::kLanes;
  const int64_t B = x.size(0), C = x.size(1);
  const auto xs = x.strides();
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  const TrueDivideVec<scalar_t> divide(divisor);
  const int64_t rows_per_plane = static_cast<int64_t>(g.d.out) * g.h.out;
  std::vector<acc_t> row_sum(plane_sum == nullptr ? 0 : B * rows_per_plane * C);
  const int64_t blocks = (C + kLanes - 1) / kLanes;
  const int tail = static_cast<int>(C - (blocks - 1) * kLanes);  // the last block's channels
  at::parallel_for(0, B * rows_per_plane, 1, [&](int64_t begin, int64_t end) {
    std::vector<VecPick<acc_t, WithOffsets>> window(blocks);
    __at_align__ acc_t offsets[kLanes];
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / rows_per_plane;
      const int od = static_cast<int>(r % rows_per_plane / g.h.out), oh = static_cast<int>(r % g.h.out);
      acc_t* sums = row_sum.empty() ? nullptr : row_sum.data() + r * C;
      if (sums != nullptr) std::fill(sums, sums + C, acc_t(0));
      for (int ow = 0; ow < g.w.out; ++ow) {
        const int64_t p = (static_cast<int64_t>(od) * g.h.out + oh) * g.w.out + ow;
        pick_window_channels<scalar_t, WithOffsets>(g, od, oh, ow, xp + b * xs[0], xs[2], xs[3], xs[4], blocks,
                                                    tail, divide, window.data());
        for (int64_t k = 0; k < blocks; ++k) {
          const int64_t c = k * kLanes;
          const int count = k + 1 < blocks ? kLanes : tail;
          if (sums != nullptr) (Vec::loadu(sums + c, count) + window[k].value).store(sums + c, count);
          if constexpr (WithOffsets) {
            window[k].offset.store(offsets);
            index_t* out = picks + b * ps.batch + c * ps.channel + p * ps.position;
            for (int i = 0; i < count; ++i) out[i * ps.channel] = static_cast<index_t>(offsets[i]);
          }
        }
      }
    }
  });
  if (plane_sum == nullptr) return;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t c = 0; c < C; c += kLanes) {
        const int count = static_cast<int>(std::min<int64_t>(kLanes, C - c));
        Vec total(acc_t(0));
        for (int64_t r = 0; r < rows_per_plane; ++r) {
          total = total + Vec::loadu(row_sum.data() + (b * rows_per_plane + r) * C + c, count);
        }
        total.store(plane_sum + b * C + c, count);
      }
    }
  });
}

// Every window's pick of x / divisor: its offset into picks (when not null;
// (B, C, D', H', W') laid out as ps says) and the sum of the picked values
// per plane into plane_sum (when not null; (B, C) contiguous), by the path
// x's layout allows.
template <typename scalar_t, typename index_t>
void pick_windows(const at::Tensor& x, const MaxPool3dGeometry& g, double divisor, index_t* picks,
                  PickStrides ps, at::opmath_type<scalar_t>* plane_sum) {
  const bool lanes_exact = g.kernel_volume() < kMaxLanePickNumber;
  if (lanes_exact && is_channels_last_3d(x)) {
    dispatch_with_offsets(picks != nullptr, [&](auto with_offsets) {
      pick_windows_channels_last<scalar_t, index_t, decltype(with_offsets)::value>(x, g, divisor, picks, ps,
                                                                                  plane_sum);
    });
  } else if (lanes_exact && x.stride(4) == 1) {
    dispatch_with_offsets(picks != nullptr, [&](auto with_offsets) {
      pick_windows_along_w<scalar_t, index_t, decltype(with_offsets)::value>(x, g, divisor, picks, ps, plane_sum);
    });
  } else {
    pick_windows_strided<scalar_t>(x, g, divisor, picks, ps, plane_sum);
  }
}

// grad_x[b, c, e] = divide(count(e) * grad_mean[b, c] / N): count(e) windows
// pick e, N = D' * H' * W'; every other element is divide(0) (-0 for a
// negative divisor, as PyTorch's). Each window's gradient goes to its pick
// (PickPositions). With disjoint windows each element is picked at most
// once: grad_x is filled, then the picks stored over it (per plane for a
// contiguous grad_x; per output position over the channels for a
// channels_last_3d one). Overlapping windows count their picks per element
// first (a plane of ints per thread) and write the plane from the counts,
// once per element.
template <typename scalar_t, typename index_t>
void scatter_grad(const at::Tensor& grad_mean, const index_t* picks, PickStrides ps,
                  const MaxPool3dGeometry& g, double divisor, at::Tensor& grad_x) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t B = grad_x.size(0), C = grad_x.size(1);
  const scalar_t* gm = grad_mean.const_data_ptr<scalar_t>();
  const auto gs = grad_mean.strides();
  scalar_t* gx = grad_x.mutable_data_ptr<scalar_t>();
  const TrueDivide<scalar_t> divide(divisor);
  const int64_t pooled = g.pooled_plane();
  const int64_t plane = static_cast<int64_t>(g.d.in) * g.h.in * g.w.in;
  const PickPositions where({&g}, g.d.in, g.h.in, g.w.in);
  const bool disjoint = g.windows_disjoint();
  const scalar_t zero = divide(acc_t(0));
  auto window_grad = [&](int64_t n) {
    return static_cast<acc_t>(gm[n / C * gs[0] + n % C * gs[1]]) / static_cast<acc_t>(pooled);
  };
  // element e of plane n: gx[n / C * batch_step + n % C * channel_step + e * element_step]
  const bool channels_last = is_channels_last_3d(grad_x);
  const int64_t element_step = channels_last ? C : 1;
  if (channels_last && disjoint) {
    grad_x.fill_(zero);
    std::vector<scalar_t> picked(B * C);
    for (int64_t n = 0; n < B * C; ++n) picked[n] = divide(window_grad(n));
    at::parallel_for(0, B * pooled, 1, [&](int64_t begin, int64_t end) {
      for (int64_t q = begin; q < end; ++q) {
        const int64_t b = q / pooled, p = q % pooled;
        const index_t* pq = picks + b * ps.batch + p * ps.position;
        scalar_t* out = gx + (b * plane + where.position(p, 0)) * C;
        for (int64_t c = 0; c < C; ++c) {
          out[where.delta(static_cast<int64_t>(pq[c * ps.channel])) * C + c] = picked[b * C + c];
        }
      }
    });
    return;
  }
  at::parallel_for(0, B * C, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> counts(disjoint ? 0 : plane);
    for (int64_t n = begin; n < end; ++n) {
      const acc_t grad = window_grad(n);
      const index_t* pn = picks + ps.plane(n, C);
      scalar_t* out = gx + n / C * grad_x.stride(0) + n % C * grad_x.stride(1);
      if (disjoint) {  // contiguous
        std::fill(out, out + plane, zero);
        const scalar_t picked = divide(grad);
        where.for_each(pn, [&](int64_t, int64_t e) { out[e] = picked; }, ps.position);
      } else {
        std::fill(counts.begin(), counts.end(), 0);
        where.for_each(pn, [&](int64_t, int64_t e) { ++counts[e]; }, ps.position);
        for (int64_t e = 0; e < plane; ++e) {
          out[e * element_step] = counts[e] == 0 ? zero : divide(counts[e] * grad);
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
  auto [mean, indices] = max_pool3d_mean_outputs(x, g, save_indices, dtype, grad_memory_format(x));
  FUSED_OPS_DISPATCH_FLOATING_TYPES(x.scalar_type(), "max_pool3d_mean_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    std::vector<acc_t> plane_sum(x.size(0) * x.size(1));
    pick_windows<scalar_t, uint8_t>(x, g, divisor,
                                    save_indices ? indices.mutable_data_ptr<uint8_t>() : nullptr,
                                    PickStrides::of(indices), plane_sum.data());
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
  const auto format = picks_memory_format(indices, x);
  auto args = max_pool3d_mean_backward_setup(grad_mean, indices, x, input_size, kernel_size,
                                             stride, padding, ceil_mode, divisor, format);
  const MaxPool3dGeometry& g = args.g;
  const PickStrides ps = PickStrides::of(args.picks);
  FUSED_OPS_DISPATCH_FLOATING_TYPES(grad_mean.scalar_type(), "max_pool3d_mean_backward_cpu", [&] {
    dispatch_picks(args.picks, [&](auto* picks) {
      if (args.recompute) pick_windows<scalar_t>(args.x, g, divisor, picks, ps, nullptr);
      scatter_grad<scalar_t>(grad_mean, picks, ps, g, divisor, args.grad_x);
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
