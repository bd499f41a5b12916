// A's convolution on wgmma (issue 46 item 1): the kernel of conv3d_max_pool3d_mean's calls of SPEC's shape
// (conv3d_max_pool3d_mean.cu) and of bench/extensions/conv3d_wgmma_prototype.cu's (which times its variants
// for bench/bench_conv3d_wgmma_prototype.py). y = conv3d(x, w) + bias,
// x (N, 8, D, H, 64) read channels-last (NDHWC), w (16, 8, 3, 3, 3), sums in float32: float32 by TF32 wgmma
// (two operand layouts, below) or bfloat16; its epilogue (Epilogue) writes either y (N, 16, D', H', W') float32
// channels_last_3d, or conv3d_max_pool3d_mean's result: y / divisor (PyTorch's division by a number, rounded to
// x's type), 2 x 2 x 2 max-pool windows, their maxima's mean per (n, o), and (kMeanAndPicks) each window's pick
// by PyTorch's rule (WindowPick: one byte, its scan-order offset).
//
// GEMM rows are x's positions in its own row layout (W = 64: an output row's 64 positions, 62 kept, are one
// m64 tile), N = the 16 output channels, K = 27 taps x 8 channels. Tap (t, r, s)'s A operand for output row
// h of plane z is x plane z + t's rows from (h + r) * 64 + s: a staged box of x rows serves all 9 taps (r, s)
// of its plane at offsets of (r * 64 + s) rows (descriptors, or with A in registers ldmatrix addresses), no
// im2col copies. The operand layouts (Layouts):
// - Tf32Swizzled: rows of 8 channels (32 bytes), 32-byte swizzled; a descriptor at any row (wgmma swizzles by
//   the shared address, as TMA writes: wgmma_ss.cuh's note, shown there for 128-byte rows), k8 a tap;
// - Tf32Planes: two planes of 4 channels (rows of 16 bytes, no swizzle: K-major core matrices of 8 rows x 16
//   bytes at any 16-byte offset), the K chunks a plane apart, k8 a tap;
// - Bf16Pairs: rows of 8 bfloat16 channels (16 bytes, no swizzle), k16 = two taps a step, their K chunks rows
//   apart: (r, s), (r, s + 1) one row, (0, 2), (1, 2) 64 rows; (2, 2) with a zero chunk: 5 steps a plane.
// B = the step's weights, (16 output channels) x K, K-major in the same layout.
//
// A CTA (persistent over columns): a tile is 2 output planes (z0, z0 + 1) x 4 output rows (h0 .. h0 + 3) of one
// n; its 4 stages are x planes z0 .. z0 + 3, rows h0 .. h0 + 5 (TMA boxes, zeros past x's end); stage j adds
// tap t = j - zo to output plane z0 + zo. A column is T consecutive tiles of an (n, row block), z0 = 2 pp0, 2 pp0 +
// 2, ...: its x planes are staged once each, in order (the ring's items), two consecutive tiles sharing two of
// them, so x is staged 1.5 (T + 1) / T times (1.71 at SPEC's shape, T = 7) where a tile's own 4 planes staged it 3
// times (T = 1 still where small batches spread over the SMs: tiles_of). One producer warp group (a thread
// issues the boxes), two consumer warp groups taking alternate tiles (ping-pong: one's epilogue runs while the
// other's wgmma instructions do), each all 4 rows of its tile (8 m64 n16 accumulators of 8 floats: 2 planes x 4
// rows). With A from shared memory a TF32 m64 n16 k8 instruction reads 2.5 KB (A 2 KB, B 0.5) for 8192 MACs,
// over what shared memory serves; the RS layouts (the library's) load each A fragment into registers once a
// stage, for every tap and output plane that reads it (consume_tile_row_fragments,
// consume_tile_bf16_row_fragments). Pooled, a row pair is one row of pool windows over both planes: a lane holds
// 4 of a window's elements (column w), lane ^ 4 the other 4 (column w ^ 1); their picks merge by a shuffle.
//
// kNcdhw: x float32 NCDHW as A's module passes it (no channels-last copy): TMA boxes of x as it lies (8 channel
// planes of 6 rows x 64) into four staging slots, which the producer warp group's 128 threads convert into the
// stage's layout (TF32 rounded to nearest, or bfloat16) with 16-byte stores, fenced for the async proxy (wgmma's
// reads of the SS layouts' stages).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>

// (bulk_copy.cuh before CUTLASS's headers, which include cudaTypedefs.h inside their namespace)
#include "bulk_copy.cuh"
#include "cutlass/arch/reg_reconfig.h"
#include "../max_pool3d.h"  // (WindowPick)
#include "mma.cuh"          // (round_pair_to, Tf32Mma, Mma16)
#include "wgmma_ss.cuh"

