// Variants of conv_transpose3d_stride1_channels_last's CUTLASS Hopper fprop (csrc/cuda/
// conv_transpose3d_stride1_fprop.cuh) for bench/bench_conv_transpose3d_stride1_variants.py, which builds
// this file as a torch extension of its own (not part of fused_ops): the op's tiles, each with clusters of
// 1, 2 and 4 CTAs along M (the filter's tile, the same for every CTA where the output channels are one
// tile, loaded once a cluster by TMA multicast), and clusters of 2 with tile K doubled; TF32 and bf16.
// SPEC's D: GEMM M = 414,720 output positions, N = 128 channels (one tile), K = 125 taps x 64 channels;
// each CTA reads its whole K of both operands from L2 (8 MB a tile in TF32, 26 GB in all), the filter's
// half of it what a cluster shares.
//
// And a prototype of the fprop as a kernel of our own ("row-shifted", TF32 and bf16; issue 46's D forward,
// before it takes the batch norm's sums in its epilogue): x zero-padded by k - 1 - p into (N, Dp, Hp, L, I)
// with rows of L >= Wp columns (L such that H' L is a multiple of 32), TF32's rounded to nearest; the output's rows
// m = (n, z, p, q') with q' over all L columns (those past W' computed, not stored). Tap (t, r, s)'s operand
// for a run of rows within a plane is then x_pad's rows at a constant offset, (z + t) Hp L + r L + s from
// the run's (n, z) plane start plus its offset p L + q' in the plane: plain 2-D TMA boxes (128 bytes of
// channels x 32 rows, 128-byte swizzled), no im2col. A CTA: 128 rows x 128 output channels; the K loop over
// (tap, 128 bytes of channels), the taps whose x_pad planes or rows are zeros for all its rows skipped
// (TapRanges: 21 % of SPEC's D's taps, whose zero padding makes 37 % of an implicit GEMM's products); one
// producer warp group (a thread issues 4 boxes of x and one of the flipped filter w' a stage), two consumer
// warp groups of 64 rows (wgmma m64 n128, k8 TF32 or k16 bf16); y (N, D', H', W', O) written in x's dtype with
// the bias. x_pad is made in one pass (padded_rows_kernel).
#ifndef NDEBUG
#define NDEBUG  // before any header (csrc/cuda/cutlass_conv.cuh says why)
#endif

#include <torch/extension.h>

#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include <pybind11/functional.h>

#include "bulk_copy.cuh"
#include "conv_transpose3d_stride1_fprop.cuh"
#include "cutlass/arch/reg_reconfig.h"
#include "mma.cuh"
#include "tf32_rounding.cuh"
#include "wgmma_ss.cuh"

