// What the CUDA kernels of conv3d_max_pool3d_mean (conv3d_max_pool3d_mean.cu)
// and of its weight gradient (conv3d_max_pool3d_mean_backward.cu) share: the
// tasks (one plane of 2 x 2 x 2 windows, two rows of windows, 32 windows
// across, of one image: 2 x 4 x 64 outputs of the 3 x 3 x 3 convolution), each
// warp's part of a task (one row of windows, 8 windows across), and the input
// box the copy engine stages for a task and a block of 8 input channels.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/detail/IntegerDivider.cuh>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "../conv3d_max_pool3d_mean.h"
#include "bulk_copy.cuh"
#include "plane_rows.cuh"

namespace fused_ops::conv3d_pool {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kTaps = 27;           // the 3 x 3 x 3 kernel
constexpr int kChannels = 16;       // output channels (an m16 tile), at most
constexpr int kBlockChannels = 8;   // input channels per block
constexpr int kMaxChannelBlocks = 2;  // (the kernels' items: a channel block by a shift or a comparison)
constexpr int kTileColumns = 64;    // output columns per task (32 windows)
constexpr int kBoxCols = 72;        // the task's 66 input columns, up to 3 in front (16-byte box starts), rounded up
constexpr int kBoxRows = 6;         // 4 output rows + 2
constexpr int kBoxPlanes = 4;       // 2 output planes + 2
constexpr int kPlaneWords = kBoxRows * kBoxCols;
constexpr int kChannelWords = kBoxPlanes * kPlaneWords;  // one channel of a box
constexpr int kBoxWords = kBlockChannels * kChannelWords;
constexpr int kMaxStages = 2;
constexpr int kBarrierWords = 32;
static_assert(kBoxCols >= 3 + kTileColumns + 2, "a box covers its task's columns");

// Word offset of tap (kd, kh, kw) in a channel's box.
__host__ __device__ constexpr int tap_offset(int tap) {
  return tap / 9 * kPlaneWords + tap / 3 % 3 * kBoxCols + tap % 3;
}

// The tasks of a call: windows per dimension, the padding, and how the box of
// a task starts (`lead` columns in front of its first input column, so that
// the box starts at a 16-byte column: (-pad_w) mod 4).
struct TaskGrid {
  int PD, PH, PW, pad_d, pad_h, pad_w, lead;
  int row_groups, col_tiles, channel_blocks;
  int tasks;  // (at most INT_MAX: kernel_takes)
  // task_coords' divisors (row_groups x col_tiles, PD, col_tiles) as multiplications
  at::cuda::detail::IntDivider<unsigned> plane_tasks, planes, tiles;
};

struct TaskCoords {
  int n, pd, row_group, col_tile;
};

__device__ __forceinline__ TaskCoords task_coords(int task, const TaskGrid& grid) {
  const auto plane = grid.plane_tasks.divmod(static_cast<unsigned>(task));
  const auto n = grid.planes.divmod(plane.div), row = grid.tiles.divmod(plane.mod);
  return {static_cast<int>(n.div), static_cast<int>(n.mod), static_cast<int>(row.div), static_cast<int>(row.mod)};
}

// Stages the input box of `task` and channel block `block` at `stage` by the
// copy engine (x's map: ncdhw_tensor_map; zeros outside the image and past C).
// Called by one thread: it announces the bytes on `bar` and issues the copy.
__device__ __forceinline__ void load_box(float* stage, uint64_t* bar, const CUtensorMap& map, const TaskGrid& grid,
                                         int task, int block) {
  const TaskCoords tc = task_coords(task, grid);
  barrier_arrive_expect(bar, kBoxWords * sizeof(float));
  tensor_load_5d(stage, map, tc.col_tile * kTileColumns - grid.pad_w - grid.lead, tc.row_group * 4 - grid.pad_h,
                 tc.pd * 2 - grid.pad_d, block * kBlockChannels, tc.n, bar);
}

// A task's row groups of a plane (2 rows of windows each) and column tiles of a row (kTileColumns / 2 windows),
// from the pooled output's PH and PW.
constexpr int64_t row_groups_of(int64_t PH) { return (PH + 1) / 2; }
constexpr int64_t col_tiles_of(int64_t PW) { return (PW + kTileColumns / 2 - 1) / (kTileColumns / 2); }

// The tasks of a call: N x PD x row groups x column tiles (64-bit: kernel_takes bounds it).
inline int64_t task_count(const at::Tensor& x, const Conv3dPoolGeometry& g) {
  return x.size(0) * g.pooled[0] * row_groups_of(g.pooled[1]) * col_tiles_of(g.pooled[2]);
}

// The task grid of a call whose geometry the kernels take (kernel_takes).
inline TaskGrid task_grid(const at::Tensor& x, const at::Tensor& weight, const Conv3dPoolGeometry& g) {
  TaskGrid grid{};
  grid.PD = static_cast<int>(g.pooled[0]);
  grid.PH = static_cast<int>(g.pooled[1]);
  grid.PW = static_cast<int>(g.pooled[2]);
  grid.pad_d = static_cast<int>(g.padding[0]);
  grid.pad_h = static_cast<int>(g.padding[1]);
  grid.pad_w = static_cast<int>(g.padding[2]);
  grid.lead = (4 - grid.pad_w % 4) % 4;
  grid.row_groups = static_cast<int>(row_groups_of(grid.PH));
  grid.col_tiles = static_cast<int>(col_tiles_of(grid.PW));
  grid.channel_blocks = static_cast<int>((weight.size(1) + kBlockChannels - 1) / kBlockChannels);
  grid.tasks = static_cast<int>(task_count(x, g));
  // (at least 1: an empty output has no tasks to divide)
  const auto divider = [](int d) {
    return at::cuda::detail::IntDivider<unsigned>(static_cast<unsigned>(std::max(d, 1)));
  };
  grid.plane_tasks = divider(grid.row_groups * grid.col_tiles);
  grid.planes = divider(grid.PD);
  grid.tiles = divider(grid.col_tiles);
  return grid;
}

// Whether the kernels take a call: a GPU of compute capability 9.0 (the copy
// engine); a contiguous float32 x (the convolution in TF32, or x rounded to a
// 16-bit weight) whose rows are whole 16-byte chunks at a 16-byte aligned
// address; a 3 x 3 x 3 kernel, a 2 x 2 x 2 pool, at most 16 input and output
// channels; sizes the kernels' int fields and the copy engine's coordinates hold.
inline bool kernel_takes(const at::Tensor& x, const at::Tensor& weight, const Conv3dPoolGeometry& g) {
  if (x.scalar_type() != at::kFloat || !x.is_contiguous() || weight.size(0) > kChannels ||
      weight.size(1) > kBlockChannels * kMaxChannelBlocks) {
    return false;
  }
  if (weight.size(2) != 3 || weight.size(3) != 3 || weight.size(4) != 3) return false;
  if (g.pool != std::array<int64_t, 3>{2, 2, 2}) return false;
  if (x.size(4) % 4 != 0 || reinterpret_cast<uintptr_t>(x.const_data_ptr()) % 16 != 0) return false;
  for (int d = 0; d < 3; ++d) {
    if (x.size(2 + d) + 2 * g.padding[d] + kBoxCols > INT_MAX) return false;
  }
  if (x.size(0) > INT_MAX || x.numel() / x.size(0) >= (int64_t{1} << 38)) return false;
  // (32-bit task indices: the forward's partial sums index task x kWarps x kChannels, the items task x
  // kMaxChannelBlocks)
  if (task_count(x, g) > INT_MAX / (kWarps * kChannels)) return false;
  return device_attribute(cudaDevAttrComputeCapabilityMajor, x.get_device()) >= 9;
}

// The copy engine's map over a contiguous float32 x (N, C, D, H, W), innermost
// first (W, H, D, C, N), boxes of (kBoxCols, kBoxRows, kBoxPlanes, kBlockChannels, 1).
inline CUtensorMap ncdhw_tensor_map(const at::Tensor& x) {
  return contiguous_tensor_map(x, {kBoxCols, kBoxRows, kBoxPlanes, kBlockChannels, 1});
}

// Stages of `box_words` (a box) that fit beside `fixed_words` of other shared memory on
// x's device, up to `max_stages` (0: the kernel does not fit), and the bytes in all.
struct SharedLayout {
  int stages;
  size_t smem;
};

inline SharedLayout shared_layout(int64_t fixed_words, const at::Tensor& x, int64_t box_words = kBoxWords,
                                  int max_stages = kMaxStages) {
  const int64_t limit = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, x.get_device());
  const int64_t fixed = (kBarrierWords + fixed_words) * static_cast<int64_t>(sizeof(float));
  const int64_t box = box_words * static_cast<int64_t>(sizeof(float));
  const int stages = static_cast<int>(std::clamp<int64_t>((limit - fixed) / box, 0, max_stages));
  return {stages, static_cast<size_t>(fixed + stages * box)};
}

// The weight's storage type W, for a kernel that reads or writes it (its bias and gradients are stored
// alike): float for a float32 weight, else the operation's type T (operand_type takes a 16-bit weight of
// the operation's own type only). f(static_cast<W*>(nullptr)) is called with it.
template <typename T, typename F>
void with_weight_storage(const at::Tensor& weight, F&& f) {
  if (weight.scalar_type() == at::kFloat) {
    f(static_cast<float*>(nullptr));
  } else {
    f(static_cast<T*>(nullptr));
  }
}

}  // namespace fused_ops::conv3d_pool