namespace fused_ops::wgmma_conv3d {

constexpr int kChannelsIn = 8, kChannelsOut = 16, kRow = 64;  // I, O, x's row (W)
constexpr int kTileRows = 4, kTilePlanes = 2;                   // output rows and planes a tile
constexpr int kBoxRows = kTileRows + 2, kStagesPerTile = kTilePlanes + 2;
// The ring's stages: two tiles' (T = 1: consumer c's tiles' items always in stages 4c .. 4c + 3, so that each
// waits on and releases its own items only). Columns (T > 1) share items: both consumers wait on every item's
// full phase, in order, and release every item (passing those their tiles do not read: pass_stage). An mbarrier
// tells a phase's parity, not its number: a consumer waiting on a stage whose previous phase (an item it had not
// waited on) had not completed would see the parity it waits for already complete and read the stage early
// (session 34: six stages, each consumer waiting on its own tiles' items only, got a few tiles wrong in some
// runs). T = 1 passes nothing: passing where tiles are apart makes a consumer's epilogue hold the other's next
// stages (H200, SPEC's A, TF32 with picks, one ncu launch each: 321 -> 485 us).
constexpr int kStages = 2 * kStagesPerTile;
constexpr int kThreads = 384;  // the producer warp group, two consumers
constexpr int kPad = 1024;     // past each box: a tap's rows read up to 3 rows beyond it (kept zero)

// A K-major tile without swizzling at `tile`: core matrices of 8 rows x 16 bytes (rows 16 bytes apart), the
// 8-row groups `sbo` bytes apart, the K chunks `lbo` bytes apart.
__device__ __forceinline__ uint64_t interleaved_tile_descriptor(const void* tile, uint32_t lbo, uint32_t sbo) {
  cute::GmmaDescriptor d;
  d.bitfield.start_address_ = static_cast<uint16_t>(shared_address(tile) >> 4);
  d.bitfield.leading_byte_offset_ = static_cast<uint16_t>(lbo >> 4);
  d.bitfield.stride_byte_offset_ = static_cast<uint16_t>(sbo >> 4);
  d.bitfield.base_offset_ = 0;
  d.bitfield.layout_type_ = 0;  // INTERLEAVE: no swizzle
  return d.desc_;
}

// v[0 .. 3] rounded to TF32 (to nearest, as cuDNN rounds) as one 16-byte word (kNcdhw's producer).
__device__ __forceinline__ uint4 tf32_quad(const float* v) {
  return make_uint4(Tf32Mma::pack(v[0], 0.f), Tf32Mma::pack(v[1], 0.f), Tf32Mma::pack(v[2], 0.f),
                    Tf32Mma::pack(v[3], 0.f));
}

struct Tf32Swizzled {
  using T = float;
  static constexpr int kBoxes = 1, kBoxBytes = kBoxRows * kRow * 32, kBoxStride = kBoxBytes + kPad;
  static constexpr int kSteps = 9;  // a plane's wgmma: the (r, s) taps
  static constexpr CUtensorMapSwizzle kSwizzle = CU_TENSOR_MAP_SWIZZLE_32B;
  static constexpr int kBoxChannels = 8;
  // the weights: kWeightSteps x kWeightRows rows of kBoxChannels (the TMA box's order): (tap, o) rows
  static constexpr int kWeightSteps = 27, kWeightRows = 16;
  static constexpr int kWeightBytes = kWeightSteps * kWeightRows * kBoxChannels * sizeof(T);
  static constexpr bool kRegisterA = false;  // (A from shared memory: wgmma's SS form)
  // A's descriptor for output row `row` of the tile (0 .. 3) at step `step` of a plane: a_base(box) (a stage's,
  // once) plus a_offset(row, step) (a constant: the descriptors' arithmetic out of the wgmma loop); B's for tap
  // t's step: b_base(weights) plus b_bytes(t, step) / 16
  static __device__ uint64_t a_base(const unsigned char* box) { return swizzled_tile_descriptor<32>(box); }
  static constexpr uint64_t a_offset(int row, int step) { return ((row + step / 3) * kRow + step % 3) * 32 / 16; }
  static __device__ uint64_t b_base(const unsigned char* weights) { return swizzled_tile_descriptor<32>(weights); }
  static constexpr int b_bytes(int t, int step) { return (t * kSteps + step) * 16 * 32; }
  static __device__ void mma(uint64_t a, uint64_t b, float (&d)[8]) {
    cute::SM90::GMMA::MMA_64x16x8_F32TF32TF32_SS_TN<>::fma(a, b, d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]);
  }
  // position `row` of a stage's box (h 64 + w) from x's 8 channels v (kNcdhw's producer): rounded to TF32 (to
  // nearest, as cuDNN rounds), 16-byte chunk c / 4 of the 32-byte row at chunk (c / 4) ^ (row / 4 % 2) (the
  // 32-byte swizzle: address bit 4 ^= bit 7, the stage 1024-byte aligned)
  static __device__ void store_position(unsigned char* box, int row, const float (&v)[8]) {
#pragma unroll
    for (int chunk = 0; chunk < 2; ++chunk) {
      *reinterpret_cast<uint4*>(box + row * 32 + ((chunk ^ (row >> 2)) & 1) * 16) = tf32_quad(v + 4 * chunk);
    }
  }
};

struct Tf32Planes {
  using T = float;
  static constexpr int kBoxes = 2, kBoxBytes = kBoxRows * kRow * 16, kBoxStride = kBoxBytes + kPad;
  static constexpr int kSteps = 9;
  static constexpr CUtensorMapSwizzle kSwizzle = CU_TENSOR_MAP_SWIZZLE_NONE;
  static constexpr int kBoxChannels = 4;
  static constexpr int kWeightSteps = 27, kWeightRows = 2 * 16;  // (tap, chunk, o) rows of 4 channels
  static constexpr int kWeightBytes = kWeightSteps * kWeightRows * kBoxChannels * sizeof(T);
  static constexpr bool kRegisterA = false;
  static __device__ uint64_t a_base(const unsigned char* box) {
    return interleaved_tile_descriptor(box, kBoxStride, 128);
  }
  static constexpr uint64_t a_offset(int row, int step) { return ((row + step / 3) * kRow + step % 3) * 16 / 16; }
  static __device__ uint64_t b_base(const unsigned char* weights) {
    return interleaved_tile_descriptor(weights, 256, 128);
  }
  static constexpr int b_bytes(int t, int step) { return (t * kSteps + step) * 512; }
  static __device__ void mma(uint64_t a, uint64_t b, float (&d)[8]) {
    cute::SM90::GMMA::MMA_64x16x8_F32TF32TF32_SS_TN<>::fma(a, b, d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]);
  }
  // (channels 0-3 in the first box's row, 4-7 in the second's, rounded to TF32)
  static __device__ void store_position(unsigned char* box, int row, const float (&v)[8]) {
#pragma unroll
    for (int plane = 0; plane < 2; ++plane) {
      *reinterpret_cast<uint4*>(box + plane * kBoxStride + row * 16) = tf32_quad(v + 4 * plane);
    }
  }
};

// A's fragment for wgmma's RS form by one ldmatrix.x4 (four 8 x 16-byte matrices, each lane one row's
// address: matrix lane / 8): register i from matrix i, fenced for the wgmma instructions that read it.
__device__ __forceinline__ void load_a_fragment(uint32_t address, uint32_t (&a)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(address));
#pragma unroll
  for (int i = 0; i < 4; ++i) cute::warpgroup_fence_operand(a[i]);
}

