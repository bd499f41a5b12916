// CUDA kernel of conv2d_sigmoid_sum (the math: ../conv2d_sigmoid_sum.h): the
// convolution as an implicit GEMM on tensor cores (mma.sync: TF32 m16n8k8 for
// a float32 weight, bf16 / f16 m16n8k16 for a 16-bit one, x rounded as it is
// read), the bias, sigmoid and sum its epilogue; y never reaches memory. Where
// the backward needs it the epilogue also writes sigmoid'(y) (the factor, in
// the layout the header gives: the weight-gradient kernel's B fragments).
//
// GEMM: rows = output pixels of a row, columns = output channels (up to 8 n8
// tiles, 64 channels), k = (input channel, kh, kw). A task is four output rows
// of one image, 96 output columns wide; its eight warps each own 48 pixels
// (three m16 tiles) of one row by every channel (24 MMAs per A fragment). The k
// loop runs over blocks of two input channels, staged in shared memory, several
// blocks in flight: for each half of the task's columns, a box of those
// channels' input rows under it (NCHW read in place, zeros outside the image),
// then the block's B fragments (the weight rounded to the operation's type, in
// fragment order: weight_fragments_kernel writes them once per call). The
// stages come by the bulk tensor copy engine where the device has it and x's
// rows are 16-byte aligned (the last warp done with a stage refills it; its
// barrier says when the bytes landed), else by 16-byte cp.async spread over the
// warps (a block barrier per k block). A lane's A fragment is read straight
// from the boxes (each lane keeps the offsets of its k).
//
// Bank conflicts: a fragment load's lanes are 8 pixels (stride SW words) by 4
// k. For SW = 4, lanes whose taps' kw differ mod 4 fall in distinct banks: KOrder
// groups the taps so (for a 6-wide kernel 12 of 18 loads conflict-free, the
// others 2-way).
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
#include <type_traits>

#include "../conv2d_sigmoid_sum.h"
#include "bulk_copy.cuh"
#include "conv2d_sigmoid_sum.cuh"
#include "mma.cuh"
#include "plane_rows.cuh"

namespace fused_ops {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kTileRows = 4;        // output rows per task, one per two warps
constexpr int kWarpPixels = 48;     // three m16 tiles
constexpr int kTilePixels = 2 * kWarpPixels;
constexpr int kMTiles = kWarpPixels / 16;
constexpr int kStageChannels = 2;   // input channels per k block

// The order of a k block's taps in the GEMM's k: GEMM k i is the block's k
// natural[i] (natural: (channel, kh, kw)). One fragment load's lanes t = 0..3
// read the taps of one group of four GEMM k (Mma's k step, h and, for two k
// per register, which of them), at words 4 * pixel + kw (+ multiples of 4: rows
// and channels) for pixel strides of 4 words: they fall in distinct banks when
// the four kw differ mod 4. With kByResidue, groups take one tap of each
// residue while every residue has some left, the rest alternating (for a 6-wide
// kernel 12 of 18 groups conflict-free, the others 2-way); else natural order.
template <int kStageK, int KW, typename Mma, bool kByResidue>
struct KOrder {
  int natural[kStageK];

  static constexpr int position(int group, int t) {  // the GEMM k of lane t's tap in a group
    constexpr int P = Mma::kPerRegister;
    return Mma::kStepK * (group / (2 * P)) + Mma::kStepK / 2 * (group / P % 2) + P * t + group % P;
  }

