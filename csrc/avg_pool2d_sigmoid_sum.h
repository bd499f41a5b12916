// avg_pool2d_sigmoid_sum: out[b] = sum over (c, oh, ow) of sigmoid(avg_pool2d(x)[b, c, oh, ow]).
//
// Host-side pieces shared by the CPU and CUDA kernels: argument checks, the
// pooling geometry, and the layout of the tensors the op creates.
//
// The forward can also save, per pooled element, what its backward needs,
//   sigmoid[b, c, oh, ow] = s = sigmoid(p),   p = avg_pool2d(x)[b, c, oh, ow],
// in the accumulation type (float for half/bfloat16/float, double for double): what
// PyTorch's sigmoid saves. It has the pooled size, and the backward then needs neither
// x nor a re-read: with each window's factor sigmoid'(p) / divisor = s (1 - s) / divisor
// (AvgPool2dGeometry::factor),
//   grad_x[b, c, h, w] = grad_out[b] * sum over windows (oh, ow) containing (h, w)
//                        of factor(sigmoid[b, c, oh, ow], oh, ow).
// s also gives the second derivative (sigmoid'' = s (1 - s) (1 - 2 s)): the autograd
// kernel (autograd/avg_pool2d_sigmoid_sum.cpp) returns it as a differentiable output.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/OpMathType.h>
#include <ATen/ops/empty.h>
#include <c10/core/MemoryFormat.h>

#include <optional>

#include "dispatch.h"
#include "pool_geometry.h"

namespace fused_ops {

struct AvgPool2dGeometry {
  PoolDim h, w;
  bool count_include_pad = true;
  int divisor_override = 0;  // 0: divide by the window size

  // What window (oh, ow) divides its sum by, as avg_pool2d does.
  template <typename acc_t>
  C10_HOST_DEVICE acc_t divisor(int oh, int ow) const {
    if (divisor_override != 0) return static_cast<acc_t>(divisor_override);
    if (count_include_pad) {
      return static_cast<acc_t>(h.padded_length(oh) * w.padded_length(ow));
    }
    return static_cast<acc_t>((h.end(oh) - h.begin(oh)) * (w.end(ow) - w.begin(ow)));
  }

