// CPU kernels of avg_pool2d_sigmoid_sum (the math: ../avg_pool2d_sigmoid_sum.h).
// Parallel over (batch, channel) planes; any input strides, read in place.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "../avg_pool2d_sigmoid_sum.h"
#include "../dispatch.h"

namespace fused_ops {
namespace {

template <typename scalar_t>
void forward_planes(const at::Tensor& x, const AvgPool2dGeometry& g, at::Tensor& out,
                    at::Tensor& sigmoid_saved) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t B = x.size(0), C = x.size(1);
  const auto xs = x.strides();
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  const bool save = sigmoid_saved.numel() > 0;
  acc_t* sp = save ? sigmoid_saved.mutable_data_ptr<acc_t>() : nullptr;
  const auto ss = sigmoid_saved.strides();
  std::vector<acc_t> plane_sum(B * C);
  at::parallel_for(0, B * C, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t b = n / C, c = n % C;
      const scalar_t* xn = xp + b * xs[0] + c * xs[1];
      acc_t total = 0;
      for (int oh = 0; oh < g.h.out; ++oh) {
        for (int ow = 0; ow < g.w.out; ++ow) {
          acc_t sum = 0;
          for (int h = g.h.begin(oh); h < g.h.end(oh); ++h) {
            for (int w = g.w.begin(ow); w < g.w.end(ow); ++w) {
              sum += static_cast<acc_t>(xn[h * xs[2] + w * xs[3]]);
            }
          }
          const acc_t divisor = g.divisor<acc_t>(oh, ow);
          const acc_t s = sigmoid(sum / divisor);
          total += s;
          if (save) sp[b * ss[0] + c * ss[1] + oh * ss[2] + ow * ss[3]] = s;
        }
      }
      plane_sum[n] = total;
    }
  });
  dispatch_scalar_or_acc<scalar_t>(out.scalar_type(), [&](auto* tag) {
    using out_t = std::remove_pointer_t<decltype(tag)>;
    out_t* op = out.mutable_data_ptr<out_t>();
    for (int64_t b = 0; b < B; ++b) {
      acc_t total = 0;
      for (int64_t c = 0; c < C; ++c) total += plane_sum[b * C + c];
      op[b] = static_cast<out_t>(total);
    }
  });
}