  constexpr KOrder() : natural() {
    int sequence[kStageK] = {};  // the taps group by group
    if constexpr (kByResidue) {
      int lists[4][kStageK] = {}, counts[4] = {}, taken[4] = {};
      for (int k = 0; k < kStageK; ++k) {
        const int r = k % KW % 4;
        lists[r][counts[r]++] = k;
      }
      int n = 0;
      while (taken[0] < counts[0] && taken[1] < counts[1] && taken[2] < counts[2] && taken[3] < counts[3]) {
        for (int r = 0; r < 4; ++r) sequence[n++] = lists[r][taken[r]++];
      }
      while (n < kStageK) {
        for (int r = 0; r < 4; ++r) {
          if (taken[r] < counts[r]) sequence[n++] = lists[r][taken[r]++];
        }
      }
    } else {
      for (int k = 0; k < kStageK; ++k) sequence[k] = k;
    }
    for (int i = 0; i < kStageK; ++i) natural[position(i / 4, i % 4)] = sequence[i];
  }
};

// The geometry of one kernel shape (KH x KW kernel, stride SH x SW, NT n8 tiles) and operation.
template <int KH, int KW, int SH, int SW, int NT, typename Mma>
struct Tile {
  static constexpr int kSH = SH, kSW = SW;
  static constexpr int kTaps = KH * KW;
  static constexpr int kStageK = kStageChannels * kTaps;  // k of a block
  // k steps of a block; the last one's upper half (a2, a3, b1) zero where kStageK is an odd multiple of 8
  static constexpr int kKSteps = (kStageK + Mma::kStepK - 1) / Mma::kStepK;
  static constexpr bool kHalfLastStep = kStageK % Mma::kStepK != 0;
  static constexpr int kRows = (kTileRows - 1) * SH + KH;
  static constexpr int kHalfColumn = kWarpPixels * SW;  // the second half's first input column, from the first's
  // a half's input columns from a multiple of 4 (the copy engine's boxes start at 16-byte
  // columns: up to 3 more in front), in whole 16-byte chunks
  static constexpr int kBoxCols = ((kWarpPixels - 1) * SW + KW + 3 + 3) / 4 * 4;
  static constexpr int kChannelStride = kRows * kBoxCols;
  static constexpr int kBoxWords = kStageChannels * kChannelStride;
  static constexpr int kBoxStride = (kBoxWords + 31) / 32 * 32;  // boxes 128-byte aligned
  static constexpr int kBoxesWords = 2 * kBoxStride;
  static constexpr int kStageChunks = 2 * kBoxWords / 4;
  static constexpr int kPairs = NT / 2;  // n8 tile pairs: one 16-byte weight load each
  static constexpr int kWeightWords = kKSteps * kPairs * 32 * 4;  // per k block
  static constexpr int kStageWords = kBoxesWords + kWeightWords;  // a stage: the boxes, the block's B fragments
  static_assert(kStageK % 8 == 0, "a k block of whole groups of four");
  using Order = KOrder<kStageK, KW, Mma, SW == 4>;
  static_assert(NT % 2 == 0 && NT <= 8, "NT: 2, 4, 6 or 8 n8 tiles");
  static_assert(kBoxCols <= 256 && kRows <= 256, "boxes the copy engine takes");
  static_assert(kTilePixels * SW % 4 == 0 && kHalfColumn % 4 == 0, "boxes at 16-byte columns");
};

struct Params {
  const float* x;
  const void* weight;  // (O, C, KH, KW) in its dtype (Mma::Input)
  const void* bias;    // (O,) in the weight's dtype, or null
  const uint32_t* fragments;  // the weight's B fragments: (channel_blocks, kWeightWords)
  float* partial;       // (N, tasks_per_image * kWarps)
  float* factor;        // sigmoid'(y) in its layout (conv2d_sigmoid_sum.h), or null where not saved
  int factor_tiles;     // its 48-column blocks per row
  int C, H, W, O, OH, OW, pad_h, pad_w;
  int row_groups, col_tiles, channel_blocks, stages;
  int lead;  // columns staged in front of a box's first input column: (-pad_w) mod 4
  int64_t tasks;
};

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

// s = 1 / (1 + e^-v) by the special-function unit's exponential and reciprocal
// (a few ulp, growing with |v| where the sigmoid saturates: far below TF32's
// 2^-11); NaN stays NaN, -inf gives 0, +inf 1. With its derivative s (1 - s),
// as e^-v s^2 where v >= 0 (1 - s would cancel) and s - s^2 elsewhere.
struct Sigmoid {
  float s, derivative;
};

__device__ __forceinline__ Sigmoid fast_sigmoid(float v) {
  const float e = __expf(-v);
  float s;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(s) : "f"(1.f + e));
  return {s, v >= 0.f ? e * s * s : s - s * s};
}

