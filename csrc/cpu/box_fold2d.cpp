// CPU kernels of box_fold2d and its backward (the math: ../box_fold2d.h):
// each result element from its plane of the (contiguous) input, in float64.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/TypeCast.h>
#include <torch/library.h>

#include <optional>

#include "../box_fold2d.h"
#include "../dispatch.h"

namespace fused_ops {
namespace {

// out (`shape`, `dtype`) with out[plane, i, j] = tap(in's plane, i, j), rounded once.
template <typename Tap>
at::Tensor map_planes_cpu(const at::Tensor& in_, at::IntArrayRef shape, at::ScalarType dtype, Tap tap) {
  const at::Tensor in = in_.contiguous();
  at::Tensor out = at::empty(shape, in.options().dtype(dtype));
  const int64_t rows = out.size(-2), cols = out.size(-1), plane = rows * cols;
  const int64_t in_plane = in.size(-2) * in.size(-1);
  FUSED_OPS_DISPATCH_FLOATING_TYPES(in.scalar_type(), "box_fold2d_cpu", [&] {
    using in_t = scalar_t;
    const in_t* src = in.const_data_ptr<in_t>();
    FUSED_OPS_DISPATCH_FLOATING_TYPES(dtype, "box_fold2d_cpu", [&] {
      scalar_t* dst = out.mutable_data_ptr<scalar_t>();
      at::parallel_for(0, out.numel(), 4096, [&](int64_t begin, int64_t end) {
        for (int64_t e = begin; e < end; ++e) {
          const int64_t p = e / plane, i = e % plane / cols, j = e % cols;
          dst[e] = c10::convert<scalar_t>(tap(src + p * in_plane, i, j));
        }
      });
    });
  });
  return out;
}

at::Tensor box_fold2d_cpu(const at::Tensor& weight, at::IntArrayRef box, double divisor,
                          std::optional<at::ScalarType> dtype) {
  return box_fold2d_with([](auto&&... a) { return map_planes_cpu(a...); }, weight, box, divisor, dtype);
}

at::Tensor box_fold2d_backward_cpu(const at::Tensor& grad, at::IntArrayRef kernel_size, at::IntArrayRef box,
                                   double divisor, at::ScalarType dtype) {
  return box_fold2d_backward_with([](auto&&... a) { return map_planes_cpu(a...); }, grad, kernel_size, box,
                                  divisor, dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("box_fold2d", &box_fold2d_cpu);
  m.impl("box_fold2d_backward", &box_fold2d_backward_cpu);
}

}  // namespace fused_ops
