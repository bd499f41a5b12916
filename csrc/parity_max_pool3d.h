// Max-pools over an input in parity-class layout, for convolutions rewritten
// to compute a max-pool's windows side by side (fused_ops/rewrites/):
//
// y (N, Md, Mh, Mw, C, Q) holds, for each output position m = (md, mh, mw) of
// a first max-pool stage and each channel c, the Q elements of that window in
// scan order. It is the channels-last output of a convolution with one output
// channel per (c, q): for a pool of kernel = stride P, element q = (qd * Ph +
// qh) * Pw + qw of window m is x[P * m + (qd, qh, qw)] of the pooled tensor x.
// Stage 1 picks over q by PyTorch's rule (max_pool3d.h, WindowPick). Then
//   parity_max_pool3d_mean:        mean[n, c] = mean over m of the stage-1 values;
//   parity_max_pool3d_cascade_sum: out[n, 0, o] = sum over c of the pick of a
//     second stage (kernel k2 = stride, no padding) among the stage-1 values of
//     window o, m = k2 * o + off, off in scan order.
// The picks saved for the backward are one byte each: q (mean), or
// off * Q + q (cascade). Every y element lies in at most one window of each
// stage, so the backward routes each window's gradient to its pick alone:
//   mean:    grad_y[n, m, c, q] = grad_mean[n, c] / (Md Mh Mw) if q is (n, m, c)'s pick;
//   cascade: grad_y[n, m, c, q] = grad_out[n, 0, o] if (off, q) is (n, o, c)'s pick;
// and 0 elsewhere (also where m lies in no stage-2 window).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <array>
#include <cstdint>

#include "max_pool3d.h"
#include "pool_geometry.h"

namespace fused_ops {

// y's sizes: batch, stage-1 positions (Md, Mh, Mw), channels, parity classes.
struct ParityLayout {
  int64_t batch;
  std::array<int64_t, 3> stage1;
  int64_t channels, classes;

  C10_HOST_DEVICE int64_t positions() const { return stage1[0] * stage1[1] * stage1[2]; }
};

// Checks y (6-D floating point, no zero sizes, at most 256 classes: a pick is
// one byte) and returns its layout.
inline ParityLayout parity_layout(const char* what, const at::Tensor& y) {
  TORCH_CHECK_VALUE(y.dim() == 6, what,
                    ": expected a 6-D input (batch, depth, height, width, channels, parity "
                    "classes), got ", y.dim(), "-D input of shape ", y.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(y.scalar_type()), what,
                   ": input must be a floating-point tensor (float64, float32, float16 or "
                   "bfloat16), got ", y.scalar_type());
  for (int64_t i = 0; i < 6; ++i) {
    TORCH_CHECK_VALUE(y.size(i) > 0, what, ": every dimension must be non-zero, got input of shape ",
                      y.sizes());
  }
  TORCH_CHECK_VALUE(y.size(5) <= kMaxSavedKernelVolume, what, ": at most ", kMaxSavedKernelVolume,
                    " parity classes (a pick is one byte), got ", y.size(5));
  return {y.size(0), {y.size(1), y.size(2), y.size(3)}, y.size(4), y.size(5)};
}

// The second stage of parity_max_pool3d_cascade_sum: kernel = stride, no padding.
struct CascadeStage2 {
  std::array<int64_t, 3> kernel, out;

