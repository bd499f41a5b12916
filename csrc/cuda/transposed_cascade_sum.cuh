// The kernel of conv_transpose3d_cascade_sum, TF32, bfloat16 or bf16x3 (Bf16x3 below; launched by
// conv_transpose3d_cascade_sum.cu; included only in a build with CUTLASS, whose sm_90a code it needs:
// wgmma by CuTe's instructions, TMA by bulk_copy.cuh).
//
// The math (../conv_transpose3d_cascade_sum.h): for stride 2, stage-1 position m = (md, mh, mw)
// and parity class q = (qd, qh, qw), y[2 m + q] = sum over the class's taps (ud, uh, uw) (at most
// 3 a dim) and input channels i of x[n, i, m + start + u] w[i, o, tap_q(u)]; stage 1 picks over
// the 8 classes in scan order, stage 2 over 3 x 3 x 3 stage-1 positions, then the channels add.
//
// A CTA takes one cell item: batch element n, 3 stage-1 depths (one output depth), 6 stage-1 rows
// (two output rows) and 30 stage-1 columns (ten output columns). x is read channels-last
// (N, D, H, W, 32): for each of the 5 input depths the item reads, one TMA box "slice" of 8 input
// rows x 32 input columns x 32 channels (rows of 128 bytes in float32, 64 in bfloat16, swizzled
// across them), zeros outside x.
// A position (r, w) of the tile is slice row r * 32 + w, so tap (uh, uw) of the positions of rows
// r0 .. r0 + 2 is the 96 slice rows from (r0 + uh) * 32 + uw on: one wgmma B operand at a row
// offset (wgmma reads a swizzled operand at any row: the swizzle is the address's), no copies.
// Columns 30 and 31 of each row are computed and dropped (they read into the next row).
// The weights, per tap of each class in order, are boxes of 64 output channels x 32 input
// channels: the A operand (m64). Per stage-1 depth a consumer warp group accumulates each class's
// taps in turn (m64 n96 wgmma, 3 rows of 32 positions; up to kPending taps' instructions in flight)
// and keeps the stage-1 pick in registers (of the sums rounded to bfloat16 in bfloat16, as the
// original's y is); then stage 2 runs through shared memory. One producer warp group (a thread
// issues the copies) fills the slices' ring (3 slots) and the weights' ring; two consumer warp
// groups take rows 0-2 and 3-5.
//
// The last wave: a grid of whole items leaves its last wave mostly idle (SPEC's B: 800 items on
// 132 multiprocessors, 8 in the 7th wave, which took 0.10 of 0.62 ms in bfloat16). Without picks
// the cascade is a maximum over (depth, class, position) per cell and channel, so the items past
// the last whole wave split by stage-1 depth and groups of classes (the host's schedule():
// conv_transpose3d_cascade_sum.cu): each part writes its maxima (`partial`) and
// cascade_parts_sum_kernel takes their maximum and the channels' sum.
//
// SPEC's B on an H200 (2026-11-27, kernel alone from a channels-last x, no picks: a profile of B's module,
// bench/results/profile-B-nvidia-h200-session15.log): 0.59 ms in TF32 (0.68 with every item whole and the
// earlier tap loop; 0.79 with the picks, which keep every item whole), 0.47 in bfloat16 (0.53 with the earlier
// tap loop, whose descriptors were rebuilt from the smem address and the tap's (ud, uh, uw) each tap: ~74
// SASS instructions a tap against 53; 0.62 with every item whole). What limits it (ncu, bfloat16, before the
// split and the tap loop's change): the tensor pipe active 47% of the time, no unit saturated (issue 44%,
// shared memory 43%, L2 17%): latency between the taps' short instruction
// groups (2 x m64n96k16 a tap in bfloat16) and the classes' ends (each consumer waits for its
// instructions, then takes the stage-1 step, both at once). Tried without gain: 2 or 4 taps in
// flight instead of 3, 24 weight stages in bfloat16, a pair of taps per stage (slower: 0.90 /
// 0.84), consumer 1 started half a ring behind consumer 0 (slower), the next class's first taps
// issued before the stage-1 step in a second set of accumulators (ptxas serializes every wgmma:
// it cannot see the two sets apart). Split parts of 1 depth and 4 class groups beat 3 depths x 1
// group (0.570) and class groups alone (0.558 for 8, 0.583 for 4; not scheduled: schedule() says why).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "../max_pool3d.h"
#include "bulk_copy.cuh"
#include "cutlass/arch/reg_reconfig.h"
#include "wgmma_ss.cuh"

