// CUDA kernel of conv_transpose3d_cascade_sum (the math: ../conv_transpose3d_cascade_sum.h).
//
// On an sm_90 device, in a build with CUTLASS (FUSED_OPS_CUTLASS), for float32 where PyTorch's
// convolutions round to TF32 (cuDNN enabled, its TF32 allowed for convolutions) and for bfloat16,
// stride 2, kernel2 3, at most 3 taps per class and dim (kernel <= 6), 32 input channels and at most
// 64 output channels: the convolution and its tail in one wgmma kernel (transposed_cascade_sum.cuh),
// over a channels-last copy of x (none where x is channels-last already) and the weights
// rearranged per tap (cascade_weight_taps_kernel). Sums in float32, rounded to bfloat16 where the
// original's y is (before the pools) and to the result's dtype. With bf16x3 operands and picks (a
// training step's), the picks certified: windows with a near tie are listed by the kernel and picked
// again from float64 sums (cascade_picks_fixup_kernel; CascadeCertify). Everything else by the composite.
// SPEC's B on an H200, the kernel from a channels-last x: 0.59 ms in TF32, 0.47 in bfloat16 (0.68 and
// 0.62 with every item whole and the earlier tap loop), against 1.42 for the whole op by the
// parity-class formulation B's rewrite took before and 40.7 for cuDNN's transposed convolution
// (bench/results/conv_transpose3d_cascade_sum-nvidia-h200.log, session 13's tree: 0.74 / 0.67 TF32
// from an NCDHW / channels-last x, 0.70 in bfloat16 with x's cast).

#ifdef FUSED_OPS_CUTLASS
#ifndef NDEBUG
#define NDEBUG  // before any header (cutlass_conv.cuh says why)
#endif
#endif

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

#include "../conv_transpose3d_cascade_sum.h"
#include "../dispatch.h"

#ifdef FUSED_OPS_CUTLASS
#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>

// (bulk_copy.cuh before CUTLASS's headers, which include cudaTypedefs.h inside their namespace)
#include "bulk_copy.cuh"
#include "cutlass_conv.cuh"
#include "plane_rows.cuh"
#include "transposed_cascade_sum.cuh"
#endif