// Tf32Swizzled's stages and weights with A from registers (wgmma's RS form): each consumer warp loads its 16
// rows of a row's A (a tap's 64 positions x 8 channels) by one ldmatrix.x4 (8 x 16-byte rows a matrix: rows
// 0-7 and 8-15 of channels 0-3, then of channels 4-7, as wgmma's TF32 A fragment lies: (row lane / 4 (+ 8),
// channel lane % 4 (+ 4))); one fragment serves the instructions of every tap and output plane that read it
// (consume_tile_row_fragments), and a stage is free as soon as its fragments are loaded.
struct Tf32SwizzledRegisterA : Tf32Swizzled {
  static constexpr bool kRegisterA = true;
  // This lane's ldmatrix address of output row `row`'s A at step `step` (tap (r, s) = (step / 3, step % 3)) in
  // a stage at shared address `box` (1024-byte aligned): matrix lane / 8's row lane % 8, i.e. box position
  // (row + r) 64 + s + 16 warp + lane % 8 + 8 (lane / 8 % 2), its 16-byte chunk lane / 16, swizzled as TMA
  // writes 32-byte rows (address bit 4 ^= bit 7). The swizzle depends on s and the lane only (the rest moves
  // the address by multiples of 256 bytes): lanes() once a tile, a_address() a constant added.
  static __device__ void lanes(int warp, int lane, uint32_t (&l)[3]) {
#pragma unroll
    for (int s = 0; s < 3; ++s) {
      const uint32_t address = (16 * warp + (lane & 7) + 8 * ((lane >> 3) & 1) + s) * 32 + (lane >> 4) * 16;
      l[s] = address ^ ((address >> 3) & 16);
    }
  }
  static __device__ uint32_t a_address(uint32_t box, const uint32_t (&l)[3], int row, int step) {
    return box + l[step % 3] + (row + step / 3) * kRow * 32;
  }
  static __device__ void mma(const uint32_t (&a)[4], uint64_t b, float (&d)[8]) {
    cute::SM90::GMMA::MMA_64x16x8_F32TF32TF32_RS_TN<>::fma(a[0], a[1], a[2], a[3], b, d[0], d[1], d[2], d[3], d[4],
                                                             d[5], d[6], d[7]);
  }
};

struct Bf16Pairs {
  using T = __nv_bfloat16;
  static constexpr int kBoxes = 1, kBoxBytes = kBoxRows * kRow * 16, kBoxStride = kBoxBytes + kPad;
  static constexpr int kSteps = 5;  // tap pairs a plane
  static constexpr CUtensorMapSwizzle kSwizzle = CU_TENSOR_MAP_SWIZZLE_NONE;
  static constexpr int kBoxChannels = 8;
  static constexpr int kWeightSteps = 3 * 5, kWeightRows = 2 * 16;  // ((t, step), (chunk, o)) rows of 8 channels
  static constexpr int kWeightBytes = kWeightSteps * kWeightRows * kBoxChannels * sizeof(T);
  static constexpr bool kRegisterA = false;
  // step -> its first tap (r, s) and the rows to its second: (0, 0)(0, 1), (1, 0)(1, 1), (2, 0)(2, 1), (0, 2)(1, 2),
  // (2, 2)(zero weights: its chunk reads the box's zeroed pad, not x, whose inf or NaN would make 0 x inf a NaN)
  // a_base(box): the stage's, with no chunk offset (LBO); a_offset(row, step): the row's start and the step's LBO
  static __device__ uint64_t a_base(const unsigned char* box) { return interleaved_tile_descriptor(box, 0, 128); }
  static constexpr int a_bytes(int row, int step) {
    return ((row + (step < 3 ? step : 2 * (step - 3))) * kRow + (step < 3 ? 0 : 2)) * 16;
  }
  static constexpr uint64_t a_offset(int row, int step) {
    const int lbo = step < 3 ? 16 : step == 3 ? kRow * 16 : kBoxBytes - a_bytes(row, step);
    // (the descriptor's start address, bits 0-13, and LBO, bits 16-29, both in 16-byte units)
    return static_cast<uint64_t>(a_bytes(row, step) / 16) + (static_cast<uint64_t>(lbo / 16) << 16);
  }
  static __device__ uint64_t b_base(const unsigned char* weights) {
    return interleaved_tile_descriptor(weights, 256, 128);
  }
  static constexpr int b_bytes(int t, int step) { return (t * kSteps + step) * 512; }
  static __device__ void mma(uint64_t a, uint64_t b, float (&d)[8]) {
    cute::SM90::GMMA::MMA_64x16x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>::fma(
        a, b, d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]);
  }
  // (the 8 channels rounded to bfloat16, to nearest even, as .to() rounds: one 16-byte row)
  static __device__ void store_position(unsigned char* box, int row, const float (&v)[8]) {
    using Pack = Mma16<true>;
    *reinterpret_cast<uint4*>(box + row * 16) =
        make_uint4(Pack::pack(v[0], v[1]), Pack::pack(v[2], v[3]), Pack::pack(v[4], v[5]), Pack::pack(v[6], v[7]));
  }
};

// Bf16Pairs' stages and weights with A from registers: bf16's A fragment (row lane / 4 (+ 8), K pair 2 (lane % 4)
// (+ 8)) by one ldmatrix.x4 a warp, matrices 0 and 1 the step's first tap (rows 0-7, 8-15), 2 and 3 its second:
// one position on for steps 0-2, one x row (64 positions) on for step 3; step 4's second tap is the zero-weight
// chunk, whose A registers are zeros (consume_tile_bf16_row_fragments composes steps 3 and 4's fragments).
struct Bf16PairsRegisterA : Bf16Pairs {
  static constexpr bool kRegisterA = true;
  // l[0]: position 16 warp + lane % 8 + 8 (lane / 8 % 2), one on for lanes 16-31; l[1]: 64 on for them (l[2]
  // unused: Tf32SwizzledRegisterA's three shifts)
  static __device__ void lanes(int warp, int lane, uint32_t (&l)[3]) {
    const uint32_t position = 16 * warp + (lane & 7) + 8 * ((lane >> 3) & 1), second = lane >> 4;
    l[0] = (position + second) * 16;
    l[1] = (position + 64 * second) * 16;
    l[2] = 0;
  }
  // (steps 0 .. 3)
  static __device__ uint32_t a_address(uint32_t box, const uint32_t (&l)[3], int row, int step) {
    return box + l[step == 3 ? 1 : 0] + a_bytes(row, step);
  }
  static __device__ void mma(const uint32_t (&a)[4], uint64_t b, float (&d)[8]) {
    cute::SM90::GMMA::MMA_64x16x16_F32BF16BF16_RS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>::fma(
        a[0], a[1], a[2], a[3], b, d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]);
  }
};

// kNcdhw: x float32 NCDHW (A's input as it comes), each stage's box from a staging slot of x's box as TMA lays
// it out, (8 channels, kBoxRows rows, 64 columns), converted into the layout by the producer warp group.
constexpr int kStagingSlots = 4, kStagingBytes = kChannelsIn * kBoxRows * kRow * 4;
constexpr int kPositionsPerThread = kBoxRows * kRow / 128;  // (the producer warp group's share of a box)
static_assert(kBoxRows * kRow % 128 == 0, "a box's positions a multiple of the producer's threads");

