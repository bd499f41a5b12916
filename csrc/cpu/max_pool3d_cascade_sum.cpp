// CPU kernels of max_pool3d_cascade_sum (the math: ../max_pool3d_cascade_sum.h):
//   out[b, 0, p] = sum over c of the cascade's pick for output p in channel c,
//   grad_x[b, c, e] = sum of grad_out[b, 0, p] over the outputs p picking e in c.
// Three forward paths, one rule (vectorized.h, max_pool3d.h): a
// channels_last_3d x in vectors over channels, parallel over (b, output
// position); an x whose w is adjacent (contiguous) per (b, c) plane, stage 1
// in vectors along w; any other strides element by element. The picks are
// laid out as x is (channels_last_3d for such an x), and so is grad_x.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../dispatch.h"
#include "../max_pool3d_cascade_sum.h"
#include "vectorized.h"

namespace fused_ops {
namespace {

// Element by element, any strides, parallel over (b, output position): every
// output's cascade pick per channel into picks (when not null; laid out as ps
// says) and the channel sum of the picked values, channels added in order,
// into out (when not null; (B, 1, D'', H'', W'') contiguous, of scalar_t or
// its accumulation type).
template <typename scalar_t, typename index_t, typename out_t>
void pick_cascades_strided(const at::Tensor& x, const MaxPool3dCascade& g, index_t* picks, PickStrides ps,
                           out_t* out) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t C = x.size(1), P = g.outputs();
  const auto xs = x.strides();
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  const MaxPool3dGeometry& s = g.second;
  at::parallel_for(0, x.size(0) * P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t b = n / P, p = n % P;
      const int od = static_cast<int>(p / (int64_t{s.h.out} * s.w.out));
      const int oh = static_cast<int>(p / s.w.out % s.h.out), ow = static_cast<int>(p % s.w.out);
      acc_t total = 0;
      for (int64_t c = 0; c < C; ++c) {
        const scalar_t* xc = xp + b * xs[0] + c * xs[1];
        auto value_at = [&](int d, int h, int w) {
          return static_cast<acc_t>(xc[d * xs[2] + h * xs[3] + w * xs[4]]);
        };
        const auto pick = cascade_pick<acc_t>(g, od, oh, ow, value_at);
        total += pick.value;
        if (picks != nullptr) picks[b * ps.batch + c * ps.channel + p * ps.position] = static_cast<index_t>(pick.offset);
      }
      if (out != nullptr) out[n] = static_cast<out_t>(total);
    }
  });
}

// x with w adjacent (x.stride(4) == 1), parallel over (b, c) planes: stage 1's
// whole output plane picked row by row in vectors along w
// (pick_row_along_w), then stage 2 offered its picks in its scan order
// (cascade_pick's rule); each pick's value to a (B, C, P) buffer, whose
// channels are then added per output in order, as the strided path adds them.
template <typename scalar_t, typename index_t, typename out_t, bool WithOffsets>
void pick_cascades_along_w(const at::Tensor& x, const MaxPool3dCascade& g, index_t* picks, PickStrides ps,
                           out_t* out) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t B = x.size(0), C = x.size(1), P = g.outputs();
  const auto xs = x.strides();
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  const MaxPool3dGeometry &f = g.first, &s = g.second;
  const int volume1 = static_cast<int>(f.kernel_volume());
  std::vector<acc_t> values(out == nullptr ? 0 : B * C * P);
  at::parallel_for(0, B * C, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> columns(2 * static_cast<size_t>(f.w.in));
    std::vector<WindowPick<acc_t>> stage1(f.pooled_plane());
    for (int64_t n = begin; n < end; ++n) {
      const scalar_t* xn = xp + n / C * xs[0] + n % C * xs[1];
      for (int d1 = 0; d1 < f.d.out; ++d1) {
        for (int h1 = 0; h1 < f.h.out; ++h1) {
          pick_row_along_w<scalar_t, WithOffsets>(f, d1, h1, xn, xs[2], xs[3], SameValues{}, columns.data(),
                                                  stage1.data() + (int64_t{d1} * f.h.out + h1) * f.w.out);
        }
      }
      int64_t p = 0;
      for (int od = 0; od < s.d.out; ++od) {
        for (int oh = 0; oh < s.h.out; ++oh) {
          for (int ow = 0; ow < s.w.out; ++ow, ++p) {
            const int d0 = s.d.origin(od), h0 = s.h.origin(oh), w0 = s.w.origin(ow);
            WindowPick<acc_t> pick;
            for (int d1 = s.d.begin(od); d1 < s.d.end(od); ++d1) {
              for (int h1 = s.h.begin(oh); h1 < s.h.end(oh); ++h1) {
                const WindowPick<acc_t>* row = stage1.data() + (int64_t{d1} * f.h.out + h1) * f.w.out;
                for (int w1 = s.w.begin(ow); w1 < s.w.end(ow); ++w1) {
                  const int offset2 = s.offset(d1 - d0, h1 - h0, w1 - w0);
                  pick.update(row[w1].value, WithOffsets ? offset2 * volume1 + row[w1].offset : offset2);
                }
              }
            }
            if (out != nullptr) values[n * P + p] = pick.value;
            if constexpr (WithOffsets) {
              picks[ps.plane(n, C) + p * ps.position] = static_cast<index_t>(pick.offset);
            }
          }
        }
      }
    }
  });
  if (out == nullptr) return;
  at::parallel_for(0, B * P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      const int64_t b = q / P, p = q % P;
      acc_t total = 0;
      for (int64_t c = 0; c < C; ++c) total += values[(b * C + c) * P + p];
      out[q] = static_cast<out_t>(total);
    }
  });
}