namespace fused_ops {
namespace {

template <int kClusterM, int kTileK = 32>
using Tf32 = CutlassConv<Operator::kFprop, 3, float, float, 128, 128, kTileK, /*kBias=*/true, kClusterM>;
template <int kClusterM, int kTileK = 64>
using Bf16 = CutlassConv<Operator::kFprop, 3, cutlass::bfloat16_t, cutlass::bfloat16_t, 128, 128, kTileK, true,
                         kClusterM>;
// (the op's first in each dtype; then its tile K doubled: half the barriers a K, fewer stages; none with
// FUSED_OPS_PROTOTYPE_ONLY, the benchmark's --prototype-only)
#ifdef FUSED_OPS_PROTOTYPE_ONLY
using Variants = std::tuple<>;
#else
using Variants =
    std::tuple<Tf32<1>, Tf32<2>, Tf32<4>, Tf32<2, 64>, Bf16<1>, Bf16<2>, Bf16<4>, Bf16<2, 128>>;
#endif

// Calls f(K) for the variant-th kernel of Variants.
template <class F, size_t... I>
void with_variant(int64_t variant, F&& f, std::index_sequence<I...>) {
  ((variant == static_cast<int64_t>(I) ? f(std::tuple_element_t<I, Variants>{}) : void()), ...);
}

template <class F>
void with_variant(int64_t variant, F&& f) {
  TORCH_CHECK_VALUE(variant >= 0 && variant < static_cast<int64_t>(std::tuple_size_v<Variants>), "variant ", variant,
                    " out of range");
  with_variant(variant, f, std::make_index_sequence<std::tuple_size_v<Variants>>{});
}

std::vector<std::string> names() {
  std::vector<std::string> out;
  for (int64_t v = 0; v < static_cast<int64_t>(std::tuple_size_v<Variants>); ++v) {
    with_variant(v, [&](auto kernel) { out.push_back(kernel_name<decltype(kernel)>()); });
  }
  return out;
}

// y by variant `variant`, or None where it does not take the call (another dtype, CUTLASS's can_implement).
std::optional<at::Tensor> run(int64_t variant, const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias, std::vector<int64_t> padding) {
  const TransposedConvStride1 g = transposed_conv_stride1_setup(x, weight, bias, padding);
  std::optional<at::Tensor> y;
  with_variant(variant, [&](auto kernel) {
    using K = decltype(kernel);
    const bool dtype = std::is_same_v<typename K::Element, float> ? x.scalar_type() == at::kFloat
                                                                  : x.scalar_type() == at::kBFloat16;
    if (dtype && fprop_takes<K>(x, g)) y = run_cutlass<K>("conv_transpose3d_stride1_variants", x, weight, bias, g);
  });
  return y;
}

// The row-shifted prototype (file comment).
constexpr int kTileRows = 128, kBoxRows = 32;

struct RowShifted {
  int64_t rows;          // the output's rows N D' H' L
  int plane_rows;        // H' L, a multiple of kBoxRows
  int depth_out;         // D'
  int x_plane_rows;      // Hp L: x_pad's rows per (n, depth)
  int depth_pad;         // Dp
  int row;               // L
  int width_out;         // W'
  int kt, kr, ks;        // the kernel
  int pad_d, depth;      // x_pad's leading zero planes (kt - 1 - padding), x's D
  int pad_h, height;     // x_pad's leading zero rows a plane (kr - 1 - padding), x's H
  int in_blocks;         // I / 32
  int out_channels;      // O (128)
};

// The taps (t, r) a tile of output rows from m0 reads data through: t in [t0, t1), r in [r0, r1) (every s).
// Its row m (plane n D' + z, in-plane row h L + q') reads x_pad plane z + t and row h + r, data only where
// pad_d <= z + t < pad_d + D and pad_h <= h + r < pad_h + H; the other taps read x_pad's zeros and are
// skipped (a box of 32 rows never straddles planes: H' L is a multiple of 32). The ranges are the union over
// the tile's boxes, so a tap in them may still read zeros for some rows (those rows add 0).
struct TapRanges {
  int t0, t1, r0, r1;
  __device__ TapRanges(int64_t m0, const RowShifted& p) : t0(p.kt), t1(0), r0(p.kr), r1(0) {
    for (int b = 0; b < kTileRows / kBoxRows; ++b) {
      const int64_t first = min(m0 + b * kBoxRows, p.rows - 1);
      const int z = static_cast<int>(first / p.plane_rows % p.depth_out);
      const int within = static_cast<int>(first % p.plane_rows);
      const int h_lo = within / p.row, h_hi = min(within + kBoxRows - 1, p.plane_rows - 1) / p.row;
      t0 = min(t0, max(0, p.pad_d - z));
      t1 = max(t1, min(p.kt, p.pad_d + p.depth - z));
      r0 = min(r0, max(0, p.pad_h - h_hi));
      r1 = max(r1, min(p.kr, p.pad_h + p.height - h_lo));
    }
  }
  __device__ int k_steps(const RowShifted& p) const { return (t1 - t0) * (r1 - r0) * p.ks * p.in_blocks; }
};

constexpr int kRowThreads = 384;  // the producer warp group, two consumers
constexpr int kABytes = kTileRows * 128, kBBytes = 128 * 128;  // rows of 128 bytes of channels
constexpr int kRowStageBytes = kABytes + kBBytes;
constexpr int kRowStages = 6;
constexpr int kRowSmemBytes = kRowStages * kRowStageBytes + 2 * kRowStages * 8 + 1024;
template <typename T>
constexpr int kTileK = 128 / sizeof(T);  // channels a K step: 32 TF32, 64 bf16

// (torch's extensions build without bfloat16's implicit conversions)
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return __float2bfloat16_rn(v);
  }
}