struct TaskCoords {
  int64_t n;
  int row_group, col_tile;
};

__device__ __forceinline__ TaskCoords task_coords(int64_t task, const Params& p) {
  const int64_t per_image = int64_t{p.row_groups} * p.col_tiles;
  const int64_t n = task / per_image;
  const int rest = static_cast<int>(task - n * per_image);
  return {n, rest / p.col_tiles, rest % p.col_tiles};
}

// The input coordinates of a task's first box: column (a multiple of 4, p.lead
// before the task's first input column), row (negative in the padding above).
__device__ __forceinline__ int2 task_origin(const TaskCoords& tc, int sh, int sw, const Params& p) {
  return {tc.col_tile * kTilePixels * sw - p.pad_w - p.lead, tc.row_group * kTileRows * sh - p.pad_h};
}

// Stages k block `block` of `task` at `stage` by the copy engine: two boxes
// (for each half of the task's columns, its input channels' rows under it;
// zeros outside the image: padding, the tile's overhang, channels past C), then
// the block's B fragments. Called by one thread: it announces the bytes on
// `bar` and issues the three copies.
template <typename T>
__device__ __forceinline__ void load_stage_tensor(float* stage, uint64_t* bar, const CUtensorMap& map, int64_t task,
                                                  int block, const Params& p) {
  const TaskCoords tc = task_coords(task, p);
  const int2 origin = task_origin(tc, T::kSH, T::kSW, p);
  barrier_arrive_expect(bar, (2 * T::kBoxWords + T::kWeightWords) * sizeof(float));
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    tensor_load_4d(stage + half * T::kBoxStride, map, origin.x + half * T::kHalfColumn, origin.y,
                   block * kStageChannels, static_cast<int>(tc.n), bar);
  }
  bulk_load(stage + T::kBoxesWords, p.fragments + int64_t{block} * T::kWeightWords, T::kWeightWords * sizeof(float),
            bar);
}

// The same stage by cp.async, in 16-byte chunks spread over the block's
// threads: each box chunk from x where its four words lie inside the image
// and are 16-byte aligned there, else word by word, zeros outside the image.
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
      // (outside: nothing read, from an address of a 16-byte aligned allocation)
      cp_async_zfill<16>(dst, row_inside ? src : reinterpret_cast<const float*>(p.fragments), row_inside);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool inside = iw + e >= 0 && iw + e < p.W;
        cp_async_zfill<4>(dst + e, inside ? src + e : p.x, inside);
      }
    }
  }
  const float* fragments = reinterpret_cast<const float*>(p.fragments) + int64_t{block} * T::kWeightWords;
  for (int chunk = threadIdx.x; chunk < T::kWeightWords / 4; chunk += kThreads) {
    cp_async_zfill<16>(stage + T::kBoxesWords + 4 * chunk, fragments + 4 * chunk, true);
  }
}

