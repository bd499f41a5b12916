// conv_transpose3d_cascade_weight_grad: the weight gradient of a transposed
// 3-D convolution followed by architecture B's tail, from the tail's picks
// alone (fused_ops/rewrites/conv_transpose3d_max_pool.py, B's rewrite).
//
// y = conv_transpose3d(x, w) (stride P, padding pad; no dilation or groups):
//   y[n, o, Y] = sum over i and taps k with Y = P p - pad + k (per dim) of x[n, i, p] w[i, o, k].
// The tail, parity_max_pool3d_cascade_sum over y in parity-class layout
// (parity_max_pool3d.h), routes grad_out[n, 0, c] (c a stage-2 cell) per
// channel o to the one y element its pick (off Q + q) names:
//   Y = P (k2 c + off) + q   per dim (off, q unpacked in scan order),
// and gives every other y element a zero gradient. So
//   grad_w[i, o, k] = sum over n, c of grad_out[n, 0, c] x[n, i, p],  p = (Y + pad - k) / P
// where that is a whole number inside x: per pick about (K / P)^3 taps of I
// channels, the dense weight gradient's work over the picked elements alone.
//
// The zero gradients matter only where x is not finite: PyTorch's dense
// weight gradient adds 0 * x there, NaN, for every tap k of every x element
// (im2col's padding of y's gradient included). So after the sum,
// grad_w[i, o, k] is NaN wherever a non-finite x[n, i, p] meets, by tap k, a
// position Y = P p - pad + k that is not (n, o)'s pick, outside y's
// `output_size` too (a picked one is in the sum already). A tap of (n, o)
// reaches at most one x position from each of the `cells` picks, so where more
// than `cells` of x[n, i, :] are not finite, every grad_w[i, :, :] is NaN.
// Sums in the accumulation type (float64 on the CPU), one order per element:
// deterministic.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>

#include <array>
#include <cstdint>
#include <optional>

#include "max_pool3d.h"
#include "pool_geometry.h"

namespace fused_ops {

struct CascadeWeightGrad {
  int64_t batch, in_channels, out_channels, classes;  // N, I, O, Q = P^3's volume
  std::array<int64_t, 3> in, out, kernel, stride, padding, kernel2, cells;

  C10_HOST_DEVICE int64_t taps() const { return kernel[0] * kernel[1] * kernel[2]; }
  C10_HOST_DEVICE int64_t num_cells() const { return cells[0] * cells[1] * cells[2]; }
  C10_HOST_DEVICE int64_t in_volume() const { return in[0] * in[1] * in[2]; }
  // The picks' numbers, [0, pick_volume()): a class and an element of kernel2's window.
  C10_HOST_DEVICE int64_t pick_volume() const { return classes * kernel2[0] * kernel2[1] * kernel2[2]; }

  // y's position (per dim) that a pick names in stage-2 cell `cell` (its scan index).
  C10_HOST_DEVICE void picked(uint8_t pick, int64_t cell, int64_t (&y)[3]) const {
    const int64_t q = pick % classes, off = pick / classes;
    const int64_t c[3] = {cell / (cells[1] * cells[2]), cell / cells[2] % cells[1], cell % cells[2]};
    const int64_t o[3] = {off / (kernel2[1] * kernel2[2]), off / kernel2[2] % kernel2[1], off % kernel2[2]};
    const int64_t r[3] = {q / (stride[1] * stride[2]), q / stride[2] % stride[1], q % stride[2]};
    for (int d = 0; d < 3; ++d) y[d] = stride[d] * (kernel2[d] * c[d] + o[d]) + r[d];
  }

  // The input positions [first, last] of dim d that reach y position `y` (tap k = y + pad - P p).
  C10_HOST_DEVICE void reaching(int d, int64_t y, int64_t& first, int64_t& last) const {
    const int64_t top = y + padding[d], low = top - kernel[d] + 1;  // top >= 0
    first = low > 0 ? (low + stride[d] - 1) / stride[d] : 0;
    last = top / stride[d] < in[d] - 1 ? top / stride[d] : in[d] - 1;
  }

  // f(tap, row) for each tap by which an input row of (n, p) (row: the scan index of (n, p) over
  // (N, D, H, W), x channels last) reaches y's position `y`.
  template <typename F>
  C10_HOST_DEVICE void for_each_reaching_tap(int64_t n, const int64_t (&y)[3], F&& f) const {
    int64_t first[3], last[3];
    for (int d = 0; d < 3; ++d) reaching(d, y[d], first[d], last[d]);
    for (int64_t pd = first[0]; pd <= last[0]; ++pd) {
      for (int64_t ph = first[1]; ph <= last[1]; ++ph) {
        for (int64_t pw = first[2]; pw <= last[2]; ++pw) {
          const int64_t tap = ((y[0] + padding[0] - stride[0] * pd) * kernel[1] +
                               (y[1] + padding[1] - stride[1] * ph)) * kernel[2] +
                              (y[2] + padding[2] - stride[2] * pw);
          f(tap, ((n * in[0] + pd) * in[1] + ph) * in[2] + pw);
        }
      }
    }
  }

