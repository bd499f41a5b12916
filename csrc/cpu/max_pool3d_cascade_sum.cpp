// CPU kernels of max_pool3d_cascade_sum (the math: ../max_pool3d_cascade_sum.h).
// Forward parallel over (batch, output position), backward over (batch,
// channel) planes; any input strides, read in place.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../dispatch.h"
#include "../max_pool3d_cascade_sum.h"

namespace fused_ops {
namespace {

// Every output's cascade pick per channel into picks (when not null; (B, C,
// D'', H'', W'') contiguous of index_t) and the channel sum of the picked
// values, channels added in order, into out (when not null; (B, 1, D'', H'',
// W'') contiguous, of scalar_t or its accumulation type).
template <typename scalar_t, typename index_t, typename out_t>
void pick_cascades(const at::Tensor& x, const MaxPool3dCascade& g, index_t* picks, out_t* out) {
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
        if (picks != nullptr) picks[(b * C + c) * P + p] = static_cast<index_t>(pick.offset);
      }
      if (out != nullptr) out[n] = static_cast<out_t>(total);
    }
  });
}

// grad_x[b, c, e] = sum of grad_out[b, 0, p] over the outputs p whose pick
// for channel c is e, scattered per (b, c) plane: each output's gradient goes
// to its pick (PickPositions), zero elsewhere. With disjoint windows in both
// stages each element is picked at most once: the plane is zero-filled, then
// the gradients stored over it. Otherwise they are added in PyTorch's order
// (acc_t, a buffer per thread): per stage-1 window over the outputs in order,
// as stage 2's backward; then per element over the stage-1 windows in order.
template <typename scalar_t, typename index_t>
void scatter_grad(const at::Tensor& grad_out, const index_t* picks, const MaxPool3dCascade& g,
                  at::Tensor& grad_x) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t C = grad_x.size(1), P = g.outputs();
  const int D = grad_x.size(2), H = grad_x.size(3), W = grad_x.size(4);
  const int64_t plane = static_cast<int64_t>(D) * H * W;
  const MaxPool3dGeometry& f = g.first;
  const int64_t P1 = f.pooled_plane(), volume1 = f.kernel_volume();
  const scalar_t* go = grad_out.const_data_ptr<scalar_t>();  // contiguous
  scalar_t* gx = grad_x.mutable_data_ptr<scalar_t>();
  const PickPositions where({&g.first, &g.second}, D, H, W);
  const PickPositions where1({&g.second}, f.d.out, f.h.out, f.w.out);  // in stage 1's output
  const bool disjoint = g.first.windows_disjoint() && g.second.windows_disjoint();
  at::parallel_for(0, grad_x.size(0) * C, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> sums(disjoint ? 0 : plane), grad1(disjoint ? 0 : P1);
    std::vector<int64_t> element1(disjoint ? 0 : P1);  // stage-1 window -> its pick in x
    for (int64_t n = begin; n < end; ++n) {
      const scalar_t* gb = go + n / C * P;
      const index_t* plane_picks = picks + n * P;
      scalar_t* out = gx + n * plane;
      if (disjoint) {
        std::fill(out, out + plane, scalar_t(0));
        // 0 + g as the sum would make it (+0 for a gradient of -0)
        where.for_each(plane_picks, [&](int64_t p, int64_t e) {
          out[e] = static_cast<scalar_t>(acc_t(0) + static_cast<acc_t>(gb[p]));
        });
      } else {
        std::fill(grad1.begin(), grad1.end(), acc_t(0));
        std::fill(element1.begin(), element1.end(), int64_t{-1});
        where.for_each(plane_picks, [&](int64_t p, int64_t e) {
          const int64_t w1 = where1.position(p, static_cast<int64_t>(plane_picks[p]) / volume1);
          grad1[w1] += static_cast<acc_t>(gb[p]);
          element1[w1] = e;
        });
        std::fill(sums.begin(), sums.end(), acc_t(0));
        for (int64_t w1 = 0; w1 < P1; ++w1) {
          if (element1[w1] >= 0) sums[element1[w1]] += grad1[w1];
        }
        for (int64_t e = 0; e < plane; ++e) out[e] = static_cast<scalar_t>(sums[e]);
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
  auto [out, indices] = max_pool3d_cascade_sum_outputs(x, g, save_indices, dtype);
  FUSED_OPS_DISPATCH_FLOATING_TYPES(x.scalar_type(), "max_pool3d_cascade_sum_cpu", [&] {
    dispatch_scalar_or_acc<scalar_t>(out.scalar_type(), [&](auto* tag) {
      using out_t = std::remove_pointer_t<decltype(tag)>;
      pick_cascades<scalar_t, uint8_t>(x, g, save_indices ? indices.mutable_data_ptr<uint8_t>() : nullptr,
                                       out.mutable_data_ptr<out_t>());
    });
  });
  return {out, indices};
}

at::Tensor max_pool3d_cascade_sum_backward_cpu(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& indices,
    const std::optional<at::Tensor>& x, at::IntArrayRef input_size, at::IntArrayRef kernel1,
    at::IntArrayRef stride1, at::IntArrayRef padding1, at::IntArrayRef kernel2,
    at::IntArrayRef stride2, at::IntArrayRef padding2) {
  auto args = max_pool3d_cascade_sum_backward_setup(
      grad_out, indices, x, input_size, {kernel1, stride1, padding1, kernel2, stride2, padding2});
  FUSED_OPS_DISPATCH_FLOATING_TYPES(grad_out.scalar_type(), "max_pool3d_cascade_sum_backward_cpu", [&] {
    dispatch_picks(args.picks, [&](auto* picks) {
      if (args.recompute) pick_cascades<scalar_t>(args.x, args.g, picks, static_cast<scalar_t*>(nullptr));
      scatter_grad<scalar_t>(args.grad_out, picks, args.g, args.grad_x);
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
