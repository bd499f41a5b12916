// CUDA kernel of conv2d_sigmoid_sum (the math: ../conv2d_sigmoid_sum.h): the
// convolution as an implicit GEMM on tensor cores (TF32 mma.sync, m16n8k8),
// the bias, sigmoid and sum its epilogue; y never reaches memory.
//
// GEMM: rows = output pixels of a row, columns = output channels (up to 8 n8
// tiles, 64 channels), k = (input channel, kh, kw). A task is two output rows of
// one image, 96 output columns wide; its eight warps each own 48 pixels (three
// m16 tiles) of one row by half the channels (two warps per scheduler: one
// alone there stalls on every dependent load). The k loop runs over blocks of two
// input channels, staged in shared memory, several blocks in flight: for each
// half of the task's columns, a box of those channels' input rows under it
// (NCHW read in place, zeros outside the image). The boxes come by the bulk
// tensor copy engine where the device has it and x's rows are 16-byte aligned
// (a ninth warp issues them; barriers per stage let the computing warps run
// apart), else by 16-byte cp.async spread over the computing warps (a block
// barrier per k block). A lane's A fragment is read straight from the boxes (each
// lane keeps the offset of its k columns); the B fragments (the weight, rounded
// to TF32) sit in shared memory in fragment order for the whole kernel, one
// 16-byte load per two n8 tiles.
//
// Bank conflicts: a fragment load's lanes are 8 pixels (stride SW words) by 4 k
// columns. For SW = 4 and a 6-wide kernel, 4 consecutive taps fall in 4 banks
// unless a row break sits among them (a third of the loads: 2-way); boxes of
// whole 16-byte rows (as the copy engine writes them) leave it so.
//
// Each task's per-warp sums go to `partial` (N, tasks per image x kWarps); each
// image's are added in a fixed order after (deterministic results).
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "../conv2d_sigmoid_sum.h"
#include "bulk_copy.cuh"
#include "plane_rows.cuh"

namespace fused_ops {
namespace {

constexpr int kWarps = 8;            // computing warps
constexpr int kThreads = 32 * kWarps;
constexpr int kChannelGroups = 2;   // warps splitting the channels
constexpr int kTileRows = 2;        // output rows per task, one per warp pair
constexpr int kWarpPixels = 48;     // three m16 tiles
constexpr int kTilePixels = 2 * kWarpPixels;
constexpr int kMTiles = kWarpPixels / 16;
constexpr int kStageChannels = 2;   // input channels per k block
constexpr int kMaxStages = 4;
constexpr int kBarrierWords = 32;   // the stages' barriers (full, empty), padded to 128 bytes

// The geometry of one kernel shape (KH x KW kernel, stride SH x SW, NT n8 tiles).
template <int KH, int KW, int SH, int SW, int NT>
struct Tile {
  static constexpr int kSH = SH, kSW = SW;
  static constexpr int kTaps = KH * KW;
  static constexpr int kStageK = kStageChannels * kTaps;  // k of a block
  static constexpr int kKSteps = kStageK / 8;
  static constexpr int kRows = (kTileRows - 1) * SH + KH;
  static constexpr int kHalfColumn = kWarpPixels * SW;  // the second half's first input column, from the first's
  // a half's input columns from a multiple of 4 (the copy engine's boxes start at 16-byte
  // columns: up to 3 more in front), in whole 16-byte chunks
  static constexpr int kBoxCols = ((kWarpPixels - 1) * SW + KW + 3 + 3) / 4 * 4;
  static constexpr int kChannelStride = kRows * kBoxCols;
  static constexpr int kBoxWords = kStageChannels * kChannelStride;
  static constexpr int kBoxStride = (kBoxWords + 31) / 32 * 32;  // boxes 128-byte aligned
  static constexpr int kStageWords = 2 * kBoxStride;
  static constexpr int kStageChunks = 2 * kBoxWords / 4;
  static constexpr int kPairs = NT / 2;  // n8 tile pairs: one 16-byte weight load each
  static constexpr int kWarpTiles = NT / kChannelGroups;  // a warp's n8 tiles
  static constexpr int kWeightWords = kKSteps * kPairs * 32 * 4;  // per k block
  static_assert(kStageK % 8 == 0, "a k block of whole k steps");
  static_assert(NT % (2 * kChannelGroups) == 0 && NT <= 8, "NT: 4 or 8 n8 tiles");
  static_assert(kBoxCols <= 256 && kRows <= 256, "boxes the copy engine takes");
  static_assert(kTilePixels * SW % 4 == 0 && kHalfColumn % 4 == 0, "boxes at 16-byte columns");
};

struct Params {
  const float* x;
  const float* weight;  // (O, C, KH, KW)
  const float* bias;    // (O,) or null
  float* partial;       // (N, tasks_per_image * kWarps)
  int C, H, W, O, OH, OW, pad_h, pad_w;
  int row_pairs, col_tiles, channel_blocks, stages;
  int lead;  // columns staged in front of a box's first input column: (-pad_w) mod 4
  int64_t tasks;
};

__device__ __forceinline__ uint32_t to_tf32(float v) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
  return r;
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// cp.async of `bytes` (4 or 16) from src, or zeros where valid is false.
template <int bytes>
__device__ __forceinline__ void cp_async_zfill(float* dst, const float* src, bool valid) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  if constexpr (bytes == 16) {  // (through L2 only: x is read once)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(d), "l"(src), "n"(bytes),
                 "r"(valid ? bytes : 0));
  }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(pending));
}