template <class L, bool kNcdhw>
struct Smem {
  static constexpr int kStageStride = L::kBoxes * L::kBoxStride;  // (multiples of 1024 bytes)
  static constexpr int kWeightStride = (L::kWeightBytes + 1023) / 1024 * 1024;
  static constexpr int kStaging = kNcdhw ? kStagingSlots * kStagingBytes : 0;
  static constexpr int kBarriers = 2 * kStages + 1 + (kNcdhw ? 2 * kStagingSlots : 0);
  static constexpr int kBytes = kStages * kStageStride + kWeightStride + kStaging + kBarriers * 8 + 1024;
};

// What the kernel writes: y; the pool's partial sums (its mean's); those and each window's pick.
enum class Epilogue { kY, kMean, kMeanAndPicks };

struct Conv3dTiles {
  int depth_out, height_out, width_out;  // D', H', W' (W' = 62)
  int plane_pairs, row_blocks;           // ceil(D' / 2), ceil(H' / 4)
  int tiles;                             // N plane_pairs row_blocks
  // a column: column_tiles consecutive plane pairs (a segment) of an (n, row block); its tiles' x planes, 2
  // column_tiles + 2 items (planes past x: zeros), staged once each; a CTA's are blockIdx.x, + gridDim.x, ...
  int segments, column_tiles, column_items;  // ceil(plane_pairs / column_tiles), its tiles, 2 column_tiles + 2
  int columns;                               // N row_blocks segments
  float reciprocal;                      // pooled: 1 / divisor, as PyTorch's CUDA division multiplies
  int pooled[3];                         // pooled: the windows (PD, PH, PW) = floor((D', H', W') / 2)
  uint8_t* picks;                        // kMeanAndPicks: (N, 16, PD, PH, PW)
  float* partial;                        // pooled: (tiles, 8 warps, 16): each warp's sum of its windows
};

// y's epilogue of a row pair's accumulators (planes z0 + zo, rows h0 + jj): fragment element e is row 16 warp +
// lane / 4 (+ 8 for e % 4 >= 2) of the m64 tile (the output column w), output channel 8 (e / 4) + 2 (lane % 4) +
// e % 2; y + bias written where inside y.
__device__ __forceinline__ void conv_epilogue(const float (&acc)[kTilePlanes][2][8], const float* __restrict__ bias,
                                              float* __restrict__ y, const Conv3dTiles& p, int n, int z0, int h0,
                                              int warp, int lane) {
#pragma unroll
  for (int zo = 0; zo < kTilePlanes; ++zo) {
    const int z = z0 + zo;
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
      const int h = h0 + jj;
      if (z >= p.depth_out || h >= p.height_out) continue;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int w = 16 * warp + lane / 4 + 8 * half;
        if (w >= p.width_out) continue;
        float* const out = y + ((static_cast<int64_t>(n) * p.depth_out + z) * p.height_out + h) * int64_t{p.width_out} *
                                   kChannelsOut + int64_t{w} * kChannelsOut;
#pragma unroll
        for (int e = 2 * half; e < 8; e += 4) {
          const int o = 8 * (e / 4) + 2 * (lane % 4);
          *reinterpret_cast<float2*>(out + o) = make_float2(acc[zo][jj][e] + bias[o], acc[zo][jj][e + 1] + bias[o + 1]);
        }
      }
    }
  }
}

// The larger of a and b, or NaN where either is (PTX max.NaN).
__device__ __forceinline__ float nan_max(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// The pool's epilogue of a row pair's accumulators (planes 2 pd + zo, rows 2 ph + jj): of y = (acc + bias) /
// divisor rounded as PyTorch rounds the convolution's output and the quotient (to T), this warp's sum of its
// windows' maxima per output channel into p.partial, and (kPicks) each window's pick, written where the window
// lies inside the pooled output. Without the picks a window's value is its maximum by max.NaN: PyTorch's pick's
// value (a NaN where the window holds one; of equal values, +-0, either adds the same to a sum begun at +0).
template <typename T, bool kPicks>
__device__ __forceinline__ void pool_epilogue(const float (&acc)[kTilePlanes][2][8], const float* __restrict__ bias,
                                              const Conv3dTiles& p, int tile, int n, int pd, int ph, int pair,
                                              int warp, int lane) {
  // (fragment elements e % 2 + 2 (e / 4): channels o = 8 (e / 4) + 2 (lane % 4) + e % 2)
  float sum[4] = {0.f, 0.f, 0.f, 0.f};
  // window (pd, ph, pw) of channel o at picks[(((n 16 + o) PD + pd) PH + ph) PW + pw]: this lane's row of windows of
  // its first channel, the others `channel` bytes apart (the index's arithmetic once a call, not once a window)
  const int64_t channel = int64_t{p.pooled[0]} * p.pooled[1] * p.pooled[2];
  const int64_t row_picks = (int64_t{n} * kChannelsOut + 2 * (lane % 4)) * channel +
                            (int64_t{pd} * p.pooled[1] + ph) * p.pooled[2];
  int64_t channel_picks[4];  // (fragment element k's channel: o = 8 (k / 2) + 2 (lane % 4) + k % 2)
#pragma unroll
  for (int k = 0; k < 4; ++k) channel_picks[k] = row_picks + (8 * (k / 2) + k % 2) * channel;
  const bool row_inside = pd < p.pooled[0] && ph < p.pooled[1];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int w = 16 * warp + lane / 4 + 8 * half, pw = w / 2;
    const bool inside = row_inside && pw < p.pooled[2];
    // y[k][2 zo + jj]: (acc + bias) rounded to T, times 1 / divisor rounded to T, for fragment elements e, e + 1 =
    // 2 half + 4 kp + (0, 1) (channels o, o + 1) side by side: their roundings by one conversion a pair; element
    // 2 zo + jj of this lane's half of the window, offset (2 zo + jj) 2 + w % 2 in it
    float y[4][2 * kTilePlanes];
#pragma unroll
    for (int kp = 0; kp < 2; ++kp) {
      const int e = 2 * half + 4 * kp, o = 8 * kp + 2 * (lane % 4);
#pragma unroll
      for (int zo = 0; zo < kTilePlanes; ++zo)
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          float a = acc[zo][jj][e] + bias[o], b = acc[zo][jj][e + 1] + bias[o + 1];
          round_pair_to<T>(a, b);
          a = __fmul_rn(a, p.reciprocal);
          b = __fmul_rn(b, p.reciprocal);
          round_pair_to<T>(a, b);
          y[2 * kp][2 * zo + jj] = a;
          y[2 * kp + 1][2 * zo + jj] = b;
        }
    }
    // Each window's pick by PyTorch's rule (the last NaN, else the first maximum in scan order): with no NaN
    // among the warp's values, by their maximum (max.NaN, which lets a NaN through: the test) and
    // WindowPick::first_maximum, in about half the instructions of update()'s element by element way, which a
    // NaN (or an inf - inf in the test's sum) sends the whole warp's windows through.
    float most[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) most[k] = nan_max(nan_max(y[k][0], y[k][1]), nan_max(y[k][2], y[k][3]));
    if constexpr (!kPicks) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        // (every lane shuffles: the partner's half of the window)
        const float value = nan_max(most[k], __shfl_xor_sync(0xffffffffu, most[k], 4));
        if (w % 2 == 0 && inside) sum[k] += value;
      }
      continue;
    }
    const float any = (most[0] + most[1]) + (most[2] + most[3]);
    const bool exact = __any_sync(0xffffffffu, any != any);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      WindowPick<float> pick;
      if (exact) {
#pragma unroll
        for (int i = 0; i < 4; ++i) pick.update(y[k][i], i * 2 + w % 2);
      } else {
        pick = WindowPick<float>::first_maximum(y[k], most[k], w % 2, 2);
      }
      // (every lane shuffles: the partner's elements of the window, offsets interleaved with this lane's)
      pick.merge(__shfl_xor_sync(0xffffffffu, pick.value, 4), __shfl_xor_sync(0xffffffffu, pick.offset, 4));
      if (w % 2 == 0 && inside) {
        p.picks[channel_picks[k] + pw] = static_cast<uint8_t>(pick.offset);
        sum[k] += pick.value;
      }
    }
  }
  // the warp's sums: lanes of one lane % 4 hold the same channels
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    sum[k] += __shfl_xor_sync(0xffffffffu, sum[k], 4);
    sum[k] += __shfl_xor_sync(0xffffffffu, sum[k], 8);
    sum[k] += __shfl_xor_sync(0xffffffffu, sum[k], 16);
    if (lane < 4) {
      p.partial[(static_cast<int64_t>(tile) * 8 + 4 * pair + warp) * kChannelsOut + 8 * (k / 2) + 2 * lane + k % 2] =
          sum[k];
    }
  }
}

