// CPU kernel of conv_transpose3d_cascade_weight_grad (the math:
// ../conv_transpose3d_cascade_weight_grad.h): the output channels split among
// the threads, each channel's (taps, I) sums in float64 over x channels last
// (a pick's taps read rows of I contiguous channels); then the non-finite x
// (the header's rule).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/TypeCast.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../conv_transpose3d_cascade_weight_grad.h"
#include "../dispatch.h"

namespace fused_ops {
namespace {

at::Tensor conv_transpose3d_cascade_weight_grad_cpu(const at::Tensor& grad_out, const at::Tensor& picks_,
                                                    const at::Tensor& x, at::IntArrayRef kernel_size,
                                                    at::IntArrayRef stride, at::IntArrayRef padding,
                                                    at::IntArrayRef kernel2, at::IntArrayRef output_size,
                                                    at::ScalarType dtype) {
  const CascadeWeightGrad g =
      cascade_weight_grad_setup(grad_out, picks_, x, kernel_size, stride, padding, kernel2, output_size, dtype);
  const int64_t I = g.in_channels, O = g.out_channels, taps = g.taps();
  at::Tensor grad_w = at::empty({I, O, g.kernel[0], g.kernel[1], g.kernel[2]}, x.options().dtype(dtype));
  const at::Tensor values = grad_out.to(at::kDouble).contiguous();
  const at::Tensor picks = picks_.contiguous();
  const at::Tensor x_last = x.contiguous(at::MemoryFormat::ChannelsLast3d);  // (N, D, H, W, I) in memory
  const double* v = values.const_data_ptr<double>();
  const uint8_t* pick = picks.const_data_ptr<uint8_t>();
  FUSED_OPS_DISPATCH_FLOATING_TYPES(x.scalar_type(), "conv_transpose3d_cascade_weight_grad_cpu", [&] {
    using x_t = scalar_t;
    const x_t* xs = x_last.const_data_ptr<x_t>();
    FUSED_OPS_DISPATCH_FLOATING_TYPES(dtype, "conv_transpose3d_cascade_weight_grad_cpu", [&] {
      scalar_t* out = grad_w.mutable_data_ptr<scalar_t>();
      at::parallel_for(0, O, 1, [&](int64_t begin, int64_t end) {
        std::vector<double> acc(taps * I);  // [tap][i]
        for (int64_t o = begin; o < end; ++o) {
          std::fill(acc.begin(), acc.end(), 0.0);
          for (int64_t n = 0; n < g.batch; ++n) {
            for (int64_t cell = 0; cell < g.num_cells(); ++cell) {
              const double value = v[n * g.num_cells() + cell];
              int64_t y[3];
              g.picked(pick[(n * g.num_cells() + cell) * O + o], cell, y);
              g.for_each_reaching_tap(n, y, [&](int64_t tap, int64_t row) {
                const x_t* in = xs + row * I;
                double* a = acc.data() + tap * I;
                for (int64_t i = 0; i < I; ++i) a[i] += value * static_cast<double>(in[i]);
              });
            }
          }
          for (int64_t i = 0; i < I; ++i) {
            for (int64_t tap = 0; tap < taps; ++tap) {
              out[(i * O + o) * taps + tap] = c10::convert<scalar_t>(acc[tap * I + i]);
            }
          }
        }
      });
      // PyTorch's 0 * x at a non-finite x's taps but the picked ones: per (n, i) the non-finite
      // positions, counted and kept while at most `cells` (more make the whole channel NaN), the
      // batch split among the threads; then each output channel's NaN
      const int64_t cells = g.num_cells(), volume = g.in_volume();
      std::vector<int64_t> count(g.batch * I, 0);
      std::vector<std::vector<int64_t>> where(g.batch * I);
      at::parallel_for(0, g.batch, 1, [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) {
          for (int64_t p = 0; p < volume; ++p) {
            const x_t* row = xs + (n * volume + p) * I;
            for (int64_t i = 0; i < I; ++i) {
              if (!std::isfinite(static_cast<double>(row[i])) && ++count[n * I + i] <= cells) {
                where[n * I + i].push_back(p);
              }
            }
          }
        }
      });
      std::vector<char> whole(I, 0);  // channels every (o, tap) of which is NaN
      for (int64_t ni = 0; ni < g.batch * I; ++ni) whole[ni % I] |= count[ni] > cells;
      const scalar_t nan = std::numeric_limits<scalar_t>::quiet_NaN();
      at::parallel_for(0, O, 1, [&](int64_t begin, int64_t end) {
        for (int64_t o = begin; o < end; ++o) {
          for (int64_t i = 0; i < I; ++i) {
            if (whole[i]) std::fill(out + (i * O + o) * taps, out + (i * O + o + 1) * taps, nan);
          }
          for (int64_t ni = 0; ni < g.batch * I; ++ni) {
            const int64_t n = ni / I, i = ni % I;
            if (whole[i]) continue;
            for (const int64_t p : where[ni]) {
              for (int64_t tap = 0; tap < taps; ++tap) {
                if (g.zero_product(pick, n, p, o, tap)) out[(i * O + o) * taps + tap] = nan;
              }
            }
          }
        }
      });
    });
  });
  return grad_w;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("conv_transpose3d_cascade_weight_grad", &conv_transpose3d_cascade_weight_grad_cpu);
}

}  // namespace fused_ops
