// The TF32 kernels of conv_transpose3d_weight_grad's "shifted rows" path (launched by
// conv_transpose3d_weight_grad.cu; included only in a build with CUTLASS, whose sm_90a code they
// need: wgmma by CuTe's instructions, TMA by bulk_copy.cuh).
//
// The math (../conv_transpose3d_weight_grad.h), with u = w + s the gradient's column:
//   grad_w[i, o, t, r, s] = sum over n, d, h and u in [0, Q) of X_s[i, n, d, h L + u] * G[o, n, d + t, (h + r) L + u]
// for G = grad_y as (O, N, Z, P, L) and X_s[i, n, d, h, u] = x[n, i, d, h, u - s] as (I, N, D, H, L)
// for each shift s < ks, rows of L >= Q = W + ks - 1 (a multiple of 4: 16-byte planes) padded with
// zeros where u - s falls outside [0, W) (x's shifted copies: a swizzled TMA box cannot start
// between 16-byte chunks). Over each (n, d) plane it is a GEMM whose K is the plane's H L
// positions: one per tap (t, r) over (O rows) x (ks shifts x I) columns. A CTA takes one tap
// (t, r), 128 output channels, 64 input channels, KS <= 5 of the shifts (the accumulators of
// 5 x 64 columns fill a consumer's registers), and a range of the K tiles (32 positions) of every
// plane: per tile one TMA box of G (128 x 32, at the row shifted by r L, depth d + t) and one of
// each of its X_s (64 x 32), 128-byte swizzled, K-major as TF32's wgmma wants them. One G box
// serves KS boxes of X (46.8 flop per byte loaded for KS = 5, where a CTA per tap would get 25.6).
// One producer warp group (a thread issues the copies) fills a ring of stages; two consumer warp
// groups take 64 output channels each.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <utility>

#include "bulk_copy.cuh"
#include "cutlass/arch/reg_reconfig.h"
#include "mma.cuh"
#include "wgmma_ss.cuh"