// The accumulators fenced against the wgmma instructions in flight (their registers not moved across).
__device__ __forceinline__ void fence_accumulators(float (&acc)[2][kTilePlanes][2][8]) {
#pragma unroll
  for (int e = 0; e < 2 * kTilePlanes * 2 * 8; ++e) cute::warpgroup_fence_operand((&acc[0][0][0][0])[e]);
}

// This CTA's columns' x planes (the ring's items, in order) and tiles.
__device__ __forceinline__ int64_t cta_columns(const Conv3dTiles& p) {
  return p.columns > static_cast<int>(blockIdx.x) ? (p.columns - 1 - blockIdx.x) / gridDim.x + 1 : 0;
}
__device__ __forceinline__ int64_t cta_items(const Conv3dTiles& p) { return cta_columns(p) * p.column_items; }

// The CTA's column `local` (its columns counted from 0): sample n, row block rb, its first plane pair.
struct Column {
  int n, rb, pp0;
};
__device__ __forceinline__ Column cta_column(const Conv3dTiles& p, int local) {
  const int column = static_cast<int>(blockIdx.x) + local * static_cast<int>(gridDim.x), rest = column / p.row_blocks;
  return {rest / p.segments, column % p.row_blocks, rest % p.segments * p.column_tiles};
}

// The producer's walk over its CTA's items in order (the ring's boxes): x plane z = 2 pp0 + plane, rows h0 .. h0 + 5
// of sample n, for item `plane` of the CTA's column `local`: cta_column's divisions once a column, not on the TMA
// thread's path an item (its warp converts the next box only after it).
struct ItemWalk {
  int local = 0, plane = 0;
  Column c;
  __device__ explicit ItemWalk(const Conv3dTiles& p) : c(cta_column(p, 0)) {}
  __device__ int n() const { return c.n; }
  __device__ int z() const { return kTilePlanes * c.pp0 + plane; }
  __device__ int h0() const { return kTileRows * c.rb; }
  __device__ void advance(const Conv3dTiles& p) {
    if (++plane == p.column_items) {
      plane = 0;
      c = cta_column(p, ++local);
    }
  }
};

// The producer of kNcdhw: thread 0 loads x's boxes (8 channels, rows h0 .. h0 + 5, 64 columns of plane z) into
// the staging slots by TMA, kStagingSlots items ahead; the warp group's 128 threads convert each into its stage
// (3 positions a thread: 8 loads each a stride apart, conflict-free, then one or two 16-byte stores each), fence
// them for wgmma (the async proxy), and release the stage as full (an arrival each) and the slot as read.
template <class L>
__device__ void produce_from_ncdhw(const CUtensorMap& x_map, const Conv3dTiles& p, unsigned char* smem,
                                   float* staging, uint64_t* full, uint64_t* empty, uint64_t* staging_full,
                                   uint64_t* staging_empty) {
  using S = Smem<L, true>;
  const int64_t items = cta_items(p);
  ItemWalk walk(p);
  auto load = [&](int64_t item) {  // (thread 0, items in order)
    const int slot = static_cast<int>(item % kStagingSlots);
    barrier_arrive_expect(&staging_full[slot], kStagingBytes);
    tensor_load_5d(staging + slot * (kStagingBytes / 4), x_map, 0, walk.h0(), walk.z(), 0, walk.n(),
                   &staging_full[slot]);
    walk.advance(p);
  };
  if (threadIdx.x == 0) {
    for (int64_t item = 0; item < std::min<int64_t>(kStagingSlots, items); ++item) load(item);
  }
  for (int64_t item = 0; item < items; ++item) {
    const int slot = static_cast<int>(item % kStagingSlots), stage = static_cast<int>(item % kStages);
    barrier_wait(&staging_full[slot], static_cast<uint32_t>(item / kStagingSlots) & 1);
    barrier_wait(&empty[stage], (static_cast<uint32_t>(item / kStages) & 1) ^ 1);
    const float* const box = staging + slot * (kStagingBytes / 4);
    // (every load of the thread's positions before its first store: one warp a scheduler converts, and a
    // position at a time left it waiting on each load's latency, the consumers on it: ncu, session 37)
    float v[kPositionsPerThread][kChannelsIn];
#pragma unroll
    for (int i = 0; i < kPositionsPerThread; ++i)
#pragma unroll
      for (int c = 0; c < kChannelsIn; ++c) v[i][c] = box[c * kBoxRows * kRow + threadIdx.x + 128 * i];
#pragma unroll
    for (int i = 0; i < kPositionsPerThread; ++i) {
      L::store_position(smem + stage * S::kStageStride, threadIdx.x + 128 * i, v[i]);
    }
    fence_shared_to_async_proxy();  // (the stores, before wgmma reads them)
    barrier_arrive(&full[stage]);
    barrier_arrive(&staging_empty[slot]);
    if (threadIdx.x == 0 && item + kStagingSlots < items) {
      barrier_wait(&staging_empty[slot], static_cast<uint32_t>(item / kStagingSlots) & 1);
      load(item + kStagingSlots);
    }
  }
}