  C10_HOST_DEVICE int64_t volume() const { return kernel[0] * kernel[1] * kernel[2]; }
  C10_HOST_DEVICE int64_t cells() const { return out[0] * out[1] * out[2]; }
};

inline CascadeStage2 cascade_stage2(const char* what, const std::array<int64_t, 3>& stage1,
                                    int64_t classes, c10::IntArrayRef kernel2) {
  CascadeStage2 s{expand_param<3>(what, "kernel2", kernel2), {}};
  for (int i = 0; i < 3; ++i) {
    TORCH_CHECK_VALUE(s.kernel[i] > 0, what, ": kernel2 must be positive, got ", kernel2);
    TORCH_CHECK_VALUE(stage1[i] >= s.kernel[i], what, ": the stage-1 output ",
                      c10::IntArrayRef(stage1), " is smaller than kernel2 ", kernel2);
    s.out[i] = stage1[i] / s.kernel[i];
  }
  TORCH_CHECK_VALUE(s.volume() * classes <= kMaxSavedKernelVolume, what,
                    ": kernel2's volume times the parity classes must be at most ",
                    kMaxSavedKernelVolume, " (a pick is one byte), got ", s.volume(), " * ", classes);
  return s;
}

inline at::Tensor saved_picks(const at::Tensor& y, bool save, at::IntArrayRef shape) {
  const auto options = y.options().dtype(at::kByte);
  return save ? at::empty(shape, options) : at::empty({0}, options);
}

// Checks the backward's gradient (floating point, of `shape`) and the saved
// picks (uint8, on the gradient's device).
inline void check_parity_backward(const char* what, const at::Tensor& grad, at::IntArrayRef shape,
                                  const at::Tensor& picks) {
  TORCH_CHECK_TYPE(at::isFloatingType(grad.scalar_type()), what,
                   ": the gradient must be a floating-point tensor, got ", grad.scalar_type());
  TORCH_CHECK_VALUE(grad.sizes() == shape, what, ": expected a gradient of shape ", shape, ", got ",
                    grad.sizes());
  TORCH_CHECK_TYPE(picks.scalar_type() == at::kByte, what, ": picks must be uint8, got ",
                   picks.scalar_type());
  TORCH_CHECK_VALUE(picks.device() == grad.device(), what,
                    ": the gradient and picks must be on the same device, got ", grad.device(),
                    " and ", picks.device());
}

// parity_max_pool3d_mean_backward's checked arguments: the layout, and the
// picks and grad_y (contiguous) to fill.
struct ParityMeanBackward {
  ParityLayout layout;
  at::Tensor picks, grad_y;
};

inline ParityMeanBackward parity_mean_backward_setup(const at::Tensor& grad_mean,
                                                     const at::Tensor& picks, int64_t classes) {
  constexpr const char* what = "parity_max_pool3d_mean_backward";
  TORCH_CHECK_VALUE(picks.dim() == 5, what, ": picks must be 5-D (batch, depth, height, width, "
                    "channels), got shape ", picks.sizes());
  TORCH_CHECK_VALUE(classes >= 1 && classes <= kMaxSavedKernelVolume, what,
                    ": parity_classes must be in [1, ", kMaxSavedKernelVolume, "], got ", classes);
  const ParityLayout l{picks.size(0), {picks.size(1), picks.size(2), picks.size(3)}, picks.size(4), classes};
  check_parity_backward(what, grad_mean, {l.batch, l.channels}, picks);
  check_saved_picks(what, "picks", picks, classes);
  at::Tensor grad_y = at::empty({l.batch, l.stage1[0], l.stage1[1], l.stage1[2], l.channels, classes},
                                grad_mean.options());
  return {l, picks.contiguous(), grad_y};
}

// parity_max_pool3d_cascade_sum_backward's checked arguments.
struct ParityCascadeBackward {
  ParityLayout layout;
  CascadeStage2 stage2;
  at::Tensor picks, grad_y;
};

inline ParityCascadeBackward parity_cascade_backward_setup(const at::Tensor& grad_out,
                                                           const at::Tensor& picks,
                                                           c10::IntArrayRef stage1_size,
                                                           c10::IntArrayRef kernel2,
                                                           int64_t classes) {
  constexpr const char* what = "parity_max_pool3d_cascade_sum_backward";
  TORCH_CHECK_VALUE(stage1_size.size() == 3, what, ": stage1_size must have 3 elements, got ",
                    stage1_size.size());
  TORCH_CHECK_VALUE(picks.dim() == 5, what, ": picks must be 5-D (batch, depth, height, width, "
                    "channels), got shape ", picks.sizes());
  TORCH_CHECK_VALUE(classes >= 1, what, ": parity_classes must be positive, got ", classes);
  const ParityLayout l{picks.size(0), {stage1_size[0], stage1_size[1], stage1_size[2]}, picks.size(4), classes};
  const auto s = cascade_stage2(what, l.stage1, classes, kernel2);
  check_parity_backward(what, grad_out, {l.batch, 1, s.out[0], s.out[1], s.out[2]}, picks);
  const std::array<int64_t, 5> picks_shape{l.batch, s.out[0], s.out[1], s.out[2], l.channels};
  TORCH_CHECK_VALUE(picks.sizes() == c10::IntArrayRef(picks_shape), what, ": expected picks of shape ",
                    c10::IntArrayRef(picks_shape), " for stage1_size ", stage1_size, " and kernel2 ", kernel2,
                    ", got ", picks.sizes());
  check_saved_picks(what, "picks", picks, classes * s.volume());
  at::Tensor grad_y = at::empty({l.batch, l.stage1[0], l.stage1[1], l.stage1[2], l.channels, classes},
                                grad_out.options());
  return {l, s, picks.contiguous(), grad_y};
}

// The stage-1 pick of the Q = `classes` elements at `window` (in scan order,
// contiguous), in the accumulation type.
template <typename acc_t, typename scalar_t>
C10_HOST_DEVICE inline WindowPick<acc_t> parity_pick(const scalar_t* window, int classes) {
  WindowPick<acc_t> pick;
  for (int q = 0; q < classes; ++q) pick.update(static_cast<acc_t>(window[q]), q);
  return pick;
}

}  // namespace fused_ops
