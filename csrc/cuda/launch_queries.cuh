// What a launch asks of the CUDA driver (device attributes, a kernel's
// occupancy, binary version and shared-memory allowance): answers that do not
// change while the process runs, each a few microseconds of host time on a
// launch's path, so asked once per key and then remembered.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

namespace fused_ops {

// ask() for `key` the first time, its answer after that. One table per call
// site (each lambda its own type), shared by the threads; a throwing ask()
// leaves nothing remembered.
template <typename Key, typename Ask>
auto ask_once(const Key& key, Ask ask) -> decltype(ask()) {
  static std::mutex mutex;
  static std::map<Key, decltype(ask())> known;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = known.find(key);
  if (found != known.end()) return found->second;
  return known[key] = ask();
}

inline int current_device() {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

// A device attribute (compute capability, the shared memory a block may opt into, ...).
inline int device_attribute(cudaDeviceAttr attribute, int device) {
  return ask_once(std::make_pair(static_cast<int>(attribute), device), [&] {
    int value = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attribute, device));
    return value;
  });
}

// Resident blocks of `kernel` over the whole current device: the grid of a grid-stride loop.
template <typename Kernel>
int64_t resident_blocks(Kernel kernel, int block_threads, size_t smem) {
  const int device = current_device();
  return ask_once(std::make_tuple(reinterpret_cast<const void*>(kernel), block_threads, smem, device), [&] {
    int per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, block_threads, smem));
    return int64_t{device_attribute(cudaDevAttrMultiProcessorCount, device)} * std::max(per_sm, 1);
  });
}

// Lets `kernel` launch with `smem` bytes of dynamic shared memory on the current device: the first
// call allows it all the device lets a block opt into (cudaFuncSetAttribute, a setting per device, not
// per launch: so no thread ever lowers it under another's launch).
template <typename Kernel>
void allow_dynamic_shared_memory(Kernel kernel, size_t smem) {
  const int device = current_device();
  const size_t allowed = ask_once(std::make_pair(reinterpret_cast<const void*>(kernel), device), [&] {
    cudaFuncAttributes attributes;
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
    const size_t most = static_cast<size_t>(device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device)) -
                        attributes.sharedSizeBytes;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(most)));
    return most;
  });
  TORCH_CHECK(smem <= allowed, "fused_ops: a kernel asks for ", smem, " bytes of shared memory, the device allows ",
              allowed);
}

// The grid of a grid-stride loop over `items`, `items_per_block` per block and
// round: as many blocks as can be resident, no more than the items need.
template <typename Kernel>
unsigned grid_stride_blocks(Kernel kernel, int block_threads, size_t smem, int64_t items,
                            int64_t items_per_block) {
  const int64_t needed = (items + items_per_block - 1) / items_per_block;
  return static_cast<unsigned>(std::clamp<int64_t>(needed, 1, resident_blocks(kernel, block_threads, smem)));
}

}  // namespace fused_ops
