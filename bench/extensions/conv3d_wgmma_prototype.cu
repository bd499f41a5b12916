// A prototype of A's convolution on wgmma (issue 46 item 1), for bench/bench_conv3d_wgmma_prototype.py,
// which builds this file as a torch extension of its own (not part of fused_ops): y = conv3d(x, w) + bias,
// x (N, 8, D, H, 64) read channels-last (NDHWC), w (16, 8, 3, 3, 3), float32 by TF32 wgmma, sums in float32;
// either y (N, 16, D', H', W') channels_last_3d, or (kPool) conv3d_max_pool3d_mean's result: y / divisor
// (PyTorch's division by a number), 2 x 2 x 2 max-pool windows picked by PyTorch's rule (WindowPick), their
// mean per (n, o) and each window's pick (one byte, its scan-order offset).
//
// GEMM rows are x's positions in its own row layout (W = 64: an output row's 64 positions, 62 kept, are one
// m64 tile), N = the 16 output channels, K = 27 taps x 8 channels. Tap (t, r, s)'s A operand for output row
// h of plane z is x plane z + t's rows from (h + r) * 64 + s: a staged box of x rows (8 channels = 32 bytes a
// row, 32-byte swizzled) serves all 9 taps (r, s) of its plane through descriptor offsets of (r * 64 + s)
// rows, no copies (wgmma swizzles by the shared address, as TMA writes: wgmma_ss.cuh's note, shown there for
// 128-byte rows; this prototype's error column shows it for 32-byte ones). B = the tap's 16 x 8 weights.
//
// A CTA (persistent over tiles): a tile is 2 output planes (z0, z0 + 1) x 4 output rows (h0 .. h0 + 3) of one
// n; its 4 stages are x planes z0 .. z0 + 3, rows h0 .. h0 + 5 (one TMA box each, zeros past x's end); stage j
// adds tap t = j - zo to output plane z0 + zo. One producer warp group (a thread issues the boxes), two
// consumer warp groups of 2 output rows each (4 m64 n16 accumulators of 8 floats: 2 planes x 2 rows).
// Shared memory reads bound it: 2.5 KB an m64 n16 k8 instruction (A 2 KB, B 0.5) for 8192 MACs. With kPool
// a consumer's two rows are one row of pool windows over both planes: a lane holds 4 of a window's elements
// (column w), lane ^ 4 the other 4 (column w ^ 1); their picks merge by a shuffle.
#ifndef NDEBUG
#define NDEBUG  // before any header (csrc/cuda/cutlass_conv.cuh says why)
#endif

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>

// (bulk_copy.cuh before CUTLASS's headers, which include cudaTypedefs.h inside their namespace)
#include "bulk_copy.cuh"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass_conv.cuh"  // (runs_sm90a, tf32_convolution)
#include "../dispatch.h"    // (ReciprocalMultiply)
#include "../max_pool3d.h"  // (WindowPick)
#include "wgmma_ss.cuh"