// grad_x[b, c, h, w] = grad_out[b] * sum of the factors (g.factor of the saved sigmoid)
// of the windows containing (h, w).
// Rows h within the same windows get equal values: a row is computed once
// and copied to every following row of the same window range. A row in one
// window row oh, with disjoint windows along w, is that window row's values
// grad * (0 + factor[oh, ow]) spread over their columns; other rows sum
// the windows in (oh, ow) order, column ranges precomputed.
template <typename scalar_t>
void backward_planes(const at::Tensor& grad_out, const at::Tensor& sigmoid_saved,
                     const AvgPool2dGeometry& g, at::Tensor& grad_x) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t B = grad_x.size(0), C = grad_x.size(1);
  const int W = g.w.in;
  const scalar_t* gop = grad_out.const_data_ptr<scalar_t>();
  const int64_t go_stride = grad_out.stride(0);
  const acc_t* sp = sigmoid_saved.const_data_ptr<acc_t>();
  const auto ss = sigmoid_saved.strides();
  scalar_t* gxp = grad_x.mutable_data_ptr<scalar_t>();
  const auto xs = grad_x.strides();
  std::vector<int> ow_begin(W), ow_end(W);
  for (int w = 0; w < W; ++w) {
    ow_begin[w] = g.w.first_window(w);
    ow_end[w] = g.w.last_window(w);
  }
  const bool w_disjoint = g.w.kernel <= g.w.stride;
  at::parallel_for(0, B * C, 1, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> row(W), window_row(g.w.out);
    for (int64_t n = begin; n < end; ++n) {
      const int64_t b = n / C, c = n % C;
      const acc_t grad = static_cast<acc_t>(gop[b * go_stride]);
      const scalar_t zero = static_cast<scalar_t>(grad * acc_t(0));  // outside every window
      const acc_t* sn = sp + b * ss[0] + c * ss[1];
      scalar_t* gxn = gxp + b * xs[0] + c * xs[1];
      int row_oh0 = -1, row_oh1 = -1;  // the window range `row` holds
      for (int h = 0; h < g.h.in; ++h) {
        const int oh0 = g.h.first_window(h), oh1 = g.h.last_window(h);
        if (oh0 != row_oh0 || oh1 != row_oh1) {
          if (oh1 - oh0 == 1 && w_disjoint) {
            const acc_t* s_row = sn + oh0 * ss[2];
            for (int ow = 0; ow < g.w.out; ++ow) {
              window_row[ow] = static_cast<scalar_t>(grad * (acc_t(0) + g.factor(s_row[ow * ss[3]], oh0, ow)));
            }
            for (int w = 0; w < W; ++w) {
              row[w] = ow_begin[w] < ow_end[w] ? window_row[ow_begin[w]] : zero;
            }
          } else {
            for (int w = 0; w < W; ++w) {
              acc_t sum = 0;
              for (int oh = oh0; oh < oh1; ++oh) {
                for (int ow = ow_begin[w]; ow < ow_end[w]; ++ow) {
                  sum += g.factor(sn[oh * ss[2] + ow * ss[3]], oh, ow);
                }
              }
              row[w] = static_cast<scalar_t>(grad * sum);
            }
          }
          row_oh0 = oh0;
          row_oh1 = oh1;
        }
        scalar_t* out = gxn + h * xs[2];
        if (xs[3] == 1) {
          std::copy(row.begin(), row.end(), out);
        } else {
          for (int w = 0; w < W; ++w) out[w * xs[3]] = row[w];
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> avg_pool2d_sigmoid_sum_cpu(
    const at::Tensor& x, at::IntArrayRef kernel_size, at::IntArrayRef stride,
    at::IntArrayRef padding, bool ceil_mode, bool count_include_pad,
    std::optional<int64_t> divisor_override, bool save_sigmoid,
    std::optional<at::ScalarType> dtype) {
  const auto g = avg_pool2d_sigmoid_sum_geometry(x, kernel_size, stride, padding, ceil_mode,
                                                 count_include_pad, divisor_override);
  auto [out, sigmoid_saved] = avg_pool2d_sigmoid_sum_outputs(x, g, save_sigmoid, dtype);
  FUSED_OPS_DISPATCH_FLOATING_TYPES(x.scalar_type(), "avg_pool2d_sigmoid_sum_cpu", [&] {
    forward_planes<scalar_t>(x, g, out, sigmoid_saved);
  });
  return {out, sigmoid_saved};
}

at::Tensor avg_pool2d_sigmoid_sum_backward_cpu(const at::Tensor& grad_out,
                                               const at::Tensor& sigmoid_saved,
                                               at::IntArrayRef input_hw,
                                               at::IntArrayRef kernel_size,
                                               at::IntArrayRef stride, at::IntArrayRef padding,
                                               bool count_include_pad,
                                               std::optional<int64_t> divisor_override,
                                               bool channels_last) {
  auto args = avg_pool2d_sigmoid_sum_backward_setup(grad_out, sigmoid_saved, input_hw, kernel_size, stride,
                                                    padding, count_include_pad, divisor_override, channels_last);
  FUSED_OPS_DISPATCH_FLOATING_TYPES(grad_out.scalar_type(), "avg_pool2d_sigmoid_sum_backward_cpu",
                                    [&] {
                                      backward_planes<scalar_t>(grad_out, args.sigmoid,
                                                                args.g, args.grad_x);
                                    });
  return args.grad_x;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("avg_pool2d_sigmoid_sum", &avg_pool2d_sigmoid_sum_cpu);
  m.impl("avg_pool2d_sigmoid_sum_backward", &avg_pool2d_sigmoid_sum_backward_cpu);
}

}  // namespace fused_ops
