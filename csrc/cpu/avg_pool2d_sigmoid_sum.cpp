// CPU kernels of avg_pool2d_sigmoid_sum (the math: ../avg_pool2d_sigmoid_sum.h).
// Parallel over (batch, channel) planes; any input strides, read in place.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "../avg_pool2d_sigmoid_sum.h"
#include "../dispatch.h"

namespace fused_ops {
namespace {

template <typename scalar_t>
void forward_planes(const at::Tensor& x, const AvgPool2dGeometry& g, at::Tensor& out,
                    at::Tensor& grad_factor) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t B = x.size(0), C = x.size(1);
  const auto xs = x.strides();
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  const bool save = grad_factor.numel() > 0;
  acc_t* gfp = save ? grad_factor.mutable_data_ptr<acc_t>() : nullptr;
  const auto gs = grad_factor.strides();
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
          if (save) {
            gfp[b * gs[0] + c * gs[1] + oh * gs[2] + ow * gs[3]] = s * (1 - s) / divisor;
          }
        }
      }
      plane_sum[n] = total;
    }
  });
  scalar_t* op = out.mutable_data_ptr<scalar_t>();
  for (int64_t b = 0; b < B; ++b) {
    acc_t total = 0;
    for (int64_t c = 0; c < C; ++c) total += plane_sum[b * C + c];
    op[b] = static_cast<scalar_t>(total);
  }
}

// grad_x[b, c, h, w] = grad_out[b] * sum of grad_factor over the windows containing (h, w).
template <typename scalar_t>
void backward_planes(const at::Tensor& grad_out, const at::Tensor& grad_factor,
                     const AvgPool2dGeometry& g, at::Tensor& grad_x) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t B = grad_x.size(0), C = grad_x.size(1);
  const scalar_t* gop = grad_out.const_data_ptr<scalar_t>();
  const int64_t go_stride = grad_out.stride(0);
  const acc_t* gfp = grad_factor.const_data_ptr<acc_t>();
  const auto gs = grad_factor.strides();
  scalar_t* gxp = grad_x.mutable_data_ptr<scalar_t>();
  const auto xs = grad_x.strides();
  at::parallel_for(0, B * C, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t b = n / C, c = n % C;
      const acc_t grad = static_cast<acc_t>(gop[b * go_stride]);
      const acc_t* gfn = gfp + b * gs[0] + c * gs[1];
      scalar_t* gxn = gxp + b * xs[0] + c * xs[1];
      for (int h = 0; h < g.h.in; ++h) {
        const int oh0 = g.h.first_window(h), oh1 = g.h.last_window(h);
        for (int w = 0; w < g.w.in; ++w) {
          const int ow0 = g.w.first_window(w), ow1 = g.w.last_window(w);
          acc_t sum = 0;
          for (int oh = oh0; oh < oh1; ++oh) {
            for (int ow = ow0; ow < ow1; ++ow) sum += gfn[oh * gs[2] + ow * gs[3]];
          }
          gxn[h * xs[2] + w * xs[3]] = static_cast<scalar_t>(grad * sum);
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> avg_pool2d_sigmoid_sum_cpu(
    const at::Tensor& x, at::IntArrayRef kernel_size, at::IntArrayRef stride,
    at::IntArrayRef padding, bool ceil_mode, bool count_include_pad,
    std::optional<int64_t> divisor_override, bool save_grad_factor) {
  const auto g = avg_pool2d_sigmoid_sum_geometry(x, kernel_size, stride, padding, ceil_mode,
                                                 count_include_pad, divisor_override);
  auto [out, grad_factor] = avg_pool2d_sigmoid_sum_outputs(x, g, save_grad_factor);
  FUSED_OPS_DISPATCH_FLOATING_TYPES(x.scalar_type(), "avg_pool2d_sigmoid_sum_cpu", [&] {
    forward_planes<scalar_t>(x, g, out, grad_factor);
  });
  return {out, grad_factor};
}

at::Tensor avg_pool2d_sigmoid_sum_backward_cpu(const at::Tensor& grad_out,
                                               const at::Tensor& grad_factor,
                                               at::IntArrayRef input_hw,
                                               at::IntArrayRef kernel_size,
                                               at::IntArrayRef stride, at::IntArrayRef padding,
                                               bool channels_last) {
  auto args = avg_pool2d_sigmoid_sum_backward_setup(grad_out, grad_factor, input_hw,
                                                    kernel_size, stride, padding, channels_last);
  FUSED_OPS_DISPATCH_FLOATING_TYPES(grad_out.scalar_type(), "avg_pool2d_sigmoid_sum_backward_cpu",
                                    [&] {
                                      backward_planes<scalar_t>(grad_out, args.grad_factor,
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
