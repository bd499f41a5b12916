// CUDA kernels of conv2d_sigmoid_sum_backward (the math: ../conv2d_sigmoid_sum.h):
// the weight's and the bias's gradients as one implicit GEMM on tensor cores
// (TF32 mma.sync m16n8k8) over x and the forward's saved factor; grad_y never
// reaches memory. x's gradient, where asked for, is PyTorch's convolution
// backward's (conv2d_sigmoid_sum_backward_composite).
//
// GEMM, per input channel c: D[r][o] = sum over output pixels p of A[r][p] B[p][o],
// rows r = the taps (kh, kw) (x's im2col: A[r][p] = x_padded[c, oh*SH + kh, ow*SW + kw])
// and a row of ones (its sums are the bias's gradient), columns o = 64 output
// channels, B = sigmoid'(y) (the factor). A task is one output row's 48 columns
// (one block of the factor); for it the copy engine stages a box of x (the task's
// input rows of eight channels, zeros outside the image) and the factor's block
// as it lies (its layout is B's fragment order: one 16-byte load per lane and
// n8 tile pair). The eight warps take one channel each (passes of eight over
// the channels), every tap and channel of it: 96 accumulators a lane.
//
// A block runs one unit: a contiguous range of one image's tasks, so that
// grad_out[n] multiplies its sums once, after. Each unit's sums go to
// `partial`; the reduce kernel adds grad_out[n] * partial over the units in a
// fixed order (deterministic results).
//
// Bank conflicts: a fragment load's lanes are 8 rows (g) by 4 pixels (t, SW
// words apart). The box's rows are 16 words mod 32 apart and TapOrder puts taps
// (kh, kw) and (kh + 1, kw) in rows 2i and 2i + 1 of each group of 8, the four
// pairs' kw distinct mod 4 while there are such: for SW = 4 such a load's lanes
// fall in 32 banks.
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
#include "conv2d_sigmoid_sum.cuh"
#include "mma.cuh"
#include "plane_rows.cuh"

namespace fused_ops {
namespace {

constexpr int kWarps = 8;  // one input channel each in a pass
constexpr int kThreads = 32 * kWarps;
constexpr int kGroups = kFactorColumns / 8;   // k8 groups of pixels in a task
constexpr int kPairs = kFactorChannels / 16;  // n8 tile pairs of output channels
constexpr int kZeroRow = -1;
constexpr int64_t kPartialWordsAlways = int64_t{16} << 20;  // 64 MiB of partial sums

// The geometry of one kernel shape (KH x KW, stride SH x SW).
template <int KH, int KW, int SH, int SW>
struct GradTile {
  static constexpr int kTaps = KH * KW;
  static constexpr int kOnes = kTaps;  // the code of the row of ones
  static constexpr int kMTiles = (kTaps + 1 + 15) / 16;
  static constexpr int kRows = 16 * kMTiles;
  // the task's input columns from a multiple of 4 (the copy engine's boxes start at 16-byte columns:
  // up to 3 more in front), whole 16-byte chunks, the row stride 16 words mod 32 (TapOrder)
  static constexpr int kMinCols = ((kFactorColumns - 1) * SW + KW + 3 + 3) / 4 * 4;
  static constexpr int kBoxCols = kMinCols + (48 - kMinCols % 32) % 32;
  static constexpr int kChannelWords = KH * kBoxCols;
  static constexpr int kBoxWords = kWarps * kChannelWords;
  static constexpr int kStageWords = (kBoxWords + kFactorWords + 31) / 32 * 32;  // stages 128-byte aligned
  static_assert(kBoxCols <= 256 && KH <= 256, "boxes the copy engine takes");
  static_assert(kBoxCols % 32 == 16 && kBoxWords % 4 == 0, "row stride, the factor's block 16-byte aligned");
};

// The GEMM's rows: tap[r] is row r's tap kh * KW + kw, KH * KW for the row of
// ones, kZeroRow past them. Pairs (kh, kw), (kh + 1, kw) for even kh fill rows
// 2i, 2i + 1, taken by kw mod 4 in turn (groups of 8 rows with one pair of each
// residue while every residue has pairs left), then the last row of taps of an
// odd KH, the ones, the zeros.
template <int KH, int KW, int kRows>
struct TapOrder {
  int tap[kRows];

