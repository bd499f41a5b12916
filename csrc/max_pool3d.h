// 3-D max-pool windows and PyTorch's rule for the element a window picks,
// shared by every op that max-pools and by its CPU and CUDA kernels.
//
// A window's elements are numbered in scan order, (d, h, w) over the whole
// kernel (padding included): offset = (kd * kernel_h + kh) * kernel_w + kw.
// The offset does not depend on clipping, so a backward can tell from an
// element's position alone whether it is its window's pick.
#pragma once

#include <ATen/NumericUtils.h>
#include <c10/macros/Macros.h>

#include <cstdint>

#include "pool_geometry.h"

namespace fused_ops {

// The scan-order offset of the element at (kd, kh, kw) from its window's
// origin, for a kernel of height kernel_h and width kernel_w.
C10_HOST_DEVICE inline int scan_offset(int kd, int kh, int kw, int kernel_h, int kernel_w) {
  return (kd * kernel_h + kh) * kernel_w + kw;
}

struct MaxPool3dGeometry {
  PoolDim d, h, w;

  C10_HOST_DEVICE int64_t pooled_plane() const {
    return static_cast<int64_t>(d.out) * h.out * w.out;
  }
  // Offsets of the kernel volume: [0, kernel_volume()).
  C10_HOST_DEVICE int64_t kernel_volume() const {
    return static_cast<int64_t>(d.kernel) * h.kernel * w.kernel;
  }
  // No input element lies in two windows.
  C10_HOST_DEVICE bool windows_disjoint() const {
    return d.kernel <= d.stride && h.kernel <= h.stride && w.kernel <= w.stride;
  }
  C10_HOST_DEVICE bool windows_inside() const {
    return d.windows_inside() && h.windows_inside() && w.windows_inside();
  }
  // The scan-order offset of the element at (kd, kh, kw) from the window's origin.
  C10_HOST_DEVICE int offset(int kd, int kh, int kw) const {
    return scan_offset(kd, kh, kw, h.kernel, w.kernel);
  }
};

// The element a max-pool window picks, fed its elements in scan order. The
// rule of PyTorch's max_pool3d kernels (CPU MaxPoolKernel.cpp, CUDA
// DilatedMaxPool3d.cu): starting at the window's first element with max = -inf,
//   if (val > max || isnan(val)) { max = val; pick = element; }
// so the pick is the first maximum, except that any NaN takes over: the last
// NaN wins. Taking the first element unconditionally is the same start.
template <typename acc_t>
struct WindowPick {
  acc_t value = acc_t(0);
  int offset = -1;  // none yet

  // Offers element `element` of value v; `present` false: a position outside
  // the input, skipped. Branch-free, so that a GPU thread's loads for several
  // windows need not wait on each other's compares.
  C10_HOST_DEVICE void update(acc_t v, int element, bool present = true) {
    const bool take = present & ((offset < 0) | (v > value) | at::_isnan(v));
    value = take ? v : value;
    offset = take ? element : offset;
  }
};

// The pick of window (od, oh, ow), reading the element at input position
// (d, h, w) as value_at(d, h, w) (already in the accumulation type).
template <typename acc_t, typename ValueAt>
C10_HOST_DEVICE WindowPick<acc_t> pick_in_window(const MaxPool3dGeometry& g, int od, int oh,
                                                 int ow, const ValueAt& value_at) {
  const int d0 = g.d.origin(od), h0 = g.h.origin(oh), w0 = g.w.origin(ow);
  WindowPick<acc_t> pick;
  for (int d = g.d.begin(od); d < g.d.end(od); ++d) {
    for (int h = g.h.begin(oh); h < g.h.end(oh); ++h) {
      for (int w = g.w.begin(ow); w < g.w.end(ow); ++w) {
        pick.update(value_at(d, h, w), g.offset(d - d0, h - h0, w - w0));
      }
    }
  }
  return pick;
}

// How many windows pick input position (d, h, w), given each window's pick
// offset in `picks` (one plane, (D', H', W') contiguous). A max-pool's
// backward routes each window's gradient to its pick, so this is the factor
// of the window gradient that the element receives.
template <typename index_t>
C10_HOST_DEVICE int pick_count(const MaxPool3dGeometry& g, const index_t* picks, int d, int h,
                               int w) {
  int count = 0;
  for (int od = g.d.first_window(d); od < g.d.last_window(d); ++od) {
    for (int oh = g.h.first_window(h); oh < g.h.last_window(h); ++oh) {
      const index_t* row = picks + (static_cast<int64_t>(od) * g.h.out + oh) * g.w.out;
      for (int ow = g.w.first_window(w); ow < g.w.last_window(w); ++ow) {
        const int element = g.offset(d - g.d.origin(od), h - g.h.origin(oh), w - g.w.origin(ow));
        count += static_cast<int>(row[ow]) == element;
      }
    }
  }
  return count;
}

}  // namespace fused_ops