// 1 / (1 + e^-v) by the special-function unit's exponential and reciprocal (a
// few ulp, growing with |v| where the sigmoid saturates: far below TF32's
// 2^-11); NaN stays NaN, -inf gives 0, +inf 1.
__device__ __forceinline__ float fast_sigmoid(float v) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.f + __expf(-v)));
  return r;
}

struct TaskCoords {
  int64_t n;
  int row_pair, col_tile;
};

__device__ __forceinline__ TaskCoords task_coords(int64_t task, const Params& p) {
  const int64_t per_image = int64_t{p.row_pairs} * p.col_tiles;
  const int64_t n = task / per_image;
  const int rest = static_cast<int>(task - n * per_image);
  return {n, rest / p.col_tiles, rest % p.col_tiles};
}

// The input coordinates of a task's first box: column (a multiple of 4, p.lead
// before the task's first input column), row (negative in the padding above).
__device__ __forceinline__ int2 task_origin(const TaskCoords& tc, int sh, int sw, const Params& p) {
  return {tc.col_tile * kTilePixels * sw - p.pad_w - p.lead, tc.row_pair * kTileRows * sh - p.pad_h};
}

// Stages k block `block` of `task` (two boxes: for each half of the task's
// columns, its input channels' rows under it) at `stage` by the copy engine,
// called by one thread: it announces the bytes on `bar` and issues both copies
// (zeros outside the image: padding, the tile's overhang, channels past C).
template <typename T>
__device__ __forceinline__ void load_stage_tensor(float* stage, uint64_t* bar, const CUtensorMap& map, int64_t task,
                                                  int block, const Params& p) {
  const TaskCoords tc = task_coords(task, p);
  const int2 origin = task_origin(tc, T::kSH, T::kSW, p);
  barrier_arrive_expect(bar, 2 * T::kBoxWords * sizeof(float));
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    tensor_load_4d(stage + half * T::kBoxStride, map, origin.x + half * T::kHalfColumn, origin.y,
                   block * kStageChannels, static_cast<int>(tc.n), bar);
  }
}

