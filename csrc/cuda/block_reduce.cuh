// Warp and block sums shared by the CUDA kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fused_ops {

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum of v over the block (any shape, at most 1024 threads); the result is
// valid in thread 0. `scratch` holds 32 values in shared memory. Ends with a
// barrier-free read, so a second call needs a __syncthreads() before it.
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* scratch) {
  const int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int warps = (blockDim.x * blockDim.y * blockDim.z + 31) / 32;
  v = warp_sum(v);
  if ((tid & 31) == 0) scratch[tid >> 5] = v;
  __syncthreads();
  if (tid < 32) {
    v = tid < warps ? scratch[tid] : T(0);
    v = warp_sum(v);
  }
  return v;
}

// out[r] = sum of partial[r, 0:parts], one block per row r (blockIdx.x), in an
// order fixed by `parts` and the block size alone: deterministic results.
// out_t: the op's result dtype (the accumulation type, or the input's).
template <typename acc_t, typename out_t>
__global__ void sum_rows_kernel(const acc_t* __restrict__ partial, int64_t parts,
                                out_t* __restrict__ out) {
  __shared__ acc_t scratch[32];
  const acc_t* row = partial + blockIdx.x * parts;
  acc_t sum = 0;
#pragma unroll 4
  for (int64_t i = threadIdx.x; i < parts; i += blockDim.x) sum += row[i];
  sum = block_sum(sum, scratch);
  if (threadIdx.x == 0) out[blockIdx.x] = static_cast<out_t>(sum);
}

// The sum over r < rows of column[r * stride] by a block of kColumnSlices warps,
// one column a lane: slice s = threadIdx.x / 32 adds rows s, s + kColumnSlices,
// ..., then slice 0 adds the slices' sums: an order fixed by the shape alone
// (deterministic results), coalesced reads where adjacent lanes read adjacent
// columns. The sum is valid in slice 0; `active` false (a column past the end)
// reads nothing and adds zero. Its shared memory is one array per T: a second
// call in a kernel needs a __syncthreads() before it.
constexpr int kColumnSlices = 8;

template <typename T>
__device__ __forceinline__ T sum_column(const T* __restrict__ column, int64_t rows, int64_t stride, bool active) {
  __shared__ T sums[kColumnSlices][32];
  const int lane = threadIdx.x % 32, slice = threadIdx.x / 32;
  T sum = 0;
  if (active) {
#pragma unroll 4
    for (int64_t r = slice; r < rows; r += kColumnSlices) sum += column[r * stride];
  }
  sums[slice][lane] = sum;
  __syncthreads();
  if (slice == 0) {
    for (int s = 1; s < kColumnSlices; ++s) sum += sums[s][lane];
  }
  return sum;
}

}  // namespace fused_ops