// A consumer's wait on item `item`'s stage and its release, for an item its tiles do not read (kStages says why).
__device__ __forceinline__ void pass_stage(uint64_t* full, uint64_t* empty, int64_t item) {
  const int stage = static_cast<int>(item % kStages);
  barrier_wait(&full[stage], static_cast<uint32_t>(item / kStages) & 1);
  barrier_arrive(&empty[stage]);
}

// Output row jj's wgmma at `step` for stage j from A (a descriptor in shared memory, or a fragment in registers),
// for each output plane zo whose tap t = j - zo lies in 0 .. 2.
template <class L, class A>
__device__ __forceinline__ void mma_planes(const A& a, uint64_t b_base, int step, int j, int jj,
                                           float (&acc)[2][kTilePlanes][2][8]) {
#pragma unroll
  for (int zo = 0; zo < kTilePlanes; ++zo) {
    const int t = j - zo;
    if (t >= 0 && t <= 2) L::mma(a, b_base + L::b_bytes(t, step) / 16, acc[jj / 2][zo][jj % 2]);
  }
}

// A consumer's tile (items first .. first + 3 of the ring) with A from shared memory: a stage's wgmma as one
// batch, the previous stage released once that batch's predecessor is done (wait<1>).
template <class L, bool kNcdhw>
__device__ __forceinline__ void consume_tile_shared_a(const unsigned char* smem, uint64_t b_base, uint64_t* full,
                                                      uint64_t* empty, int64_t first,
                                                      float (&acc)[2][kTilePlanes][2][8]) {
  int previous = -1;
#pragma unroll
  for (int j = 0; j < kStagesPerTile; ++j) {
    const int64_t item = first + j;
    const int stage = static_cast<int>(item % kStages);
    barrier_wait(&full[stage], static_cast<uint32_t>(item / kStages) & 1);
    const uint64_t a_base = L::a_base(smem + stage * Smem<L, kNcdhw>::kStageStride);
    fence_accumulators(acc);
    cute::warpgroup_arrive();
    // (each A descriptor, a row's at a step, serves both output planes; compile-time, j, zo and step unrolled)
#pragma unroll
    for (int step = 0; step < L::kSteps; ++step) {
#pragma unroll
      for (int jj = 0; jj < kTileRows; ++jj) mma_planes<L>(a_base + L::a_offset(jj, step), b_base, step, j, jj, acc);
    }
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<1>();  // the previous stage's instructions are done: it is free
    fence_accumulators(acc);
    if (previous >= 0) barrier_arrive(&empty[previous]);
    previous = stage;
  }
  cute::warpgroup_wait<0>();
  fence_accumulators(acc);
  barrier_arrive(&empty[previous]);
}

// A consumer's tile (items first .. first + 3) with A from registers (wgmma's RS form): each stage's taps in
// kBatches batches, batch n's fragments loaded by load(box, a, batch) into buffer n % 2 of a, then queued by
// issue(a, j, batch) as one wgmma batch. A buffer is reloaded only after wait<1> says batch n - 2, the last to read it, is done; a stage
// is released once its last batch's fragments are in registers (wgmma reads only B, the weights, from shared
// memory).
template <class L, bool kNcdhw, int kBatches, class Load, class Issue>
__device__ __forceinline__ void consume_tile_in_batches(const unsigned char* smem, uint64_t* full, uint64_t* empty,
                                                        int64_t first, float (&acc)[2][kTilePlanes][2][8],
                                                        Load&& load, Issue&& issue) {
  uint32_t a[2][kBoxRows][4];
#pragma unroll
  for (int j = 0; j < kStagesPerTile; ++j) {
    const int64_t item = first + j;
    const int stage = static_cast<int>(item % kStages);
    barrier_wait(&full[stage], static_cast<uint32_t>(item / kStages) & 1);
    const uint32_t box = shared_address(smem + stage * Smem<L, kNcdhw>::kStageStride);
#pragma unroll
    for (int batch = 0; batch < kBatches; ++batch) {
      const int n = j * kBatches + batch;
      if (n >= 2) cute::warpgroup_wait<1>();
      load(box, a[n % 2], batch);
      if (batch == kBatches - 1) barrier_arrive(&empty[stage]);
      fence_accumulators(acc);
      cute::warpgroup_arrive();
      issue(a[n % 2], j, batch);
      cute::warpgroup_commit_batch();
      fence_accumulators(acc);
    }
  }
  cute::warpgroup_wait<0>();
  fence_accumulators(acc);
}

// consume_tile_in_batches for a layout of one tap a step (step 3 r + s: Tf32SwizzledRegisterA): x row q's
// fragment at column shift s serves every tap (r, s) that reads it, for output row q - r and both output planes,
// so a stage loads its 6 rows x 3 shifts (18 ldmatrix a warp) instead of 4 output rows x 9 taps (36): shared
// memory was 73 % busy with a load a tap, the tensor pipe 29 % (ncu, session 36). A batch a shift: 6 fragments,
// then up to 24 wgmma in (r, row, plane) order (up to 8 accumulators apart before one is reused).
template <class L, bool kNcdhw>
__device__ __forceinline__ void consume_tile_row_fragments(const unsigned char* smem, uint64_t b_base, uint64_t* full,
                                                           uint64_t* empty, int64_t first, int warp, int lane,
                                                           float (&acc)[2][kTilePlanes][2][8]) {
  static_assert(L::kSteps == 9, "one tap a step");
  uint32_t lanes[3];
  L::lanes(warp, lane, lanes);
  const auto load = [&](uint32_t box, uint32_t(&a)[kBoxRows][4], int shift) {
#pragma unroll
    for (int q = 0; q < kBoxRows; ++q) load_a_fragment(L::a_address(box, lanes, q, shift), a[q]);
  };
  const auto issue = [&](const uint32_t(&a)[kBoxRows][4], int j, int shift) {
#pragma unroll
    for (int r = 0; r < 3; ++r) {
#pragma unroll
      for (int jj = 0; jj < kTileRows; ++jj) mma_planes<L>(a[jj + r], b_base, 3 * r + shift, j, jj, acc);
    }
  };
  consume_tile_in_batches<L, kNcdhw, 3>(smem, full, empty, first, acc, load, issue);
}