// The same boxes by cp.async, in 16-byte chunks spread over the block's
// threads: each from x where its four words lie inside the image and are
// 16-byte aligned there, else word by word, zeros outside the image.
template <typename T>
__device__ __forceinline__ void load_stage_async(float* stage, int64_t task, int block, const Params& p) {
  const TaskCoords tc = task_coords(task, p);
  const int2 origin = task_origin(tc, T::kSH, T::kSW, p);
  constexpr int kRowChunks = T::kBoxCols / 4;
  for (int chunk = threadIdx.x; chunk < T::kStageChunks; chunk += kThreads) {
    const int row = chunk / kRowChunks, q = chunk % kRowChunks;  // row: (half, channel of the block, row)
    const int half = row / (kStageChannels * T::kRows), box_row = row % (kStageChannels * T::kRows);
    const int c = block * kStageChannels + box_row / T::kRows, ih = origin.y + box_row % T::kRows;
    const bool row_inside = c < p.C && ih >= 0 && ih < p.H;
    const int iw = origin.x + half * T::kHalfColumn + 4 * q;
    const float* src = p.x + ((tc.n * p.C + (row_inside ? c : 0)) * p.H + (row_inside ? ih : 0)) * p.W + iw;
    float* dst = stage + half * T::kBoxStride + box_row * T::kBoxCols + 4 * q;
    if (!row_inside || (iw >= 0 && iw + 3 < p.W && (reinterpret_cast<uintptr_t>(src) & 15) == 0)) {
      cp_async_zfill<16>(dst, row_inside ? src : p.x, row_inside);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool inside = iw + e >= 0 && iw + e < p.W;
        cp_async_zfill<4>(dst + e, inside ? src + e : p.x, inside);
      }
    }
  }
}

// The weight's B fragments for every k block, rounded to TF32, in the order the
// k loop reads them: [block][k step][n8 tile pair][lane] x {b0, b1 of tile 2j,
// b0, b1 of tile 2j + 1}, with b0 = w[k = 8 step + lane % 4][n = 8 tile + lane / 4],
// b1 the same at k + 4; zero past C and past O.
template <typename T>
__device__ void stage_weight_fragments(float* fragments, const Params& p) {
  const int total = p.channel_blocks * T::kWeightWords;
  for (int i = threadIdx.x; i < total; i += blockDim.x) {
    const int e = i % 4, lane = (i / 4) % 32;
    const int rest = i / (4 * 32);
    const int pair = rest % T::kPairs, step = (rest / T::kPairs) % T::kKSteps;
    const int block = rest / (T::kPairs * T::kKSteps);
    const int n = 8 * (2 * pair + e / 2) + lane / 4;
    const int k = 8 * step + lane % 4 + 4 * (e % 2);
    const int c = block * kStageChannels + k / T::kTaps, tap = k % T::kTaps;
    float v = 0.f;
    if (c < p.C && n < p.O) v = p.weight[((int64_t{n} * p.C + c) * T::kTaps) + tap];
    fragments[i] = __uint_as_float(to_tf32(v));
  }
}

