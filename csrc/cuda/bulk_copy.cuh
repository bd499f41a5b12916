// Hopper's bulk copy engine (sm_90): global memory into shared memory in one
// request that completes on a shared-memory barrier (mbarrier). Kernels that
// use it are launched only on devices of compute capability 9.0 or later
// (runs_bulk_copy); on older targets these helpers compile to a trap.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace fused_ops {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FUSED_OPS_BULK_COPY 1
#endif

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A barrier one thread arrives at, completing when the bytes it announced have landed.
__device__ __forceinline__ void barrier_init(uint64_t* bar) {
#ifdef FUSED_OPS_BULK_COPY
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(bar)));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#else
  __trap();
#endif
}

// Waits until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void barrier_wait(uint64_t* bar, uint32_t parity) {
#ifdef FUSED_OPS_BULK_COPY
  asm volatile(
      "{\n .reg .pred done;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT_%=;\n}" ::"r"(shared_address(bar)),
      "r"(parity)
      : "memory");
#else
  __trap();
#endif
}

// Elements of `src` before its first 16-byte boundary.
template <typename T>
__device__ __forceinline__ int bulk_load_head(const T* src) {
  return static_cast<int>((16 - reinterpret_cast<uintptr_t>(src) % 16) % 16 / sizeof(T));
}

// Where bulk_load_async(dst, src, ...) puts src[0]: dst plus less than 16
// bytes, so that the 16-byte boundaries of src and of shared memory match.
template <typename T>
__device__ __forceinline__ T* bulk_load_destination(T* dst, const T* src) {
  return dst + (16 / sizeof(T) - bulk_load_head(src)) % (16 / sizeof(T));
}

// Elements [0, n) of `src` into shared memory at bulk_load_destination(dst,
// src), completing on `bar` (its phases alternate parity, one per call).
// Called by one whole warp: the 16-byte-aligned middle of the range is one
// bulk copy, its ends (under 16 bytes each) are loaded by lanes of the warp.
// `dst` is 16-byte aligned and holds n elements and 16 bytes more.
template <typename T>
__device__ __forceinline__ void bulk_load_async(T* dst, const T* src, int n, uint64_t* bar) {
  static_assert(16 % sizeof(T) == 0);
  constexpr int kPerChunk = 16 / sizeof(T);
  const int lane = threadIdx.x % 32;
  const int head = bulk_load_head(src);
  const int middle = n > head ? (n - head) / kPerChunk * kPerChunk : 0;
  T* const out = bulk_load_destination(dst, src);
  for (int i = lane; i < n - middle; i += 32) {
    const int e = i < head ? i : middle + i;
    out[e] = src[e];
  }
  __syncwarp();
#ifdef FUSED_OPS_BULK_COPY
  if (lane == 0) {
    const uint32_t bytes = static_cast<uint32_t>(middle * sizeof(T));
    // Release: the lanes' stores above are visible to whoever waits on bar.
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes)
                 : "memory");
    if (bytes > 0) {
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
              shared_address(out + head)),
          "l"(src + head), "r"(bytes), "r"(shared_address(bar))
          : "memory");
    }
  }
#else
  __trap();
#endif
}

// Whether `kernel` runs on the current device as code built for sm_90 or
// later, where the helpers above do not trap.
template <typename Kernel>
bool runs_bulk_copy(Kernel kernel) {
  cudaFuncAttributes attributes;
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  return attributes.binaryVersion >= 90;
}

}  // namespace fused_ops
