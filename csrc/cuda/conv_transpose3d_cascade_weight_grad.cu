// CUDA kernels of conv_transpose3d_cascade_weight_grad (the math:
// ../conv_transpose3d_cascade_weight_grad.h).
//
// partials: a block per (output channel o, slice of the batch, 32 input
// channels), its warps taking the slice's picks in turn; lane i adds a pick's
// value times x[n, i, p] for each tap the pick reaches into its own column of
// the warp's (taps, 32) sums in shared memory (x channels last: a tap's read is
// one 128-byte row; no atomics, no bank conflicts); then the block adds its
// warps' sums in order into its slice's partial. reduce: each weight element
// adds the slices' partials in order (deterministic). Then the non-finite x
// (the header's rule): their count per (n, i), the channels they make wholly
// NaN, and the taps each of the others reaches off the picks. Taps beyond the
// shared memory's room run in further passes.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/TypeCast.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "../conv_transpose3d_cascade_weight_grad.h"
#include "../dispatch.h"
#include "plane_rows.cuh"

namespace fused_ops {
namespace {

constexpr int kLanes = 32;
constexpr int kWarps = 4;
constexpr int kThreads = kLanes * kWarps;

template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads)
    cascade_weight_grad_partials_kernel(const CascadeWeightGrad g, const acc_t* __restrict__ values,
                                        const uint8_t* __restrict__ picks, const scalar_t* __restrict__ x_last,
                                        int64_t tap_begin, int64_t tap_count, int64_t slice_batch,
                                        acc_t* __restrict__ partials) {
  extern __shared__ __align__(16) unsigned char smem[];
  acc_t* sums = reinterpret_cast<acc_t*>(smem);  // [warp][tap - tap_begin][lane]
  const int64_t o = blockIdx.x, slice = blockIdx.y, i = blockIdx.z * int64_t{kLanes} + threadIdx.x % kLanes;
  const int warp = threadIdx.x / kLanes, lane = threadIdx.x % kLanes;
  const bool active = i < g.in_channels;
  acc_t* mine = sums + warp * tap_count * kLanes + lane;  // this lane's column
  for (int64_t t = 0; t < tap_count; ++t) mine[t * kLanes] = 0;

  const int64_t first_n = slice * slice_batch, cells = g.num_cells();
  const int64_t items = (min(g.batch, first_n + slice_batch) - first_n) * cells;
  for (int64_t item = warp; item < items; item += kWarps) {
    const int64_t n = first_n + item / cells, cell = item % cells;
    const acc_t value = values[n * cells + cell];
    int64_t y[3];
    g.picked(picks[(n * cells + cell) * g.out_channels + o], cell, y);
    g.for_each_reaching_tap(n, y, [&](int64_t tap, int64_t row) {
      tap -= tap_begin;
      if (active && tap >= 0 && tap < tap_count) {
        mine[tap * kLanes] += value * static_cast<acc_t>(x_last[row * g.in_channels + i]);
      }
    });
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < tap_count * kLanes; e += kThreads) {
    const int64_t column = blockIdx.z * int64_t{kLanes} + e % kLanes;
    if (column >= g.in_channels) continue;
    acc_t total = 0;
    for (int w = 0; w < kWarps; ++w) total += sums[w * tap_count * kLanes + e];
    partials[((slice * g.out_channels + o) * g.taps() + tap_begin + e / kLanes) * g.in_channels + column] = total;
  }
}

template <typename acc_t, typename out_t>
__global__ void cascade_weight_grad_reduce_kernel(const CascadeWeightGrad g, const acc_t* __restrict__ partials,
                                                  int64_t slices, out_t* __restrict__ grad_w) {
  const int64_t taps = g.taps(), total = g.in_channels * g.out_channels * taps;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total; e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = e / (g.out_channels * taps), o = e / taps % g.out_channels, tap = e % taps;
    acc_t sum = 0;
    for (int64_t s = 0; s < slices; ++s) sum += partials[((s * g.out_channels + o) * taps + tap) * g.in_channels + i];
    grad_w[e] = c10::convert<out_t>(sum);
  }
}