  constexpr TapOrder() : tap() {
    int pairs[4][KH * KW] = {}, counts[4] = {}, taken[4] = {};
    for (int kw = 0; kw < KW; ++kw) {
      for (int kh = 0; kh + 1 < KH; kh += 2) pairs[kw % 4][counts[kw % 4]++] = kh * KW + kw;
    }
    int n = 0;
    for (bool left = true; left;) {  // a pair of each residue with pairs left, in turn
      left = false;
      for (int r = 0; r < 4; ++r) {
        if (taken[r] < counts[r]) {
          const int first = pairs[r][taken[r]++];
          tap[n++] = first;
          tap[n++] = first + KW;
          left = true;
        }
      }
    }
    if (KH % 2 == 1) {
      for (int kw = 0; kw < KW; ++kw) tap[n++] = (KH - 1) * KW + kw;
    }
    tap[n++] = KH * KW;
    while (n < kRows) tap[n++] = kZeroRow;
  }

  // whether the 8 rows from `first` are all zero rows / all taps
  constexpr bool zeros(int first) const {
    for (int i = 0; i < 8; ++i) {
      if (tap[first + i] != kZeroRow) return false;
    }
    return true;
  }
  constexpr bool taps(int first) const {
    for (int i = 0; i < 8; ++i) {
      if (tap[first + i] < 0 || tap[first + i] >= KH * KW) return false;
    }
    return true;
  }
};

struct GradParams {
  const float* factor;  // (N, OH, T, 1, kFactorWords)
  float* partial;       // (units, kFactorChannels, C, taps): each unit's sums
  float* bias_partial;  // (units, kFactorChannels)
  int C, OH, T, pad_h, pad_w, passes, units_per_image, stages;
  int lead;  // columns staged in front of a box's first input column: (-pad_w) mod 4
};

// Operand: the convolution's input type, to which x is rounded as it is read (the forward's x:
// a float32 x convolved with a 16-bit weight was rounded to it), then to TF32 (exact for
// bfloat16 and float16 values).
template <int KH, int KW, int SH, int SW, typename Operand>
__global__ void __launch_bounds__(kThreads, 1)
    conv2d_sigmoid_sum_weight_grad_kernel(const GradParams p, const __grid_constant__ CUtensorMap map) {
  using T = GradTile<KH, KW, SH, SW>;
  // shared memory: the stages' barriers, the stages (x's box, the factor's block)
  extern __shared__ __align__(128) float smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + kMaxStages;
  float* stages = smem + kBarrierWords;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;

  // this block's unit: tasks [first, first + count) of image n; items (pass, task), pass by pass
  const int n = blockIdx.x / p.units_per_image, part = blockIdx.x % p.units_per_image;
  const int tasks = p.OH * p.T;
  const int first = static_cast<int>(int64_t{part} * tasks / p.units_per_image);
  const int count = static_cast<int>(int64_t{part + 1} * tasks / p.units_per_image) - first;
  const int items = count * p.passes;
  auto load_item = [&](int64_t item, int s) {
    const int pass = static_cast<int>(item / count), task = first + static_cast<int>(item % count);
    const int oh = task / p.T, block = task % p.T;
    float* stage = stages + s * T::kStageWords;
    barrier_arrive_expect(&full[s], (T::kBoxWords + kFactorWords) * sizeof(float));
    tensor_load_4d(stage, map, block * kFactorColumns * SW - p.pad_w - p.lead, oh * SH - p.pad_h, pass * kWarps, n,
                   &full[s]);
    bulk_load(stage + T::kBoxWords, p.factor + ((int64_t{n} * p.OH + oh) * p.T + block) * kFactorWords,
              kFactorWords * sizeof(float), &full[s]);
  };
  StageRing ring{full, empty, p.stages, items};
  ring.start(kThreads, load_item);

  // This lane's GEMM rows 16 mt + 8 h + g: their codes (TapOrder) and box offsets.
  constexpr TapOrder<KH, KW, T::kRows> order{};
  int code[T::kMTiles][2], offset[T::kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < T::kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = order.tap[16 * mt + 8 * h + g];
      code[mt][h] = c;
      offset[mt][h] = c >= 0 && c < T::kTaps ? (c / KW) * T::kBoxCols + c % KW : 0;
    }
  }
  const int lane_offset = warp * T::kChannelWords + p.lead + SW * t;

