// CPU-only helpers of the vectorized kernels (their layouts: ../memory_format.h):
// vectors of the accumulation type over adjacent elements (channels of a
// channels_last_3d tensor, or w of a row), PyTorch's `tensor / number` and
// `tensor * number` on them (dispatch.h's TrueDivide and Multiply), and the
// max-pool pick rule of max_pool3d.h on lanes; where the max-pool kernels'
// picks lie in their (B, C, D', H', W') tensor.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../dispatch.h"
#include "../max_pool3d.h"
#include "../memory_format.h"

namespace fused_ops {

// Where a plane's picks lie in a (B, C, D', H', W') picks tensor, contiguous
// or channels_last_3d: plane (b, c) at b * batch + c * channel, its output p
// (D', H', W' row-major) p * position further.
struct PickStrides {
  int64_t batch = 0, channel = 0, position = 0;

  static PickStrides of(const at::Tensor& picks) {
    return picks.dim() == 5 ? PickStrides{picks.stride(0), picks.stride(1), picks.stride(4)} : PickStrides{};
  }
  int64_t plane(int64_t n, int64_t C) const { return n / C * batch + n % C * channel; }
};

// kLanes adjacent scalar_t values as a vector of at::opmath_type<scalar_t>
// (16-bit types converted to float on load, rounded back on store).
template <typename scalar_t>
struct ChannelVec {
  using acc_t = at::opmath_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  static constexpr int kLanes = Vec::size();
  static constexpr bool kReduced = !std::is_same_v<scalar_t, acc_t>;

  // count (<= kLanes) values from p; the lanes past count are 0.
  static Vec load(const scalar_t* p, int count = kLanes) {
    if constexpr (!kReduced) {
      return count == kLanes ? Vec::loadu(p) : Vec::loadu(p, count);
    } else {
      Vec v;
      if (count == kLanes) {
        at::vec::load_to_float(p, v);
      } else {
        scalar_t part[kLanes] = {};
        std::copy(p, p + count, part);
        at::vec::load_to_float(part, v);
      }
      return v;
    }
  }
  // The first count lanes of v, rounded to scalar_t, to p.
  static void store(scalar_t* p, const Vec& v, int count = kLanes) {
    if constexpr (!kReduced) {
      v.store(p, count);
    } else {
      at::vec::convert_from_float<scalar_t>(v, v).store(p, count);
    }
  }
  // v rounded to scalar_t, as the value a scalar_t result holds (in acc_t).
  static Vec round(const Vec& v) {
    if constexpr (!kReduced) {
      return v;
    } else {
      return std::get<0>(at::vec::convert_to_float<scalar_t>(at::vec::convert_from_float<scalar_t>(v, v)));
    }
  }
};

// TrueDivide (dispatch.h) on lanes: v / divisor in acc_t, rounded to
// scalar_t. A power-of-two divisor whose reciprocal is a normal number
// multiplies by the reciprocal instead: both round the same real number
// once, so they are equal, and a product is cheaper.
template <typename scalar_t>
struct TrueDivideVec {
  using acc_t = at::opmath_type<scalar_t>;
  using Vec = typename ChannelVec<scalar_t>::Vec;
  Vec divisor, reciprocal;
  bool by_reciprocal;

  explicit TrueDivideVec(double number) {
    const acc_t d = static_cast<acc_t>(number);
    int exponent = 0;
    const acc_t r = acc_t(1) / d;
    by_reciprocal = std::abs(std::frexp(d, &exponent)) == acc_t(0.5) && std::isnormal(r);
    divisor = Vec(d);
    reciprocal = Vec(r);
  }
  Vec operator()(const Vec& v) const {
    return ChannelVec<scalar_t>::round(by_reciprocal ? v * reciprocal : v / divisor);
  }
};

// Multiply (dispatch.h) on lanes: v * factor in acc_t, rounded to scalar_t.
template <typename scalar_t>
struct MultiplyVec {
  using Vec = typename ChannelVec<scalar_t>::Vec;
  Vec factor;

  explicit MultiplyVec(double number) : factor(static_cast<at::opmath_type<scalar_t>>(number)) {}
  Vec operator()(const Vec& v) const { return ChannelVec<scalar_t>::round(v * factor); }
};

// The values as loaded (a max-pool of x itself).
struct SameValues {
  template <typename Vec>
  const Vec& operator()(const Vec& v) const {
    return v;
  }
};

// WindowPick::update on lanes, elements offered in scan order (the first
// offered unconditionally): value and offset (an acc_t holding an integer,
// exact below 2^24 in float) per lane. WithOffsets false tracks the value
// alone, by a NaN-propagating maximum: the same value, but for the sign of a
// zero maximum (a sum of picks starting at +0 is the same either way).
template <typename acc_t, bool WithOffsets>
struct VecPick {
  using Vec = at::vec::Vectorized<acc_t>;
  Vec value, offset;

