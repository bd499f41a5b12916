// 3-D max-pool windows and PyTorch's rule for the element a window picks,
// shared by every op that max-pools and by its CPU and CUDA kernels.
//
// A window's elements are numbered in scan order, (d, h, w) over the whole
// kernel (padding included): offset = (kd * kernel_h + kh) * kernel_w + kw.
// The offset does not depend on clipping, so a backward can tell from an
// element's position alone whether it is its window's pick.
#pragma once

#include <ATen/NumericUtils.h>
#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <vector>

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

// The largest kernel volume whose pick offsets fit a saved byte.
constexpr int64_t kMaxSavedKernelVolume = 256;

// Checks the pooling arguments for an input of spatial size `input_size` and
// returns the geometry. An empty stride means stride = kernel_size.
inline MaxPool3dGeometry max_pool3d_geometry(const char* what, c10::IntArrayRef input_size,
                                             c10::IntArrayRef kernel_size,
                                             c10::IntArrayRef stride, c10::IntArrayRef padding,
                                             bool ceil_mode) {
  const auto k = expand_param<3>(what, "kernel_size", kernel_size);
  const auto s = stride.empty() ? k : expand_param<3>(what, "stride", stride);
  const auto p = expand_param<3>(what, "padding", padding);
  MaxPool3dGeometry g;
  const char* dims[3] = {"depth", "height", "width"};
  PoolDim* pd[3] = {&g.d, &g.h, &g.w};
  for (int i = 0; i < 3; ++i) {
    *pd[i] = make_pool_dim(what, dims[i], input_size[i], k[i], s[i], p[i], ceil_mode);
  }
  TORCH_CHECK_VALUE(g.kernel_volume() < (int64_t{1} << 31), what,
                    ": kernel volumes of 2^31 or more are not supported, got kernel_size ",
                    c10::IntArrayRef(k));
  return g;
}

// Checks that x is a (B, C, D, H, W) floating-point input with non-empty planes.
inline void check_pool3d_input(const char* what, const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() == 5, what,
                    ": expected a 5-D input (batch, channels, depth, height, width), got ",
                    x.dim(), "-D input of shape ", x.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(x.scalar_type()), what,
                   ": input must be a floating-point tensor (float64, float32, float16 or "
                   "bfloat16), got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.size(1) > 0 && x.size(2) > 0 && x.size(3) > 0 && x.size(4) > 0, what,
                    ": channels, depth, height and width must be non-zero, got input of shape ",
                    x.sizes());
}