  float acc[T::kMTiles][2 * kPairs][4];
  int64_t item = 0;
  for (int pass = 0; pass < p.passes; ++pass) {
    const int c = pass * kWarps + warp;
#pragma unroll
    for (int mt = 0; mt < T::kMTiles; ++mt)
#pragma unroll
      for (int j = 0; j < 2 * kPairs; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mt][j][e] = 0.f;

    for (int i = 0; i < count; ++i, ++item) {
      ring.acquire(item, load_item);
      if (c < p.C) {
        const float* box = stages + ring.stage * T::kStageWords + lane_offset;
        const uint4* b_words = reinterpret_cast<const uint4*>(stages + ring.stage * T::kStageWords + T::kBoxWords);
#pragma unroll
        for (int kk = 0; kk < kGroups; ++kk) {
          // A: rows g (a0, a2) and g + 8 (a1, a3), pixels k = t (a0, a1) and t + 4 (a2, a3: 8 columns on)
          const int pixel = 16 * (kk / 2) + 4 * (kk % 2);
          uint32_t a[T::kMTiles][4];
#pragma unroll
          for (int mt = 0; mt < T::kMTiles; ++mt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int h = e & 1, rows = 16 * mt + 8 * h;
              if (order.zeros(rows)) {
                a[mt][e] = 0;
              } else {
                const float value = box[offset[mt][h] + SW * (pixel + 8 * (e >> 1))];
                const uint32_t v = Tf32Mma::pack(rounded_to<Operand>(value), 0.f);
                a[mt][e] = order.taps(rows) || (code[mt][h] >= 0 && code[mt][h] < T::kTaps)
                               ? v
                               : (code[mt][h] == T::kOnes ? Tf32Mma::kOne : 0u);
              }
            }
          }
#pragma unroll
          for (int pair = 0; pair < kPairs; ++pair) {
            const uint4 b = b_words[(kk * kPairs + pair) * 32 + lane];
#pragma unroll
            for (int mt = 0; mt < T::kMTiles; ++mt) {
              Tf32Mma::mma(acc[mt][2 * pair], a[mt], b.x, b.y);
              Tf32Mma::mma(acc[mt][2 * pair + 1], a[mt], b.z, b.w);
            }
          }
        }
      }
      ring.release();
    }

    // the pass's sums: rows g (c0, c1) and g + 8 (c2, c3) by channels 8 j + 2 t (+ 1); the taps' to
    // partial, the ones' (the first channel's warp) to bias_partial
    if (c < p.C) {
#pragma unroll
      for (int mt = 0; mt < T::kMTiles; ++mt) {
#pragma unroll
        for (int j = 0; j < 2 * kPairs; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = code[mt][e >> 1], o = 8 * j + 2 * t + (e & 1);
            if (r >= 0 && r < T::kTaps) {
              p.partial[((int64_t{blockIdx.x} * kFactorChannels + o) * p.C + c) * T::kTaps + r] = acc[mt][j][e];
            } else if (r == T::kOnes && c == 0) {
              p.bias_partial[int64_t{blockIdx.x} * kFactorChannels + o] = acc[mt][j][e];
            }
          }
        }
      }
    }
  }
}

// grad_weight (O, C, taps) and grad_bias (O,): grad_out[n] times each unit's
// sums, added over the units in a fixed order (in float64). A block takes
// kReduceOutputs outputs; its kReduceSlices threads of an output each add the
// units u = slice (mod kReduceSlices) in turn, then one adds the slices' sums.
constexpr int kReduceOutputs = 32, kReduceSlices = 8;