namespace fused_ops {
namespace {

#ifdef FUSED_OPS_CUTLASS

// The kernel's operands (transposed_cascade_sum.cuh): a float32 x as bf16x3 (a float32 convolution's
// accuracy) where PyTorch's float32 matrix products keep full float32
// (torch.get_float32_matmul_precision() "highest", the default), as TF32 where a user allowed them
// less ("high", "medium", or torch.backends.cuda.matmul.allow_tf32: as fast as TF32 goes); a bfloat16
// x as it is.
enum class CascadeOperands { kTf32, kBf16x3, kBf16 };

CascadeOperands cascade_operands(const at::Tensor& x) {
  if (x.scalar_type() == at::kBFloat16) return CascadeOperands::kBf16;
  return at::globalContext().float32MatmulPrecision() == at::Float32MatmulPrecision::HIGHEST
             ? CascadeOperands::kBf16x3
             : CascadeOperands::kTf32;
}

// conv_transpose3d_cascade_sum_path's names for the kernel, per operands
const char* kernel_path(CascadeOperands operands) {
  switch (operands) {
    case CascadeOperands::kTf32: return "tf32 transposed cascade sum";
    case CascadeOperands::kBf16x3: return "bf16x3 transposed cascade sum";
    default: return "bf16 transposed cascade sum";
  }
}

// One dim of the stride-2 parity-class convolution (rewrites._transposed_axis): stage-1 position m
// of class q reads input m + first + u by the original tap taps[q][u] (-1: none), u < width.
struct TransposedAxis {
  int first, width;
  int taps[2][3];
};

int64_t floor_div(int64_t a, int64_t b) { return a / b - (a % b != 0 && (a < 0) != (b < 0)); }

// The axis of kernel k, padding pad, stride 2, or none past 3 taps a class.
std::optional<TransposedAxis> transposed_axis(int64_t k, int64_t pad) {
  int64_t first = std::numeric_limits<int64_t>::max(), last = std::numeric_limits<int64_t>::min();
  for (int64_t q = 0; q < 2; ++q) {
    first = std::min(first, -floor_div(k - 1 - q - pad, 2));
    last = std::max(last, floor_div(q + pad, 2));
  }
  if (last - first + 1 > 3) return std::nullopt;
  TransposedAxis axis{static_cast<int>(first), static_cast<int>(last - first + 1), {}};
  for (int q = 0; q < 2; ++q) {
    for (int u = 0; u < 3; ++u) {
      const int64_t tap = q + pad - 2 * (first + u);
      axis.taps[q][u] = u < axis.width && tap >= 0 && tap < k ? static_cast<int>(tap) : -1;
    }
  }
  return axis;
}

// cascade_weight_taps_kernel's parameters: per tap in order, the original kernel's flattened tap
// (t kr + r) ks + s.
struct WeightTaps {
  int16_t kernel_tap[kCascadeMaxTaps];
  int taps, out_channels, volume;  // T, O, kt kr ks
};

// The kernel's problem, its taps and its weights' rearrangement.
struct CascadePlan {
  CascadeOperands operands;
  std::array<TransposedAxis, 3> axes;  // (certified picks' float64 sums: cascade_picks_fixup_kernel)
  TransposedCascade p;  // (p.tap_operand set for the element type: set_tap_operands)
  uint8_t tap[kCascadeMaxTaps];  // per tap of the classes in order, (ud * 3 + uh) * 3 + uw
  WeightTaps weights;
};

// The kernel's plan for these (checked) arguments, or none where it does not apply.
std::optional<CascadePlan> cascade_plan(const at::Tensor& x, const TransposedCascadeSum& g) {
  if (x.scalar_type() != at::kBFloat16 && !tf32_convolution(x)) return std::nullopt;
  if (!runs_sm90a(x.get_device()) || !runs_bulk_copy(conv_transpose3d_cascade_sum_kernel<float, true>)) {
    return std::nullopt;
  }
  if (g.in_channels != 32 || g.out_channels > 64) return std::nullopt;
  if (!fits_cutlass_extents({x.numel()})) return std::nullopt;
  std::array<TransposedAxis, 3> axes;
  for (int d = 0; d < 3; ++d) {
    if (g.stride[d] != 2 || g.kernel2[d] != 3) return std::nullopt;
    const auto axis = transposed_axis(g.kernel[d], g.padding[d]);
    if (!axis) return std::nullopt;
    axes[d] = *axis;
  }
  CascadePlan plan{};
  plan.operands = cascade_operands(x);
  plan.axes = axes;
  TransposedCascade& p = plan.p;
  for (int d = 0; d < 3; ++d) {
    p.cells[d] = static_cast<int>(g.cells(d));
    p.start[d] = axes[d].first;
  }
  p.row_tiles = (p.cells[1] + 1) / 2;
  p.col_tiles = (p.cells[2] + 9) / 10;
  p.out_channels = static_cast<int>(g.out_channels);
  WeightTaps& w = plan.weights;
  int taps = 0;
  for (int q = 0; q < 8; ++q) {
    const int qd = q / 4, qh = q / 2 % 2, qw = q % 2;
    for (int u = 0; u < 27; ++u) {
      const int t = axes[0].taps[qd][u / 9], r = axes[1].taps[qh][u / 3 % 3], s = axes[2].taps[qw][u % 3];
      if (t < 0 || r < 0 || s < 0) continue;
      plan.tap[taps] = static_cast<uint8_t>(u);
      w.kernel_tap[taps++] = static_cast<int16_t>((t * g.kernel[1] + r) * g.kernel[2] + s);
    }
    p.class_end[q] = taps;
  }
  w.taps = taps;
  w.out_channels = p.out_channels;
  w.volume = static_cast<int>(g.kernel[0] * g.kernel[1] * g.kernel[2]);
  if (g.batch * p.cells[0] * p.row_tiles * p.col_tiles > std::numeric_limits<int32_t>::max()) return std::nullopt;
  return plan;
}

// The kernel's schedule of `items` CTAs' work on `sms` multiprocessors (one CTA each): where no picks
// are kept and the items past the last whole wave fill at most a third of a wave, those split in
// parts (transposed_cascade_sum.cuh's module comment): by stage-1 depth, then in up to 4 groups of
// classes of about equal taps. (Not in class groups alone: a part of 3 depths loads 5 slices
// through 3 slots, and where its classes read no slice of the first depth, nothing would wait for
// that slice's copy before its slot is loaded again.)
void schedule(TransposedCascade& p, int64_t items, int64_t sms, bool picks) {
  p.whole_items = items;
  p.class_groups = 1;
  p.group_end[0] = 8;
  const int64_t rest = items % sms, fit = rest == 0 || picks ? 1 : sms / rest;
  if (fit < 3 || items > std::numeric_limits<int32_t>::max() - sms) return;  // (the grid: under 2^31 CTAs)
  p.whole_items = items - rest;
  const int taps = p.class_end[7], groups = static_cast<int>(std::min<int64_t>(fit / 3, 4));
  // group g closes at the class whose taps reach (g + 1) / groups of them; trailing classes without taps join the last
  p.class_groups = 0;
  for (int q = 0; q < 8; ++q) {
    const int before = q == 0 ? 0 : p.class_end[q - 1];
    if (p.class_end[q] > before && p.class_end[q] * groups >= (p.class_groups + 1) * taps) {
      p.group_end[p.class_groups++] = q + 1;
    }
  }
  p.group_end[p.class_groups - 1] = 8;
}

// The operands' element type in memory: x's and the weight's (float for Bf16x3), and the kernel's.
template <typename T>
using Source = std::conditional_t<std::is_same_v<T, Bf16x3>, float, T>;
template <typename T>
using Element = typename TransposedCascadeConfig<T>::Element;

// out[e, o, r] = w[i, o, kernel_tap[e]] (w (32, O, kt, kr, ks) contiguous), 0 for o >= O, in row
// element r of input channel i = r % 32 (Bf16x3: part r / 32 of it): the kernel's A operand,
// (T, 64, R).
template <typename T>
__global__ void cascade_weight_taps_kernel(const Source<T>* __restrict__ w, Element<T>* __restrict__ out,
                                           const __grid_constant__ WeightTaps taps) {
  constexpr int R = TransposedCascadeConfig<T>::kRowElements;
  const int index = blockIdx.x * blockDim.x + threadIdx.x;
  if (index >= taps.taps * 64 * R) return;
  const int e = index / (64 * R), o = index / R % 64, r = index % R;
  const Source<T> v = o < taps.out_channels ? w[(r % 32 * taps.out_channels + o) * taps.volume + taps.kernel_tap[e]]
                                            : Source<T>{};
  if constexpr (std::is_same_v<T, Bf16x3>) {
    out[index] = bf16x3_part(v, r / 32);
  } else {
    out[index] = v;
  }
}

// x's channels-last float32 rows (positions, 32) as Bf16x3's (positions, 64): a thread takes 8
// channels of a position, their high parts to its row's first half, their low parts to its second; and
// max |x| into *x_max (zero before; its bits as an int's: |x|'s order, a NaN above inf).
__global__ void bf16x3_rows_kernel(const float* __restrict__ x, __nv_bfloat16* __restrict__ out, int64_t groups,
                                   float* __restrict__ x_max) {
  const int64_t group = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // (position, 8 channels)
  float largest = 0.f;
  if (group < groups) {
    const auto first = load_vector<float, 4>(x + group * 8), second = load_vector<float, 4>(x + group * 8 + 4);
    Vector<__nv_bfloat16, 8> high, low;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float v = e < 4 ? first.v[e] : second.v[e - 4];
      high.v[e] = bf16x3_part(v, 0);
      low.v[e] = bf16x3_part(v, 1);
      largest = __int_as_float(max(__float_as_int(largest), __float_as_int(fabsf(v))));
    }
    __nv_bfloat16* const row = out + group / 4 * 64 + group % 4 * 8;
    *reinterpret_cast<Vector<__nv_bfloat16, 8>*>(row) = high;
    *reinterpret_cast<Vector<__nv_bfloat16, 8>*>(row + 32) = low;
  }
  int bits = __float_as_int(largest);
#pragma unroll
  for (int lanes = 16; lanes > 0; lanes /= 2) bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, lanes));
  if (threadIdx.x % 32 == 0) atomicMax(reinterpret_cast<int*>(x_max), bits);
}

