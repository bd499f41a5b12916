// CUDA kernels of box_fold2d and its backward (the math: ../box_fold2d.h): one
// thread per result element, its plane of the (contiguous) input read in
// place, the sum in float64: one launch each way (the fold ran as four ops of
// host time in each training step of architecture C).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/TypeCast.h>
#include <torch/library.h>

#include <optional>

#include "../box_fold2d.h"
#include "../dispatch.h"

namespace fused_ops {
namespace {

constexpr int kThreads = 256;

template <typename in_t, typename out_t, typename Tap>
__global__ void __launch_bounds__(kThreads) map_planes_kernel(const in_t* __restrict__ in, out_t* __restrict__ out,
                                                              int64_t numel, int64_t rows, int64_t cols,
                                                              int64_t in_plane, Tap tap) {
  for (int64_t e = blockIdx.x * int64_t{kThreads} + threadIdx.x; e < numel; e += int64_t{gridDim.x} * kThreads) {
    const int64_t plane = e / (rows * cols), i = e % (rows * cols) / cols, j = e % cols;
    out[e] = c10::convert<out_t>(tap(in + plane * in_plane, i, j));
  }
}

// out (`shape`, `dtype`) with out[plane, i, j] = tap(in's plane, i, j), rounded once.
template <typename Tap>
at::Tensor map_planes_cuda(const at::Tensor& in_, at::IntArrayRef shape, at::ScalarType dtype, Tap tap) {
  const c10::cuda::CUDAGuard guard(in_.device());
  const at::Tensor in = in_.contiguous();
  at::Tensor out = at::empty(shape, in.options().dtype(dtype));
  if (out.numel() == 0) return out;
  const int64_t blocks = std::min<int64_t>((out.numel() + kThreads - 1) / kThreads, 65535);
  FUSED_OPS_DISPATCH_FLOATING_TYPES(in.scalar_type(), "box_fold2d_cuda", [&] {
    using in_t = scalar_t;
    FUSED_OPS_DISPATCH_FLOATING_TYPES(dtype, "box_fold2d_cuda", [&] {
      map_planes_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          in.const_data_ptr<in_t>(), out.mutable_data_ptr<scalar_t>(), out.numel(), out.size(-2), out.size(-1),
          in.size(-2) * in.size(-1), tap);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

at::Tensor box_fold2d_cuda(const at::Tensor& weight, at::IntArrayRef box, double divisor,
                          std::optional<at::ScalarType> dtype) {
  return box_fold2d_with([](auto&&... a) { return map_planes_cuda(a...); }, weight, box, divisor, dtype);
}

at::Tensor box_fold2d_backward_cuda(const at::Tensor& grad, at::IntArrayRef kernel_size, at::IntArrayRef box,
                                   double divisor, at::ScalarType dtype) {
  return box_fold2d_backward_with([](auto&&... a) { return map_planes_cuda(a...); }, grad, kernel_size, box,
                                  divisor, dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("box_fold2d", &box_fold2d_cuda);
  m.impl("box_fold2d_backward", &box_fold2d_backward_cuda);
}

}  // namespace fused_ops
