// max_pool3d_mean: mean[b, c] = mean over (D', H', W') of max_pool3d(x / divisor)[b, c].
//
// Host-side pieces shared by the CPU and CUDA kernels: argument checks, the
// pooling geometry, and the tensors the op creates.
//
// v = x / divisor is rounded to x's dtype before the pool, as PyTorch divides
// a tensor by a number (dispatch.h: TrueDivide on the CPU, ReciprocalMultiply
// on CUDA), and the pool picks per window by PyTorch's rule (max_pool3d.h).
//
// The forward can also save, per pooled element, the scan-order offset of its
// window's pick as one byte (kernel volumes of at most 256); the backward
// otherwise recomputes the picks from x. With N = D' * H' * W':
//   d mean[b, c] / d x[b, c, e] = (number of windows whose pick is e) / N / divisor,
// so grad_x[b, c, e] = count(e) * grad_mean[b, c] / N, divided by the divisor
// as PyTorch divides (the backward of x / divisor is the same division).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <optional>

#include "dispatch.h"
#include "max_pool3d.h"
#include "pool_geometry.h"

namespace fused_ops {

inline void check_divisor(const char* what, double divisor) {
  TORCH_CHECK_VALUE(divisor != 0, what, ": divisor must be non-zero");
}

inline MaxPool3dGeometry max_pool3d_mean_geometry(const at::Tensor& x,
                                                  c10::IntArrayRef kernel_size,
                                                  c10::IntArrayRef stride,
                                                  c10::IntArrayRef padding, bool ceil_mode,
                                                  double divisor, bool save_indices) {
  constexpr const char* what = "max_pool3d_mean";
  check_pool3d_input(what, x);
  check_divisor(what, divisor);
  const auto g = max_pool3d_geometry(what, x.sizes().slice(2), kernel_size, stride, padding,
                                     ceil_mode);
  TORCH_CHECK_VALUE(!save_indices || g.kernel_volume() <= kMaxSavedKernelVolume, what,
                    ": save_indices needs a kernel volume of at most ", kMaxSavedKernelVolume,
                    " (one byte per pick), got ", g.kernel_volume(),
                    "; without it the backward recomputes the picks from x");
  return g;
}

// The forward's outputs: mean (B, C) in the result's dtype (x's, or its
// accumulation type: result_dtype), and the picks (B, C, D', H', W') as
// uint8 in `format` (contiguous; the CPU kernels lay them out as a
// channels_last_3d x), or an empty uint8 tensor when not saved.
inline std::pair<at::Tensor, at::Tensor> max_pool3d_mean_outputs(
    const at::Tensor& x, const MaxPool3dGeometry& g, bool save_indices,
    std::optional<at::ScalarType> dtype, at::MemoryFormat format = at::MemoryFormat::Contiguous) {
  at::Tensor mean = at::empty({x.size(0), x.size(1)},
                              x.options().dtype(result_dtype("max_pool3d_mean", x.scalar_type(), dtype)));
  const auto byte_options = x.options().dtype(at::kByte);
  at::Tensor indices = save_indices ? at::empty({x.size(0), x.size(1), g.d.out, g.h.out, g.w.out},
                                                byte_options.memory_format(format))
                                    : at::empty({0}, byte_options);
  return {mean, indices};
}

// The backward's checked arguments: the geometry; the picks, (B, C, D', H',
// W') in `format`: the forward's saved ones, or (recompute) a buffer to fill
// from x first; and grad_x to fill, in `format` (contiguous; the CPU kernels
// write a channels_last_3d x's gradient channels_last_3d).
struct MaxPool3dMeanBackward {
  MaxPool3dGeometry g;
  at::Tensor picks;
  bool recompute;
  at::Tensor x;
  at::Tensor grad_x;
};

inline MaxPool3dMeanBackward max_pool3d_mean_backward_setup(
    const at::Tensor& grad_mean, const std::optional<at::Tensor>& indices,
    const std::optional<at::Tensor>& x, c10::IntArrayRef input_size,
    c10::IntArrayRef kernel_size, c10::IntArrayRef stride, c10::IntArrayRef padding,
    bool ceil_mode, double divisor, at::MemoryFormat format = at::MemoryFormat::Contiguous) {
  constexpr const char* what = "max_pool3d_mean_backward";
  TORCH_CHECK_TYPE(at::isFloatingType(grad_mean.scalar_type()), what,
                   ": grad_mean must be a floating-point tensor, got ", grad_mean.scalar_type());
  TORCH_CHECK_VALUE(grad_mean.dim() == 2, what, ": grad_mean must be 2-D (batch, channels), got shape ",
                    grad_mean.sizes());
  TORCH_CHECK_VALUE(input_size.size() == 3, what, ": input_size must have 3 elements, got ",
                    input_size.size());
  bool saved = false;
  picks_source(what, "grad_mean", grad_mean, indices, x, saved);
  check_divisor(what, divisor);
  const auto g = max_pool3d_geometry(what, input_size, kernel_size, stride, padding, ceil_mode);
  const int64_t B = grad_mean.size(0), C = grad_mean.size(1);
  if (saved) {
    TORCH_CHECK_TYPE(indices->scalar_type() == at::kByte, what, ": indices must be uint8, got ",
                     indices->scalar_type());
    TORCH_CHECK_VALUE(g.kernel_volume() <= kMaxSavedKernelVolume, what,
                      ": saved indices need a kernel volume of at most ", kMaxSavedKernelVolume,
                      ", got ", g.kernel_volume());
    TORCH_CHECK_VALUE(indices->sizes() == c10::IntArrayRef({B, C, g.d.out, g.h.out, g.w.out}),
                      what, ": indices of shape ", indices->sizes(),
                      " do not match max-pooling an input of shape (", B, ", ", C, ", ",
                      input_size, ") (expected (", B, ", ", C, ", ", g.d.out, ", ", g.h.out,
                      ", ", g.w.out, "))");
    check_saved_picks(what, "indices", *indices, g.kernel_volume());
  } else {
    TORCH_CHECK_TYPE(x->scalar_type() == grad_mean.scalar_type(), what,
                     ": x must have grad_mean's dtype ", grad_mean.scalar_type(), ", got ",
                     x->scalar_type());
    TORCH_CHECK_VALUE(x->dim() == 5 && x->size(0) == B && x->size(1) == C &&
                          x->sizes().slice(2) == input_size,
                      what, ": x of shape ", x->sizes(), " does not match grad_mean's (", B,
                      ", ", C, ") and input_size ", input_size);
  }
  at::Tensor grad_x = at::empty({B, C, input_size[0], input_size[1], input_size[2]},
                                grad_mean.options().memory_format(format));
  if (saved) return {g, indices->contiguous(format), false, at::Tensor(), grad_x};
  const auto pick_dtype = g.kernel_volume() <= kMaxSavedKernelVolume ? at::kByte : at::kInt;
  at::Tensor picks = at::empty({B, C, g.d.out, g.h.out, g.w.out},
                               x->options().dtype(pick_dtype).memory_format(format));
  return {g, picks, true, *x, grad_x};
}

}  // namespace fused_ops
