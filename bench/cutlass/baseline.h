// What the CUTLASS baselines (C interfaces loaded by ctypes) share: errors as exceptions, one
// convolution's launch, the messages handed back to the caller.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <stdexcept>
#include <string>

#include "cutlass/cutlass.h"

namespace cutlass_baseline {

inline void check_status(cutlass::Status status, const char* step) {
  if (status != cutlass::Status::kSuccess) {
    throw std::runtime_error(std::string(step) + " failed: " + cutlassGetStatusString(status));
  }
}

inline void check_cuda(cudaError_t error, const char* step) {
  if (error != cudaSuccess) throw std::runtime_error(std::string(step) + ": " + cudaGetErrorString(error));
}

// A CUTLASS device-level convolution (ConvUniversalAdapter) on `stream`: can_implement,
// initialize without a workspace of its own (these baselines take none), run.
template <class Conv>
void run_convolution(const typename Conv::Arguments& args, cudaStream_t stream) {
  Conv conv;
  check_status(conv.can_implement(args), "can_implement");
  if (Conv::get_workspace_size(args) != 0) throw std::runtime_error("the kernel wants a workspace of its own");
  check_status(conv.initialize(args, nullptr, stream), "initialize");
  check_status(conv.run(stream), "run");
  check_cuda(cudaGetLastError(), "launch");
}

// text into the caller's buffer of `size` bytes (cut to fit, NUL-terminated).
inline void write_message(char* buffer, int size, const std::string& text) {
  if (buffer != nullptr && size > 0) std::snprintf(buffer, size, "%s", text.c_str());
}

// entries[i].description into the caller's buffer; 0, or -1 for no variant i.
template <class Entries>
int describe(const Entries& entries, int i, char* buffer, int size) {
  if (i < 0 || i >= static_cast<int>(entries.size())) return -1;
  write_message(buffer, size, entries[i].description);
  return 0;
}

}  // namespace cutlass_baseline