// The weight's B fragments for every k block, rounded to the operation's type,
// in the order the k loop reads them: [block][k step][n8 tile pair][lane] x
// {b0, b1 of tile 2j, b0, b1 of tile 2j + 1}, with b0 = w[k][n = 8 tile + lane /
// 4] at the lane's GEMM k of h = 0 (Mma's comment; the tap KOrder puts there),
// b1 at h = 1; zero past the block's k, past C and past O.
template <typename T, typename Mma>
__global__ void weight_fragments_kernel(const Params p, uint32_t* fragments) {
  const int64_t total = int64_t{p.channel_blocks} * T::kWeightWords;
  auto weight = [&](int block, int k, int n) {
    const int c = block * kStageChannels + k / T::kTaps, tap = k % T::kTaps;
    const auto* w = static_cast<const typename Mma::Input*>(p.weight);
    return k < T::kStageK && c < p.C && n < p.O ? widened(w[((int64_t{n} * p.C + c) * T::kTaps) + tap])
                                                 : 0.f;
  };
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int e = i % 4, lane = (i / 4) % 32;
    const int64_t rest = i / (4 * 32);
    const int pair = rest % T::kPairs, step = (rest / T::kPairs) % T::kKSteps;
    const int block = static_cast<int>(rest / (T::kPairs * T::kKSteps));
    const int n = 8 * (2 * pair + e / 2) + lane / 4;
    constexpr typename T::Order order{};
    const int k = Mma::kStepK * step + Mma::kPerRegister * (lane % 4) + Mma::kStepK / 2 * (e % 2);
    auto natural = [&](int gemm_k) { return gemm_k < T::kStageK ? order.natural[gemm_k] : gemm_k; };
    fragments[i] = Mma::pack(weight(block, natural(k), n),
                             Mma::kPerRegister == 2 ? weight(block, natural(k + 1), n) : 0.f);
  }
}

