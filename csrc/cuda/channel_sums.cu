// CUDA kernel of channel_sums (the math: ../channel_sums.h). Where t's memory is rows of its C channels
// (channels-last, or (N, C) contiguous): two kernels, deterministic (no atomics): chunks of rows each summed
// per channel by a block (a warp a row at a time, a lane a channel: 128-byte loads of float32 rows), the 8
// warps' sums added in order, then the chunks' sums added in order. Any other layout by ATen's reduction.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/TypeCast.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../channel_sums.h"
#include "../dispatch.h"
#include "plane_rows.cuh"

namespace fused_ops {
namespace {

constexpr int kWarps = 8, kLanes = 32;

// partial[chunk, c] = sum of t's rows [chunk * rows_per_chunk, +rows_per_chunk) at channel c: block
// (chunk, channel tile of 32), warp w the rows w, w + 8, ... of the chunk, lane c - 32 tile.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kWarps * kLanes)
    channel_partial_sums_kernel(const scalar_t* __restrict__ t, int64_t rows, int channels, int64_t rows_per_chunk,
                                acc_t* __restrict__ partial) {
  __shared__ acc_t sums[kWarps][kLanes];
  const int warp = threadIdx.x / kLanes, lane = threadIdx.x % kLanes;
  const int c = blockIdx.y * kLanes + lane;
  const int64_t first = blockIdx.x * rows_per_chunk, last = std::min(rows, first + rows_per_chunk);
  acc_t sum = acc_t(0);
  if (c < channels) {
#pragma unroll 4
    for (int64_t r = first + warp; r < last; r += kWarps) sum += static_cast<acc_t>(t[r * channels + c]);
  }
  sums[warp][lane] = sum;
  __syncthreads();
  if (warp == 0 && c < channels) {
    acc_t total = sums[0][lane];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) total += sums[w][lane];
    partial[blockIdx.x * channels + c] = total;
  }
}

// out[c] = the chunks' partial sums of channel c added in order, rounded to out's type.
template <typename scalar_t, typename acc_t>
__global__ void channel_chunk_sums_kernel(const acc_t* __restrict__ partial, int64_t chunks, int channels,
                                          scalar_t* __restrict__ out) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  acc_t sum = acc_t(0);
  for (int64_t k = 0; k < chunks; ++k) sum += partial[k * channels + c];
  out[c] = c10::convert<scalar_t>(sum);
}

// Whether t's memory is (rows, C) rows of its channels: t permuted to (N, *spatial, C) is contiguous.
bool channel_rows(const at::Tensor& t) {
  std::vector<int64_t> order{0};
  for (int64_t d = 2; d < t.dim(); ++d) order.push_back(d);
  order.push_back(1);
  return t.permute(order).is_contiguous();
}

at::Tensor channel_sums_cuda(const at::Tensor& t) {
  channel_sums_check(t);
  const c10::cuda::CUDAGuard guard(t.device());
  const int64_t channels = t.size(1);
  // (a grid's y under 2^16: channel tiles of 32)
  if (!channel_rows(t) || channels > int64_t{65535} * kLanes) {
    return channel_sums_by_reduction(t);
  }
  at::Tensor out = at::empty({channels}, t.options());
  const int64_t rows = channels == 0 ? 0 : t.numel() / channels;
  if (rows == 0 || channels == 0) return out.zero_();
  // chunks: about 4 blocks a multiprocessor over the channel tiles, at least 64 rows a chunk
  const int64_t tiles = (channels + kLanes - 1) / kLanes;
  const int64_t wanted = std::max<int64_t>(1, 4 * device_attribute(cudaDevAttrMultiProcessorCount, t.get_device()) / tiles);
  const int64_t chunks = std::clamp<int64_t>((rows + 63) / 64, 1, wanted);
  const int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  FUSED_OPS_DISPATCH_FLOATING_TYPES(t.scalar_type(), "channel_sums_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    at::Tensor partial = at::empty({chunks, channels}, t.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    channel_partial_sums_kernel<scalar_t, acc_t>
        <<<dim3(static_cast<unsigned>(chunks), static_cast<unsigned>(tiles)), kWarps * kLanes, 0, stream>>>(
            t.const_data_ptr<scalar_t>(), rows, static_cast<int>(channels), rows_per_chunk,
            partial.mutable_data_ptr<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    channel_chunk_sums_kernel<scalar_t, acc_t><<<static_cast<unsigned>(tiles), kLanes, 0, stream>>>(
        partial.const_data_ptr<acc_t>(), chunks, static_cast<int>(channels), out.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) { m.impl("channel_sums", &channel_sums_cuda); }

}  // namespace fused_ops