  // The factor of window (oh, ow)'s elements' gradients, sigmoid'(p) / divisor, from its
  // saved s = sigmoid(p).
  template <typename acc_t>
  C10_HOST_DEVICE acc_t factor(acc_t s, int oh, int ow) const {
    return s * (1 - s) / divisor<acc_t>(oh, ow);
  }
};

// x is in channels_last layout (and not also plainly contiguous): the op then
// keeps that layout for the saved sigmoid and grad_x.
inline bool is_channels_last(const at::Tensor& x) {
  return !x.is_contiguous() && x.is_contiguous(at::MemoryFormat::ChannelsLast);
}

inline void check_floating_input(const char* what, const char* name,
                                  const at::Tensor& t) {
  TORCH_CHECK_TYPE(at::isFloatingType(t.scalar_type()), what, ": ", name,
                   " must be a floating-point tensor (float64, float32, float16 "
                   "or bfloat16), got ", t.scalar_type());
}

// What the windows divide their sums by: count_include_pad and divisor_override as
// nn.AvgPool2d takes them.
inline void set_divisor(const char* what, AvgPool2dGeometry& g, bool count_include_pad,
                        std::optional<int64_t> divisor_override) {
  g.count_include_pad = count_include_pad;
  if (divisor_override.has_value()) {
    TORCH_CHECK_VALUE(*divisor_override != 0, what, ": divisor_override must be non-zero");
    TORCH_CHECK_VALUE(*divisor_override > INT32_MIN && *divisor_override <= INT32_MAX,
                      what, ": divisor_override out of range: ", *divisor_override);
    g.divisor_override = static_cast<int>(*divisor_override);
  }
}

inline AvgPool2dGeometry avg_pool2d_sigmoid_sum_geometry(
    const at::Tensor& x, c10::IntArrayRef kernel_size, c10::IntArrayRef stride,
    c10::IntArrayRef padding, bool ceil_mode, bool count_include_pad,
    std::optional<int64_t> divisor_override) {
  constexpr const char* what = "avg_pool2d_sigmoid_sum";
  TORCH_CHECK_VALUE(x.dim() == 4, what,
                    ": expected a 4-D input (batch, channels, height, width), got ",
                    x.dim(), "-D input of shape ", x.sizes());
  check_floating_input(what, "input", x);
  TORCH_CHECK_VALUE(x.size(1) > 0 && x.size(2) > 0 && x.size(3) > 0, what,
                    ": channels, height and width must be non-zero, got input of shape ",
                    x.sizes());
  const auto k = expand_param<2>(what, "kernel_size", kernel_size);
  // An empty stride means stride = kernel_size, as in nn.AvgPool2d.
  const auto s = stride.empty() ? k : expand_param<2>(what, "stride", stride);
  const auto p = expand_param<2>(what, "padding", padding);
  AvgPool2dGeometry g;
  g.h = make_pool_dim(what, "height", x.size(2), k[0], s[0], p[0], ceil_mode);
  g.w = make_pool_dim(what, "width", x.size(3), k[1], s[1], p[1], ceil_mode);
  set_divisor(what, g, count_include_pad, divisor_override);
  return g;
}

// The forward's outputs: out (B,) in the result's dtype (x's, or its
// accumulation type: result_dtype), and sigmoid (B, C, OH, OW) in the
// accumulation type and x's layout, or an empty tensor when not saved.
inline std::pair<at::Tensor, at::Tensor> avg_pool2d_sigmoid_sum_outputs(
    const at::Tensor& x, const AvgPool2dGeometry& g, bool save_sigmoid,
    std::optional<at::ScalarType> dtype) {
  at::Tensor out = at::empty(
      {x.size(0)}, x.options().dtype(result_dtype("avg_pool2d_sigmoid_sum", x.scalar_type(), dtype)));
  const auto acc_options = x.options().dtype(at::toOpMathType(x.scalar_type()));
  at::Tensor sigmoid =
      save_sigmoid
          ? at::empty({x.size(0), x.size(1), g.h.out, g.w.out},
                      acc_options.memory_format(is_channels_last(x)
                                                    ? at::MemoryFormat::ChannelsLast
                                                    : at::MemoryFormat::Contiguous))
          : at::empty({0}, acc_options);
  return {out, sigmoid};
}

// The backward's checked arguments: the geometry, the saved sigmoid in the layout the
// forward saved it in (a no-op for the one it saved), and grad_x to fill.
struct AvgPool2dSigmoidSumBackward {
  AvgPool2dGeometry g;
  at::Tensor sigmoid;
  at::Tensor grad_x;
};

inline AvgPool2dSigmoidSumBackward avg_pool2d_sigmoid_sum_backward_setup(
    const at::Tensor& grad_out, const at::Tensor& sigmoid,
    c10::IntArrayRef input_hw, c10::IntArrayRef kernel_size, c10::IntArrayRef stride,
    c10::IntArrayRef padding, bool count_include_pad, std::optional<int64_t> divisor_override,
    bool channels_last) {
  constexpr const char* what = "avg_pool2d_sigmoid_sum_backward";
  check_floating_input(what, "grad_out", grad_out);
  TORCH_CHECK_VALUE(sigmoid.dim() == 4, what, ": sigmoid must be 4-D, got shape ",
                    sigmoid.sizes());
  TORCH_CHECK_VALUE(grad_out.dim() == 1 && grad_out.size(0) == sigmoid.size(0), what,
                    ": grad_out must have shape (", sigmoid.size(0), ",), got ",
                    grad_out.sizes());
  TORCH_CHECK_TYPE(sigmoid.scalar_type() == at::toOpMathType(grad_out.scalar_type()),
                   what, ": sigmoid must be ",
                   at::toOpMathType(grad_out.scalar_type()), " for a ",
                   grad_out.scalar_type(), " grad_out, got ", sigmoid.scalar_type());
  TORCH_CHECK_VALUE(grad_out.device() == sigmoid.device(), what,
                    ": grad_out and sigmoid must be on the same device, got ",
                    grad_out.device(), " and ", sigmoid.device());
  TORCH_CHECK_VALUE(input_hw.size() == 2, what, ": input_hw must have 2 elements");
  const auto k = expand_param<2>(what, "kernel_size", kernel_size);
  const auto s = stride.empty() ? k : expand_param<2>(what, "stride", stride);
  const auto p = expand_param<2>(what, "padding", padding);
  AvgPool2dGeometry g;
  const char* dims[2] = {"height", "width"};
  PoolDim* pd[2] = {&g.h, &g.w};
  for (int d = 0; d < 2; ++d) {
    *pd[d] = make_pool_dim(what, dims[d], input_hw[d], k[d], s[d], p[d], false);
    const int64_t out = sigmoid.size(2 + d);
    TORCH_CHECK_VALUE(out == pd[d]->out ||
                          out == pooled_size(input_hw[d], k[d], s[d], p[d], true),
                      what, ": sigmoid's ", dims[d], " ", out,
                      " does not match pooling an input of ", dims[d], " ", input_hw[d]);
    pd[d]->out = static_cast<int>(out);
  }
  set_divisor(what, g, count_include_pad, divisor_override);
  const auto format =
      channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  return {g, sigmoid.contiguous(format),
          at::empty({sigmoid.size(0), sigmoid.size(1), input_hw[0], input_hw[1]},
                    grad_out.options().memory_format(format))};
}

}  // namespace fused_ops