  // Whether PyTorch's dense gradient adds 0 * x[n, i, p] (for every i; p: the scan index over
  // (D, H, W)) into grad_w[i, o, tap]: the tap's y position lies outside y, or is not (n, o)'s pick.
  C10_HOST_DEVICE bool zero_product(const uint8_t* picks, int64_t n, int64_t p, int64_t o, int64_t tap) const {
    const int64_t at[3] = {p / (in[1] * in[2]), p / in[2] % in[1], p % in[2]};
    const int64_t k[3] = {tap / (kernel[1] * kernel[2]), tap / kernel[2] % kernel[1], tap % kernel[2]};
    int64_t y[3];
    for (int d = 0; d < 3; ++d) {
      y[d] = stride[d] * at[d] - padding[d] + k[d];
      if (y[d] < 0 || y[d] >= out[d]) return true;
    }
    return !is_picked(picks, n, o, y);
  }

  // Whether (n, o)'s pick in `picks` (N, cells..., O), contiguous, is y's element `y`.
  C10_HOST_DEVICE bool is_picked(const uint8_t* picks, int64_t n, int64_t o, const int64_t (&y)[3]) const {
    int64_t cell = 0, off = 0, q = 0;
    for (int d = 0; d < 3; ++d) {
      const int64_t m = y[d] / stride[d], c = m / kernel2[d];
      if (c >= cells[d]) return false;  // (in no stage-2 window)
      cell = cell * cells[d] + c;
      off = off * kernel2[d] + m % kernel2[d];
      q = q * stride[d] + y[d] % stride[d];
    }
    return picks[(n * num_cells() + cell) * out_channels + o] == off * classes + q;
  }
};

// The checked arguments: grad_out (N, 1, cells...), picks (N, cells..., O)
// uint8, x (N, I, D, H, W), floating point, on one device; kernel_size,
// stride, padding, kernel2 and output_size (y's spatial size) of 3 (or 1)
// ints; the cells kernel2 tiles within y's stage-1 windows, inside y.
inline CascadeWeightGrad cascade_weight_grad_setup(const at::Tensor& grad_out, const at::Tensor& picks,
                                                   const at::Tensor& x, at::IntArrayRef kernel_size,
                                                   at::IntArrayRef stride, at::IntArrayRef padding,
                                                   at::IntArrayRef kernel2, at::IntArrayRef output_size,
                                                   at::ScalarType dtype) {
  constexpr const char* what = "conv_transpose3d_cascade_weight_grad";
  TORCH_CHECK_VALUE(x.dim() == 5, what, ": x must be 5-D (batch, channels, depth, height, width), got shape ",
                    x.sizes());
  TORCH_CHECK_VALUE(grad_out.dim() == 5 && grad_out.size(1) == 1, what,
                    ": grad_out must be (batch, 1, depth, height, width), got shape ", grad_out.sizes());
  TORCH_CHECK_VALUE(picks.dim() == 5, what, ": picks must be 5-D (batch, depth, height, width, channels), got shape ",
                    picks.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(x.scalar_type()) && at::isFloatingType(grad_out.scalar_type()) &&
                       at::isFloatingType(dtype),
                   what, ": x, grad_out and dtype must be floating point, got ", x.scalar_type(), ", ",
                   grad_out.scalar_type(), ", ", dtype);
  TORCH_CHECK_TYPE(picks.scalar_type() == at::kByte, what, ": picks must be uint8, got ", picks.scalar_type());
  TORCH_CHECK_VALUE(x.device() == grad_out.device() && x.device() == picks.device(), what,
                    ": x, grad_out and picks must be on one device, got ", x.device(), ", ", grad_out.device(),
                    ", ", picks.device());
  CascadeWeightGrad g{x.size(0), x.size(1), picks.size(4), 1,
                      {x.size(2), x.size(3), x.size(4)},
                      expand_param<3>(what, "output_size", output_size),
                      expand_param<3>(what, "kernel_size", kernel_size),
                      expand_param<3>(what, "stride", stride),
                      expand_param<3>(what, "padding", padding),
                      expand_param<3>(what, "kernel2", kernel2),
                      {grad_out.size(2), grad_out.size(3), grad_out.size(4)}};
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK_VALUE(g.kernel[d] > 0 && g.stride[d] > 0 && g.padding[d] >= 0 && g.kernel2[d] > 0, what,
                      ": kernel_size, stride and kernel2 must be positive and padding non-negative, got ",
                      kernel_size, ", ", stride, ", ", kernel2, ", ", padding);
    TORCH_CHECK_VALUE(g.cells[d] * g.kernel2[d] * g.stride[d] <= g.out[d], what, ": ", g.cells[d],
                      " cells of kernel2 ", kernel2, " over windows of ", stride, " reach past output_size ",
                      output_size);
    g.classes *= g.stride[d];
  }
  TORCH_CHECK_VALUE(g.pick_volume() <= kMaxSavedKernelVolume, what,
                    ": the stride's volume times kernel2's must be at most ", kMaxSavedKernelVolume,
                    " (a pick is one byte), got ", stride, ", ", kernel2);
  TORCH_CHECK_VALUE(picks.size(0) == g.batch && grad_out.size(0) == g.batch &&
                        picks.size(1) == g.cells[0] && picks.size(2) == g.cells[1] && picks.size(3) == g.cells[2],
                    what, ": x, grad_out and picks must agree on the batch and the cells, got ", x.sizes(), ", ",
                    grad_out.sizes(), ", ", picks.sizes());
  check_saved_picks(what, "picks", picks, g.pick_volume());
  return g;
}

}  // namespace fused_ops
