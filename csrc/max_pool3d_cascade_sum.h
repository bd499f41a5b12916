// max_pool3d_cascade_sum: out[b, 0, p] = sum over c of max_pool3d_2(max_pool3d_1(x))[b, c, p].
//
// Host-side pieces shared by the CPU and CUDA kernels: argument checks, the
// two stages' geometry, the tensors the op creates, and the cascade's pick
// and gradient per element (host and device).
//
// The cascade, as PyTorch computes it: stage 1 max-pools x (its windows
// clipped to x, its picks by the rule of max_pool3d.h); stage 2 max-pools
// stage 1's output with the same rule (its padding is padding of stage 1's
// output, never offered). So the cascade's pick for output p is the stage-1
// pick inside the stage-1 window that stage 2 picks, ties at each stage going
// to the first maximum in that stage's scan order, the last NaN winning. It is
// numbered (stage-2 scan offset) * volume1 + (stage-1 scan offset), volume1
// the stage-1 kernel volume: one byte when volume1 * volume2 <= 256.
//
// Ordered by that number, the cascade's pick is the pick of one max-pool rule
// over all (stage-1 window, element) pairs of the output: with no NaN both
// stages take the first maximum, so the pick is the maximum first in
// (stage-2 offset, stage-1 offset) order; with a NaN both take the last NaN.
// The CUDA kernels use this to combine the elements in any order
// (WindowPick::merge).
//
// Backward: d out[b, 0, p] / d x[b, c, e] = [e is channel c's cascade pick for p], so
//   grad_x[b, c, e] = sum of grad_out[b, 0, p] over the outputs p whose pick for c is e,
// zero where no output picks it: the CUDA kernels gather it per element
// (cascade_grad), the CPU kernel scatters each output's gradient to its pick
// (max_pool3d.h, PickPositions).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <optional>
#include <string>

#include "dispatch.h"
#include "max_pool3d.h"
#include "pool_geometry.h"

namespace fused_ops {

struct MaxPool3dCascade {
  MaxPool3dGeometry first, second;

