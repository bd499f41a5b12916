// Hopper's bulk copy engine (sm_90): global memory into shared memory in one
// request that completes on a shared-memory barrier (mbarrier), either a
// contiguous range (bulk_load_async) or a box of a tensor described by a
// tensor map (tensor_load_4d, tiled_tensor_map). Kernels that use it are
// launched only on devices of compute capability 9.0 or later
// (runs_bulk_copy); on older targets these helpers compile to a trap.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "launch_queries.cuh"

namespace fused_ops {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FUSED_OPS_BULK_COPY 1
#endif

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A barrier whose phase completes when `arrivals` threads have arrived and
// the bytes they announced (barrier_arrive_expect) have landed.
__device__ __forceinline__ void barrier_init(uint64_t* bar, uint32_t arrivals = 1) {
#ifdef FUSED_OPS_BULK_COPY
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(arrivals));
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

// One arrival on the barrier, announcing `bytes` that copies will land on it
// (release: the arriving thread's stores before it are visible to whoever waits).
__device__ __forceinline__ void barrier_arrive_expect(uint64_t* bar, uint32_t bytes) {
#ifdef FUSED_OPS_BULK_COPY
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
#else
  __trap();
#endif
}

// One arrival on the barrier (release: the arriving thread's memory accesses
// before it, reads included, happen before whatever waits on the barrier).
__device__ __forceinline__ void barrier_arrive(uint64_t* bar) {
#ifdef FUSED_OPS_BULK_COPY
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(bar)) : "memory");
#else
  __trap();
#endif
}

// Orders this thread's writes to shared memory (the generic proxy) before the
// async proxy's accesses after them: the copy engine's writes, wgmma's reads.
__device__ __forceinline__ void fence_shared_to_async_proxy() {
#ifdef FUSED_OPS_BULK_COPY
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#else
  __trap();
#endif
}

// `bytes` (a multiple of 16) from global memory at `src` into shared memory at
// `dst` (both 16-byte aligned) in one copy, completing on `bar`; called by one
// thread, which announced the bytes (barrier_arrive_expect).
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#ifdef FUSED_OPS_BULK_COPY
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   shared_address(dst)),
               "l"(src), "r"(bytes), "r"(shared_address(bar))
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
    barrier_arrive_expect(bar, bytes);  // (after the lanes' stores above: the warp synced)
    if (bytes > 0) bulk_load(out + head, src + head, bytes, bar);
  }
#else
  __trap();
#endif
}

// The box of `map` whose first element is at coordinates (c0, c1, c2, c3)
// (innermost first; negative or past the end where the box overhangs the
// tensor, whose missing elements arrive as zeros) into shared memory at `dst`
// (128-byte aligned), densely, innermost dimension fastest; completes on
// `bar`, whose expected bytes the caller announced (barrier_arrive_expect).
// `map` is a __grid_constant__ kernel parameter.
__device__ __forceinline__ void tensor_load_4d(void* dst, const CUtensorMap& map, int c0, int c1, int c2, int c3,
                                               uint64_t* bar) {
#ifdef FUSED_OPS_BULK_COPY
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
      "%5}], [%6];" ::"r"(shared_address(dst)),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(shared_address(bar))
      : "memory");
#else
  __trap();
#endif
}

// tensor_load_4d's five-dimensional form: the box at (c0, c1, c2, c3, c4).
__device__ __forceinline__ void tensor_load_5d(void* dst, const CUtensorMap& map, int c0, int c1, int c2, int c3,
                                               int c4, uint64_t* bar) {
#ifdef FUSED_OPS_BULK_COPY
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
      "%5, %6}], [%7];" ::"r"(shared_address(dst)),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(shared_address(bar))
      : "memory");
#else
  __trap();
#endif
}

// Thread 0 initializes `stages` pairs of a ring's barriers: full[s] completes on one arrival (the thread that
// announces the stage's bytes) and those bytes, empty[s] on `releasers` arrivals; then the block synchronizes
// (no block barrier is needed after it).
__device__ __forceinline__ void init_stage_barriers(uint64_t* full, uint64_t* empty, int stages, uint32_t releasers) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      barrier_init(&full[s]);
      barrier_init(&empty[s], releasers);
    }
  }
  __syncthreads();
}

// A ring of `stages` shared-memory stages that thread 0 fills by the copy
// engine, item after item (item i in stage i mod stages), each stage with a
// full barrier (its bytes landed) and an empty one (each of the block's
// threads is done with it). load(item, stage) issues an item's copies,
// announcing their bytes on full[stage].
struct StageRing {
  uint64_t* full;
  uint64_t* empty;
  int stages;
  int64_t items;
  int stage = 0, previous = 0;             // the current item's stage, the previous item's
  uint32_t phase = 0, previous_phase = 0;  // of their barriers in this round over the ring