// channels_last_3d x, parallel over (b, output position), in vectors over
// blocks of kLanes channels: stage 2 offered, in its scan order, the stage-1
// picks (pick_window_channels) of its window's elements; the blocks' picked
// values added lane by lane, the lanes then added.
template <typename scalar_t, typename index_t, typename out_t, bool WithOffsets>
void pick_cascades_channels_last(const at::Tensor& x, const MaxPool3dCascade& g, index_t* picks,
                                 PickStrides ps, out_t* out) {
  using acc_t = at::opmath_type<scalar_t>;
  using CV = ChannelVec<scalar_t>;
  using Vec = typename CV::Vec;
  constexpr int kLanes = CV::kLanes;
  const int64_t C = x.size(1), P = g.outputs();
  const int64_t blocks = (C + kLanes - 1) / kLanes;
  const int tail = static_cast<int>(C - (blocks - 1) * kLanes);  // the last block's channels
  const auto xs = x.strides();
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  const MaxPool3dGeometry &f = g.first, &s = g.second;
  const acc_t volume1 = static_cast<acc_t>(f.kernel_volume());
  at::parallel_for(0, x.size(0) * P, 1, [&](int64_t begin, int64_t end) {
    std::vector<VecPick<acc_t, WithOffsets>> stage1(blocks), stage2(blocks);
    __at_align__ acc_t offsets[kLanes];
    for (int64_t q = begin; q < end; ++q) {
      const int64_t b = q / P, p = q % P;
      const int od = static_cast<int>(p / (int64_t{s.h.out} * s.w.out));
      const int oh = static_cast<int>(p / s.w.out % s.h.out), ow = static_cast<int>(p % s.w.out);
      const int d0 = s.d.origin(od), h0 = s.h.origin(oh), w0 = s.w.origin(ow);
      const scalar_t* xb = xp + b * xs[0];
      bool first2 = true;
      for (int d1 = s.d.begin(od); d1 < s.d.end(od); ++d1) {
        for (int h1 = s.h.begin(oh); h1 < s.h.end(oh); ++h1) {
          for (int w1 = s.w.begin(ow); w1 < s.w.end(ow); ++w1) {
            pick_window_channels<scalar_t, WithOffsets>(f, d1, h1, w1, xb, xs[2], xs[3], xs[4], blocks, tail,
                                                        SameValues{}, stage1.data());
            const Vec offset2(static_cast<acc_t>(s.offset(d1 - d0, h1 - h0, w1 - w0)) * volume1);
            for (int64_t k = 0; k < blocks; ++k) {
              const Vec number = WithOffsets ? offset2 + stage1[k].offset : offset2;
              if (first2) {
                stage2[k].first(stage1[k].value, number);
              } else {
                stage2[k].update(stage1[k].value, number);
              }
            }
            first2 = false;
          }
        }
      }
      Vec total(acc_t(0));
      for (int64_t k = 0; k < blocks; ++k) {
        total = total + stage2[k].value;  // lanes past C hold 0
        if constexpr (WithOffsets) {
          stage2[k].offset.store(offsets);
          index_t* at = picks + b * ps.batch + k * kLanes * ps.channel + p * ps.position;
          for (int i = 0; i < (k + 1 < blocks ? kLanes : tail); ++i) at[i * ps.channel] = static_cast<index_t>(offsets[i]);
        }
      }
      if (out != nullptr) {
        out[q] = static_cast<out_t>(at::vec::vec_reduce_all([](Vec a, Vec b) { return a + b; }, total));
      }
    }
  });
}