  void first(const Vec& v, const Vec& element) {
    value = v;
    if constexpr (WithOffsets) offset = element;
  }
  void update(const Vec& v, const Vec& element) {
    if constexpr (WithOffsets) {
      const Vec take = (v > value) | v.isnan();
      value = Vec::blendv(value, v, take);
      offset = Vec::blendv(offset, element, take);
    } else {
      value = at::vec::maximum(value, v);
    }
  }
};

// The largest pick number the vector kernels carry in a float lane exactly.
constexpr int64_t kMaxLanePickNumber = int64_t{1} << 24;

// The picks of window (od, oh, ow) for all channels from `base` (channel 0
// of one batch of a channels_last_3d x; steps sd, sh, sw between input
// positions) in blocks of kLanes channels, the last one of `tail`, into
// picks[0, blocks): the window's elements offered in scan order, each
// element's blocks in turn (its channels are adjacent), transformed as read.
template <typename scalar_t, bool WithOffsets, typename Transform>
void pick_window_channels(const MaxPool3dGeometry& g, int od, int oh, int ow, const scalar_t* base,
                          int64_t sd, int64_t sh, int64_t sw, int64_t blocks, int tail,
                          const Transform& transform, VecPick<at::opmath_type<scalar_t>, WithOffsets>* picks) {
  using acc_t = at::opmath_type<scalar_t>;
  using CV = ChannelVec<scalar_t>;
  const int d0 = g.d.origin(od), h0 = g.h.origin(oh), w0 = g.w.origin(ow);
  bool first = true;
  for (int d = g.d.begin(od); d < g.d.end(od); ++d) {
    for (int h = g.h.begin(oh); h < g.h.end(oh); ++h) {
      for (int w = g.w.begin(ow); w < g.w.end(ow); ++w) {
        const scalar_t* element = base + d * sd + h * sh + w * sw;
        const typename CV::Vec offset(static_cast<acc_t>(g.offset(d - d0, h - h0, w - w0)));
        for (int64_t k = 0; k < blocks; ++k) {
          const auto v = transform(CV::load(element + k * CV::kLanes, k + 1 < blocks ? CV::kLanes : tail));
          if (first) {
            picks[k].first(v, offset);
          } else {
            picks[k].update(v, offset);
          }
        }
        first = false;
      }
    }
  }
}

// Calls f(std::true_type{}) where the picks' offsets are wanted, else
// f(std::false_type{}) (the values alone: VecPick's WithOffsets).
template <typename F>
void dispatch_with_offsets(bool with_offsets, F&& f) {
  if (with_offsets) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// The picks of output row (od, oh) of one plane whose elements along w are
// adjacent (pointer `plane`, steps sd, sh), transformed as read, into
// picks[0, W'): per input column w, first the pick over the window's (d, h)
// rows in scan order, kLanes columns at a time; then per window the picks of
// its columns merged (WindowPick::merge: the scan-order pick in any order).
// `columns` holds 2 * W values of scratch. Without offsets, the values only
// (NaN-propagating maxima; the offsets left -1).
template <typename scalar_t, bool WithOffsets, typename Transform>
void pick_row_along_w(const MaxPool3dGeometry& g, int od, int oh, const scalar_t* plane, int64_t sd,
                      int64_t sh, const Transform& transform, at::opmath_type<scalar_t>* columns,
                      WindowPick<at::opmath_type<scalar_t>>* picks) {
  using acc_t = at::opmath_type<scalar_t>;
  using CV = ChannelVec<scalar_t>;
  constexpr int kLanes = CV::kLanes;
  const int W = g.w.in;
  acc_t* column_value = columns;
  acc_t* column_offset = columns + W;
  const int d0 = g.d.origin(od), h0 = g.h.origin(oh);
  for (int w = 0; w < W; w += kLanes) {
    const int count = std::min(kLanes, W - w);
    VecPick<acc_t, WithOffsets> pick;
    bool first = true;
    for (int d = g.d.begin(od); d < g.d.end(od); ++d) {
      for (int h = g.h.begin(oh); h < g.h.end(oh); ++h) {
        const auto v = transform(CV::load(plane + d * sd + h * sh + w, count));
        const at::vec::Vectorized<acc_t> row(static_cast<acc_t>((d - d0) * g.h.kernel + (h - h0)));
        if (first) {
          pick.first(v, row);
          first = false;
        } else {
          pick.update(v, row);
        }
      }
    }
    pick.value.store(column_value + w, count);
    if constexpr (WithOffsets) pick.offset.store(column_offset + w, count);
  }
  for (int ow = 0; ow < g.w.out; ++ow) {
    const int w0 = g.w.origin(ow);
    WindowPick<acc_t> pick;
    for (int w = g.w.begin(ow); w < g.w.end(ow); ++w) {
      if constexpr (WithOffsets) {
        pick.merge(column_value[w], static_cast<int>(column_offset[w]) * g.w.kernel + (w - w0));
      } else {
        pick.update(column_value[w], 0);
      }
    }
    if constexpr (!WithOffsets) pick.offset = -1;
    picks[ow] = pick;
  }
}

}  // namespace fused_ops