__global__ void __launch_bounds__(kReduceOutputs * kReduceSlices)
    weight_grad_reduce_kernel(const float* partial, const float* bias_partial, const float* grad_out, int units,
                              int units_per_image, int O, int per_channel, float* grad_weight, float* grad_bias) {
  __shared__ double sums[kReduceSlices][kReduceOutputs];
  const int column = threadIdx.x % kReduceOutputs, slice = threadIdx.x / kReduceOutputs;
  const int64_t weights = int64_t{O} * per_channel;
  const int64_t i = int64_t{blockIdx.x} * kReduceOutputs + column;
  // (a weight's sums are partial[u * 64 * per_channel + i], the bias's bias_partial[u * 64 + o])
  const bool is_weight = i < weights;
  const float* values = is_weight ? partial + i : bias_partial + (i - weights);
  const int64_t stride = is_weight ? int64_t{kFactorChannels} * per_channel : kFactorChannels;
  double sum = 0.0;
  if (i < weights + O) {
#pragma unroll 4
    for (int u = slice; u < units; u += kReduceSlices) {
      sum += double{grad_out[u / units_per_image]} * values[u * stride];
    }
  }
  sums[slice][column] = sum;
  __syncthreads();
  if (slice == 0 && i < weights + O) {
    for (int s = 1; s < kReduceSlices; ++s) sum += sums[s][column];
    if (is_weight) {
      grad_weight[i] = static_cast<float>(sum);
    } else {
      grad_bias[i - weights] = static_cast<float>(sum);
    }
  }
}

// Units per image: at least enough for a block on every multiprocessor, then
// the fewest whose last wave is at least 90% full (units = blocks, taken as one
// resident per multiprocessor: the 6 x 6 shape's stages take most of its shared
// memory), at most one per task.
int units_per_image(int64_t images, int64_t tasks, int64_t multiprocessors) {
  const int64_t least = std::max<int64_t>(1, (multiprocessors + images - 1) / images);
  int64_t best = least;
  double best_fill = 0.0;
  for (int64_t s = least; s <= 4 * least && s <= tasks; ++s) {
    const int64_t units = images * s;
    const double fill = static_cast<double>(units) / (((units + multiprocessors - 1) / multiprocessors) * multiprocessors);
    if (fill >= 0.9) return static_cast<int>(s);
    if (fill > best_fill) best = s, best_fill = fill;
  }
  return static_cast<int>(std::min(best, tasks));
}