// consume_tile_in_batches for Bf16PairsRegisterA (two taps a step), each fragment loaded once a stage: its taps in
// two batches, (r, 0)(r, 1) for steps r = 0 .. 2 (x row q's fragment, matrices 2-3 one position on, serves output
// row q - r at step r: 6 ldmatrix), then the column shift 2 (x rows 2p and 2p + 1 at shift 2 by one ldmatrix, p =
// 0 .. 2; step 3's fragment of output row jj is rows jj and jj + 1's matrices, step 4's row jj + 2's beside zeros,
// the zero-weight chunk's): 9 ldmatrix a stage instead of 20.
template <class L, bool kNcdhw>
__device__ __forceinline__ void consume_tile_bf16_row_fragments(const unsigned char* smem, uint64_t b_base,
                                                                uint64_t* full, uint64_t* empty, int64_t first,
                                                                int warp, int lane,
                                                                float (&acc)[2][kTilePlanes][2][8]) {
  static_assert(L::kSteps == 5, "Bf16Pairs' steps");
  uint32_t lanes[3];
  L::lanes(warp, lane, lanes);
  const auto load = [&](uint32_t box, uint32_t(&a)[kBoxRows][4], int half) {
#pragma unroll
    for (int q = 0; q < (half == 0 ? kBoxRows : kBoxRows / 2); ++q) {
      load_a_fragment(L::a_address(box, lanes, half == 0 ? q : 2 * q, half == 0 ? 0 : 3), a[q]);
    }
  };
  const auto issue = [&](const uint32_t(&a)[kBoxRows][4], int j, int half) {
    // (matrices 0-1 of x row q at shift 2, in the second batch: pair q / 2's first or second half)
    const auto shift2 = [&](int q, int i) { return a[q / 2][2 * (q % 2) + i]; };
#pragma unroll
    for (int r = 0; r < (half == 0 ? 3 : 2); ++r) {
#pragma unroll
      for (int jj = 0; jj < kTileRows; ++jj) {
        if (half == 0) {
          mma_planes<L>(a[jj + r], b_base, r, j, jj, acc);
        } else if (r == 0) {  // (step 3: rows jj and jj + 1; composed fragments are copies that wgmma reads
          // asynchronously: ptxas keeps them until the wait that retires it, or serializes the wgmma with a warning,
          // which tools/check_cuda_compile.py fails on)
          const uint32_t rows[4] = {shift2(jj, 0), shift2(jj, 1), shift2(jj + 1, 0), shift2(jj + 1, 1)};
          mma_planes<L>(rows, b_base, 3, j, jj, acc);
        } else {  // (step 4: row jj + 2, zeros)
          const uint32_t row[4] = {shift2(jj + 2, 0), shift2(jj + 2, 1), 0, 0};
          mma_planes<L>(row, b_base, 4, j, jj, acc);
        }
      }
    }
  };
  consume_tile_in_batches<L, kNcdhw, 2>(smem, full, empty, first, acc, load, issue);
}