  // The cascade's pick numbers: [0, pick_volume()).
  C10_HOST_DEVICE int64_t pick_volume() const {
    return first.kernel_volume() * second.kernel_volume();
  }
  // Output positions per (b, c): D'' * H'' * W''.
  C10_HOST_DEVICE int64_t outputs() const { return second.pooled_plane(); }
  // Both stages tile their input from its origin (stride = kernel, no
  // padding): output p's elements are a box of kernel1 * kernel2 per
  // dimension, the boxes adjacent and disjoint, starting at x's origin.
  C10_HOST_DEVICE bool tiled() const {
    auto tiles = [](const PoolDim& p) { return p.kernel == p.stride && p.pad == 0; };
    return tiles(first.d) && tiles(first.h) && tiles(first.w) && tiles(second.d) &&
           tiles(second.h) && tiles(second.w);
  }
};

// The pool arguments of both stages, as the op takes them.
struct CascadeArgs {
  c10::IntArrayRef kernel1, stride1, padding1, kernel2, stride2, padding2;
};

// Checks both stages' arguments for an input of spatial size `input_size`
// (nn.MaxPool3d's: dilation 1, ceil_mode False; an empty stride means the
// kernel size) and returns the geometry.
inline MaxPool3dCascade max_pool3d_cascade_geometry(const char* what,
                                                    c10::IntArrayRef input_size,
                                                    const CascadeArgs& a) {
  const std::string first_what = std::string(what) + " (first pool)";
  const std::string second_what = std::string(what) + " (second pool)";
  MaxPool3dCascade g;
  g.first = max_pool3d_geometry(first_what.c_str(), input_size, a.kernel1, a.stride1,
                                a.padding1, false);
  const int64_t pooled[3] = {g.first.d.out, g.first.h.out, g.first.w.out};
  g.second = max_pool3d_geometry(second_what.c_str(), pooled, a.kernel2, a.stride2, a.padding2,
                                 false);
  TORCH_CHECK_VALUE(g.pick_volume() < (int64_t{1} << 31), what,
                    ": the product of the two kernel volumes must be below 2^31, got ",
                    g.pick_volume());
  return g;
}

inline MaxPool3dCascade max_pool3d_cascade_sum_geometry(const at::Tensor& x, const CascadeArgs& a,
                                                        bool save_indices) {
  constexpr const char* what = "max_pool3d_cascade_sum";
  check_pool3d_input(what, x);
  const auto g = max_pool3d_cascade_geometry(what, x.sizes().slice(2), a);
  TORCH_CHECK_VALUE(!save_indices || g.pick_volume() <= kMaxSavedKernelVolume, what,
                    ": save_indices needs the product of the two kernel volumes to be at most ",
                    kMaxSavedKernelVolume, " (one byte per pick), got ", g.pick_volume(),
                    "; without it the backward recomputes the picks from x");
  return g;
}

// The forward's outputs: out (B, 1, D'', H'', W'') in the result's dtype
// (x's, or its accumulation type: result_dtype), and the picks (B, C, D'',
// H'', W'') as uint8 in `format` (contiguous; the CPU kernels lay them out as
// a channels_last_3d x), or an empty uint8 tensor when not saved.
inline std::pair<at::Tensor, at::Tensor> max_pool3d_cascade_sum_outputs(
    const at::Tensor& x, const MaxPool3dCascade& g, bool save_indices,
    std::optional<at::ScalarType> dtype, at::MemoryFormat format = at::MemoryFormat::Contiguous) {
  const auto& s = g.second;
  at::Tensor out =
      at::empty({x.size(0), 1, s.d.out, s.h.out, s.w.out},
                x.options().dtype(result_dtype("max_pool3d_cascade_sum", x.scalar_type(), dtype)));
  const auto byte_options = x.options().dtype(at::kByte);
  at::Tensor indices =
      save_indices ? at::empty({x.size(0), x.size(1), s.d.out, s.h.out, s.w.out},
                               byte_options.memory_format(format))
                   : at::empty({0}, byte_options);
  return {out, indices};
}

// The backward's checked arguments: the geometry; grad_out, contiguous; the
// picks, (B, C, D'', H'', W'') in `format`: the forward's saved ones, or
// (recompute) a buffer to fill from x first; and grad_x to fill, in `format`
// (contiguous; the CPU kernels write a channels_last_3d x's gradient
// channels_last_3d).
struct MaxPool3dCascadeBackward {
  MaxPool3dCascade g;
  at::Tensor grad_out;
  at::Tensor picks;
  bool recompute;
  at::Tensor x;
  at::Tensor grad_x;
};

inline MaxPool3dCascadeBackward max_pool3d_cascade_sum_backward_setup(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& indices,
    const std::optional<at::Tensor>& x, c10::IntArrayRef input_size, const CascadeArgs& a,
    at::MemoryFormat format = at::MemoryFormat::Contiguous) {
  constexpr const char* what = "max_pool3d_cascade_sum_backward";
  TORCH_CHECK_TYPE(at::isFloatingType(grad_out.scalar_type()), what,
                   ": grad_out must be a floating-point tensor, got ", grad_out.scalar_type());
  TORCH_CHECK_VALUE(input_size.size() == 3, what, ": input_size must have 3 elements, got ",
                    input_size.size());
  bool saved = false;
  const at::Tensor& given = picks_source(what, "grad_out", grad_out, indices, x, saved);
  const auto g = max_pool3d_cascade_geometry(what, input_size, a);
  const auto& s = g.second;
  const int64_t B = grad_out.dim() > 0 ? grad_out.size(0) : 0;
  TORCH_CHECK_VALUE(grad_out.sizes() == c10::IntArrayRef({B, 1, s.d.out, s.h.out, s.w.out}), what,
                    ": grad_out of shape ", grad_out.sizes(),
                    " does not match the cascade's output for input_size ", input_size,
                    " (expected (B, 1, ", s.d.out, ", ", s.h.out, ", ", s.w.out, "))");
  TORCH_CHECK_VALUE(given.dim() == 5 && given.size(0) == B, what, ": ",
                    saved ? "indices" : "x", " of shape ", given.sizes(),
                    " do not match grad_out of shape ", grad_out.sizes());
  const int64_t C = given.size(1);
  if (saved) {
    TORCH_CHECK_TYPE(indices->scalar_type() == at::kByte, what, ": indices must be uint8, got ",
                     indices->scalar_type());
    TORCH_CHECK_VALUE(g.pick_volume() <= kMaxSavedKernelVolume, what,
                      ": saved indices need the product of the kernel volumes to be at most ",
                      kMaxSavedKernelVolume, ", got ", g.pick_volume());
    TORCH_CHECK_VALUE(indices->sizes().slice(2) == c10::IntArrayRef({s.d.out, s.h.out, s.w.out}),
                      what, ": indices of shape ", indices->sizes(),
                      " do not match the cascade's output for input_size ", input_size,
                      " (expected (", B, ", C, ", s.d.out, ", ", s.h.out, ", ", s.w.out, "))");
    check_saved_picks(what, "indices", *indices, g.pick_volume());
  } else {
    TORCH_CHECK_TYPE(x->scalar_type() == grad_out.scalar_type(), what,
                     ": x must have grad_out's dtype ", grad_out.scalar_type(), ", got ",
                     x->scalar_type());
    TORCH_CHECK_VALUE(x->sizes().slice(2) == input_size, what, ": x of shape ", x->sizes(),
                      " does not match input_size ", input_size);
  }
  at::Tensor grad_x = at::empty({B, C, input_size[0], input_size[1], input_size[2]},
                                grad_out.options().memory_format(format));
  if (saved) return {g, grad_out.contiguous(), indices->contiguous(format), false, at::Tensor(), grad_x};
  const auto pick_dtype = g.pick_volume() <= kMaxSavedKernelVolume ? at::kByte : at::kInt;
  at::Tensor picks = at::empty({B, C, s.d.out, s.h.out, s.w.out},
                               x->options().dtype(pick_dtype).memory_format(format));
  return {g, grad_out.contiguous(), picks, true, *x, grad_x};
}

// The cascade's pick for output (od, oh, ow), reading the element at x
// position (d, h, w) as value_at(d, h, w) (in the accumulation type): stage 2
// offered, in its scan order, the stage-1 picks of its window's elements.
template <typename acc_t, typename ValueAt>
C10_HOST_DEVICE WindowPick<acc_t> cascade_pick(const MaxPool3dCascade& g, int od, int oh, int ow,
                                               const ValueAt& value_at) {
  const MaxPool3dGeometry& s = g.second;
  const int volume1 = static_cast<int>(g.first.kernel_volume());
  const int d0 = s.d.origin(od), h0 = s.h.origin(oh), w0 = s.w.origin(ow);
  WindowPick<acc_t> pick;
  for (int d = s.d.begin(od); d < s.d.end(od); ++d) {
    for (int h = s.h.begin(oh); h < s.h.end(oh); ++h) {
      for (int w = s.w.begin(ow); w < s.w.end(ow); ++w) {
        const auto first = pick_in_window<acc_t>(g.first, d, h, w, value_at);
        pick.update(first.value, s.offset(d - d0, h - h0, w - w0) * volume1 + first.offset);
      }
    }
  }
  return pick;
}

// grad_x at x position (d, h, w) of one (b, c): the sum of grad_at(od, oh,
// ow) over the outputs whose pick (in `picks`, one plane (D'', H'', W'')
// contiguous) is that element, through every stage-1 window holding it and
// every stage-2 window holding that one.
template <typename acc_t, typename index_t, typename GradAt>
C10_HOST_DEVICE acc_t cascade_grad(const MaxPool3dCascade& g, const index_t* picks, int d, int h,
                                   int w, const GradAt& grad_at) {
  const MaxPool3dGeometry &f = g.first, &s = g.second;
  const int volume1 = static_cast<int>(f.kernel_volume());
  acc_t sum = 0;
  for (int d1 = f.d.first_window(d); d1 < f.d.last_window(d); ++d1) {
    for (int h1 = f.h.first_window(h); h1 < f.h.last_window(h); ++h1) {
      for (int w1 = f.w.first_window(w); w1 < f.w.last_window(w); ++w1) {
        const int first = f.offset(d - f.d.origin(d1), h - f.h.origin(h1), w - f.w.origin(w1));
        for (int od = s.d.first_window(d1); od < s.d.last_window(d1); ++od) {
          for (int oh = s.h.first_window(h1); oh < s.h.last_window(h1); ++oh) {
            const index_t* row = picks + (static_cast<int64_t>(od) * s.h.out + oh) * s.w.out;
            for (int ow = s.w.first_window(w1); ow < s.w.last_window(w1); ++ow) {
              const int pick =
                  s.offset(d1 - s.d.origin(od), h1 - s.h.origin(oh), w1 - s.w.origin(ow)) *
                      volume1 + first;
              if (static_cast<int>(row[ow]) == pick) sum += grad_at(od, oh, ow);
            }
          }
        }
      }
    }
  }
  return sum;
}

// A tiled cascade (MaxPool3dCascade::tiled) along one dimension: the pick
// number of the element at position k of its output's box is the sum over
// dimensions of key(k), k = (k / kernel1) * weight2 + k % kernel1 * weight1
// being its stage-2 and stage-1 offsets, weighted by their places in the number.
struct TiledDim {
  int kernel1, kernel2, box, weight2, weight1;

  C10_HOST_DEVICE int key(int k) const { return k / kernel1 * weight2 + k % kernel1 * weight1; }
};

struct TiledCascade {
  TiledDim d, h, w;
};

inline TiledCascade tiled_cascade(const MaxPool3dCascade& g) {
  const MaxPool3dGeometry &f = g.first, &s = g.second;
  const int volume1 = static_cast<int>(f.kernel_volume());
  auto dim = [](const PoolDim& first, const PoolDim& second, int weight2, int weight1) {
    return TiledDim{first.kernel, second.kernel, first.kernel * second.kernel, weight2, weight1};
  };
  return {dim(f.d, s.d, s.h.kernel * s.w.kernel * volume1, f.h.kernel * f.w.kernel),
          dim(f.h, s.h, s.w.kernel * volume1, f.w.kernel), dim(f.w, s.w, volume1, 1)};
}

}  // namespace fused_ops