// tap_bound[o] (CascadeCertify): the largest over the classes of the sum over a class's taps and the 32
// input channels of |w[i, o, tap]|; a block of 32 threads (input channel i) per output channel o.
__global__ void cascade_tap_bound_kernel(const float* __restrict__ w, const __grid_constant__ WeightTaps taps,
                                         const __grid_constant__ TransposedCascade p, float* __restrict__ tap_bound) {
  const int o = blockIdx.x, i = threadIdx.x;
  float bound = 0.f;
  for (int q = 0, e = 0; q < 8; ++q) {
    float sum = 0.f;
    for (; e < p.class_end[q]; ++e) sum += fabsf(w[(i * taps.out_channels + o) * taps.volume + taps.kernel_tap[e]]);
#pragma unroll
    for (int lanes = 16; lanes > 0; lanes /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, lanes);
    bound = fmaxf(bound, sum);
  }
  if (i == 0) tap_bound[o] = bound;
}

// Certified picks (transposed_cascade_sum.cuh's CascadeCertify): a block per listed window (n, cell, o)
// sums its 216 elements y[n, o, 2 m + q] in float64 (a listed window is a near tie, which a float32 sum
// in another order than cuDNN's can decide otherwise than float64), then picks as the kernel does:
// stage 1 over the 8 classes, stage 2 over the 27 stage-1 positions, each in scan order (WindowPick).
// The window's x region (channels-last float32 x: its (2 + width)^3 positions' 32 channels) and
// w[:, o, :] (w (32, O, kt, kr, ks) float32) are staged in shared memory as float64, channel-major;
// warp q takes class q (its taps, the same for every lane), lane s2 < 27 stage-1 position s2.
struct PickFixup {
  TransposedAxis axes[3];
  int kernel[3];  // kt, kr, ks
  int in[3];      // x's D, H, W
  int region[3];  // the window's input positions per dim, 2 + the axis's width
};