// x_map: x NDHWC as (8, 64, H, D, N) innermost first, boxes (L::kBoxChannels, 64, 6, 1, 1); or (kNcdhw) x
// float32 NCDHW as (64, H, D, 8, N), boxes (64, 6, 1, 8, 1); w_map: the layout's weights (L::kWeightBytes, one
// box); y (N, D', H', W', 16) float32, unused when pooled. bias float32.
template <class L, Epilogue kEpilogue, bool kNcdhw>
__global__ void __launch_bounds__(kThreads, 1)
    conv3d_wgmma_kernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap w_map,
                        const float* __restrict__ bias, float* __restrict__ y, const Conv3dTiles p) {
#ifdef FUSED_OPS_BULK_COPY  // (sm_90a's: TMA, wgmma; other targets' code traps, and runs_sm90a keeps calls away)
  using S = Smem<L, kNcdhw>;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* const smem = smem_raw + (1024 - shared_address(smem_raw) % 1024) % 1024;
  unsigned char* const weights = smem + kStages * S::kStageStride;
  float* const staging = reinterpret_cast<float*>(weights + S::kWeightStride);
  uint64_t* const full = reinterpret_cast<uint64_t*>(weights + S::kWeightStride + S::kStaging);
  uint64_t* const empty = full + kStages;
  uint64_t* const weights_landed = empty + kStages;
  uint64_t* const staging_full = weights_landed + 1;  // (kNcdhw)
  uint64_t* const staging_empty = staging_full + kStagingSlots;

  // the stages zeroed once: their pads (past each box, which TMA never writes) stay zero
  for (int i = threadIdx.x; i < kStages * S::kStageStride / 16; i += kThreads) {
    reinterpret_cast<uint4*>(smem)[i] = make_uint4(0, 0, 0, 0);
  }
  fence_shared_to_async_proxy();  // (before the copy engine writes there)
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      barrier_init(&full[s], kNcdhw ? 128 : 1);  // (the producer's threads, or its TMA thread's arrival)
      barrier_init(&empty[s], p.column_tiles > 1 ? 256 : 128);  // (both consumers' threads, or one's: kStages)
    }
    barrier_init(weights_landed);
    for (int s = 0; kNcdhw && s < kStagingSlots; ++s) {
      barrier_init(&staging_full[s]);
      barrier_init(&staging_empty[s], 128);
    }
  }
  __syncthreads();

  // (registers: 56 x 128 producer threads + 224 x 256 consumer threads = the 168 x 384 the launch holds, so the
  // consumers' setmaxnreg.inc is always served; the producer's conversion spilled at 40)
  if (threadIdx.x < 128) {  // the producer
    cutlass::arch::warpgroup_reg_dealloc<56>();
    if (threadIdx.x == 0) {
      barrier_arrive_expect(weights_landed, L::kWeightBytes);
      tensor_load_4d(weights, w_map, 0, 0, 0, 0, weights_landed);
    }
    if constexpr (kNcdhw) {
      produce_from_ncdhw<L>(x_map, p, smem, staging, full, empty, staging_full, staging_empty);
    } else if (threadIdx.x == 0) {
      const int64_t items = cta_items(p);
      ItemWalk walk(p);
      for (int64_t item = 0; item < items; ++item, walk.advance(p)) {
        const int stage = static_cast<int>(item % kStages);
        barrier_wait(&empty[stage], (static_cast<uint32_t>(item / kStages) & 1) ^ 1);
        barrier_arrive_expect(&full[stage], L::kBoxes * L::kBoxBytes);
        for (int box = 0; box < L::kBoxes; ++box) {
          tensor_load_5d(smem + stage * S::kStageStride + box * L::kBoxStride, x_map, box * L::kBoxChannels, 0,
                         walk.h0(), walk.z(), walk.n(), &full[stage]);
        }
      }
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<224>();
  // ping-pong: consumer c takes the CTA's tiles k = c, c + 2, ... (tile k % T of column k / T, T = column_tiles:
  // the ring's items first = column_items (k / T) + 2 (k % T) .. first + 3), all 4 rows, so that one's epilogue
  // runs while the other's wgmma instructions do; columns (T > 1): it passes the items between (pass_stage)
  // (the warp group's index by a shuffle from lane 0: the compiler then knows it, the tile, the stage and the
  // descriptors warp-uniform, and keeps them in uniform registers, as wgmma reads its descriptors)
  const int consumer = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0) - 1;
  const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
  barrier_wait(weights_landed, 0);
  const uint64_t b_base = L::b_base(weights);
  const int columns = static_cast<int>(cta_columns(p));  // (a CTA's columns, tiles and items fit in int)
  int next = 0;  // (the first item this consumer has not waited on)
  // tile k = T local + t (t < T), stepped without divisions: the first item, and so the stages, from uniform
  // values before the tile's first wait; the tile's place (cta_column's divisions) after its wgmma are issued
  // (branch-free steps of t by at most 2 < T + 2 past a column's end: the compiler keeps t, local, the first
  // item and the stages in uniform registers in TF32's kernels, as single tiles' from k alone; bf16's still not)
  const auto step = [&](int& local, int& t) {
    for (int twice = 0; twice < 2; ++twice) {
      const int wraps = t >= p.column_tiles;
      t -= wraps * p.column_tiles;
      local += wraps;
    }
  };
  int local = 0, t = consumer;
  step(local, t);
  while (local < columns) {
    const int first = local * p.column_items + kTilePlanes * t;
    for (; p.column_tiles > 1 && next < first; ++next) pass_stage(full, empty, next);
    next = first + kStagesPerTile;
    float acc[2][kTilePlanes][2][8];  // (row pair jj / 2, output plane zo, row jj % 2, the m64 n16 fragment)
#pragma unroll
    for (int e = 0; e < 2 * kTilePlanes * 2 * 8; ++e) (&acc[0][0][0][0])[e] = 0.f;
    if constexpr (!L::kRegisterA) {
      consume_tile_shared_a<L, kNcdhw>(smem, b_base, full, empty, first, acc);
    } else if constexpr (L::kSteps == 9) {
      consume_tile_row_fragments<L, kNcdhw>(smem, b_base, full, empty, first, warp, lane, acc);
    } else {
      consume_tile_bf16_row_fragments<L, kNcdhw>(smem, b_base, full, empty, first, warp, lane, acc);
    }
    const Column c = cta_column(p, local);
    const int pp = c.pp0 + t, rb = c.rb, n = c.n;
    if (pp < p.plane_pairs) {  // (a last segment's tiles past D' are convolved, not written)
      const int tile = (n * p.plane_pairs + pp) * p.row_blocks + rb;  // (tiles_of's numbering: p.partial's rows)
#pragma unroll
      for (int pair = 0; pair < 2; ++pair) {
        if constexpr (kEpilogue != Epilogue::kY) {
          pool_epilogue<typename L::T, kEpilogue == Epilogue::kMeanAndPicks>(acc[pair], bias, p, tile, n, pp,
                                                                             2 * rb + pair, pair, warp, lane);
        } else {
          conv_epilogue(acc[pair], bias, y, p, n, kTilePlanes * pp, kTileRows * rb + 2 * pair, warp, lane);
        }
      }
    }
    t += 2;
    step(local, t);
  }
  for (const int items = columns * p.column_items; p.column_tiles > 1 && next < items; ++next) {
    pass_stage(full, empty, next);
  }
#else
  __trap();
#endif
}

// The number of tiles of x's convolution, in 64 bits: N ceil(D' / 2) ceil(H' / 4).
inline int64_t tile_count(const at::Tensor& x) {
  return x.size(0) * ((x.size(2) - 2 + kTilePlanes - 1) / kTilePlanes) * ((x.size(3) - 2 + kTileRows - 1) / kTileRows);
}

// The tiles of x's convolution and their columns for a GPU of `sms` SMs: T (column_tiles) of the plane pairs
// whose busiest CTA stages the fewest plane pairs, ceil(columns / sms) (T + 1) (a column stages T + 1; ties to
// the longer columns, which stage less in all): whole (n, row block)s at SPEC's shape, shorter segments where a
// small batch would leave SMs idle or a few CTAs with a column more than the rest. Columns for every launch, not
// single tiles (T = 1) where the consumers limit the kernel: single tiles, each CTA's every 132nd, left a few
// CTAs 1.6x slower in most launches after an L2 flush, their SMs' box deliveries slowed (the launch 307 or 451
// us, TF32 at SPEC's shape, H200); columns none (321-329 us; bf16 256-259 against 259 or 350: NOTES, session 39).
inline Conv3dTiles tiles_of(const at::Tensor& x, int sms) {
  const int64_t tiles = tile_count(x);
  TORCH_CHECK(tiles <= std::numeric_limits<int32_t>::max(), "conv3d_wgmma: too many tiles");
  Conv3dTiles p{};
  p.depth_out = static_cast<int>(x.size(2) - 2);
  p.height_out = static_cast<int>(x.size(3) - 2);
  p.width_out = kRow - 2;
  p.plane_pairs = (p.depth_out + kTilePlanes - 1) / kTilePlanes;
  p.row_blocks = (p.height_out + kTileRows - 1) / kTileRows;
  p.tiles = static_cast<int>(tiles);
  const int64_t rows = x.size(0) * p.row_blocks;
  int64_t best = std::numeric_limits<int64_t>::max();
  for (int t = std::max(p.plane_pairs, 1); t >= 1; --t) {
    const int64_t segments = (p.plane_pairs + t - 1) / t, columns = rows * segments;
    const int64_t staged = (columns + sms - 1) / sms * (t + 1);
    if (staged < best) {
      best = staged;
      p.column_tiles = t;
      p.segments = static_cast<int>(segments);
      p.columns = static_cast<int>(columns);  // (at most tiles)
    }
  }
  p.column_items = kTilePlanes * p.column_tiles + 2;
  return p;
}

}  // namespace fused_ops::wgmma_conv3d