// The non-finite x (the header's rule): count[n, i] of x[n, i, :] (a thread per element).
template <typename scalar_t>
__global__ void cascade_weight_grad_count_kernel(const CascadeWeightGrad g, const scalar_t* __restrict__ x_last,
                                                 int* __restrict__ count) {
  const int64_t volume = g.in_volume(), total = g.batch * volume * g.in_channels;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total; e += int64_t{gridDim.x} * blockDim.x) {
    if (!::isfinite(static_cast<at::opmath_type<scalar_t>>(x_last[e]))) {
      atomicAdd(count + e / (g.in_channels * volume) * g.in_channels + e % g.in_channels, 1);
    }
  }
}

// NaN where PyTorch's dense gradient adds 0 * a non-finite x: every (o, tap) of a channel with
// more than `cells` of them in one item (a thread per weight element), else the taps each one
// reaches off the picks (a thread per x element). Every writer of an element writes NaN.
template <typename out_t>
__global__ void cascade_weight_grad_whole_channel_kernel(const CascadeWeightGrad g, const int* __restrict__ count,
                                                         out_t* __restrict__ grad_w) {
  const int64_t taps = g.taps(), total = g.in_channels * g.out_channels * taps;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total; e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = e / (g.out_channels * taps);
    for (int64_t n = 0; n < g.batch; ++n) {
      if (count[n * g.in_channels + i] > g.num_cells()) {
        grad_w[e] = std::numeric_limits<out_t>::quiet_NaN();
        break;
      }
    }
  }
}

template <typename scalar_t, typename out_t>
__global__ void cascade_weight_grad_nonfinite_kernel(const CascadeWeightGrad g, const uint8_t* __restrict__ picks,
                                                     const scalar_t* __restrict__ x_last,
                                                     const int* __restrict__ count, out_t* __restrict__ grad_w) {
  const int64_t volume = g.in_volume(), total = g.batch * volume * g.in_channels, taps = g.taps();
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total; e += int64_t{gridDim.x} * blockDim.x) {
    if (::isfinite(static_cast<at::opmath_type<scalar_t>>(x_last[e]))) continue;
    const int64_t i = e % g.in_channels, p = e / g.in_channels % volume, n = e / (g.in_channels * volume);
    if (count[n * g.in_channels + i] > g.num_cells()) continue;  // (the whole channel's)
    for (int64_t o = 0; o < g.out_channels; ++o) {
      for (int64_t tap = 0; tap < taps; ++tap) {
        if (g.zero_product(picks, n, p, o, tap)) {
          grad_w[(i * g.out_channels + o) * taps + tap] = std::numeric_limits<out_t>::quiet_NaN();
        }
      }
    }
  }
}