constexpr int kFixupThreads = 256;  // a warp per class

// Shared memory of cascade_picks_fixup_kernel: x's region and w[:, o, :] as float64, then the 216 sums.
int64_t fixup_smem_bytes(const PickFixup& f) {
  const int64_t region = static_cast<int64_t>(f.region[0]) * f.region[1] * f.region[2];
  return (32 * region + 32 * f.kernel[0] * f.kernel[1] * f.kernel[2] + 216) * static_cast<int64_t>(sizeof(double));
}

__global__ void __launch_bounds__(kFixupThreads)
    cascade_picks_fixup_kernel(const float* __restrict__ x, const float* __restrict__ w,
                               const __grid_constant__ TransposedCascade p, const __grid_constant__ PickFixup f,
                               const int* __restrict__ count, const int* __restrict__ windows,
                               uint8_t* __restrict__ picks) {
  extern __shared__ double fixup_smem[];
  const int rd = f.region[0], rh = f.region[1], rw = f.region[2], region = rd * rh * rw;
  const int volume = f.kernel[0] * f.kernel[1] * f.kernel[2], O = p.out_channels;
  double* const xs = fixup_smem;            // (32, region)
  double* const ws = xs + 32 * region;      // (32, volume)
  double* const y = ws + 32 * volume;       // (27 stage-1 positions, 8 classes)
  const int q = threadIdx.x / 32, s2 = threadIdx.x % 32, listed = *count;
  for (int e = blockIdx.x; e < listed; e += gridDim.x) {
    const int index = windows[e];
    const int o = index % O;
    int cell = index / O;
    const int w2 = cell % p.cells[2];
    cell /= p.cells[2];
    const int h2 = cell % p.cells[1];
    cell /= p.cells[1];
    const int d2 = cell % p.cells[0];
    const int64_t n = cell / p.cells[0];
    // the region's first input position per dim (stage-1 position m's taps read m + start + u)
    const int z0 = 3 * d2 + p.start[0], h0 = 3 * h2 + p.start[1], v0 = 3 * w2 + p.start[2];
    __syncthreads();  // (the previous window's reads of the staged values done)
    for (int k = threadIdx.x; k < 32 * region; k += kFixupThreads) {  // a position's 32 channels a warp
      const int position = k / 32, i = k % 32;
      const int z = z0 + position / (rh * rw), h = h0 + position / rw % rh, v = v0 + position % rw;
      const bool inside = z >= 0 && z < f.in[0] && h >= 0 && h < f.in[1] && v >= 0 && v < f.in[2];
      xs[i * region + position] =
          inside ? static_cast<double>(x[(((n * f.in[0] + z) * f.in[1] + h) * f.in[2] + v) * 32 + i]) : 0.0;
    }
    for (int k = threadIdx.x; k < 32 * volume; k += kFixupThreads) {  // w[i, o, :] contiguous per i
      ws[k] = static_cast<double>(w[(static_cast<int64_t>(k / volume) * O + o) * volume + k % volume]);
    }
    __syncthreads();
    if (s2 < 27) {
      const int md = s2 / 9, mh = s2 / 3 % 3, mw = s2 % 3;
      double sum = 0.0;
      for (int ud = 0; ud < f.axes[0].width; ++ud) {
        const int t = f.axes[0].taps[q / 4][ud], z = z0 + md + ud;
        if (t < 0 || z < 0 || z >= f.in[0]) continue;  // (outside x: no term, as the original's)
        for (int uh = 0; uh < f.axes[1].width; ++uh) {
          const int r = f.axes[1].taps[q / 2 % 2][uh], h = h0 + mh + uh;
          if (r < 0 || h < 0 || h >= f.in[1]) continue;
          for (int uw = 0; uw < f.axes[2].width; ++uw) {
            const int s = f.axes[2].taps[q % 2][uw], v = v0 + mw + uw;
            if (s < 0 || v < 0 || v >= f.in[2]) continue;
            const double* const xp = xs + ((md + ud) * rh + mh + uh) * rw + mw + uw;
            const double* const wp = ws + (t * f.kernel[1] + r) * f.kernel[2] + s;
#pragma unroll 8
            for (int i = 0; i < 32; ++i) sum = fma(xp[i * region], wp[i * volume], sum);
          }
        }
      }
      y[s2 * 8 + q] = sum;
    }
    __syncthreads();
    if (threadIdx.x < 27) {  // stage 1: thread m's stage-1 position, over its 8 classes
      const int m = threadIdx.x;
      WindowPick<double> stage1;
#pragma unroll
      for (int c = 0; c < 8; ++c) stage1.update(y[m * 8 + c], c);
      y[m * 8] = stage1.value;
      y[m * 8 + 1] = m * 8 + stage1.offset;
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // stage 2, over the 27 positions in scan order
      WindowPick<double> window;
#pragma unroll 1
      for (int m = 0; m < 27; ++m) window.update(y[m * 8], static_cast<int>(y[m * 8 + 1]));
      picks[index] = static_cast<uint8_t>(window.offset);
    }
  }
}

