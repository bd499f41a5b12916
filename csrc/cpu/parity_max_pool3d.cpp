// CPU kernels of parity_max_pool3d_mean and parity_max_pool3d_cascade_sum
// (the math: ../parity_max_pool3d.h). y is read from a contiguous copy where
// it is not contiguous; the loops are parallel over batch elements (the
// mean's forward) or over windows.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "../dispatch.h"
#include "../parity_max_pool3d.h"

namespace fused_ops {
namespace {

std::tuple<at::Tensor, at::Tensor> parity_max_pool3d_mean_cpu(const at::Tensor& y_in, bool save_indices,
                                                              std::optional<at::ScalarType> dtype) {
  constexpr const char* what = "parity_max_pool3d_mean";
  const auto l = parity_layout(what, y_in);
  const at::Tensor y = y_in.contiguous();
  at::Tensor mean = at::empty({l.batch, l.channels}, y.options().dtype(result_dtype(what, y.scalar_type(), dtype)));
  at::Tensor picks = saved_picks(y, save_indices, {l.batch, l.stage1[0], l.stage1[1], l.stage1[2], l.channels});
  const int64_t M = l.positions(), C = l.channels;
  const int Q = static_cast<int>(l.classes);
  FUSED_OPS_DISPATCH_FLOATING_TYPES(y.scalar_type(), "parity_max_pool3d_mean_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* yp = y.const_data_ptr<scalar_t>();
    uint8_t* pp = save_indices ? picks.mutable_data_ptr<uint8_t>() : nullptr;
    dispatch_scalar_or_acc<scalar_t>(mean.scalar_type(), [&](auto* tag) {
      using out_t = std::remove_pointer_t<decltype(tag)>;
      out_t* out = mean.mutable_data_ptr<out_t>();
      at::parallel_for(0, l.batch, 1, [&](int64_t begin, int64_t end) {
        std::vector<acc_t> sum(C);
        for (int64_t n = begin; n < end; ++n) {
          std::fill(sum.begin(), sum.end(), acc_t(0));
          for (int64_t mc = n * M * C; mc < (n + 1) * M * C; ++mc) {
            const auto pick = parity_pick<acc_t>(yp + mc * Q, Q);
            sum[mc % C] += pick.value;
            if (pp != nullptr) pp[mc] = static_cast<uint8_t>(pick.offset);
          }
          for (int64_t c = 0; c < C; ++c) out[n * C + c] = static_cast<out_t>(sum[c] / static_cast<acc_t>(M));
        }
      });
    });
  });
  return {mean, picks};
}

at::Tensor parity_max_pool3d_mean_backward_cpu(const at::Tensor& grad_mean, const at::Tensor& picks_in,
                                               int64_t parity_classes) {
  auto args = parity_mean_backward_setup(grad_mean, picks_in, parity_classes);
  const ParityLayout& l = args.layout;
  const int64_t M = l.positions(), C = l.channels, Q = l.classes;
  FUSED_OPS_DISPATCH_FLOATING_TYPES(grad_mean.scalar_type(), "parity_max_pool3d_mean_backward_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* gm = grad_mean.const_data_ptr<scalar_t>();
    const int64_t gs0 = grad_mean.stride(0), gs1 = grad_mean.stride(1);
    const uint8_t* picks = args.picks.const_data_ptr<uint8_t>();
    scalar_t* gy = args.grad_y.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, l.batch * M, 1, [&](int64_t begin, int64_t end) {
      for (int64_t nm = begin; nm < end; ++nm) {
        const int64_t n = nm / M;
        for (int64_t c = 0; c < C; ++c) {
          scalar_t* window = gy + (nm * C + c) * Q;
          std::fill(window, window + Q, scalar_t(0));
          window[picks[nm * C + c]] =
              static_cast<scalar_t>(static_cast<acc_t>(gm[n * gs0 + c * gs1]) / static_cast<acc_t>(M));
        }
      }
    });
  });
  return args.grad_y;
}

// Calls f(position, off) for the stage-2 window `cell` (D2, H2, W2 row-major)
// with each of its stage-1 positions (Md, Mh, Mw row-major) in scan order.
template <typename F>
void for_each_in_window(const ParityLayout& l, const CascadeStage2& s, int64_t cell, F&& f) {
  const int64_t od = cell / (s.out[1] * s.out[2]), oh = cell / s.out[2] % s.out[1], ow = cell % s.out[2];
  int64_t off = 0;
  for (int64_t a = 0; a < s.kernel[0]; ++a) {
    for (int64_t b = 0; b < s.kernel[1]; ++b) {
      for (int64_t e = 0; e < s.kernel[2]; ++e, ++off) {
        f(((od * s.kernel[0] + a) * l.stage1[1] + oh * s.kernel[1] + b) * l.stage1[2] + ow * s.kernel[2] + e, off);
      }
    }
  }
}