// kTensorLoads: the stages come by the copy engine (`map`: x as a 4-D tensor
// (W, H, C, N), boxes of (kBoxCols, kRows, kStageChannels, 1)): a stage is read
// once its `full` barrier has seen the bytes land; once every thread has
// arrived on its `empty` barrier, thread 0 refills it with the item p.stages
// later (as it starts the next item: only warp 0 waits for the others); else
// the warps load by cp.async, a block barrier between items. kSaveFactor: the
// epilogue also writes sigmoid' (p.factor); without it (eval) it computes none.
template <int KH, int KW, int SH, int SW, int NT, typename Mma, bool kTensorLoads, bool kSaveFactor>
__global__ void __launch_bounds__(kThreads, 1)
    conv2d_sigmoid_sum_kernel(const Params p, const __grid_constant__ CUtensorMap map) {
  using T = Tile<KH, KW, SH, SW, NT, Mma>;
  // shared memory: the stages' barriers (copy engine), the stages
  extern __shared__ __align__(128) float smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + kMaxStages;
  float* stages = smem + kBarrierWords;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;

  // this block's tasks: an equal contiguous share, k block by k block (items)
  const int64_t first = blockIdx.x * p.tasks / gridDim.x;
  const int64_t last = (blockIdx.x + 1) * p.tasks / gridDim.x;
  const int64_t items = (last - first) * p.channel_blocks;
  auto load_item = [&](int64_t item, int s) {
    load_stage_tensor<T>(stages + s * T::kStageWords, &full[s], map, first + item / p.channel_blocks,
                         static_cast<int>(item % p.channel_blocks), p);
  };
  StageRing ring{full, empty, p.stages, items};
  if constexpr (kTensorLoads) ring.start(kThreads, load_item);

  // This lane's A fragment words relative to a stage: its k's offsets (h = 0,
  // 1; each of a register's k), its pixels' (the half's box, row of the group,
  // 48 pixels of the warp, + 8 for a1 / a3).
  int k_offset[T::kKSteps][2][Mma::kPerRegister];
  {
    constexpr typename T::Order order{};
#pragma unroll
    for (int step = 0; step < T::kKSteps; ++step) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int j = 0; j < Mma::kPerRegister; ++j) {
          const int i = Mma::kStepK * step + Mma::kPerRegister * t + Mma::kStepK / 2 * h + j;
          const int k = order.natural[std::min(i, T::kStageK - 1)], tap = k % T::kTaps;
          k_offset[step][h][j] = (k / T::kTaps) * T::kChannelStride + (tap / KW) * T::kBoxCols + tap % KW;
        }
      }
    }
  }
  const int row_in_group = warp / 2, half = warp % 2;
  // (the m16 tiles' and a1 / a3 rows' offsets from it are constants: immediate offsets of the loads)
  const int pixel_offset = half * T::kBoxStride + row_in_group * SH * T::kBoxCols + p.lead + g * SW;
  float bias[NT][2];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int o = 8 * j + 2 * t + e;
      bias[j][e] = (p.bias != nullptr && o < p.O) ? widened(static_cast<const typename Mma::Input*>(p.bias)[o]) : 0.f;
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

  float acc[kMTiles][NT][4];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][j][e] = 0.f;

  int64_t item = 0;
  for (int64_t task = first; task < last; ++task) {
    for (int block = 0; block < p.channel_blocks; ++block, ++item) {
      if constexpr (kTensorLoads) {
        ring.acquire(item, load_item);
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

      const float* stage = stages + ring.stage * T::kStageWords;
      const uint4* w = reinterpret_cast<const uint4*>(stage + T::kBoxesWords);
#pragma unroll
      for (int step = 0; step < T::kKSteps; ++step) {
        uint32_t a[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float* pixels = stage + pixel_offset + (16 * mt + 8 * (e & 1)) * SW;
            const int(&offsets)[Mma::kPerRegister] = k_offset[step][e >> 1];
            if (T::kHalfLastStep && step == T::kKSteps - 1 && e >= 2) {
              a[mt][e] = 0;  // (k past the block)
            } else {
              a[mt][e] = Mma::pack(pixels[offsets[0]], Mma::kPerRegister == 2 ? pixels[offsets[Mma::kPerRegister - 1]] : 0.f);
            }
          }
        }
#pragma unroll
        for (int pair = 0; pair < T::kPairs; ++pair) {
          const uint4 b = w[(step * T::kPairs + pair) * 32 + lane];
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            Mma::mma(acc[mt][2 * pair], a[mt], b.x, b.y);
            Mma::mma(acc[mt][2 * pair + 1], a[mt], b.z, b.w);
          }
        }
      }
      if constexpr (kTensorLoads) {
        ring.release();
      } else {
        ring.advance();
      }
    }

    // the task's epilogue: the bias, the sigmoid and this warp's sum over its pixels and channels;
    // where the backward needs it, sigmoid' of the warp's 48 columns by 64 channels (zero outside
    // the output), each lane's values of an m16 tile and n8 tile pair as two 16-byte words of the
    // factor's layout: its (c0, c2) and (c1, c3) of both tiles are the B fragment words q = 0..3
    // of the backward's lanes (2t, g % 4) and (2t + 1, g % 4) in k8 group 2 mt + g / 4.
    const TaskCoords tc = task_coords(task, p);
    const int oh = tc.row_group * kTileRows + row_in_group;
    const int first_ow = tc.col_tile * kTilePixels + kWarpPixels * half;
    static_assert(kWarpPixels == kFactorColumns && 8 * NT == kFactorChannels, "a warp's tile: a factor block");
    float4* factor = nullptr;
    if (kSaveFactor && oh < p.OH && first_ow < p.OW) {
      factor = reinterpret_cast<float4*>(
          p.factor + ((tc.n * p.OH + oh) * p.factor_tiles + tc.col_tile * 2 + half) * kFactorWords);
    }
    float sum = 0.f;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int pair = 0; pair < NT / 2; ++pair) {
        float words[2][4];  // [c1 / c3 or c0 / c2][q]
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          const int j = 2 * pair + jj;
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int ow = first_ow + 16 * mt + g + 8 * (e >> 1);
            const int o = 8 * j + 2 * t + (e & 1);
            const bool inside = oh < p.OH && ow < p.OW && o < p.O;
            const Sigmoid y = fast_sigmoid(acc[mt][j][e] + bias[j][e & 1]);
            if (inside) sum += y.s;
            if constexpr (kSaveFactor) {
              words[e & 1][2 * jj + (e >> 1)] = inside ? __uint_as_float(Tf32Mma::pack(y.derivative, 0.f)) : 0.f;
            }
            acc[mt][j][e] = 0.f;
          }
        }
        if (kSaveFactor && factor != nullptr) {
#pragma unroll
          for (int l = 0; l < 2; ++l) {
            factor[((2 * mt + g / 4) * 4 + pair) * 32 + 4 * (2 * t + l) + g % 4] =
                make_float4(words[l][0], words[l][1], words[l][2], words[l][3]);
          }
        }
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) {
      const int64_t per_image = int64_t{p.row_groups} * p.col_tiles;
      p.partial[(tc.n * per_image + tc.row_group * p.col_tiles + tc.col_tile) * kWarps + warp] = sum;
    }
  }
  if constexpr (!kTensorLoads) cp_async_wait<0>();
}