namespace fused_ops {
namespace {

constexpr int kChannelsIn = 8, kChannelsOut = 16, kRow = 64;  // I, O, x's row (W)
constexpr int kTileRows = 4, kTilePlanes = 2;                   // output rows and planes a tile
constexpr int kBoxRows = kTileRows + 2, kStagesPerTile = kTilePlanes + 2;
constexpr int kRowBytes = kChannelsIn * 4;                        // 32: one swizzled row
constexpr int kBoxBytes = kBoxRows * kRow * kRowBytes;            // 12 KB
constexpr int kStageStride = kBoxBytes + 1024;  // (the last rows' shifts read up to 2 rows past the box: outputs
                                                // w >= 62, not stored; 1024-byte aligned stages)
constexpr int kStages = 6;
constexpr int kTaps = 27;
constexpr int kWeightBytes = kTaps * kChannelsOut * kRowBytes;  // (tap, o) rows of 8 channels
constexpr int kWeightStride = (kWeightBytes + 1023) / 1024 * 1024;
constexpr int kThreads = 384;  // the producer warp group, two consumers
constexpr int kSmemBytes = kStages * kStageStride + kWeightStride + 2 * kStages * 8 + 8 + 1024;

struct Conv3dTiles {
  int depth_out, height_out, width_out;  // D', H', W' (W' = 62)
  int plane_pairs, row_blocks;           // ceil(D' / 2), ceil(H' / 4)
  int tiles;                             // N plane_pairs row_blocks
  float reciprocal;                      // kPool: 1 / divisor, as PyTorch's CUDA division multiplies
  int pooled[3];                         // kPool: the windows (PD, PH, PW) = floor((D', H', W') / 2)
  uint8_t* picks;                        // kPool: (N, 16, PD, PH, PW)
  float* partial;                        // kPool: (tiles, 8 warps, 16): each warp's sum of its windows
};

// y's epilogue of a consumer's accumulators (planes z0 + zo, rows h0 + jj): fragment element e is row 16 warp +
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

// The pool's epilogue of a consumer's accumulators (planes 2 pd + zo, rows 2 ph + jj): each window's pick of
// y = (acc + bias) / divisor, written where the window lies inside the pooled output, and this warp's sum of
// its windows' values per output channel into p.partial.
__device__ __forceinline__ void pool_epilogue(const float (&acc)[kTilePlanes][2][8], const float* __restrict__ bias,
                                              const Conv3dTiles& p, int tile, int n, int pd, int ph, int consumer,
                                              int warp, int lane) {
  float sum[4] = {0.f, 0.f, 0.f, 0.f};  // (fragment elements e % 2 + 2 (e / 4): channels o = 8 (e / 4) + 2 (lane % 4) + e % 2)
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int w = 16 * warp + lane / 4 + 8 * half, pw = w / 2;
    const bool inside = pd < p.pooled[0] && ph < p.pooled[1] && pw < p.pooled[2];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int e = 2 * half + k % 2 + 4 * (k / 2), o = 8 * (k / 2) + 2 * (lane % 4) + k % 2;
      WindowPick<float> pick;
#pragma unroll
      for (int zo = 0; zo < kTilePlanes; ++zo)
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          pick.update(__fmul_rn(acc[zo][jj][e] + bias[o], p.reciprocal), (zo * 2 + jj) * 2 + w % 2);
        }
      // (every lane shuffles: the partner's elements of the window)
      const float other_value = __shfl_xor_sync(0xffffffffu, pick.value, 4);
      const int other_offset = __shfl_xor_sync(0xffffffffu, pick.offset, 4);
      pick.merge(other_value, other_offset);
      if (w % 2 == 0 && inside) {
        p.picks[(((static_cast<int64_t>(n) * kChannelsOut + o) * p.pooled[0] + pd) * p.pooled[1] + ph) *
                    p.pooled[2] + pw] = static_cast<uint8_t>(pick.offset);
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
      p.partial[(static_cast<int64_t>(tile) * 8 + 4 * consumer + warp) * kChannelsOut + 8 * (k / 2) + 2 * lane + k % 2] =
          sum[k];
    }
  }
}