std::tuple<at::Tensor, at::Tensor> parity_max_pool3d_cascade_sum_cpu(const at::Tensor& y_in,
                                                                    at::IntArrayRef kernel2,
                                                                    bool save_indices,
                                                                    std::optional<at::ScalarType> dtype) {
  constexpr const char* what = "parity_max_pool3d_cascade_sum";
  const auto l = parity_layout(what, y_in);
  const auto s = cascade_stage2(what, l.stage1, l.classes, kernel2);
  const at::Tensor y = y_in.contiguous();
  at::Tensor out = at::empty({l.batch, 1, s.out[0], s.out[1], s.out[2]},
                             y.options().dtype(result_dtype(what, y.scalar_type(), dtype)));
  at::Tensor picks = saved_picks(y, save_indices, {l.batch, s.out[0], s.out[1], s.out[2], l.channels});
  const int64_t M = l.positions(), C = l.channels, cells = s.cells();
  const int Q = static_cast<int>(l.classes);
  FUSED_OPS_DISPATCH_FLOATING_TYPES(y.scalar_type(), "parity_max_pool3d_cascade_sum_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* yp = y.const_data_ptr<scalar_t>();
    uint8_t* pp = save_indices ? picks.mutable_data_ptr<uint8_t>() : nullptr;
    dispatch_scalar_or_acc<scalar_t>(out.scalar_type(), [&](auto* tag) {
      using out_t = std::remove_pointer_t<decltype(tag)>;
      out_t* op = out.mutable_data_ptr<out_t>();
      at::parallel_for(0, l.batch * cells, 1, [&](int64_t begin, int64_t end) {
        for (int64_t ncell = begin; ncell < end; ++ncell) {
          const int64_t n = ncell / cells;
          acc_t sum = 0;
          for (int64_t c = 0; c < C; ++c) {
            WindowPick<acc_t> pick;
            for_each_in_window(l, s, ncell % cells, [&](int64_t m, int64_t off) {
              const auto first = parity_pick<acc_t>(yp + ((n * M + m) * C + c) * Q, Q);
              pick.update(first.value, static_cast<int>(off * Q + first.offset));
            });
            sum += pick.value;
            if (pp != nullptr) pp[ncell * C + c] = static_cast<uint8_t>(pick.offset);
          }
          op[ncell] = static_cast<out_t>(sum);
        }
      });
    });
  });
  return {out, picks};
}

at::Tensor parity_max_pool3d_cascade_sum_backward_cpu(const at::Tensor& grad_out, const at::Tensor& picks_in,
                                                      at::IntArrayRef stage1_size, at::IntArrayRef kernel2,
                                                      int64_t parity_classes) {
  auto args = parity_cascade_backward_setup(grad_out, picks_in, stage1_size, kernel2, parity_classes);
  const ParityLayout& l = args.layout;
  const CascadeStage2& s = args.stage2;
  const int64_t M = l.positions(), C = l.channels, Q = l.classes, cells = s.cells();
  FUSED_OPS_DISPATCH_FLOATING_TYPES(grad_out.scalar_type(), "parity_max_pool3d_cascade_sum_backward_cpu", [&] {
    const at::Tensor go = grad_out.contiguous();
    const scalar_t* gp = go.const_data_ptr<scalar_t>();
    const uint8_t* picks = args.picks.const_data_ptr<uint8_t>();
    scalar_t* gy = args.grad_y.mutable_data_ptr<scalar_t>();
    // Zero each batch element's grad_y, then store each window's gradient at its picks.
    at::parallel_for(0, l.batch, 1, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        std::fill(gy + n * M * C * Q, gy + (n + 1) * M * C * Q, scalar_t(0));
        for (int64_t cell = 0; cell < cells; ++cell) {
          const uint8_t* cell_picks = picks + (n * cells + cell) * C;
          for_each_in_window(l, s, cell, [&](int64_t m, int64_t off) {
            for (int64_t c = 0; c < C; ++c) {
              const int64_t pick = cell_picks[c];
              if (pick / Q == off) gy[((n * M + m) * C + c) * Q + pick % Q] = gp[n * cells + cell];
            }
          });
        }
      }
    });
  });
  return args.grad_y;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("parity_max_pool3d_mean", &parity_max_pool3d_mean_cpu);
  m.impl("parity_max_pool3d_mean_backward", &parity_max_pool3d_mean_backward_cpu);
  m.impl("parity_max_pool3d_cascade_sum", &parity_max_pool3d_cascade_sum_cpu);
  m.impl("parity_max_pool3d_cascade_sum_backward", &parity_max_pool3d_cascade_sum_backward_cpu);
}

}  // namespace fused_ops