// x_map: x_pad as (I, rows, 1, 1) innermost first, boxes (kTileK, 32, 1, 1); w_map: w' as (I, V, O, 1),
// boxes (kTileK, 1, 128, 1); both 128-byte swizzled. y (rows of N D' H' W', O channels). T: float (TF32) or
// __nv_bfloat16.
template <typename T>
__global__ void __launch_bounds__(kRowThreads, 1)
    row_shifted_fprop_kernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap w_map,
                             const T* __restrict__ bias, T* __restrict__ y, const RowShifted p) {
  constexpr int kK = kTileK<T>;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* const smem = smem_raw + (1024 - shared_address(smem_raw) % 1024) % 1024;
  uint64_t* const full = reinterpret_cast<uint64_t*>(smem + kRowStages * kRowStageBytes);
  uint64_t* const empty = full + kRowStages;
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kTileRows;
  const TapRanges taps(m0, p);
  const int k_steps = taps.k_steps(p);

  init_stage_barriers(full, empty, kRowStages, 2 * 128);  // (released by every consumer thread)

  if (threadIdx.x < 128) {  // the producer
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (threadIdx.x == 0) {
      // each box's first x_pad row for tap 0: its (n, z) plane's first row, plus its rows' offset in the plane
      int base[kTileRows / kBoxRows];
#pragma unroll
      for (int b = 0; b < kTileRows / kBoxRows; ++b) {
        const int64_t m = m0 + b * kBoxRows;
        const int64_t plane = m / p.plane_rows;  // n D' + z
        const int64_t n = plane / p.depth_out, z = plane % p.depth_out;
        base[b] = static_cast<int>((n * p.depth_pad + z) * p.x_plane_rows + m % p.plane_rows);
      }
      int stage = 0;
      uint32_t phase = 0;
      for (int k = 0; k < k_steps; ++k) {
        const int i = k / p.in_blocks, channel = k % p.in_blocks * kK, rows = taps.r1 - taps.r0;
        const int t = taps.t0 + i / (rows * p.ks), r = taps.r0 + i / p.ks % rows, s = i % p.ks;
        const int offset = t * p.x_plane_rows + r * p.row + s, tap = (t * p.kr + r) * p.ks + s;
        barrier_wait(&empty[stage], phase ^ 1);
        unsigned char* const tiles = smem + stage * kRowStageBytes;
        barrier_arrive_expect(&full[stage], kRowStageBytes);
#pragma unroll
        for (int b = 0; b < kTileRows / kBoxRows; ++b) {
          tensor_load_4d(tiles + b * kBoxRows * 128, x_map, channel, base[b] + offset, 0, 0, &full[stage]);
        }
        tensor_load_4d(tiles + kABytes, w_map, channel, tap, 0, 0, &full[stage]);
        if (++stage == kRowStages) {
          stage = 0;
          phase ^= 1;
        }
      }
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<232>();
  const int consumer = threadIdx.x / 128 - 1;  // its 64 of the CTA's 128 rows
  float acc[64];
#pragma unroll
  for (int j = 0; j < 64; ++j) acc[j] = 0.f;
  int stage = 0, previous = -1;
  uint32_t phase = 0;
  for (int k = 0; k < k_steps; ++k) {
    barrier_wait(&full[stage], phase);
    const unsigned char* const tiles = smem + stage * kRowStageBytes;
    const uint64_t a = swizzled_tile_descriptor(tiles + consumer * (kABytes / 2));
    const uint64_t b = swizzled_tile_descriptor(tiles + kABytes);
#pragma unroll
    for (int j = 0; j < 64; ++j) cute::warpgroup_fence_operand(acc[j]);
    cute::warpgroup_arrive();
#pragma unroll
    for (int step = 0; step < 4; ++step) {  // (32 bytes of K an instruction)
      wgmma_ss<T, 128>(a + 2 * step, b + 2 * step, acc, std::make_index_sequence<64>{});
    }
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<1>();  // the previous stage's instructions are done: it is free
#pragma unroll
    for (int j = 0; j < 64; ++j) cute::warpgroup_fence_operand(acc[j]);
    if (previous >= 0) barrier_arrive(&empty[previous]);
    previous = stage;
    if (++stage == kRowStages) {
      stage = 0;
      phase ^= 1;
    }
  }
  cute::warpgroup_wait<0>();
#pragma unroll
  for (int j = 0; j < 64; ++j) cute::warpgroup_fence_operand(acc[j]);

  // accumulator j: row 16 warp + lane / 4 (+ 8 for j % 4 >= 2) of the consumer's 64, column (output
  // channel) 8 (j / 4) + 2 (lane % 4) + j % 2: pairs of adjacent channels stored together
  const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t m = m0 + consumer * 64 + 16 * warp + lane / 4 + 8 * half;
    const int64_t plane = m / p.plane_rows;
    const int within = static_cast<int>(m % p.plane_rows), h = within / p.row, q = within % p.row;
    if (m >= p.rows || q >= p.width_out) continue;
    T* const out = y + ((plane * (p.plane_rows / p.row) + h) * p.width_out + q) * p.out_channels;
#pragma unroll
    for (int j = 2 * half; j < 64; j += 4) {
      const int o = 8 * (j / 4) + 2 * (lane % 4);
      out[o] = from_float<T>(acc[j] + to_float(bias[o]));
      out[o + 1] = from_float<T>(acc[j + 1] + to_float(bias[o + 1]));
    }
  }
}

// x_pad's geometry (row_shifted's): x (N, I, D, H, W) of any strides into (N, Dp, Hp, L, I).
struct PaddedRows {
  int64_t stride[5];                          // x's
  int channels, depth, height, width;         // I, D, H, W
  int depth_pad, height_pad, row;             // Dp, Hp, L
  int pad_d, pad_h, pad_w;                    // the leading zeros along D, H, W
};

// x_pad in one pass (a block a row (n, dp, hp): x's channel rows into shared memory, then the row's L x I
// elements written in order, zeros outside x), TF32's rounded to nearest.
template <typename T>
__global__ void padded_rows_kernel(const T* __restrict__ x, T* __restrict__ out, const PaddedRows r) {
  extern __shared__ unsigned char tile_raw[];
  T* const tile = reinterpret_cast<T*>(tile_raw);  // (I, W + 1)
  const int64_t row = blockIdx.x;
  const int hp = static_cast<int>(row % r.height_pad), dp = static_cast<int>(row / r.height_pad % r.depth_pad);
  const int64_t n = row / r.height_pad / r.depth_pad;
  const int d = dp - r.pad_d, h = hp - r.pad_h;
  const bool data = d >= 0 && d < r.depth && h >= 0 && h < r.height;
  if (data) {
    for (int k = threadIdx.x; k < r.channels * r.width; k += blockDim.x) {
      const int i = k / r.width, w = k % r.width;
      tile[i * (r.width + 1) + w] =
          x[n * r.stride[0] + i * r.stride[1] + d * r.stride[2] + h * r.stride[3] + w * r.stride[4]];
    }
  }
  __syncthreads();
  T* const o = out + row * r.row * r.channels;
  for (int k = threadIdx.x; k < r.row * r.channels; k += blockDim.x) {
    const int i = k % r.channels, w = k / r.channels - r.pad_w;
    T v{};
    if (data && w >= 0 && w < r.width) v = tile[i * (r.width + 1) + w];
    if constexpr (std::is_same_v<T, float>) v = rounded_to_tf32(v);
    o[k] = v;
  }
}

using Launcher = std::function<at::Tensor()>;

template <typename T>
Launcher row_shifted(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                     const TransposedConvStride1& g);

// The row-shifted prototype's kernel on operands made now (x_pad, the flipped filter): a callable giving y
// (N, O, D', H', W') channels_last_3d each call, or None where the prototype does not take the call (float32
// with TF32 or bfloat16, an sm_90 GPU, input channels a multiple of 128 bytes, 128 output channels, a bias).
std::optional<Launcher> row_shifted_kernel(const at::Tensor& x, const at::Tensor& weight,
                                           const std::optional<at::Tensor>& bias, std::vector<int64_t> padding) {
  const TransposedConvStride1 g = transposed_conv_stride1_setup(x, weight, bias, padding);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  if (!(tf32_convolution(x) || bf16) || !runs_sm90a(x.get_device()) || g.in_channels * x.element_size() % 128 ||
      g.out_channels != 128 || !bias) {
    return std::nullopt;
  }
  return bf16 ? row_shifted<__nv_bfloat16>(x, weight, *bias, g) : row_shifted<float>(x, weight, *bias, g);
}

// y by the row-shifted prototype, its operands made in the call, or None where it does not take the call.
std::optional<at::Tensor> run_row_shifted(const at::Tensor& x, const at::Tensor& weight,
                                          const std::optional<at::Tensor>& bias, std::vector<int64_t> padding) {
  const std::optional<Launcher> launch = row_shifted_kernel(x, weight, bias, std::move(padding));
  return launch ? std::optional<at::Tensor>((*launch)()) : std::nullopt;
}

template <typename T>
Launcher row_shifted(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                     const TransposedConvStride1& g) {
  constexpr bool kTf32 = std::is_same_v<T, float>;
  constexpr int kK = kTileK<T>;
  int64_t pad[3], padded[3];
  for (int d = 0; d < 3; ++d) {
    pad[d] = g.kernel[d] - 1 - g.padding[d];
    padded[d] = g.in[d] + 2 * pad[d];
  }
  int64_t row = padded[2];
  while (g.out(1) * row % kBoxRows) ++row;
  const at::Tensor x_pad = at::empty({g.batch, padded[0], padded[1], row, g.in_channels}, x.options());
  PaddedRows rows{};
  for (int d = 0; d < 5; ++d) rows.stride[d] = x.stride(d);
  rows.channels = static_cast<int>(g.in_channels);
  rows.depth = static_cast<int>(g.in[0]);
  rows.height = static_cast<int>(g.in[1]);
  rows.width = static_cast<int>(g.in[2]);
  rows.depth_pad = static_cast<int>(padded[0]);
  rows.height_pad = static_cast<int>(padded[1]);
  rows.row = static_cast<int>(row);
  rows.pad_d = static_cast<int>(pad[0]);
  rows.pad_h = static_cast<int>(pad[1]);
  rows.pad_w = static_cast<int>(pad[2]);
  const int64_t tile_bytes = g.in_channels * (g.in[2] + 1) * static_cast<int64_t>(sizeof(T));
  TORCH_CHECK(tile_bytes <= 48 * 1024, "row_shifted: x's channel rows past 48 KB of shared memory");
  padded_rows_kernel<T><<<static_cast<unsigned>(g.batch * padded[0] * padded[1]), 256, tile_bytes,
                          c10::cuda::getCurrentCUDAStream()>>>(static_cast<const T*>(x.const_data_ptr()),
                                                                static_cast<T*>(x_pad.data_ptr()), rows);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const at::Tensor w = kTf32 ? rounded_to_tf32(flipped_filter(weight)) : flipped_filter(weight);  // (O, kt, kr, ks, I)
  const int64_t taps = g.kernel[0] * g.kernel[1] * g.kernel[2];
  const RowShifted p{g.batch * g.out(0) * g.out(1) * row, static_cast<int>(g.out(1) * row),
                     static_cast<int>(g.out(0)), static_cast<int>(padded[1] * row), static_cast<int>(padded[0]),
                     static_cast<int>(row), static_cast<int>(g.out(2)), static_cast<int>(g.kernel[0]),
                     static_cast<int>(g.kernel[1]), static_cast<int>(g.kernel[2]), static_cast<int>(pad[0]),
                     static_cast<int>(g.in[0]), static_cast<int>(pad[1]), static_cast<int>(g.in[1]),
                     static_cast<int>(g.in_channels / kK), static_cast<int>(g.out_channels)};
  TORCH_CHECK(x_pad.numel() / g.in_channels < (int64_t{1} << 31), "row_shifted: x_pad's rows past int32");
  const CUtensorMap x_map = contiguous_tensor_map(x_pad.view({1, 1, -1, g.in_channels}), {kK, kBoxRows, 1, 1},
                                                  CU_TENSOR_MAP_SWIZZLE_128B);
  const CUtensorMap w_map = contiguous_tensor_map(w.view({1, g.out_channels, taps, g.in_channels}),
                                                  {kK, 1, 128, 1}, CU_TENSOR_MAP_SWIZZLE_128B);
  const at::Tensor bias_values = bias.contiguous();
  // (the maps point into x_pad and w, which the callable holds)
  return [x, g, p, x_pad, w, bias_values, x_map, w_map]() {
    at::Tensor y = transposed_conv_stride1_output(x, g);  // (memory (N, D', H', W', O))
    C10_CUDA_CHECK(cudaFuncSetAttribute(row_shifted_fprop_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        kRowSmemBytes));
    const int64_t blocks = (p.rows + kTileRows - 1) / kTileRows;
    row_shifted_fprop_kernel<T><<<static_cast<unsigned>(blocks), kRowThreads, kRowSmemBytes,
                                  c10::cuda::getCurrentCUDAStream()>>>(
        x_map, w_map, static_cast<const T*>(bias_values.const_data_ptr()), static_cast<T*>(y.data_ptr()), p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y;
  };
}

}  // namespace
}  // namespace fused_ops

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("names", &fused_ops::names, "the variants' names, in order");
  m.def("run", &fused_ops::run, "y by a variant (None where it does not take the call)");
  m.def("run_row_shifted", &fused_ops::run_row_shifted,
        "y by the row-shifted prototype (None where it does not take the call)");
  m.def("row_shifted_kernel", &fused_ops::row_shifted_kernel,
        "the row-shifted prototype's kernel alone on operands made now: a callable giving y (None where it does "
        "not take the call)");
}