// Calls f(p) with the picks' data as the kernels read them: uint8_t* (one
// byte per pick, where the offsets fit) or int32_t*.
template <typename F>
void dispatch_picks(at::Tensor& picks, F&& f) {
  if (picks.scalar_type() == at::kByte) {
    f(picks.mutable_data_ptr<uint8_t>());
  } else {
    f(picks.mutable_data_ptr<int32_t>());
  }
}

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

  // The pick of elements v[0 .. n), at offsets first, first + stride, ... in scan order, where none is NaN and
  // `most` is their maximum: the first element equal to it, with its own value (of a -0 and a +0, which compare
  // equal, the first). update()'s pick of them, in fewer instructions where the maximum comes cheap (GPU: one
  // max instruction a pair, which also tells whether there is a NaN).
  template <int n>
  C10_HOST_DEVICE static WindowPick first_maximum(const acc_t (&v)[n], acc_t most, int first, int stride) {
    WindowPick pick;
    pick.value = v[n - 1];
    pick.offset = first + (n - 1) * stride;
    for (int i = n - 2; i >= 0; --i) {
      const bool equal = v[i] == most;
      pick.value = equal ? v[i] : pick.value;
      pick.offset = equal ? first + i * stride : pick.offset;
    }
    return pick;
  }

  // Offers element `element` of value v in any order (a pick of part of the
  // window, say): the result is the pick of the elements offered so far as
  // update() fed them in scan order would make it, since that pick is the
  // last NaN, else the first maximum, by offset: of two NaNs the later one,
  // a NaN over a number, of two numbers the larger, of two equal the earlier.
  C10_HOST_DEVICE void merge(acc_t v, int element) {
    const bool v_nan = at::_isnan(v), value_nan = at::_isnan(value);
    const bool wins = v_nan ? ((!value_nan) | (element > offset))
                            : ((!value_nan) & ((v > value) | ((v == value) & (element < offset))));
    const bool take = (offset < 0) | wins;
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

// Where the picks of a chain of max-pools lie in their input plane, for a
// backward that scatters each output's gradient to its pick (host only). The
// chain is one stage, or a cascade (stage 2 pooling stage 1's output, as in
// max_pool3d_cascade_sum.h), whose pick numbers are the stages' scan offsets
// as digits, the last stage's most significant: number = off2 * volume1 + off1.
// Along one dimension, with strides s_j and paddings p_j of stages j = 1..n
// (S_j = s_1 * ... * s_j, S_0 = 1), output o's window chain starts at input
// position o * S_n - sum_j p_j * S_{j-1}, and offset k_j in stage j's window
// moves k_j * S_{j-1} further: a pick's plane position (D, H, W) contiguous is
// base(od, oh, ow) + delta(number), delta tabled once per kernel call.
class PickPositions {
 public:
  PickPositions(std::initializer_list<const MaxPool3dGeometry*> stages, int depth, int height,
                int width) {
    TORCH_INTERNAL_ASSERT(stages.size() >= 1 && stages.size() <= kMaxStages);
    const int64_t plane_stride[3] = {static_cast<int64_t>(height) * width, width, 1};
    int64_t span[3] = {1, 1, 1};  // S_{j-1} per dimension
    int64_t below = 1;            // the volume of the stages before j
    for (const MaxPool3dGeometry* g : stages) {
      const PoolDim* dims[3] = {&g->d, &g->h, &g->w};
      Stage& st = stages_[num_stages_++];
      st.kernel_h = g->h.kernel;
      st.kernel_w = g->w.kernel;
      st.below = below;
      for (int i = 0; i < 3; ++i) {
        st.step[i] = span[i] * plane_stride[i];
        shift_ -= dims[i]->pad * st.step[i];
        span[i] *= dims[i]->stride;
      }
      below *= g->kernel_volume();
    }
    const MaxPool3dGeometry& last = **(stages.end() - 1);
    out_[0] = last.d.out;
    out_[1] = last.h.out;
    out_[2] = last.w.out;
    for (int i = 0; i < 3; ++i) window_step_[i] = span[i] * plane_stride[i];
    if (below <= kMaxTable) {
      table_.resize(below);
      for (int64_t n = 0; n < below; ++n) table_[n] = compute_delta(n);
    }
  }

  // The plane position of pick number `pick` relative to its output's base.
  int64_t delta(int64_t pick) const {
    return table_.empty() ? compute_delta(pick) : table_[pick];
  }

  // The plane position of output p's (D', H', W' row-major) pick numbered `pick`.
  int64_t position(int64_t p, int64_t pick) const {
    const int64_t ow = p % out_[2], oh = p / out_[2] % out_[1], od = p / out_[2] / out_[1];
    return shift_ + od * window_step_[0] + oh * window_step_[1] + ow * window_step_[2] +
           delta(pick);
  }

  // Calls f(p, position) for every output p (D', H', W' row-major) of one
  // plane, in order, with its pick's plane position; `picks` is that plane's,
  // output p's at picks[p * pick_step].
  template <typename index_t, typename F>
  void for_each(const index_t* picks, F&& f, int64_t pick_step = 1) const {
    int64_t p = 0;
    for (int od = 0; od < out_[0]; ++od) {
      for (int oh = 0; oh < out_[1]; ++oh) {
        const int64_t row = shift_ + od * window_step_[0] + oh * window_step_[1];
        for (int ow = 0; ow < out_[2]; ++ow, ++p) {
          f(p, row + ow * window_step_[2] + delta(static_cast<int64_t>(picks[p * pick_step])));
        }
      }
    }
  }

 private:
  static constexpr size_t kMaxStages = 2;
  static constexpr int64_t kMaxTable = int64_t{1} << 16;

  struct Stage {
    int kernel_h = 1, kernel_w = 1;
    int64_t below = 1;
    int64_t step[3] = {0, 0, 0};
  };

  int64_t compute_delta(int64_t pick) const {
    int64_t delta = 0;
    for (int j = num_stages_ - 1; j >= 0; --j) {
      const Stage& st = stages_[j];
      const int64_t off = pick / st.below;
      pick %= st.below;
      delta += off / (st.kernel_h * st.kernel_w) * st.step[0] +
               off / st.kernel_w % st.kernel_h * st.step[1] + off % st.kernel_w * st.step[2];
    }
    return delta;
  }

  Stage stages_[kMaxStages];
  int num_stages_ = 0;
  int out_[3] = {0, 0, 0};
  int64_t window_step_[3] = {0, 0, 0};
  int64_t shift_ = 0;
  std::vector<int64_t> table_;
};

// Saved picks (uint8, a forward's) each an element of its window, below `elements`: checked where they lie on
// the CPU, as a backward there would index past the window with another (PyTorch's CPU max-pool backward
// checks its indices too). On a GPU a pick past its window contributes nothing, without an error (refusing it
// would wait for the device): the kernels drop its window's gradient. Those that compare an element's own number
// with its window's pick need no test (no element's number is past the window); those that decode a pick into a
// position skip it (is_window_element, in the kernel or in a table of the pick bytes).
inline void check_saved_picks(const char* what, const char* name, const at::Tensor& picks, int64_t elements) {
  if (!picks.device().is_cpu() || picks.numel() == 0) return;
  const int64_t largest = picks.max().item<uint8_t>();
  TORCH_CHECK_VALUE(largest < elements, what, ": ", name, " must each name an element of its window of ", elements,
                    ", as the forward's do, got ", largest);
}

// Whether saved pick `pick` names an element of its window of `elements` (check_saved_picks): one compare.
C10_HOST_DEVICE inline bool is_window_element(int pick, int elements) { return pick < elements; }

// A max-pool backward's source of picks: `indices`, the forward's saved picks,
// or `x` to recompute them from; exactly one given, on grad's device. Returns
// it and sets `saved`.
inline const at::Tensor& picks_source(const char* what, const char* grad_name, const at::Tensor& grad,
                                      const std::optional<at::Tensor>& indices,
                                      const std::optional<at::Tensor>& x, bool& saved) {
  saved = indices.has_value() && indices->defined();
  const bool recompute = x.has_value() && x->defined();
  TORCH_CHECK_VALUE(saved != recompute, what,
                    ": pass exactly one of indices (the forward's saved picks) and x (to "
                    "recompute them)");
  const at::Tensor& given = saved ? *indices : *x;
  TORCH_CHECK_VALUE(given.device() == grad.device(), what, ": ", grad_name, " and ",
                    saved ? "indices" : "x", " must be on the same device, got ", grad.device(),
                    " and ", given.device());
  return given;
}

}  // namespace fused_ops