// Every output's cascade pick per channel into picks (when not null; (B, C,
// D'', H'', W'') laid out as ps says) and the channel sum of the picked values
// into out (when not null), by the path x's layout allows.
template <typename scalar_t, typename index_t, typename out_t>
void pick_cascades(const at::Tensor& x, const MaxPool3dCascade& g, index_t* picks, PickStrides ps, out_t* out) {
  const bool lanes_exact = g.pick_volume() < kMaxLanePickNumber;
  if (lanes_exact && is_channels_last_3d(x)) {
    dispatch_with_offsets(picks != nullptr, [&](auto with_offsets) {
      pick_cascades_channels_last<scalar_t, index_t, out_t, decltype(with_offsets)::value>(x, g, picks, ps, out);
    });
  } else if (lanes_exact && x.stride(4) == 1) {
    dispatch_with_offsets(picks != nullptr, [&](auto with_offsets) {
      pick_cascades_along_w<scalar_t, index_t, out_t, decltype(with_offsets)::value>(x, g, picks, ps, out);
    });
  } else {
    pick_cascades_strided<scalar_t>(x, g, picks, ps, out);
  }
}

// grad_x[b, c, e] = sum of grad_out[b, 0, p] over the outputs p whose pick
// for channel c is e: each output's gradient goes to its pick
// (PickPositions), zero elsewhere. With disjoint windows in both stages each
// element is picked at most once: grad_x is zero-filled, then the gradients
// stored over it (per plane for a contiguous grad_x; per output position over
// the channels for a channels_last_3d one). Otherwise they are added per
// plane in PyTorch's order (acc_t, a buffer per thread): per stage-1 window
// over the outputs in order, as stage 2's backward; then per element over the
// stage-1 windows in order.
template <typename scalar_t, typename index_t>
void scatter_grad(const at::Tensor& grad_out, const index_t* picks, PickStrides ps, const MaxPool3dCascade& g,
                  at::Tensor& grad_x) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t B = grad_x.size(0), C = grad_x.size(1), P = g.outputs();
  const int D = grad_x.size(2), H = grad_x.size(3), W = grad_x.size(4);
  const int64_t plane = static_cast<int64_t>(D) * H * W;
  const MaxPool3dGeometry& f = g.first;
  const int64_t P1 = f.pooled_plane(), volume1 = f.kernel_volume();
  const scalar_t* go = grad_out.const_data_ptr<scalar_t>();  // contiguous
  scalar_t* gx = grad_x.mutable_data_ptr<scalar_t>();
  const PickPositions where({&g.first, &g.second}, D, H, W);
  const PickPositions where1({&g.second}, f.d.out, f.h.out, f.w.out);  // in stage 1's output
  const bool disjoint = g.first.windows_disjoint() && g.second.windows_disjoint();
  // 0 + g as the sum would make it (+0 for a gradient of -0)
  auto sole = [](scalar_t grad) { return static_cast<scalar_t>(acc_t(0) + static_cast<acc_t>(grad)); };
  const bool channels_last = is_channels_last_3d(grad_x);
  if (channels_last && disjoint) {
    grad_x.zero_();
    at::parallel_for(0, B * P, 1, [&](int64_t begin, int64_t end) {
      for (int64_t q = begin; q < end; ++q) {
        const int64_t b = q / P, p = q % P;
        const index_t* pq = picks + b * ps.batch + p * ps.position;
        scalar_t* out = gx + (b * plane + where.position(p, 0)) * C;
        const scalar_t value = sole(go[q]);
        for (int64_t c = 0; c < C; ++c) {
          out[where.delta(static_cast<int64_t>(pq[c * ps.channel])) * C + c] = value;
        }
      }
    });
    return;
  }
  const int64_t element_step = channels_last ? C : 1;
  at::parallel_for(0, B * C, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> sums(disjoint ? 0 : plane), grad1(disjoint ? 0 : P1);
    std::vector<int64_t> element1(disjoint ? 0 : P1);  // stage-1 window -> its pick in x
    for (int64_t n = begin; n < end; ++n) {
      const scalar_t* gb = go + n / C * P;
      const index_t* plane_picks = picks + ps.plane(n, C);
      scalar_t* out = gx + n / C * grad_x.stride(0) + n % C * grad_x.stride(1);
      if (disjoint) {  // contiguous
        std::fill(out, out + plane, scalar_t(0));
        where.for_each(plane_picks, [&](int64_t p, int64_t e) { out[e] = sole(gb[p]); }, ps.position);
      } else {
        std::fill(grad1.begin(), grad1.end(), acc_t(0));
        std::fill(element1.begin(), element1.end(), int64_t{-1});
        where.for_each(plane_picks, [&](int64_t p, int64_t e) {
          const int64_t w1 = where1.position(p, static_cast<int64_t>(plane_picks[p * ps.position]) / volume1);
          grad1[w1] += static_cast<acc_t>(gb[p]);
          element1[w1] = e;
        }, ps.position);
        std::fill(sums.begin(), sums.end(), acc_t(0));
        for (int64_t w1 = 0; w1 < P1; ++w1) {
          if (element1[w1] >= 0) sums[element1[w1]] += grad1[w1];
        }
        for (int64_t e = 0; e < plane; ++e) out[e * element_step] = static_cast<scalar_t>(sums[e]);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> max_pool3d_cascade_sum_cpu(
    const at::Tensor& x, at::IntArrayRef kernel1, at::IntArrayRef stride1,
    at::IntArrayRef padding1, at::IntArrayRef kernel2, at::IntArrayRef stride2,
    at::IntArrayRef padding2, bool save_indices, std::optional<at::ScalarType> dtype) {
  const auto g = max_pool3d_cascade_sum_geometry(
      x, {kernel1, stride1, padding1, kernel2, stride2, padding2}, save_indices);
  auto [out, indices] = max_pool3d_cascade_sum_outputs(x, g, save_indices, dtype, grad_memory_format(x));
  FUSED_OPS_DISPATCH_FLOATING_TYPES(x.scalar_type(), "max_pool3d_cascade_sum_cpu", [&] {
    dispatch_scalar_or_acc<scalar_t>(out.scalar_type(), [&](auto* tag) {
      using out_t = std::remove_pointer_t<decltype(tag)>;
      pick_cascades<scalar_t, uint8_t>(x, g, save_indices ? indices.mutable_data_ptr<uint8_t>() : nullptr,
                                       PickStrides::of(indices), out.mutable_data_ptr<out_t>());
    });
  });
  return {out, indices};
}

at::Tensor max_pool3d_cascade_sum_backward_cpu(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& indices,
    const std::optional<at::Tensor>& x, at::IntArrayRef input_size, at::IntArrayRef kernel1,
    at::IntArrayRef stride1, at::IntArrayRef padding1, at::IntArrayRef kernel2,
    at::IntArrayRef stride2, at::IntArrayRef padding2) {
  const auto format = picks_memory_format(indices, x);
  auto args = max_pool3d_cascade_sum_backward_setup(
      grad_out, indices, x, input_size, {kernel1, stride1, padding1, kernel2, stride2, padding2}, format);
  const PickStrides ps = PickStrides::of(args.picks);
  FUSED_OPS_DISPATCH_FLOATING_TYPES(grad_out.scalar_type(), "max_pool3d_cascade_sum_backward_cpu", [&] {
    dispatch_picks(args.picks, [&](auto* picks) {
      if (args.recompute) pick_cascades<scalar_t>(args.x, args.g, picks, ps, static_cast<scalar_t*>(nullptr));
      scatter_grad<scalar_t>(args.grad_out, picks, ps, args.g, args.grad_x);
    });
  });
  return args.grad_x;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("max_pool3d_cascade_sum", &max_pool3d_cascade_sum_cpu);
  m.impl("max_pool3d_cascade_sum_backward", &max_pool3d_cascade_sum_backward_cpu);
}

}  // namespace fused_ops