at::Tensor conv_transpose3d_cascade_weight_grad_cuda(const at::Tensor& grad_out, const at::Tensor& picks_,
                                                     const at::Tensor& x, at::IntArrayRef kernel_size,
                                                     at::IntArrayRef stride, at::IntArrayRef padding,
                                                     at::IntArrayRef kernel2, at::IntArrayRef output_size,
                                                     at::ScalarType dtype) {
  const CascadeWeightGrad g =
      cascade_weight_grad_setup(grad_out, picks_, x, kernel_size, stride, padding, kernel2, output_size, dtype);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t I = g.in_channels, O = g.out_channels, taps = g.taps();
  at::Tensor grad_w = at::empty({I, O, g.kernel[0], g.kernel[1], g.kernel[2]}, x.options().dtype(dtype));
  if (grad_w.numel() == 0) return grad_w;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor picks = picks_.contiguous();
  const at::Tensor x_last = x.contiguous(at::MemoryFormat::ChannelsLast3d);  // (N, D, H, W, I) in memory
  FUSED_OPS_DISPATCH_FLOATING_TYPES(x.scalar_type(), "conv_transpose3d_cascade_weight_grad_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    using x_t = scalar_t;
    const at::Tensor values = grad_out.to(c10::CppTypeToScalarType<acc_t>::value).contiguous();
    const int64_t sms = device_attribute(cudaDevAttrMultiProcessorCount, x.get_device());
    FUSED_OPS_DISPATCH_FLOATING_TYPES(dtype, "conv_transpose3d_cascade_weight_grad_cuda", [&] {
      if (g.batch == 0 || g.num_cells() == 0) {
        grad_w.zero_();
      } else {
        // slices of the batch: blocks for two waves of the multiprocessors at least
        const int64_t channel_blocks = (I + kLanes - 1) / kLanes;
        TORCH_CHECK(channel_blocks <= 65535, "conv_transpose3d_cascade_weight_grad: at most ", 65535 * kLanes,
                    " input channels on a GPU, got ", I);
        const int64_t wanted = std::clamp<int64_t>((2 * sms + O * channel_blocks - 1) / (O * channel_blocks), 1,
                                                   std::min<int64_t>(g.batch, 65535));
        const int64_t slice_batch = (g.batch + wanted - 1) / wanted, slices = (g.batch + slice_batch - 1) / slice_batch;
        at::Tensor partials = at::empty({slices, O, taps, I}, values.options());
        const int64_t room = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, x.get_device());
        const int64_t tap_chunk = std::min<int64_t>(taps, room / (kThreads * int64_t{sizeof(acc_t)}));
        const auto kernel = cascade_weight_grad_partials_kernel<x_t, acc_t>;
        for (int64_t tap_begin = 0; tap_begin < taps; tap_begin += tap_chunk) {
          const int64_t count = std::min(tap_chunk, taps - tap_begin);
          const size_t smem = static_cast<size_t>(count * kThreads) * sizeof(acc_t);
          C10_CUDA_CHECK(
              cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
          kernel<<<dim3(static_cast<unsigned>(O), static_cast<unsigned>(slices), static_cast<unsigned>(channel_blocks)),
                   kThreads, smem, stream>>>(g, values.const_data_ptr<acc_t>(), picks.const_data_ptr<uint8_t>(),
                                             x_last.const_data_ptr<x_t>(), tap_begin, count, slice_batch,
                                             partials.mutable_data_ptr<acc_t>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
        const int64_t blocks = std::min<int64_t>((grad_w.numel() + 255) / 256, 4 * sms);
        cascade_weight_grad_reduce_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
            g, partials.const_data_ptr<acc_t>(), slices, grad_w.mutable_data_ptr<scalar_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      if (x.numel() == 0) return;
      const at::Tensor count = at::zeros({g.batch, I}, x.options().dtype(at::kInt));
      const int64_t x_blocks = std::min<int64_t>((x.numel() + 255) / 256, 8 * sms);
      cascade_weight_grad_count_kernel<<<static_cast<unsigned>(x_blocks), 256, 0, stream>>>(
          g, x_last.const_data_ptr<x_t>(), count.mutable_data_ptr<int>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      const int64_t w_blocks = std::min<int64_t>((grad_w.numel() + 255) / 256, 4 * sms);
      cascade_weight_grad_whole_channel_kernel<<<static_cast<unsigned>(w_blocks), 256, 0, stream>>>(
          g, count.const_data_ptr<int>(), grad_w.mutable_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      cascade_weight_grad_nonfinite_kernel<<<static_cast<unsigned>(x_blocks), 256, 0, stream>>>(
          g, picks.const_data_ptr<uint8_t>(), x_last.const_data_ptr<x_t>(), count.const_data_ptr<int>(),
          grad_w.mutable_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return grad_w;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("conv_transpose3d_cascade_weight_grad", &conv_transpose3d_cascade_weight_grad_cuda);
}

}  // namespace fused_ops