// The weight's and bias's gradients (float32) by the kernels, if they take the
// call: on a device that runs their sm_90 code (the copy engine), a contiguous
// float32 x whose rows are 16-byte aligned (W % 4 == 0, a 16-byte aligned
// address) and a contiguous, 16-byte aligned float32 factor, a float32 weight
// where TF32 convolutions are allowed (as PyTorch's own convolution would use
// them) or a 16-bit one (x rounded to it as the forward read it: TF32 holds
// those values exactly), a compiled kernel shape, at most 64 output channels,
// sizes the kernels' int fields and the tensor map hold, the stages fitting in
// shared memory, and the units' partial sums no larger than the factor or
// kPartialWordsAlways (many channels over small images: PyTorch's). Else false.
bool launch_weight_grad(const at::Tensor& grad_out, const at::Tensor& factor, const at::Tensor& x,
                        const at::Tensor& weight, const Conv2dGeometry& g, at::Tensor& grad_weight,
                        at::Tensor& grad_bias) {
  if (x.scalar_type() != at::kFloat || factor.scalar_type() != at::kFloat || weight.size(0) > kFactorChannels) {
    return false;
  }
  if (!with_weight_operation(weight.scalar_type(), [](auto) {})) return false;
  if (!x.is_contiguous() || !copy_engine_takes(x) || !factor.is_contiguous() ||
      reinterpret_cast<uintptr_t>(factor.const_data_ptr()) % 16 != 0) {
    return false;
  }
  const int64_t oh = conv2d_output_size(x, weight, g)[0];
  const int64_t widest = std::max({x.size(1), x.size(2) + 2 * g.padding[0], x.size(3) + 2 * g.padding[1]});
  if (widest > INT_MAX / 64 || oh * factor.size(2) > INT_MAX) return false;
  bool launched = false;
  with_compiled_shape(weight.size(2), weight.size(3), g.stride[0], g.stride[1], [&](auto shape) {
    using S = decltype(shape);
    using T = GradTile<S::kh, S::kw, S::sh, S::sw>;
    const auto kernel = weight.scalar_type() == at::kFloat
                            ? conv2d_sigmoid_sum_weight_grad_kernel<S::kh, S::kw, S::sh, S::sw, float>
                        : weight.scalar_type() == at::kBFloat16
                            ? conv2d_sigmoid_sum_weight_grad_kernel<S::kh, S::kw, S::sh, S::sw, __nv_bfloat16>
                            : conv2d_sigmoid_sum_weight_grad_kernel<S::kh, S::kw, S::sh, S::sw, __half>;
    if (device_attribute(cudaDevAttrComputeCapabilityMajor, x.get_device()) < 9 || !runs_bulk_copy(kernel)) return;
    const StagesFitting fit = stages_fitting(T::kStageWords, x);
    const size_t smem = fit.smem;
    GradParams p{};
    p.stages = fit.stages;
    if (p.stages < 2) return;
    p.C = static_cast<int>(x.size(1));
    p.OH = static_cast<int>(oh);
    p.T = static_cast<int>(factor.size(2));
    p.pad_h = static_cast<int>(g.padding[0]);
    p.pad_w = static_cast<int>(g.padding[1]);
    p.passes = (p.C + kWarps - 1) / kWarps;
    p.lead = static_cast<int>((4 - p.pad_w % 4) % 4);
    const int64_t images = x.size(0);
    p.units_per_image = units_per_image(images, int64_t{p.OH} * p.T,
                                        device_attribute(cudaDevAttrMultiProcessorCount, x.get_device()));
    const int64_t units = images * p.units_per_image;
    const int64_t partial_words = units * kFactorChannels * p.C * T::kTaps;
    if (units > INT_MAX || partial_words > std::max<int64_t>(factor.numel(), kPartialWordsAlways)) return;
    const at::Tensor partial = at::empty({units, kFactorChannels, p.C, T::kTaps}, x.options());
    const at::Tensor bias_partial = at::empty({units, kFactorChannels}, x.options());
    p.factor = factor.const_data_ptr<float>();
    p.partial = partial.mutable_data_ptr<float>();
    p.bias_partial = bias_partial.mutable_data_ptr<float>();

    const CUtensorMap map = nchw_tensor_map(x, T::kBoxCols, S::kh, kWarps);
    const auto stream = c10::cuda::getCurrentCUDAStream();
    allow_dynamic_shared_memory(kernel, smem);
    kernel<<<static_cast<unsigned>(units), kThreads, smem, stream>>>(p, map);
    C10_CUDA_KERNEL_LAUNCH_CHECK();

    grad_weight = at::empty({weight.size(0), p.C, S::kh, S::kw}, x.options());
    grad_bias = at::empty({weight.size(0)}, x.options());
    const at::Tensor g_out = grad_out.to(at::kFloat).contiguous();
    const int64_t outputs = grad_weight.numel() + grad_bias.numel();
    weight_grad_reduce_kernel<<<static_cast<unsigned>((outputs + kReduceOutputs - 1) / kReduceOutputs),
                                kReduceOutputs * kReduceSlices, 0, stream>>>(
        partial.const_data_ptr<float>(), bias_partial.const_data_ptr<float>(), g_out.const_data_ptr<float>(),
        static_cast<int>(units), p.units_per_image, static_cast<int>(weight.size(0)), p.C * T::kTaps,
        grad_weight.mutable_data_ptr<float>(), grad_bias.mutable_data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    launched = true;
  });
  return launched;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_sigmoid_sum_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& grad_factor, const at::Tensor& x, const at::Tensor& weight,
    at::IntArrayRef stride, at::IntArrayRef padding, std::array<bool, 3> output_mask) {
  const Conv2dGeometry g = check_conv2d_sigmoid_sum_backward(grad_out, grad_factor, x, weight, stride, padding);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor grad_weight, grad_bias;
  if ((output_mask[1] || output_mask[2]) && launch_weight_grad(grad_out, grad_factor, x, weight, g, grad_weight, grad_bias)) {
    return {output_mask[0] ? std::get<0>(conv2d_sigmoid_sum_backward_composite(grad_out, grad_factor, x, weight, g,
                                                                             {true, false, false}))
                           : x.new_empty({0}),
            output_mask[1] ? grad_weight.to(weight.scalar_type()) : x.new_empty({0}),
            output_mask[2] ? grad_bias.to(weight.scalar_type()) : x.new_empty({0})};
  }
  return conv2d_sigmoid_sum_backward_composite(grad_out, grad_factor, x, weight, g, output_mask);
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("conv2d_sigmoid_sum_backward", &conv2d_sigmoid_sum_backward_cuda);
}

}  // namespace fused_ops