namespace fused_ops {

// rows_copy_kernel's threads
constexpr int kRowsRelayoutThreads = 256;

// The problem as the kernel reads it (the host fills it: conv_transpose3d_weight_grad.cu).
struct ShiftedRows {
  int depth, kt, kr, ks;               // D, and the taps in depth, height and width
  int shift_blocks;                    // ceil(ks / the CTA's shifts)
  int row;                             // L
  int in_channels, out_channels;       // I, O
  int in_blocks, out_blocks;           // ceil(I / 64), ceil(O / 128)
  int plane_tiles;                     // K tiles per (n, d) plane: ceil(H L / 32)
  int64_t k_tiles;                     // N D plane_tiles
  int splits;                          // CTAs along K per output tile
  int64_t filter_numel;                // I O kt kr ks
};

template <int KS>
struct ShiftedRowsConfig {
  static constexpr int kThreads = 384;                           // the producer warp group, two consumers
  static constexpr int kTileK = 32;                              // 128 bytes of TF32: the swizzle's row
  static constexpr int kRowsG = 128, kRowsX = 64;                // output, input channels per CTA
  static constexpr int kColumns = KS * kRowsX;                   // the GEMM's N: (shift, input channel)
  static constexpr int kGBytes = kRowsG * kTileK * 4;            // a stage's G box
  static constexpr int kXBytes = kRowsX * kTileK * 4;            // one of its X boxes
  static constexpr int kStageBytes = kGBytes + KS * kXBytes;     // a multiple of 1024 (the swizzle's atom)
  static constexpr int kStages = (225 * 1024) / kStageBytes < 8 ? (225 * 1024) / kStageBytes : 8;
  static constexpr int kSmemBytes = kStages * kStageBytes + 2 * kStages * 8 + 1024;  // + barriers, alignment
  // wgmma m64 n(kMmaN) k8 instructions per K step of 8: N up to 256 in one, else halves
  static constexpr int kMmaN = kColumns <= 256 ? kColumns : kColumns / 2;
  static constexpr int kMmas = kColumns / kMmaN;
  static constexpr int kAccumulators = kColumns / 2;             // per thread: 64 x kColumns over 128 threads
  static_assert(KS >= 1 && KS <= 5 && kStages >= 3 && kStageBytes % 1024 == 0);
};

// The CTA's share of out (I, O, kt, kr, ks) (module comment): its K range's sums, written to `out`
// for split 0, else to partials + (split - 1) filter_numel (added to out after). g_map: G as (L P, Z, N, O, 1) innermost
// first, boxes (32, 1, 1, 128, 1); x_map: the X_s as (L H, D, N, I, ks), boxes (32, 1, 1, 64, 1);
// both 128-byte swizzled.
template <int KS>
__global__ void __launch_bounds__(ShiftedRowsConfig<KS>::kThreads, 1)
    shifted_rows_weight_grad_kernel(const __grid_constant__ CUtensorMap g_map, const __grid_constant__ CUtensorMap x_map,
                                    float* __restrict__ out, float* __restrict__ partials, const ShiftedRows p) {
  using C = ShiftedRowsConfig<KS>;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* const smem = smem_raw + (1024 - shared_address(smem_raw) % 1024) % 1024;
  uint64_t* const full = reinterpret_cast<uint64_t*>(smem + C::kStages * C::kStageBytes);
  uint64_t* const empty = full + C::kStages;

  int64_t block = blockIdx.x;
  const int taps = p.kt * p.kr;
  const int tap = static_cast<int>(block % taps), t = tap / p.kr, r = tap % p.kr;
  block /= taps;
  const int s0 = static_cast<int>(block % p.shift_blocks) * KS;  // the CTA's shifts s0 .. s0 + KS - 1
  block /= p.shift_blocks;
  const int in_block = static_cast<int>(block % p.in_blocks);
  block /= p.in_blocks;
  const int out_block = static_cast<int>(block % p.out_blocks);
  const int split = static_cast<int>(block / p.out_blocks);
  const int64_t k_begin = p.k_tiles * split / p.splits, k_end = p.k_tiles * (split + 1) / p.splits;

  init_stage_barriers(full, empty, C::kStages, 2 * 128);  // (released by every consumer thread)

  if (threadIdx.x < 128) {  // the producer
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (threadIdx.x == 0) {
      int stage = 0;
      uint32_t phase = 0;
      for (int64_t k = k_begin; k < k_end; ++k) {
        barrier_wait(&empty[stage], phase ^ 1);
        const int64_t plane = k / p.plane_tiles;
        const int t0 = static_cast<int>(k % p.plane_tiles) * C::kTileK;
        const int n = static_cast<int>(plane / p.depth), d = static_cast<int>(plane % p.depth);
        unsigned char* const tiles = smem + stage * C::kStageBytes;
        barrier_arrive_expect(&full[stage], C::kStageBytes);
        tensor_load_5d(tiles, g_map, t0 + r * p.row, d + t, n, out_block * C::kRowsG, 0, &full[stage]);
        for (int s = 0; s < KS; ++s) {  // (shifts past ks load the last one again: their columns are not stored)
          tensor_load_5d(tiles + C::kGBytes + s * C::kXBytes, x_map, t0, d, n, in_block * C::kRowsX,
                         s0 + s < p.ks ? s0 + s : p.ks - 1, &full[stage]);
        }
        if (++stage == C::kStages) {
          stage = 0;
          phase ^= 1;
        }
      }
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<232>();
  const int consumer = threadIdx.x / 128 - 1;  // its 64 of the CTA's 128 output channels
  float acc[C::kAccumulators];
#pragma unroll
  for (int j = 0; j < C::kAccumulators; ++j) acc[j] = 0.f;
  int stage = 0, previous = -1;
  uint32_t phase = 0;
  for (int64_t k = k_begin; k < k_end; ++k) {
    barrier_wait(&full[stage], phase);
    const unsigned char* const tiles = smem + stage * C::kStageBytes;
    const uint64_t a = swizzled_tile_descriptor(tiles + consumer * (C::kGBytes / 2));
    const uint64_t b = swizzled_tile_descriptor(tiles + C::kGBytes);
#pragma unroll
    for (int j = 0; j < C::kAccumulators; ++j) cute::warpgroup_fence_operand(acc[j]);
    cute::warpgroup_arrive();
#pragma unroll
    for (int step = 0; step < C::kTileK / 8; ++step) {
#pragma unroll
      for (int m = 0; m < C::kMmas; ++m) {
        wgmma_ss<float, C::kMmaN>(a + 2 * step, b + m * C::kMmaN * 128 / 16 + 2 * step, acc + m * (C::kMmaN / 2),
                                  std::make_index_sequence<C::kMmaN / 2>{});
      }
    }
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<1>();  // the previous tile's instructions are done: its stage is free
#pragma unroll
    for (int j = 0; j < C::kAccumulators; ++j) cute::warpgroup_fence_operand(acc[j]);
    if (previous >= 0) barrier_arrive(&empty[previous]);
    previous = stage;
    if (++stage == C::kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
  cute::warpgroup_wait<0>();
#pragma unroll
  for (int j = 0; j < C::kAccumulators; ++j) cute::warpgroup_fence_operand(acc[j]);

  // accumulator j of instruction m: row 16 warp + lane / 4 (+ 8 for j % 4 >= 2), column
  // m kMmaN + 8 (j / 4) + 2 (lane % 4) + j % 2 -- the column is (shift s, input channel)
  float* const to = split == 0 ? out : partials + (split - 1) * p.filter_numel;
  const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
  const int o_base = out_block * C::kRowsG + consumer * 64 + 16 * warp + lane / 4;
#pragma unroll
  for (int j = 0; j < C::kAccumulators; ++j) {
    const int m = j / (C::kMmaN / 2), jj = j % (C::kMmaN / 2);
    const int o = o_base + (jj % 4 >= 2 ? 8 : 0);
    const int column = m * C::kMmaN + 8 * (jj / 4) + 2 * (lane % 4) + jj % 2;
    const int s = s0 + column / C::kRowsX, i = in_block * C::kRowsX + column % C::kRowsX;
    if (o < p.out_channels && i < p.in_channels && s < p.ks) {
      to[(((int64_t{i} * p.out_channels + o) * p.kt + t) * p.kr + r) * p.ks + s] = acc[j];
    }
  }
}

// The shifted-rows operands' copies, out (shifts, C, N, D, H, L) float32 from t (N, C, D, H, W) of
// any strides: out[s, c, n, d, h, u] = t[n, c, d, h, u - s] where 0 <= u - s < W, else 0 (G: one
// shift; the X_s: ks), rounded to TF32 (to nearest: wgmma's truncation of both operands biased the
// products' sums by ~2^-10 relative, past KernelBench's 1e-4 where the terms share a sign). Two
// kernels, each reading along one of t's dims: rows_copy_kernel along W (NCDHW: no transpose),
// channels_last_rows_kernel along C (channels-last: a transpose).
struct RowsRelayout {
  int64_t size[5], stride[5];  // t's, (N, C, D, H, W)
  int row;                     // L, a multiple of 4
  int shifts;
};

// A block per (s, c, n) (blockIdx.x, row-major) over its D planes, a thread per 4 consecutive
// positions of a row (one 16-byte store), read from t's row; each thread loads 4 such quads before
// it stores them (bytes in flight).
__global__ void __launch_bounds__(kRowsRelayoutThreads)
    rows_copy_kernel(const float* __restrict__ t, float* __restrict__ out, const RowsRelayout r) {
  constexpr int kBatch = 4;
  const int64_t block = blockIdx.x;
  const int64_t n = block % r.size[0], c = block / r.size[0] % r.size[1];
  const int s = static_cast<int>(block / r.size[0] / r.size[1]);
  const float* const from = t + n * r.stride[0] + c * r.stride[1];
  float4* const to = reinterpret_cast<float4*>(out + block * r.size[2] * r.size[3] * r.row);
  const int quads = r.row / 4, width = static_cast<int>(r.size[4]);
  const int plane = static_cast<int>(r.size[3]) * quads, total = static_cast<int>(r.size[2]) * plane;
  for (int base = threadIdx.x; base < total; base += kBatch * kRowsRelayoutThreads) {
    float v[kBatch][4];
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      const int e = base + q * kRowsRelayoutThreads;
      const int d = e / plane, h = e % plane / quads, u = e % quads * 4 - s;
      const float* const source = from + d * r.stride[2] + h * r.stride[3];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        v[q][k] = e < total && u + k >= 0 && u + k < width ? round_to_tf32(source[(u + k) * r.stride[4]]) : 0.f;
      }
    }
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      const int e = base + q * kRowsRelayoutThreads;
      if (e < total) to[e] = make_float4(v[q][0], v[q][1], v[q][2], v[q][3]);
    }
  }
}

// A block per (128 output positions of a plane's H L, 32 channels, (n, d)), its 32 x 8 threads
// staging the tile through shared memory for each shift: read with lanes along C (16 loads a thread
// in flight), written with lanes along the positions.
constexpr int kChannelsLastPositions = 128;

__global__ void __launch_bounds__(32 * 8)
    channels_last_rows_kernel(const float* __restrict__ t, float* __restrict__ out, const RowsRelayout r) {
  __shared__ float tile[kChannelsLastPositions][33];
  const int64_t positions = r.size[3] * r.row, channels = r.size[1];
  const int64_t position_tiles = (positions + kChannelsLastPositions - 1) / kChannelsLastPositions;
  const int64_t channel_tiles = (channels + 31) / 32;
  int64_t block = blockIdx.x;
  const int64_t p0 = block % position_tiles * kChannelsLastPositions;
  block /= position_tiles;
  const int64_t c0 = block % channel_tiles * 32;
  block /= channel_tiles;
  const int64_t d = block % r.size[2], n = block / r.size[2];
  const float* const from = t + n * r.stride[0] + d * r.stride[2] + (c0 + threadIdx.x) * r.stride[1];
  const int lane = threadIdx.x, warp = threadIdx.y;
  const bool lane_inside = c0 + lane < channels;
  const int start = static_cast<int>(p0) + warp;  // the thread's first position, then every 8th
  for (int s = 0; s < r.shifts; ++s) {
    int h = start / r.row, u = start % r.row;  // (stepped, not divided, per position)
#pragma unroll
    for (int k = 0; k < kChannelsLastPositions / 8; ++k) {
      const int column = u - s;
      const bool inside = lane_inside && start + 8 * k < positions && column >= 0 && column < r.size[4];
      tile[warp + 8 * k][lane] = inside ? round_to_tf32(from[h * r.stride[3] + column * r.stride[4]]) : 0.f;
      for (u += 8; u >= r.row; u -= r.row) ++h;
    }
    __syncthreads();
    for (int i = warp; i < 32 && c0 + i < channels; i += 8) {
      float* const run = out + (((s * channels + c0 + i) * r.size[0] + n) * r.size[2] + d) * positions + p0;
#pragma unroll
      for (int m = 0; m < kChannelsLastPositions / 32; ++m) {
        if (p0 + lane + 32 * m < positions) run[lane + 32 * m] = tile[lane + 32 * m][i];
      }
    }
    __syncthreads();
  }
}

}  // namespace fused_ops