// kTensorLoads: the boxes come by the copy engine (`map`: x as a 4-D tensor
// (W, H, C, N), boxes of (kBoxCols, kRows, kStageChannels, 1)), issued by one
// more warp (a stage is refilled once each computing warp has arrived on its
// `empty` barrier, and read once its `full` barrier has seen the bytes land);
// else the computing warps load by cp.async, a block barrier between items.
template <int KH, int KW, int SH, int SW, int NT, bool kTensorLoads>
__global__ void __launch_bounds__(kThreads + 32, 1)
    conv2d_sigmoid_sum_kernel(const Params p, const __grid_constant__ CUtensorMap map) {
  using T = Tile<KH, KW, SH, SW, NT>;
  // shared memory: the stages' barriers (copy engine), the weight fragments, the stages
  extern __shared__ __align__(128) float smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + kMaxStages;
  float* fragments = smem + kBarrierWords;
  float* stages = fragments + p.channel_blocks * T::kWeightWords;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;

  // this block's tasks: an equal contiguous share, k block by k block (items)
  const int64_t first = blockIdx.x * p.tasks / gridDim.x;
  const int64_t last = (blockIdx.x + 1) * p.tasks / gridDim.x;

  if constexpr (kTensorLoads) {
    if (threadIdx.x == 0) {
      for (int s = 0; s < p.stages; ++s) {
        barrier_init(&full[s]);
        barrier_init(&empty[s], kWarps);
      }
    }
  }
  stage_weight_fragments<T>(fragments, p);
  if constexpr (kTensorLoads) {
    __syncthreads();  // (the barriers and fragments are ready; no block barrier after this)
    if (warp == kWarps) {  // the loading warp: one lane issues every item's copies
      if (lane == 0) {
        int s = 0;
        uint32_t phase = 0;
        for (int64_t task = first; task < last; ++task) {
          for (int block = 0; block < p.channel_blocks; ++block) {
            barrier_wait(&empty[s], phase ^ 1);  // (the first round passes: its "previous" phase counts as done)
            load_stage_tensor<T>(stages + s * T::kStageWords, &full[s], map, task, block, p);
            if (++s == p.stages) {
              s = 0;
              phase ^= 1;
            }
          }
        }
      }
      return;
    }
  }

  // This lane's A fragment words relative to a stage: its k columns' offsets
  // (k = 8 step + t, and + 4), its pixels' (the half's box, row of the pair, 48
  // pixels of the warp, + 8 for a1 / a3).
  int k_offset[T::kKSteps][2];
#pragma unroll
  for (int step = 0; step < T::kKSteps; ++step) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int k = 8 * step + t + 4 * h;
      const int tap = k % T::kTaps;
      k_offset[step][h] = (k / T::kTaps) * T::kChannelStride + (tap / KW) * T::kBoxCols + tap % KW;
    }
  }
  const int row_in_pair = warp / 4, half = (warp / 2) % 2, channel_group = warp % 2;
  // (the m16 tiles' and a1 / a3 rows' offsets from it are constants: immediate offsets of the loads)
  const int pixel_offset = half * T::kBoxStride + row_in_pair * SH * T::kBoxCols + p.lead + g * SW;
  float bias[T::kWarpTiles][2];
#pragma unroll
  for (int j = 0; j < T::kWarpTiles; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int o = 8 * (channel_group * T::kWarpTiles + j) + 2 * t + e;
      bias[j][e] = (p.bias != nullptr && o < p.O) ? p.bias[o] : 0.f;
    }
  }

  // cp.async: the loader runs stages - 1 items ahead of the compute, with its own (task, block) cursor
  int64_t load_task = first;
  int load_block = 0, load_stage_index = 0;
  auto load_next = [&]() {
    if (load_task < last) {
      load_stage_async<T>(stages + load_stage_index * T::kStageWords, load_task, load_block, p);
      load_stage_index = load_stage_index + 1 == p.stages ? 0 : load_stage_index + 1;
      if (++load_block == p.channel_blocks) {
        load_block = 0;
        ++load_task;
      }
    }
    cp_async_commit();
  };
  if constexpr (!kTensorLoads) {
    for (int s = 0; s < p.stages - 1; ++s) load_next();
  }

  float acc[kMTiles][T::kWarpTiles][4];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int j = 0; j < T::kWarpTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][j][e] = 0.f;

  int stage_index = 0;
  uint32_t phase = 0;  // of the stages' barriers in this round over them
  for (int64_t task = first; task < last; ++task) {
    for (int block = 0; block < p.channel_blocks; ++block) {
      if constexpr (kTensorLoads) {
        barrier_wait(&full[stage_index], phase);
      } else {
        // (wait_group takes a constant: the deepest pipeline's count, less where stages are fewer)
        if (p.stages == kMaxStages) {
          cp_async_wait<kMaxStages - 2>();
        } else if (p.stages == 3) {
          cp_async_wait<1>();
        } else {
          cp_async_wait<0>();
        }
        __syncthreads();  // (every warp is done with the stage the loader refills now)
        load_next();
      }

      const float* stage = stages + stage_index * T::kStageWords;
      const float4* w = reinterpret_cast<const float4*>(fragments + block * T::kWeightWords);
#pragma unroll
      for (int step = 0; step < T::kKSteps; ++step) {
        uint32_t a[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            a[mt][e] = to_tf32(stage[pixel_offset + k_offset[step][e >> 1] + (16 * mt + 8 * (e & 1)) * SW]);
          }
        }
#pragma unroll
        for (int pair = 0; pair < T::kWarpTiles / 2; ++pair) {
          const float4 b = w[(step * T::kPairs + channel_group * T::kWarpTiles / 2 + pair) * 32 + lane];
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            mma_tf32(acc[mt][2 * pair], a[mt], __float_as_uint(b.x), __float_as_uint(b.y));
            mma_tf32(acc[mt][2 * pair + 1], a[mt], __float_as_uint(b.z), __float_as_uint(b.w));
          }
        }
      }
      if constexpr (kTensorLoads) {
        __syncwarp();  // (every lane's reads of the stage are done)
        if (lane == 0) barrier_arrive(&empty[stage_index]);
      }
      if (++stage_index == p.stages) {
        stage_index = 0;
        phase ^= 1;
      }
    }

    // the task's epilogue: the bias, the sigmoid and this warp's sum over its pixels and channels
    const TaskCoords tc = task_coords(task, p);
    const int oh = tc.row_pair * kTileRows + row_in_pair;
    float sum = 0.f;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int j = 0; j < T::kWarpTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int ow = tc.col_tile * kTilePixels + kWarpPixels * half + 16 * mt + g + 8 * (e >> 1);
          const int o = 8 * (channel_group * T::kWarpTiles + j) + 2 * t + (e & 1);
          if (oh < p.OH && ow < p.OW && o < p.O) sum += fast_sigmoid(acc[mt][j][e] + bias[j][e & 1]);
          acc[mt][j][e] = 0.f;
        }
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) {
      const int64_t per_image = int64_t{p.row_pairs} * p.col_tiles;
      p.partial[(tc.n * per_image + tc.row_pair * p.col_tiles + tc.col_tile) * kWarps + warp] = sum;
    }
  }
  if constexpr (!kTensorLoads) cp_async_wait<0>();
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