// The kernel over x and weight as operands T (float: TF32, __nv_bfloat16, Bf16x3): (out, picks).
template <typename T>
std::tuple<at::Tensor, at::Tensor> run_kernel(const at::Tensor& x, const at::Tensor& weight,
                                              const TransposedCascadeSum& g, const CascadePlan& plan,
                                              bool save_indices) {
  using Config = TransposedCascadeConfig<T>;
  const auto swizzle = Config::kRowBytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  TransposedCascade p = plan.p;
  set_tap_operands<T>(p, plan.tap);
  const int64_t items = g.batch * p.cells[0] * p.row_tiles * p.col_tiles;
  schedule(p, items, device_attribute(cudaDevAttrMultiProcessorCount, x.get_device()), save_indices);
  const int64_t split = items - p.whole_items, parts = p.parts();
  TORCH_INTERNAL_ASSERT(split == 0 || !save_indices, "conv_transpose3d_cascade_sum: items split with picks");
  const int taps = plan.weights.taps;
  constexpr int R = Config::kRowElements;
  const auto element = std::is_same_v<T, float> ? at::kFloat : at::kBFloat16;
  // x channels-last, (N, D, H, W, I) contiguous, 16-byte aligned (the tensor map's base; Bf16x3's R parts
  // of it below)
  const at::Tensor x_channels_last = relayout(x, {0, 2, 3, 4, 1});
  at::Tensor x_last = x_channels_last;
  const at::Tensor w = weight.contiguous();
  // certified picks (CascadeCertify): Bf16x3 with picks
  constexpr bool certified = std::is_same_v<T, Bf16x3>;
  CascadeCertify certify{};
  at::Tensor x_max, tap_bound, count, windows;
  if constexpr (certified) {
    x_max = at::zeros({1}, x.options().dtype(at::kFloat));
    at::Tensor rows = at::empty({g.batch, g.in[0], g.in[1], g.in[2], R}, x.options().dtype(element));
    const int64_t groups = x_last.numel() / 8;
    bf16x3_rows_kernel<<<static_cast<unsigned>((groups + 255) / 256), 256, 0, stream>>>(
        x_last.const_data_ptr<float>(), static_cast<__nv_bfloat16*>(rows.mutable_data_ptr()), groups,
        x_max.mutable_data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    x_last = rows;
    if (save_indices) {
      tap_bound = at::empty({g.out_channels}, x_max.options());
      count = at::zeros({1}, x.options().dtype(at::kInt));
      windows = at::empty({g.batch * g.cells(0) * g.cells(1) * g.cells(2) * g.out_channels},
                          x.options().dtype(at::kInt));
      cascade_tap_bound_kernel<<<static_cast<unsigned>(g.out_channels), 32, 0, stream>>>(
          w.const_data_ptr<float>(), plan.weights, p, tap_bound.mutable_data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      certify = {tap_bound.const_data_ptr<float>(), x_max.const_data_ptr<float>(), count.mutable_data_ptr<int>(),
                 windows.mutable_data_ptr<int>()};
    }
  }
  at::Tensor w_taps = at::empty({1, taps, 64, R}, x.options().dtype(element));
  cascade_weight_taps_kernel<T><<<(taps * 64 * R + 255) / 256, 256, 0, stream>>>(
      static_cast<const Source<T>*>(w.const_data_ptr()), static_cast<Element<T>*>(w_taps.mutable_data_ptr()),
      plan.weights);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  const CUtensorMap x_map = contiguous_tensor_map(x_last, {R, Config::kCols, Config::kSliceRows, 1, 1}, swizzle);
  const CUtensorMap w_map = contiguous_tensor_map(w_taps, {R, 64, 1, 1}, swizzle);
  at::Tensor out = at::empty({g.batch, 1, g.cells(0), g.cells(1), g.cells(2)}, x.options().dtype(at::kFloat));
  const auto byte = x.options().dtype(at::kByte);
  at::Tensor picks = save_indices ? at::empty({g.batch, g.cells(0), g.cells(1), g.cells(2), g.out_channels}, byte)
                                  : at::empty({0}, byte);
  // the split items' parts' maxima (schedule)
  at::Tensor partial = at::empty({split * parts * 2 * 64 * 10}, out.options());
  // (without the picks, the kernel that keeps the maxima's values alone: 0.67 against 0.80 ms for SPEC's B in TF32)
  const auto kernel =
      save_indices ? conv_transpose3d_cascade_sum_kernel<T, true> : conv_transpose3d_cascade_sum_kernel<T, false>;
  // (allowed on each device it runs on: the attribute is a device's)
  allow_dynamic_shared_memory(kernel, Config::kSmemBytes);
  kernel<<<static_cast<unsigned>(p.whole_items + split * parts), Config::kThreads, Config::kSmemBytes, stream>>>(
      x_map, w_map, out.mutable_data_ptr<float>(), save_indices ? picks.mutable_data_ptr<uint8_t>() : nullptr,
      partial.mutable_data_ptr<float>(), p, certify);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if constexpr (certified) {
    if (save_indices) {
      PickFixup f{};
      for (int d = 0; d < 3; ++d) {
        f.axes[d] = plan.axes[d];
        f.kernel[d] = static_cast<int>(g.kernel[d]);
        f.in[d] = static_cast<int>(g.in[d]);
        f.region[d] = 2 + plan.axes[d].width;
      }
      const int64_t smem = fixup_smem_bytes(f);
      allow_dynamic_shared_memory(cascade_picks_fixup_kernel, smem);
      // (a block a listed window, as many as run at once: the list's length is on the device)
      const int64_t blocks = std::min<int64_t>(windows.numel(), 3 * device_attribute(cudaDevAttrMultiProcessorCount,
                                                                                      x.get_device()));
      if (blocks > 0) {
        cascade_picks_fixup_kernel<<<static_cast<unsigned>(blocks), kFixupThreads, smem, stream>>>(
            x_channels_last.const_data_ptr<float>(), w.const_data_ptr<float>(), p, f, count.const_data_ptr<int>(),
            windows.const_data_ptr<int>(), picks.mutable_data_ptr<uint8_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    }
  }
  if (split > 0) {
    cascade_parts_sum_kernel<<<static_cast<unsigned>(split * 2), 128, 0, stream>>>(partial.const_data_ptr<float>(),
                                                                                 out.mutable_data_ptr<float>(), p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {out, picks};
}

#endif  // FUSED_OPS_CUTLASS

std::tuple<at::Tensor, at::Tensor> conv_transpose3d_cascade_sum_cuda(const at::Tensor& x, const at::Tensor& weight,
                                                                     at::IntArrayRef stride, at::IntArrayRef padding,
                                                                     at::IntArrayRef output_padding,
                                                                     at::IntArrayRef kernel2, bool save_indices,
                                                                     std::optional<at::ScalarType> dtype) {
  const TransposedCascadeSum g =
      transposed_cascade_sum_setup(x, weight, stride, padding, output_padding, kernel2, save_indices);
  const c10::cuda::CUDAGuard guard(x.device());
#ifdef FUSED_OPS_CUTLASS
  const auto plan = cascade_plan(x, g);
  // (with picks, their indices under 2^31: certified picks list them as int; SPEC's B has 2^20)
  if (plan && (!save_indices || g.batch * g.cells(0) * g.cells(1) * g.cells(2) * g.out_channels <=
                                    std::numeric_limits<int32_t>::max())) {
    const at::ScalarType result = result_dtype("conv_transpose3d_cascade_sum", x.scalar_type(), dtype);
    auto [out, picks] = plan->operands == CascadeOperands::kTf32 ? run_kernel<float>(x, weight, g, *plan, save_indices)
                        : plan->operands == CascadeOperands::kBf16x3
                            ? run_kernel<Bf16x3>(x, weight, g, *plan, save_indices)
                            : run_kernel<__nv_bfloat16>(x, weight, g, *plan, save_indices);
    return {out.to(result), picks};
  }
#endif
  return transposed_cascade_sum_composite(x, weight, g, save_indices, dtype);
}

std::string conv_transpose3d_cascade_sum_path_cuda(const at::Tensor& x, const at::Tensor& weight,
                                                   at::IntArrayRef stride, at::IntArrayRef padding,
                                                   at::IntArrayRef output_padding, at::IntArrayRef kernel2) {
  [[maybe_unused]] const TransposedCascadeSum g =
      transposed_cascade_sum_setup(x, weight, stride, padding, output_padding, kernel2, false);
  const c10::cuda::CUDAGuard guard(x.device());
#ifdef FUSED_OPS_CUTLASS
  if (const auto plan = cascade_plan(x, g)) return kernel_path(plan->operands);
  return kCascadeSumByAten;
#else
  return std::string(kCascadeSumByAten) + " (built without CUTLASS)";
#endif
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("conv_transpose3d_cascade_sum", &conv_transpose3d_cascade_sum_cuda);
  m.impl("conv_transpose3d_cascade_sum_path", &conv_transpose3d_cascade_sum_path_cuda);
}

}  // namespace fused_ops