  // Initializes the barriers, synchronizes the block (no block barrier is needed
  // after this) and issues the first stages' items.
  template <typename Load>
  __device__ void start(int threads, Load&& load) {
    init_stage_barriers(full, empty, stages, threads);
    if (threadIdx.x == 0) {
      for (int s = 0; s < stages && s < items; ++s) load(int64_t{s}, s);
    }
  }

  // Waits until item `item` (the current one) has landed; first thread 0
  // refills the previous item's stage, once every thread released it, with the
  // item `stages` after that one.
  template <typename Load>
  __device__ void acquire(int64_t item, Load&& load) {
    if (threadIdx.x == 0 && item > 0 && item - 1 + stages < items) {
      barrier_wait(&empty[previous], previous_phase);
      load(item - 1 + stages, previous);
    }
    barrier_wait(&full[stage], phase);
  }

  // The calling thread is done with the current item's stage (every thread
  // calls it: an arrival releases the arriving thread's own reads); then the next item.
  __device__ void release() {
    barrier_arrive(&empty[stage]);
    advance();
  }

  // Once every thread has arrived on the current item's empty barrier (each
  // did, then a block barrier), thread 0 refills its stage with the item
  // `stages` after it; then the next item. (For kernels that copy a stage out
  // and release it early, before computing on the copy.)
  template <typename Load>
  __device__ void refill(int64_t item, Load&& load) {
    if (threadIdx.x == 0 && item + stages < items) {
      barrier_wait(&empty[stage], phase);
      load(item + stages, stage);
    }
    advance();
  }

  // The next item (a ring filled otherwise, without the barriers).
  __device__ void advance() {
    previous = stage;
    previous_phase = phase;
    if (++stage == stages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// A tensor map of `rank` dimensions over `base` (16-byte aligned): sizes
// `dims` and byte strides `strides` (of dimensions 1..rank-1, multiples of 16)
// innermost first, boxes of `box` elements (box[0] times the element size a
// multiple of 16 bytes, each at most 256), zeros outside the tensor; unswizzled, or
// `swizzle`d (then box[0] times the element size at most the swizzle's span, and
// the box's destination aligned to its atom: 1024 bytes for 128-byte swizzling).
inline CUtensorMap tiled_tensor_map(CUtensorMapDataType type, const void* base, int rank, const cuuint64_t* dims,
                                    const cuuint64_t* strides, const cuuint32_t* box,
                                    CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_NONE) {
  static const auto encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    TORCH_CHECK(found == cudaDriverEntryPointSuccess && fn != nullptr,
                "fused_ops: the CUDA driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  const cuuint32_t unit[5] = {1, 1, 1, 1, 1};
  CUtensorMap map;
  const CUresult result = encode(&map, type, static_cast<cuuint32_t>(rank), const_cast<void*>(base), dims, strides,
                                 box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(result == CUDA_SUCCESS, "fused_ops: cuTensorMapEncodeTiled failed (CUresult ", static_cast<int>(result),
              ")");
  return map;
}

// tiled_tensor_map's map over a contiguous float32 or bfloat16 tensor x (up to 5 dimensions, at a
// 16-byte aligned address, rows of whole 16-byte chunks), its dimensions innermost first, boxes of
// `box` (one size per dimension, innermost first), `swizzle`d as tiled_tensor_map's.
inline CUtensorMap contiguous_tensor_map(const at::Tensor& x, c10::ArrayRef<cuuint32_t> box,
                                         CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_NONE) {
  const int rank = static_cast<int>(x.dim());
  TORCH_INTERNAL_ASSERT(rank <= 5 && static_cast<int>(box.size()) == rank && x.is_contiguous());
  TORCH_INTERNAL_ASSERT(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16);
  cuuint64_t dims[5], strides[4];
  cuuint64_t stride = x.element_size();  // (from the sizes: a size-1 dimension's own stride may be any)
  for (int d = 0; d < rank; ++d) {
    dims[d] = static_cast<cuuint64_t>(x.size(rank - 1 - d));
    if (d + 1 < rank) strides[d] = stride *= dims[d];
  }
  return tiled_tensor_map(x.scalar_type() == at::kFloat ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                          x.const_data_ptr(), rank, dims, strides, box.data(), swizzle);
}

// Whether `kernel` runs on the current device as code built for sm_90 or
// later, where the helpers above do not trap (its PTX too: PTX for an older
// target, compiled for this device at load time, traps). Asked of the driver
// once per kernel and device, then remembered (it is on every launch's path).
template <typename Kernel>
bool runs_bulk_copy(Kernel kernel) {
  return ask_once(std::make_pair(reinterpret_cast<const void*>(kernel), current_device()), [&] {
    cudaFuncAttributes attributes;
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
    return attributes.binaryVersion >= 90 && attributes.ptxVersion >= 90;
  });
}

}  // namespace fused_ops