// Whether the fused kernel may compute this call: float32 on a GPU of compute
// capability 8.0 or later, with TF32 convolutions allowed (PyTorch's
// torch.backends.cudnn.allow_tf32, as its own convolution would use them), a
// compiled kernel shape, at most 64 output channels, and sizes the kernel's int
// fields hold (launch_fused then checks that the weight fragments and two stages
// fit in shared memory).
bool fused_kernel_applies(const at::Tensor& x, const at::Tensor& weight, const Conv2dGeometry& g) {
  if (x.scalar_type() != at::kFloat || !at::globalContext().allowTF32CuDNN()) return false;
  if (weight.size(0) > 64) return false;
  const int64_t widest = std::max({x.size(1), x.size(2) + 2 * g.padding[0], x.size(3) + 2 * g.padding[1]});
  if (widest > INT_MAX) return false;
  if (device_attribute(cudaDevAttrComputeCapabilityMajor, x.get_device()) < 8) return false;
  return with_compiled_shape(weight.size(2), weight.size(3), g.stride[0], g.stride[1], [&](auto) {});
}

// The fused kernel's launch where it applies (its shared memory: the
// barriers, the weight fragments and as many stages as fit, up to kMaxStages,
// at least two), else false. The copy engine loads the boxes where the device
// runs the kernel's sm_90 code and x's rows are 16-byte aligned (the tensor
// map's strides are multiples of 16 bytes: W % 4 == 0).
bool launch_fused(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  const Conv2dGeometry& g, at::Tensor& partial, int row_pairs, int col_tiles, int OH, int OW) {
  bool launched = false;
  with_compiled_shape(weight.size(2), weight.size(3), g.stride[0], g.stride[1], [&](auto shape) {
    using S = decltype(shape);
    using T = Tile<S::kh, S::kw, S::sh, S::sw, 8>;
    Params p{};
    p.C = static_cast<int>(x.size(1));
    p.H = static_cast<int>(x.size(2));
    p.W = static_cast<int>(x.size(3));
    p.O = static_cast<int>(weight.size(0));
    p.OH = OH;
    p.OW = OW;
    p.pad_h = static_cast<int>(g.padding[0]);
    p.pad_w = static_cast<int>(g.padding[1]);
    p.row_pairs = row_pairs;
    p.col_tiles = col_tiles;
    p.channel_blocks = (p.C + kStageChannels - 1) / kStageChannels;
    p.lead = static_cast<int>((4 - p.pad_w % 4) % 4);
    p.tasks = x.size(0) * row_pairs * col_tiles;
    const int64_t limit = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, x.get_device());
    const int64_t fixed_bytes = (kBarrierWords + int64_t{p.channel_blocks} * T::kWeightWords) * sizeof(float);
    const int64_t stage_bytes = T::kStageWords * sizeof(float);
    p.stages = static_cast<int>(std::min<int64_t>(kMaxStages, (limit - fixed_bytes) / stage_bytes));
    if (p.stages < 2) return;
    const size_t smem = fixed_bytes + p.stages * stage_bytes;
    p.x = x.const_data_ptr<float>();
    p.weight = weight.const_data_ptr<float>();
    p.bias = bias.has_value() ? bias->const_data_ptr<float>() : nullptr;
    p.partial = partial.mutable_data_ptr<float>();

    auto launch = [&](auto kernel, int threads, const CUtensorMap& map) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
      const int64_t blocks = std::min<int64_t>(p.tasks, resident_blocks(kernel, threads, smem));
      kernel<<<static_cast<unsigned>(blocks), threads, smem, c10::cuda::getCurrentCUDAStream()>>>(p, map);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    const auto tensor_kernel = conv2d_sigmoid_sum_kernel<S::kh, S::kw, S::sh, S::sw, 8, true>;
    if (p.W % 4 == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0 && runs_bulk_copy(tensor_kernel)) {
      const cuuint64_t dims[4] = {static_cast<cuuint64_t>(p.W), static_cast<cuuint64_t>(p.H),
                                  static_cast<cuuint64_t>(p.C), static_cast<cuuint64_t>(x.size(0))};
      const cuuint64_t strides[3] = {dims[0] * sizeof(float), dims[0] * dims[1] * sizeof(float),
                                     dims[0] * dims[1] * dims[2] * sizeof(float)};
      const cuuint32_t box[4] = {T::kBoxCols, T::kRows, kStageChannels, 1};
      launch(tensor_kernel, kThreads + 32, tiled_tensor_map(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, p.x, 4, dims, strides, box));
    } else {
      launch(conv2d_sigmoid_sum_kernel<S::kh, S::kw, S::sh, S::sw, 8, false>, kThreads, CUtensorMap{});
    }
    launched = true;
  });
  return launched;
}