// The tensor-core operation of the fused kernel for this call, if it takes
// it: on a GPU of compute capability 8.0 or later, a float32 x, the weight's
// operation (with_weight_operation: TF32 where PyTorch's convolution would use
// it, or 16-bit); a compiled kernel shape, at most 64 output channels, and sizes
// the kernel's int fields hold (launch_fused then checks that the weight
// fragments and two stages fit in shared memory). f(Mma{}) is called with it;
// false if none.
template <typename F>
bool with_fused_operation(const at::Tensor& x, const at::Tensor& weight, const Conv2dGeometry& g, F&& f) {
  if (x.scalar_type() != at::kFloat || weight.size(0) > 64) return false;
  const int64_t widest = std::max({x.size(1), x.size(2) + 2 * g.padding[0], x.size(3) + 2 * g.padding[1]});
  if (widest > INT_MAX) return false;
  if (device_attribute(cudaDevAttrComputeCapabilityMajor, x.get_device()) < 8) return false;
  if (!with_compiled_shape(weight.size(2), weight.size(3), g.stride[0], g.stride[1], [](auto) {})) return false;
  return with_weight_operation(weight.scalar_type(), f);
}

// The fused kernel's launch (its shared memory: the barriers and as many
// stages as fit, up to kMaxStages, at least two), or false where two stages do
// not fit. The copy engine loads the stages where the device runs the kernel's
// sm_90 code and x's rows are 16-byte aligned (the tensor map's strides are
// multiples of 16 bytes: W % 4 == 0). The weight and bias come in the
// weight's dtype (Mma::Input), widened as the kernels read them.
template <typename Mma>
bool launch_fused(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  const Conv2dGeometry& g, at::Tensor& partial, float* factor, int row_groups, int col_tiles,
                  int OH, int OW) {
  bool launched = false;
  with_compiled_shape(weight.size(2), weight.size(3), g.stride[0], g.stride[1], [&](auto shape) {
    using S = decltype(shape);
    using T = Tile<S::kh, S::kw, S::sh, S::sw, 8, Mma>;
    Params p{};
    p.C = static_cast<int>(x.size(1));
    p.H = static_cast<int>(x.size(2));
    p.W = static_cast<int>(x.size(3));
    p.O = static_cast<int>(weight.size(0));
    p.OH = OH;
    p.OW = OW;
    p.pad_h = static_cast<int>(g.padding[0]);
    p.pad_w = static_cast<int>(g.padding[1]);
    p.row_groups = row_groups;
    p.col_tiles = col_tiles;
    p.channel_blocks = (p.C + kStageChannels - 1) / kStageChannels;
    p.lead = static_cast<int>((4 - p.pad_w % 4) % 4);
    p.tasks = x.size(0) * row_groups * col_tiles;
    const StagesFitting fit = stages_fitting(T::kStageWords, x);
    const size_t smem = fit.smem;
    p.stages = fit.stages;
    if (p.stages < 2) return;
    p.x = x.const_data_ptr<float>();
    p.weight = weight.const_data_ptr();
    p.bias = bias.has_value() ? bias->const_data_ptr() : nullptr;
    p.partial = partial.mutable_data_ptr<float>();
    p.factor = factor;
    p.factor_tiles = static_cast<int>((OW + kFactorColumns - 1) / kFactorColumns);
    const auto stream = c10::cuda::getCurrentCUDAStream();
    const int64_t fragment_words = int64_t{p.channel_blocks} * T::kWeightWords;
    const at::Tensor fragments = at::empty({fragment_words}, x.options().dtype(at::kInt));
    weight_fragments_kernel<T, Mma><<<static_cast<unsigned>((fragment_words + 255) / 256), 256, 0, stream>>>(
        p, reinterpret_cast<uint32_t*>(fragments.mutable_data_ptr<int32_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    p.fragments = reinterpret_cast<const uint32_t*>(fragments.const_data_ptr<int32_t>());

    auto launch = [&](auto kernel, const CUtensorMap& map) {
      allow_dynamic_shared_memory(kernel, smem);
      const int64_t blocks = std::min<int64_t>(p.tasks, resident_blocks(kernel, kThreads, smem));
      kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(p, map);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    auto launch_saving = [&](auto save_factor) {
      constexpr bool kSave = decltype(save_factor)::value;
      const auto tensor_kernel = conv2d_sigmoid_sum_kernel<S::kh, S::kw, S::sh, S::sw, 8, Mma, true, kSave>;
      if (copy_engine_takes(x) && runs_bulk_copy(tensor_kernel)) {
        launch(tensor_kernel, nchw_tensor_map(x, T::kBoxCols, T::kRows, kStageChannels));
      } else {
        launch(conv2d_sigmoid_sum_kernel<S::kh, S::kw, S::sh, S::sw, 8, Mma, false, kSave>, CUtensorMap{});
      }
    };
    if (factor != nullptr) {
      launch_saving(std::true_type{});
    } else {
      launch_saving(std::false_type{});
    }
    launched = true;
  });
  return launched;
}

std::tuple<at::Tensor, at::Tensor> conv2d_sigmoid_sum_cuda(const at::Tensor& x, const at::Tensor& weight,
                                                           const std::optional<at::Tensor>& bias,
                                                           at::IntArrayRef stride, at::IntArrayRef padding,
                                                           bool save_grad_factor, std::optional<at::ScalarType> dtype) {
  const Conv2dGeometry g = conv2d_sigmoid_sum_geometry(x, weight, bias, stride, padding);
  const at::ScalarType out_dtype = result_dtype("conv2d_sigmoid_sum", weight.scalar_type(), dtype);
  const c10::cuda::CUDAGuard guard(x.device());
  std::optional<std::tuple<at::Tensor, at::Tensor>> result;
  with_fused_operation(x, weight, g, [&](auto mma) {
    const auto [oh, ow] = conv2d_output_size(x, weight, g);
    const int OH = static_cast<int>(oh), OW = static_cast<int>(ow);
    const int row_groups = (OH + kTileRows - 1) / kTileRows, col_tiles = (OW + kTilePixels - 1) / kTilePixels;
    at::Tensor partial = at::empty({x.size(0), int64_t{row_groups} * col_tiles * kWarps}, x.options());
    at::Tensor factor = save_grad_factor
                            ? at::empty(grad_factor_shape(x.size(0), weight.size(0), oh, ow), x.options())
                            : x.new_empty({0});
    const std::optional<at::Tensor> bias_c = bias.has_value() ? std::optional(bias->contiguous()) : std::nullopt;
    if (launch_fused<decltype(mma)>(x.contiguous(), weight.contiguous(), bias_c, g, partial,
                                    save_grad_factor ? factor.mutable_data_ptr<float>() : nullptr, row_groups,
                                    col_tiles, OH, OW)) {
      result.emplace(at::sum(partial, {1}, false, out_dtype), factor);
    }
  });
  return result.has_value() ? *result
                            : conv2d_sigmoid_sum_composite(x, weight, bias, g, save_grad_factor, out_dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("conv2d_sigmoid_sum", &conv2d_sigmoid_sum_cuda);
}

}  // namespace fused_ops