// x_map: x NDHWC as (8, 64, H, D, N) innermost first, boxes (8, 64, 6, 1, 1); w_map: (tap, o, 8 channels) as
// (8, 16, 27, 1), one box; both 32-byte swizzled. y (N, D', H', W', 16), unused with kPool.
template <bool kPool>
__global__ void __launch_bounds__(kThreads, 1)
    conv3d_wgmma_kernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap w_map,
                        const float* __restrict__ bias, float* __restrict__ y, const Conv3dTiles p) {
  extern __shared__ unsigned char smem_raw[];
  unsigned char* const smem = smem_raw + (1024 - shared_address(smem_raw) % 1024) % 1024;
  unsigned char* const weights = smem + kStages * kStageStride;
  uint64_t* const full = reinterpret_cast<uint64_t*>(weights + kWeightStride);
  uint64_t* const empty = full + kStages;
  uint64_t* const weights_landed = empty + kStages;

  init_stage_barriers(full, empty, kStages, 2 * 128);  // (released by every consumer thread)
  if (threadIdx.x == 0) barrier_init(weights_landed);
  __syncthreads();

  if (threadIdx.x < 128) {  // the producer
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (threadIdx.x == 0) {
      barrier_arrive_expect(weights_landed, kWeightBytes);
      tensor_load_4d(weights, w_map, 0, 0, 0, 0, weights_landed);
      int stage = 0;
      uint32_t phase = 0;
      for (int tile = blockIdx.x; tile < p.tiles; tile += gridDim.x) {
        const int rb = tile % p.row_blocks, pp = tile / p.row_blocks % p.plane_pairs;
        const int n = tile / p.row_blocks / p.plane_pairs;
        for (int j = 0; j < kStagesPerTile; ++j) {
          barrier_wait(&empty[stage], phase ^ 1);
          barrier_arrive_expect(&full[stage], kBoxBytes);
          tensor_load_5d(smem + stage * kStageStride, x_map, 0, 0, kTileRows * rb, kTilePlanes * pp + j, n,
                         &full[stage]);
          if (++stage == kStages) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<232>();
  const int consumer = threadIdx.x / 128 - 1;  // its output rows h0 + 2 consumer + {0, 1}
  const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
  barrier_wait(weights_landed, 0);
  int stage = 0;
  uint32_t phase = 0;
  for (int tile = blockIdx.x; tile < p.tiles; tile += gridDim.x) {
    float acc[kTilePlanes][2][8];  // (output plane zo, row jj, the m64 n16 fragment)
#pragma unroll
    for (int zo = 0; zo < kTilePlanes; ++zo)
#pragma unroll
      for (int jj = 0; jj < 2; ++jj)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[zo][jj][e] = 0.f;
    int previous = -1;
#pragma unroll
    for (int j = 0; j < kStagesPerTile; ++j) {
      barrier_wait(&full[stage], phase);
      const unsigned char* const box = smem + stage * kStageStride;
#pragma unroll
      for (int zo = 0; zo < kTilePlanes; ++zo)
#pragma unroll
        for (int jj = 0; jj < 2; ++jj)
#pragma unroll
          for (int e = 0; e < 8; ++e) cute::warpgroup_fence_operand(acc[zo][jj][e]);
      cute::warpgroup_arrive();
#pragma unroll
      for (int zo = 0; zo < kTilePlanes; ++zo) {
        const int t = j - zo;  // (compile-time: j and zo unrolled)
        if (t < 0 || t > 2) continue;
#pragma unroll
        for (int r = 0; r < 3; ++r) {
#pragma unroll
          for (int s = 0; s < 3; ++s) {
            const uint64_t b = swizzled_tile_descriptor<kRowBytes>(weights + ((t * 3 + r) * 3 + s) * kChannelsOut * kRowBytes);
#pragma unroll
            for (int jj = 0; jj < 2; ++jj) {
              const uint64_t a = swizzled_tile_descriptor<kRowBytes>(box + ((2 * consumer + jj + r) * kRow + s) * kRowBytes);
              cute::SM90::GMMA::MMA_64x16x8_F32TF32TF32_SS_TN<>::fma(
                  a, b, acc[zo][jj][0], acc[zo][jj][1], acc[zo][jj][2], acc[zo][jj][3], acc[zo][jj][4],
                  acc[zo][jj][5], acc[zo][jj][6], acc[zo][jj][7]);
            }
          }
        }
      }
      cute::warpgroup_commit_batch();
      cute::warpgroup_wait<1>();  // the previous stage's instructions are done: it is free
#pragma unroll
      for (int zo = 0; zo < kTilePlanes; ++zo)
#pragma unroll
        for (int jj = 0; jj < 2; ++jj)
#pragma unroll
          for (int e = 0; e < 8; ++e) cute::warpgroup_fence_operand(acc[zo][jj][e]);
      if (previous >= 0) barrier_arrive(&empty[previous]);
      previous = stage;
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
    cute::warpgroup_wait<0>();
#pragma unroll
    for (int zo = 0; zo < kTilePlanes; ++zo)
#pragma unroll
      for (int jj = 0; jj < 2; ++jj)
#pragma unroll
        for (int e = 0; e < 8; ++e) cute::warpgroup_fence_operand(acc[zo][jj][e]);
    barrier_arrive(&empty[previous]);

    const int rb = tile % p.row_blocks, pp = tile / p.row_blocks % p.plane_pairs;
    const int n = tile / p.row_blocks / p.plane_pairs;
    if constexpr (kPool) {
      pool_epilogue(acc, bias, p, tile, n, pp, 2 * rb + consumer, consumer, warp, lane);
    } else {
      conv_epilogue(acc, bias, y, p, n, kTilePlanes * pp, kTileRows * rb + 2 * consumer, warp, lane);
    }
  }
}

// Whether the prototype takes the call: float32 with TF32 convolutions allowed, an sm_90 GPU, x (N, 8, D, H, 64)
// with D, H >= 3, weight (16, 8, 3, 3, 3), a bias of 16 (float32 each).
bool takes(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  return x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && bias.scalar_type() == at::kFloat &&
         x.is_cuda() && x.dim() == 5 && x.size(1) == kChannelsIn && x.size(4) == kRow && x.size(2) >= 3 &&
         x.size(3) >= 3 && tf32_convolution(x) && runs_sm90a(x.get_device()) &&
         weight.sizes() == at::IntArrayRef({kChannelsOut, kChannelsIn, 3, 3, 3}) && bias.numel() == kChannelsOut;
}

// The kernel's launch on x (read channels-last: a copy unless x is channels_last_3d) with p's pool fields set
// where kPool; y defined unless kPool.
template <bool kPool>
void launch(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, Conv3dTiles& p, at::Tensor& y) {
  const at::Tensor x_ndhwc = x.contiguous(at::MemoryFormat::ChannelsLast3d).permute({0, 2, 3, 4, 1});
  // (tap, o, c): w[o, c, t, r, s] rounded to TF32 to nearest, as cuDNN's TF32 rounds
  const at::Tensor w = weight.permute({2, 3, 4, 0, 1}).contiguous().view(at::kInt).add(0x1000)
                           .bitwise_and(static_cast<int32_t>(0xffffe000u)).view(at::kFloat).view({1, kTaps, kChannelsOut, kChannelsIn});
  const CUtensorMap x_map = contiguous_tensor_map(x_ndhwc, {kChannelsIn, kRow, kBoxRows, 1, 1}, CU_TENSOR_MAP_SWIZZLE_32B);
  const CUtensorMap w_map = contiguous_tensor_map(w, {kChannelsIn, kChannelsOut, kTaps, 1}, CU_TENSOR_MAP_SWIZZLE_32B);
  const at::Tensor bias_values = bias.contiguous();
  C10_CUDA_CHECK(cudaFuncSetAttribute(conv3d_wgmma_kernel<kPool>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      kSmemBytes));
  const int sms = device_attribute(cudaDevAttrMultiProcessorCount, x.get_device());
  const int blocks = std::min(p.tiles, sms);
  conv3d_wgmma_kernel<kPool><<<blocks, kThreads, kSmemBytes, c10::cuda::getCurrentCUDAStream()>>>(
      x_map, w_map, bias_values.const_data_ptr<float>(), kPool ? nullptr : y.mutable_data_ptr<float>(), p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The tiles of x's convolution.
Conv3dTiles tiles_of(const at::Tensor& x) {
  Conv3dTiles p{};
  p.depth_out = static_cast<int>(x.size(2) - 2);
  p.height_out = static_cast<int>(x.size(3) - 2);
  p.width_out = kRow - 2;
  p.plane_pairs = (p.depth_out + kTilePlanes - 1) / kTilePlanes;
  p.row_blocks = (p.height_out + kTileRows - 1) / kTileRows;
  const int64_t tiles = x.size(0) * p.plane_pairs * p.row_blocks;
  TORCH_CHECK(tiles <= std::numeric_limits<int32_t>::max(), "conv3d_wgmma: too many tiles");
  p.tiles = static_cast<int>(tiles);
  return p;
}

// y = conv3d(x, weight, bias) by the prototype, or None where it does not take the call (takes).
std::optional<at::Tensor> conv3d_wgmma(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (!takes(x, weight, bias)) return std::nullopt;
  Conv3dTiles p = tiles_of(x);
  at::Tensor y = at::empty({x.size(0), kChannelsOut, p.depth_out, p.height_out, p.width_out},
                           x.options().memory_format(at::MemoryFormat::ChannelsLast3d));
  launch<false>(x, weight, bias, p, y);
  return y;
}

// conv3d_max_pool3d_mean(x, weight, bias, 0, 2, divisor, save_indices=True) by the prototype: (mean (N, 16),
// picks (N, 16, PD, PH, PW) uint8), or None where it does not take the call (takes, D' and H' at least 2).
std::optional<std::tuple<at::Tensor, at::Tensor>> conv3d_wgmma_pool(const at::Tensor& x, const at::Tensor& weight,
                                                                    const at::Tensor& bias, double divisor) {
  if (!takes(x, weight, bias) || x.size(2) < 4 || x.size(3) < 4) return std::nullopt;
  Conv3dTiles p = tiles_of(x);
  p.reciprocal = ReciprocalMultiply<float>(divisor).reciprocal;
  p.pooled[0] = p.depth_out / 2;
  p.pooled[1] = p.height_out / 2;
  p.pooled[2] = p.width_out / 2;
  at::Tensor picks = at::empty({x.size(0), kChannelsOut, p.pooled[0], p.pooled[1], p.pooled[2]},
                               x.options().dtype(at::kByte));
  at::Tensor partial = at::empty({x.size(0), int64_t{p.tiles} / x.size(0) * 8, kChannelsOut}, x.options());
  p.picks = picks.mutable_data_ptr<uint8_t>();
  p.partial = partial.mutable_data_ptr<float>();
  at::Tensor unused;
  launch<true>(x, weight, bias, p, unused);
  const double windows = static_cast<double>(p.pooled[0]) * p.pooled[1] * p.pooled[2];
  return std::make_tuple(partial.sum(1).div_(windows), picks);
}

}  // namespace
}  // namespace fused_ops

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("conv3d_wgmma", &fused_ops::conv3d_wgmma,
        "y = conv3d(x, weight, bias) by the wgmma prototype (None where it does not take the call)");
  m.def("conv3d_wgmma_pool", &fused_ops::conv3d_wgmma_pool,
        "(mean, picks) of conv3d_max_pool3d_mean(x, weight, bias, 0, 2, divisor) by the wgmma prototype with its "
        "pool epilogue (None where it does not take the call)");
}