at::Tensor conv2d_sigmoid_sum_cuda(const at::Tensor& x, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                   at::IntArrayRef padding, std::optional<at::ScalarType> dtype) {
  const Conv2dGeometry g = conv2d_sigmoid_sum_geometry(x, weight, bias, stride, padding);
  const at::ScalarType out_dtype = result_dtype("conv2d_sigmoid_sum", x.scalar_type(), dtype);
  const c10::cuda::CUDAGuard guard(x.device());
  if (fused_kernel_applies(x, weight, g)) {
    const int OH = static_cast<int>((x.size(2) + 2 * g.padding[0] - weight.size(2)) / g.stride[0] + 1);
    const int OW = static_cast<int>((x.size(3) + 2 * g.padding[1] - weight.size(3)) / g.stride[1] + 1);
    const int row_pairs = (OH + kTileRows - 1) / kTileRows, col_tiles = (OW + kTilePixels - 1) / kTilePixels;
    at::Tensor partial = at::empty({x.size(0), int64_t{row_pairs} * col_tiles * kWarps}, x.options());
    const std::optional<at::Tensor> bias_c = bias.has_value() ? std::optional(bias->contiguous()) : std::nullopt;
    if (launch_fused(x.contiguous(), weight.contiguous(), bias_c, g, partial, row_pairs, col_tiles, OH, OW)) {
      return at::sum(partial, {1}, false, out_dtype);
    }
  }
  return conv2d_sigmoid_sum_composite(x, weight, bias, g, out_dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("conv2d_sigmoid_sum", &conv2d_sigmoid_sum_cuda);
}

}  // namespace fused_ops