namespace fused_ops {

// The most taps of all 8 classes (3 x 3 x 3 each).
constexpr int kCascadeMaxTaps = 8 * 27;

// The problem as the kernel reads it (the host fills it: conv_transpose3d_cascade_sum.cu).
struct TransposedCascade {
  int cells[3];            // the output's D2, H2, W2
  int row_tiles, col_tiles;  // ceil(H2 / 2), ceil(W2 / 10)
  int start[3];            // the input offset of tap u = 0 at stage-1 position 0, per dim
  int out_channels;        // O <= 64
  int class_end[8];        // class q's taps: [class_end[q - 1], class_end[q])
  // per slot rotation r (a stage-1 depth whose first slice lies in slot r) and tap (ud, uh, uw):
  // ud << 16 | the tap's first slice row's offset from slot 0 in 16-byte units (set_tap_operands)
  uint32_t tap_operand[3][kCascadeMaxTaps];
  // The schedule (module comment): items [0, whole_items) one CTA each, every later item split in
  // parts(): one per stage-1 depth and class group, group g taking classes [group_end[g - 1], group_end[g]).
  int64_t whole_items;
  int class_groups;
  int group_end[8];

  __host__ __device__ int parts() const { return 3 * class_groups; }  // a split item's
};

// Certified picks (Bf16x3 with picks: a training step's): where an element of a window came within
// `eps` of its pick's value at either stage -- a near tie that bf16x3's roundings could decide
// otherwise than float64 -- the window (its picks index) is listed, and cascade_picks_fixup_kernel
// (conv_transpose3d_cascade_sum.cu) picks again from float64 sums. eps for output channel o is
// kCertifyEps * max |x| * tap_bound[o], tap_bound[o] the largest over the classes of the sum of |w|
// over a class's taps and input channels: 2^-15 of what bounds |y|. That covers bf16x3's roundings (each
// of two sums within about 3 * 2^-18 of the bound, their difference 6 * 2^-18); float32's accumulation in
// the tensor cores only by its typical size (about 2^-22 of the bound), not its worst case (up to ~2^-16
// a sum over SPEC's 27 taps): the picks are certified against the operands' split, not as a bound on
// every rounding (SPEC's B: no pick off float64's, 0.7 % of the windows listed).
struct CascadeCertify {
  const float* tap_bound;  // (O)
  const float* x_max;      // max |x| (1), by bf16x3_rows_kernel
  int* count;              // listed windows
  int* windows;            // their picks indices (the picks under 2^31: conv_transpose3d_cascade_sum_cuda)
};
constexpr float kCertifyEps = 1.0f / 32768;

// float32 operands as bfloat16 pairs ("bf16x3"): each value v split into a high part h = bf16(v)
// and a low part l = bf16(v - h), v = h + l within 2^-17 |v|; a product w x taken as
// h_w h_x + h_w l_x + l_w h_x (the l_w l_x left out is within 2^-16 |w x|), each a bfloat16 wgmma
// accumulated in float32: a float32 convolution's accuracy (KernelBench's float32 check, the
// max-pools' picks), where TF32 rounds each operand to 2^-11 (SPEC's B: 7e-4 from a float64 run).
// A row of x or of the weights holds the 32 channels' high parts, then their low parts.
struct Bf16x3 {};

// Part `part` (0 high, 1 low) of v as Bf16x3 holds it; a non-finite v all in its low part (0 high), so
// that a product of one non-finite factor keeps its value: h_w l_x for a non-finite x, l_w h_x for a
// non-finite weight (both non-finite: NaN where the product is infinite). A finite v whose bfloat16
// rounding overflows keeps its high part finite (rounded toward zero).
__device__ __forceinline__ __nv_bfloat16 bf16x3_part(float v, int part) {
  if (!isfinite(v)) return part == 0 ? __float2bfloat16_rz(0.f) : __float2bfloat16_rn(v);
  __nv_bfloat16 high = __float2bfloat16_rn(v);
  if (isinf(__bfloat162float(high))) high = __float2bfloat16_rz(v);
  return part == 0 ? high : __float2bfloat16_rn(v - __bfloat162float(high));
}

// The operands' element type T (float: TF32; __nv_bfloat16; Bf16x3) as the kernel holds it: wgmma's
// element type, the parts a value takes, and per instruction step of a tap the 32-byte chunks of
// the weights' (A) and x's (B) rows it multiplies: in order for one part; for Bf16x3 the high
// parts' two chunks with each other, with x's low parts, then the weights' low parts with x's high.
template <typename T>
struct CascadeOperand {
  using Element = T;
  static constexpr int kParts = 1;
  __host__ __device__ static constexpr int a_chunk(int step) { return step; }
  __host__ __device__ static constexpr int b_chunk(int step) { return step; }
};
template <>
struct CascadeOperand<Bf16x3> {
  using Element = __nv_bfloat16;
  static constexpr int kParts = 2;
  __host__ __device__ static constexpr int a_chunk(int step) { return step < 4 ? step % 2 : step - 2; }
  __host__ __device__ static constexpr int b_chunk(int step) { return step < 4 ? step : step - 4; }
};

// T: float (TF32), __nv_bfloat16 or Bf16x3, the operands' type (CascadeOperand).
template <typename T>
struct TransposedCascadeConfig {
  using Operand = CascadeOperand<T>;
  using Element = typename Operand::Element;
  static constexpr int kThreads = 384;               // the producer warp group, two consumers
  static constexpr int kChannels = 32;               // I
  static constexpr int kRowElements = kChannels * Operand::kParts;  // a position's (or output channel's) row
  static constexpr int kRowBytes = kRowElements * sizeof(Element);  // the swizzle's span
  static constexpr int kCols = 32;                   // slice columns (30 positions + 2 dropped)
  static constexpr int kSliceRows = 8;               // input rows a slice holds: 6 + 2
  static constexpr int kSliceBytes = kSliceRows * kCols * kRowBytes;  // a slice's TMA box
  static constexpr int kSlotBytes = kSliceBytes + 8 * kRowBytes;  // + 8 rows that the last tap reads past it
  static constexpr int kSlots = 3;
  static constexpr int kWeightBytes = 64 * kRowBytes;  // a tap's weights
  static constexpr int kWeightStages = kRowBytes == 128 ? 8 : 16;
  // wgmma instructions per tap (K 8 TF32, 16 bfloat16; Bf16x3: three products of two chunks)
  static constexpr int kSteps = Operand::kParts == 1 ? kRowBytes / 32 : 6;
  static constexpr int kPending = 3;                 // taps whose instructions may run while the next issues
  static constexpr int kPositions = 3 * kCols;        // a consumer's N: 3 rows of 32
  static constexpr int kAccumulators = kPositions / 2;  // 64 x 96 over 128 threads
  static constexpr int kPitch = kPositions + 4;       // stage-1 values' row in shared memory (banks)
  static constexpr int kValueBytes = 64 * kPitch * 4;  // a consumer's stage-1 values
  static constexpr int kClassBytes = 64 * kPitch;     // and classes
  static constexpr int kSlotsAt = 0;
  static constexpr int kWeightsAt = kSlotsAt + kSlots * kSlotBytes;
  static constexpr int kStage1At = kWeightsAt + kWeightStages * kWeightBytes;
  static constexpr int kSumsAt = kStage1At + 2 * (kValueBytes + kClassBytes);
  static constexpr int kBarriersAt = kSumsAt + 2 * 4 * 10 * 4;  // per consumer, warp and output column
  static constexpr int kBarriers = 2 * kSlots + 2 * kWeightStages;
  static constexpr int kSmemBytes = kBarriersAt + kBarriers * 8 + 1024;  // + alignment
  // (the TMA boxes at multiples of the swizzle's 8-row atom)
  static_assert(kSlotBytes % (8 * kRowBytes) == 0 && kWeightBytes % (8 * kRowBytes) == 0 &&
                kWeightsAt % (8 * kRowBytes) == 0 && kStage1At % 16 == 0 && kBarriersAt % 8 == 0);
  static_assert(kSmemBytes <= 227 * 1024);
};

// p.tap_operand for element type T from the taps u = (ud * 3 + uh) * 3 + uw of the classes in order
// (p.class_end[7] of them): tap (uh, uw) of rows r0 .. r0 + 2 reads slice rows from (r0 + uh) * 32 + uw on
// (module comment), in the slot of stage-1 depth + ud's slice.
template <typename T>
void set_tap_operands(TransposedCascade& p, const uint8_t* taps) {
  using C = TransposedCascadeConfig<T>;
  for (int r = 0; r < C::kSlots; ++r) {
    for (int e = 0; e < p.class_end[7]; ++e) {
      const int ud = taps[e] / 9, uh = taps[e] / 3 % 3, uw = taps[e] % 3;
      const int offset = (r + ud) % C::kSlots * C::kSlotBytes + (uh * C::kCols + uw) * C::kRowBytes;
      p.tap_operand[r][e] = static_cast<uint32_t>(ud) << 16 | static_cast<uint32_t>(offset / 16);
    }
  }
}

// The larger of a and b, NaN where either is (max.NaN): a max-pool's value by PyTorch's rule, the
// sign of a zero maximum aside (+0 over an equal -0, where PyTorch keeps the first).
__device__ __forceinline__ float nan_max(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// Offers element `element` of value v to a window's pick in scan order: where kPicks, its value and
// element (WindowPick's rule); else its value alone, which starts at -inf.
template <bool kPicks>
__device__ __forceinline__ void offer(WindowPick<float>& pick, float v, int element) {
  if constexpr (kPicks) {
    pick.update(v, element);
  } else {
    pick.value = nan_max(pick.value, v);
  }
}

// Offers element `element` of value v to a pick in scan order, as offer<true> does, and keeps `close`:
// whether another element lies within eps of the pick (CascadeCertify), given v's own (`v_close`: a
// near tie below it, of a stage-1 pick offered to stage 2). A NaN makes it close (picked again).
__device__ __forceinline__ void offer_close(WindowPick<float>& pick, bool& close, float v, int element, float eps,
                                            bool v_close = false) {
  const bool first = pick.offset < 0;
  const float before = pick.value;
  pick.update(v, element);
  if (first) {
    close = v_close;
  } else if (pick.offset == element) {
    close = v_close || !(v - before > eps);
  } else {
    close = close || !(before - v > eps);
  }
}

// An item's place: batch element n, output depth d2, output rows 2 row_tile + (0, 1), output
// columns 10 col_tile + (0 .. 9).
struct CascadeItem {
  int n, d2, row_tile, col_tile;
  __device__ CascadeItem(int64_t item, const TransposedCascade& p) {
    col_tile = static_cast<int>(item % p.col_tiles);
    item /= p.col_tiles;
    row_tile = static_cast<int>(item % p.row_tiles);
    item /= p.row_tiles;
    d2 = static_cast<int>(item % p.cells[0]);
    n = static_cast<int>(item / p.cells[0]);
  }
};

// out[n, 0, d2, h2, w2] for output row `row` (0, 1) of the item and its 10 columns: the sum over
// the output channels of value, where the 128 threads t of a named barrier `barrier` hold channel
// t / 2's columns 5 (t % 2) .. 5 (t % 2) + 4; summed within the warp (its 16 channels: lanes 2
// apart), then over the 4 warps through `sums` (40 floats).
__device__ __forceinline__ void store_channel_sums(const float (&value)[5], int row, const CascadeItem& at,
                                                   const TransposedCascade& p, float* sums, int barrier,
                                                   float* __restrict__ out) {
  const int t = threadIdx.x % 128, warp = t / 32, lane = t % 32, o = t / 2, first_col = 5 * (t % 2);
#pragma unroll
  for (int k = 0; k < 5; ++k) {
    float sum = o < p.out_channels ? value[k] : 0.f;
#pragma unroll
    for (int lanes = 2; lanes < 32; lanes *= 2) sum += __shfl_xor_sync(0xffffffffu, sum, lanes);
    if (lane < 2) sums[warp * 10 + first_col + k] = sum;
  }
  asm volatile("bar.sync %0, 128;" ::"r"(barrier) : "memory");
  const int h2 = 2 * at.row_tile + row, w2 = 10 * at.col_tile + t;
  if (t < 10 && h2 < p.cells[1] && w2 < p.cells[2]) {
    out[((int64_t{at.n} * p.cells[0] + at.d2) * p.cells[1] + h2) * p.cells[2] + w2] =
        ((sums[t] + sums[10 + t]) + sums[20 + t]) + sums[30 + t];
  }
}

// The CTA's cell item (module comment): out[n, 0, d2, h2, w2] for its 2 x 10 output cells and,
// where kPicks, picks[n, d2, h2, w2, o] = stage-2 offset * 8 + class (without, the maxima's values
// alone: fewer instructions between the classes' sums). x_map: x as
// (R, W, H, D, N) innermost first, boxes (R, 32, 8, 1, 1), R = kRowElements (32 channels, Bf16x3 64
// parts); w_map: the taps' weights as (R, 64 output channels, taps, 1), boxes (R, 64, 1, 1); both swizzled across
// their rows (128 or 64 bytes). A CTA past p.whole_items takes a part of an item (module comment:
// never with picks) and writes its maxima to partial (split item, part, row, channel, column),
// (., ., 2, 64, 10).
template <typename T, bool kPicks>
__global__ void __launch_bounds__(TransposedCascadeConfig<T>::kThreads, 1)
    conv_transpose3d_cascade_sum_kernel(const __grid_constant__ CUtensorMap x_map,
                                        const __grid_constant__ CUtensorMap w_map, float* __restrict__ out,
                                        uint8_t* __restrict__ picks, float* __restrict__ partial,
                                        const __grid_constant__ TransposedCascade p, const CascadeCertify certify) {
  using C = TransposedCascadeConfig<T>;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* const smem = smem_raw + (1024 - shared_address(smem_raw) % 1024) % 1024;
  uint64_t* const slot_full = reinterpret_cast<uint64_t*>(smem + C::kBarriersAt);
  uint64_t* const slot_empty = slot_full + C::kSlots;
  uint64_t* const weight_full = slot_empty + C::kSlots;
  uint64_t* const weight_empty = weight_full + C::kWeightStages;

  // the item, and the stage-1 depths and classes this CTA takes of it (all, or its part's)
  int64_t item = blockIdx.x, part = -1;
  const int parts = p.parts();
  int depth_begin = 0, depths = 3, class_begin = 0, class_end = 8;
  if (item >= p.whole_items) {
    part = (item - p.whole_items) % parts;
    item = p.whole_items + (item - p.whole_items) / parts;
    const int group = static_cast<int>(part % p.class_groups);
    depth_begin = static_cast<int>(part / p.class_groups);
    depths = 1;
    class_begin = group == 0 ? 0 : p.group_end[group - 1];
    class_end = p.group_end[group];
  }
  const CascadeItem at(item, p);
  const int first_tap = class_begin == 0 ? 0 : p.class_end[class_begin - 1], last_tap = p.class_end[class_end - 1];
  const int taps = last_tap - first_tap;  // per stage-1 depth

  if (threadIdx.x == 0) {
    for (int s = 0; s < C::kSlots; ++s) {
      barrier_init(&slot_full[s]);
      barrier_init(&slot_empty[s], 2 * 128);  // every consumer thread
    }
    for (int s = 0; s < C::kWeightStages; ++s) {
      barrier_init(&weight_full[s]);
      barrier_init(&weight_empty[s], 2 * 128);
    }
  }
  __syncthreads();

  if (threadIdx.x < 128) {  // the producer
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (threadIdx.x == 0) {
      // slice j: input depth 3 d2 + start_d + depth_begin + j, rows from 6 row_tile + start_h, columns
      // from 30 col_tile + start_w
      int loaded = 0;
      const auto load_slice = [&](int j) {
        const int slot = j % C::kSlots;
        if (j >= C::kSlots) barrier_wait(&slot_empty[slot], ((j / C::kSlots) - 1) & 1);
        barrier_arrive_expect(&slot_full[slot], C::kSliceBytes);
        tensor_load_5d(smem + C::kSlotsAt + slot * C::kSlotBytes, x_map, 0, 30 * at.col_tile + p.start[2],
                       6 * at.row_tile + p.start[1], 3 * at.d2 + p.start[0] + depth_begin + j, at.n, &slot_full[slot]);
        loaded = j + 1;
      };
      for (int j = 0; j < C::kSlots && j < depths + 2; ++j) load_slice(j);
      int stage = 0;
      uint32_t phase = 0;
      for (int depth = 0; depth < depths; ++depth) {
        for (int e = first_tap; e < last_tap; ++e) {
          // slice depth + 2 replaces depth - 1's once the weights ring is primed for this depth
          if (depth > 0 && e - first_tap == (taps < C::kWeightStages ? taps : C::kWeightStages) - 1) {
            load_slice(depth + 2);
          }
          barrier_wait(&weight_empty[stage], phase ^ 1);
          barrier_arrive_expect(&weight_full[stage], C::kWeightBytes);
          tensor_load_4d(smem + C::kWeightsAt + stage * C::kWeightBytes, w_map, 0, 0, e, 0, &weight_full[stage]);
          if (++stage == C::kWeightStages) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
      // every slice landed before the CTA may exit: the consumers wait only for slices their taps read
      for (int j = loaded > C::kSlots ? loaded - C::kSlots : 0; j < loaded; ++j) {
        barrier_wait(&slot_full[j % C::kSlots], (j / C::kSlots) & 1);
      }
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<232>();
  const int consumer = threadIdx.x / 128 - 1;  // stage-1 rows 3 consumer .. 3 consumer + 2 of the tile
  const int t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
  float* const values = reinterpret_cast<float*>(smem + C::kStage1At + consumer * (C::kValueBytes + C::kClassBytes));
  uint8_t* const classes = reinterpret_cast<uint8_t*>(values) + C::kValueBytes;
  float* const sums = reinterpret_cast<float*>(smem + C::kSumsAt) + consumer * 4 * 10;
  // stage 2: this thread's output channel o = t / 2 and output columns 5 (t % 2) .. 5 (t % 2) + 4
  const int o = t / 2, first_col = 5 * (t % 2);
  const WindowPick<float> none{kPicks ? 0.f : -INFINITY, -1};  // a pick before any element
  // certified picks (CascadeCertify): eps of this thread's stage-1 channels (16 warp + lane / 4, + 8) and of o
  constexpr bool kCertify = kPicks && std::is_same_v<T, Bf16x3>;
  float eps1[2] = {0.f, 0.f}, eps2 = 0.f;
  if constexpr (kCertify) {
    const float scale = kCertifyEps * *certify.x_max;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int channel = 16 * warp + lane / 4 + 8 * h;
      eps1[h] = channel < p.out_channels ? scale * certify.tap_bound[channel] : 0.f;
    }
    eps2 = o < p.out_channels ? scale * certify.tap_bound[o] : 0.f;
  }
  bool cell_close[5] = {};  // (certified picks: a near tie in the cell's window so far)
  WindowPick<float> cell[5];
#pragma unroll
  for (int k = 0; k < 5; ++k) cell[k] = none;

  // The taps in order (depth, then class order), the item's tap i in weight stage i mod kWeightStages
  // (power-of-two stages: a counter's bits give the stage and the barriers' phase). The wgmma
  // descriptors as a fixed high word and a low word (the start address in 16-byte units, which
  // no offset within shared memory carries past its 14 bits) moved by each tap's tap_operand:
  // the tap loop's uniform instructions read it from the parameters (no shared-memory table).
  // (A per-class count of taps and a fixed release below: the same releases counted across the
  // classes by a loop ran 40% slower.)
  static_assert((C::kWeightStages & (C::kWeightStages - 1)) == 0);
  const uint64_t a_first = swizzled_tile_descriptor<C::kRowBytes>(smem + C::kWeightsAt);
  const uint64_t b_first =
      swizzled_tile_descriptor<C::kRowBytes>(smem + C::kSlotsAt + 3 * consumer * C::kCols * C::kRowBytes);
  const uint32_t a_low = static_cast<uint32_t>(a_first), b_low = static_cast<uint32_t>(b_first);
  const uint64_t high = a_first & ~uint64_t{0xffffffffu};  // (the same for both: their layouts match)
  uint32_t taps_done = 0;  // the item's taps issued: stage taps_done % kWeightStages
  for (int depth = depth_begin; depth < depth_begin + depths; ++depth) {
    const int slice0 = depth - depth_begin;  // the slice of ud = 0
    const uint32_t* const operands = p.tap_operand[slice0 % C::kSlots];
    int ready = -1;  // the depth's slices ud <= ready are known to have landed
    WindowPick<float> pick[C::kAccumulators];  // stage 1, over the classes in scan order
    uint64_t close1 = 0;                       // (certified picks: bit j, a near tie in pick j's window)
#pragma unroll
    for (int j = 0; j < C::kAccumulators; ++j) pick[j] = none;
    for (int q = class_begin; q < class_end; ++q) {
      float acc[C::kAccumulators];
#pragma unroll
      for (int j = 0; j < C::kAccumulators; ++j) acc[j] = 0.f;
      int issued = 0;  // this class's taps so far
      const int end = p.class_end[q];
      for (int e = q == 0 ? 0 : p.class_end[q - 1]; e < end; ++e) {
        const uint32_t operand = operands[e];
        const int ud = static_cast<int>(operand >> 16);
        for (; ready < ud; ++ready) {  // (a class's taps run through ud in order)
          const int slice = slice0 + ready + 1;
          barrier_wait(&slot_full[slice % C::kSlots], (slice / C::kSlots) & 1);
        }
        const uint32_t stage = taps_done % C::kWeightStages;
        barrier_wait(&weight_full[stage], (taps_done / C::kWeightStages) & 1);
        const uint32_t a = a_low + stage * (C::kWeightBytes / 16), b = b_low + (operand & 0xffffu);
#pragma unroll
        for (int j = 0; j < C::kAccumulators; ++j) cute::warpgroup_fence_operand(acc[j]);
        cute::warpgroup_arrive();
#pragma unroll
        for (int step = 0; step < C::kSteps; ++step) {  // (32 bytes along K a step)
          wgmma_ss<typename C::Element, C::kPositions>(high | (a + 2 * C::Operand::a_chunk(step)),
                                                       high | (b + 2 * C::Operand::b_chunk(step)), acc,
                                                       std::make_index_sequence<C::kAccumulators>{});
        }
        cute::warpgroup_commit_batch();
        // all but the kPending latest taps' instructions are done: the tap kPending back frees its stage
        cute::warpgroup_wait<C::kPending>();
#pragma unroll
        for (int j = 0; j < C::kAccumulators; ++j) cute::warpgroup_fence_operand(acc[j]);
        if (issued++ >= C::kPending) barrier_arrive(&weight_empty[(taps_done - C::kPending) % C::kWeightStages]);
        ++taps_done;
      }
      cute::warpgroup_wait<0>();
#pragma unroll
      for (int j = 0; j < C::kAccumulators; ++j) cute::warpgroup_fence_operand(acc[j]);
      for (int k = issued < C::kPending ? issued : C::kPending; k > 0; --k) {
        barrier_arrive(&weight_empty[(taps_done - k) % C::kWeightStages]);
      }
#pragma unroll
      for (int j = 0; j < C::kAccumulators; ++j) {
        // (bfloat16: the sums rounded as the original's y is)
        const float v = std::is_same_v<T, __nv_bfloat16> ? __bfloat162float(__float2bfloat16_rn(acc[j])) : acc[j];
        if constexpr (kCertify) {
          bool close = (close1 >> j) & 1;
          offer_close(pick[j], close, v, q, eps1[j % 4 >= 2]);
          close1 = close ? close1 | (uint64_t{1} << j) : close1 & ~(uint64_t{1} << j);
        } else {
          offer<kPicks>(pick[j], v, q);
        }
      }
    }
    barrier_arrive(&slot_empty[(depth - depth_begin) % C::kSlots]);  // the depth's first slice is read last here

    // the stage-1 picks to shared memory: accumulator j is output channel 16 warp + lane / 4
    // (+ 8 for j % 4 >= 2), position 8 (j / 4) + 2 (lane % 4) + j % 2 = row * 32 + column
#pragma unroll
    for (int j = 0; j < C::kAccumulators; ++j) {
      const int channel = 16 * warp + lane / 4 + (j % 4 >= 2 ? 8 : 0);
      const int position = 8 * (j / 4) + 2 * (lane % 4) + j % 2;
      values[channel * C::kPitch + position] = pick[j].value;
      // (certified picks: a near tie as the class byte's bit 7)
      if constexpr (kPicks) {
        classes[channel * C::kPitch + position] =
            static_cast<uint8_t>(pick[j].offset | (kCertify && ((close1 >> j) & 1) ? 0x80 : 0));
      }
    }
    asm volatile("bar.sync %0, 128;" ::"r"(1 + consumer) : "memory");
    // stage 2 in scan order: depth, row, column
#pragma unroll
    for (int k = 0; k < 5; ++k) {
#pragma unroll
      for (int r = 0; r < 3; ++r) {
#pragma unroll
        for (int c = 0; c < 3; ++c) {
          const int position = r * C::kCols + 3 * (first_col + k) + c;
          const int byte = kPicks ? classes[o * C::kPitch + position] : 0;
          const int element = kPicks ? ((depth * 3 + r) * 3 + c) * 8 + (byte & 7) : 0;
          if constexpr (kCertify) {
            offer_close(cell[k], cell_close[k], values[o * C::kPitch + position], element, eps2, byte >> 7);
          } else {
            offer<kPicks>(cell[k], values[o * C::kPitch + position], element);
          }
        }
      }
    }
    asm volatile("bar.sync %0, 128;" ::"r"(1 + consumer) : "memory");
  }

  if constexpr (!kPicks) {  // (the schedule splits items only without picks)
    if (part >= 0) {
      float* const maxima = partial + (((item - p.whole_items) * parts + part) * 2 + consumer) * 64 * 10;
#pragma unroll
      for (int k = 0; k < 5; ++k) maxima[o * 10 + first_col + k] = cell[k].value;
      return;
    }
  }
  if constexpr (kPicks) {
    const int h2 = 2 * at.row_tile + consumer;
    const int64_t row_cell = ((int64_t{at.n} * p.cells[0] + at.d2) * p.cells[1] + h2) * p.cells[2];
#pragma unroll
    for (int k = 0; k < 5; ++k) {
      const int w2 = 10 * at.col_tile + first_col + k;
      if (h2 < p.cells[1] && o < p.out_channels && w2 < p.cells[2]) {
        const int64_t index = (row_cell + w2) * p.out_channels + o;
        picks[index] = static_cast<uint8_t>(cell[k].offset);
        if constexpr (kCertify) {
          if (cell_close[k]) certify.windows[atomicAdd(certify.count, 1)] = static_cast<int>(index);
        }
      }
    }
  }
  float value[5];
#pragma unroll
  for (int k = 0; k < 5; ++k) value[k] = cell[k].value;
  store_channel_sums(value, consumer, at, p, sums, 1 + consumer, out);
}

// out of the split items (module comment): a CTA of 128 threads per split item and output row,
// thread t taking channel t / 2's columns 5 (t % 2) .. + 4, the maximum of the parts' maxima
// (max.NaN, as the kernel takes its maxima without picks), then the channels' sum in the kernel's
// order (bitwise the whole item's result).
__global__ void __launch_bounds__(128)
    cascade_parts_sum_kernel(const float* __restrict__ partial, float* __restrict__ out,
                             const __grid_constant__ TransposedCascade p) {
  __shared__ float sums[4 * 10];
  const int64_t split = blockIdx.x / 2;
  const int row = blockIdx.x % 2, parts = p.parts();
  const int t = threadIdx.x, o = t / 2, first_col = 5 * (t % 2);
  float value[5];
#pragma unroll
  for (int k = 0; k < 5; ++k) value[k] = -INFINITY;
  for (int part = 0; part < parts; ++part) {
    const float* const maxima = partial + ((split * parts + part) * 2 + row) * 64 * 10;
#pragma unroll
    for (int k = 0; k < 5; ++k) value[k] = nan_max(value[k], maxima[o * 10 + first_col + k]);
  }
  store_channel_sums(value, row, CascadeItem(p.whole_items + split, p), p, sums, 1, out);
}

}  // namespace fused_ops
