// What the CUDA kernels of conv2d_sigmoid_sum (conv2d_sigmoid_sum.cu) and of
// its backward (conv2d_sigmoid_sum_backward.cu) share.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "bulk_copy.cuh"
#include "plane_rows.cuh"

namespace fused_ops {

// Dynamic shared memory of both kernels: the stages' barriers (full, empty),
// padded to 128 bytes, then the stages.
constexpr int kMaxStages = 4;
constexpr int kBarrierWords = 32;

// Stages of `stage_words` each that fit beside the barriers on x's device, up
// to kMaxStages (fewer than two: the kernel does not fit), and the bytes they take.
struct StagesFitting {
  int stages;
  size_t smem;
};

inline StagesFitting stages_fitting(int64_t stage_words, const at::Tensor& x) {
  const int64_t limit = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, x.get_device());
  const int64_t stage_bytes = stage_words * static_cast<int64_t>(sizeof(float));
  const int stages = static_cast<int>(
      std::min<int64_t>(kMaxStages, (limit - kBarrierWords * static_cast<int64_t>(sizeof(float))) / stage_bytes));
  return {stages, kBarrierWords * sizeof(float) + std::max(stages, 0) * stage_bytes};
}

// Whether the copy engine can stage boxes of a contiguous float32 x (N, C, H,
// W): rows of whole 16-byte chunks (W % 4 == 0) at a 16-byte aligned address,
// int32 coordinates, strides under 2^40 bytes.
inline bool copy_engine_takes(const at::Tensor& x) {
  return x.size(3) % 4 == 0 && reinterpret_cast<uintptr_t>(x.const_data_ptr()) % 16 == 0 && x.size(0) <= INT_MAX &&
         x.numel() / x.size(0) < (int64_t{1} << 38);
}

// The copy engine's map over such an x, innermost first (W, H, C, N), boxes of
// `columns` x `rows` x `channels` of one image.
inline CUtensorMap nchw_tensor_map(const at::Tensor& x, int columns, int rows, int channels) {
  return contiguous_tensor_map(
      x, {static_cast<cuuint32_t>(columns), static_cast<cuuint32_t>(rows), static_cast<cuuint32_t>(channels), 1});
}

// The kernel shapes compiled: (KH, KW, SH, SW) of architecture C's folded
// convolutions (a 3 x 3 kernel after pools of 4 and 2), each for up to 64 output
// channels. Others take PyTorch's ops.
template <int KH, int KW, int SH, int SW>
struct Shape {
  static constexpr int kh = KH, kw = KW, sh = SH, sw = SW;
};

template <typename F>
bool with_compiled_shape(int64_t kh, int64_t kw, int64_t sh, int64_t sw, F&& f) {
  if (kh == 6 && kw == 6 && sh == 4 && sw == 4) return f(Shape<6, 6, 4, 4>{}), true;
  if (kh == 4 && kw == 4 && sh == 2 && sw == 2) return f(Shape<4, 4, 2, 2>{}), true;
  return false;
}

}  // namespace fused_ops
