// CUDA kernel of conv3d_max_pool3d_mean (the math: ../conv3d_max_pool3d_mean.h):
// the 3 x 3 x 3 convolution as an implicit GEMM on tensor cores (mma.sync:
// TF32 m16n8k8 for a float32 weight, bf16 / f16 m16n8k16 for a 16-bit one, x
// rounded as it is read), the division, the 2 x 2 x 2 max-pool and the mean its
// epilogue; y never reaches memory.
//
// GEMM: rows = the (up to 16) output channels (the weight as the A operand),
// columns = output pixels along w (n8 tiles), k = (tap, input channel) for
// blocks of 8 input channels: a k step is one tap by 8 channels (TF32) or two
// taps (16-bit). A task is one plane of windows (2 output planes), two rows of
// windows (4 output rows) and 32 windows across (64 output columns) of one
// image; its eight warps each own one row of windows and 16 columns: eight n8
// tiles (2 planes x 2 rows x 2 column groups), so each lane's accumulators
// hold whole windows (its pixel pair 2t, 2t + 1 of each tile is a window's
// two columns, the four (plane, row) tiles its other six elements): the max
// needs no exchange between lanes.
//
// Loading: the copy engine stages each (task, channel block)'s input box
// (8 channels x 4 planes x 6 rows x 72 columns, NCDHW read in place, zeros
// outside the image) in one of up to two stages; the block copies it out into
// one of two operand buffers, rounded to the operation's type (16-bit: channel
// pairs packed), with the channels kOperandStride = 8 mod 32 words apart: a B
// fragment load's lanes (8 columns g by 4 channels t) hit 32 distinct banks.
// The stage is released as soon as it is copied (its next box lands while the
// block computes), and one block barrier per item separates the copy from the
// computing. The weight's A fragments for every channel block are in shared
// memory for the whole kernel (weight_fragments_kernel writes them once per call).
//
// Each warp's per-channel sums of its windows go to `partial` (tasks x kWarps
// x 16); each image's are added in a fixed order after (mean_epilogue_kernel:
// deterministic), divided by the number of windows, and the channel bias added
// and the channels summed where the call asks for them.
// Where the backward needs them each window's pick is written as one byte.
//
// In a build with CUTLASS, on an sm_90 device, calls of SPEC's shape (8 input and 16 output channels, rows 64
// wide, no padding) in TF32 or bfloat16 take the wgmma kernel instead (conv3d_wgmma_pool.cuh: TMA boxes of x
// converted into the operand layout by a producer warp group, wgmma accumulators whose rows are x's rows, the
// same epilogue's arithmetic and rule for the picks), its partial sums read by the same mean_epilogue.
#ifdef FUSED_OPS_CUTLASS
#ifndef NDEBUG
#define NDEBUG  // before any header (cutlass_conv.cuh says why)
#endif
#endif

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "../conv3d_max_pool3d_mean.h"
#include "../max_pool3d.h"
#include "block_reduce.cuh"
#include "bulk_copy.cuh"
#include "conv3d_max_pool3d_mean.cuh"
#include "mma.cuh"
#include "plane_rows.cuh"
#ifdef FUSED_OPS_CUTLASS
#include "conv3d_wgmma_pool.cuh"
#include "cutlass_conv.cuh"  // (runs_sm90a, tf32_convolution)
#endif

namespace fused_ops {
namespace {

using namespace conv3d_pool;

constexpr int kOperandStride = kChannelWords + 8;  // = 8 mod 32: conflict-free B loads
static_assert(kChannelWords % 32 == 0 && kOperandStride % 32 == 8, "bank layout");

// The operation's geometry: k steps per channel block, operand buffer words.
template <typename Mma>
struct Operation {
  static constexpr bool kTf32 = Mma::kPerRegister == 1;
  static constexpr int kSteps = kTf32 ? kTaps : (kTaps + 1) / 2;
  static constexpr int kFragmentWords = kSteps * 32 * 4;  // per channel block: a uint4 per lane and step
  static constexpr int kOperandPlanes = kTf32 ? kBlockChannels : kBlockChannels / 2;
  static constexpr int kOperandWords = kOperandPlanes * kOperandStride;
};

struct Params {
  TaskGrid grid;
  const uint32_t* fragments;  // the weight's A fragments: (channel_blocks, kFragmentWords)
  const float* bias;          // (O,) rounded to Mma::Input (weight_fragments_kernel), or null
  float* partial;             // (tasks * kWarps, kChannels)
  uint8_t* picks;             // (N, O, PD, PH, PW), or null where not saved
  float reciprocal;           // 1 / divisor, as PyTorch's CUDA division multiplies
  int O, stages;
};

// The weight's A fragments for every channel block, rounded to the operation's
// type, in the order the k loop reads them: [block][step][lane] x {a0, a1, a2, a3}
// with a_e = w[o = g + 8 (e % 2)][k = (e / 2) half of the step] (mma.cuh's
// layouts): TF32 step s is tap s, k = channel t + 4 (e / 2) of the block; a
// 16-bit step s is taps 2s (e < 2) and 2s + 1, k = channels 2t, 2t + 1. Zero
// past O, C and the 27 taps. The weight and the bias are read in their own dtype W (the
// operation's, or float32 rounded to it here: autocast's casts without their copies); the bias,
// rounded, goes to rounded_bias (O floats) where there is one.
template <typename Mma, typename W>
__global__ void weight_fragments_kernel(const W* weight, const W* bias, int O, int C, int channel_blocks,
                                        uint32_t* fragments, float* rounded_bias) {
  using Op = Operation<Mma>;
  using T = typename Mma::Input;
  const int64_t total = int64_t{channel_blocks} * Op::kFragmentWords;
  auto w = [&](int o, int c, int tap) {
    return o < O && c < C && tap < kTaps ? rounded_to<T>(widened(weight[(int64_t{o} * C + c) * kTaps + tap])) : 0.f;
  };
  if (bias != nullptr && blockIdx.x == 0 && threadIdx.x < O) {
    rounded_bias[threadIdx.x] = rounded_to<T>(widened(bias[threadIdx.x]));
  }
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int e = static_cast<int>(i % 4), lane = static_cast<int>(i / 4 % 32);
    const int step = static_cast<int>(i / 128 % Op::kSteps), block = static_cast<int>(i / Op::kFragmentWords);
    const int o = lane / 4 + 8 * (e % 2), t = lane % 4;
    if constexpr (Op::kTf32) {
      fragments[i] = Mma::pack(w(o, block * kBlockChannels + t + 4 * (e / 2), step), 0.f);
    } else {
      const int c = block * kBlockChannels + 2 * t, tap = 2 * step + e / 2;
      fragments[i] = Mma::pack(w(o, c, tap), w(o, c + 1, tap));
    }
  }
}

// The staged box copied into an operand buffer, rounded to the operation's
// type: TF32, channel c's words at c * kOperandStride; 16-bit, channels 2j and
// 2j + 1 packed into one word at j * kOperandStride.
template <typename Mma>
__device__ __forceinline__ void copy_operands(const float* stage, uint32_t* operands) {
  constexpr int kChunks = kChannelWords / 4;  // 16-byte chunks per channel
  if constexpr (Operation<Mma>::kTf32) {
    for (int i = threadIdx.x; i < kBlockChannels * kChunks; i += kThreads) {
      const float4 v = reinterpret_cast<const float4*>(stage)[i];
      const int c = i / kChunks, chunk = i % kChunks;
      reinterpret_cast<uint4*>(operands + c * kOperandStride)[chunk] =
          make_uint4(Mma::pack(v.x, 0.f), Mma::pack(v.y, 0.f), Mma::pack(v.z, 0.f), Mma::pack(v.w, 0.f));
    }
  } else {
    for (int i = threadIdx.x; i < kBlockChannels / 2 * kChunks; i += kThreads) {
      const int pair = i / kChunks, chunk = i % kChunks;
      const float4 lo = reinterpret_cast<const float4*>(stage + 2 * pair * kChannelWords)[chunk];
      const float4 hi = reinterpret_cast<const float4*>(stage + (2 * pair + 1) * kChannelWords)[chunk];
      reinterpret_cast<uint4*>(operands + pair * kOperandStride)[chunk] =
          make_uint4(Mma::pack(lo.x, hi.x), Mma::pack(lo.y, hi.y), Mma::pack(lo.z, hi.z), Mma::pack(lo.w, hi.w));
    }
  }
}

// a or b, whichever the pool keeps of a window scaled by a positive (kMax) or
// negative reciprocal; NaN wins (the value of PyTorch's pick: any NaN).
template <bool kMax>
__device__ __forceinline__ float extreme(float a, float b) {
  return (kMax ? b > a : b < a) || b != b ? b : a;
}

template <typename Mma, bool kPositive>
__global__ void __launch_bounds__(kThreads, 1)
    conv3d_max_pool3d_mean_kernel(const Params p, const __grid_constant__ CUtensorMap map) {
  using Op = Operation<Mma>;
  using T = typename Mma::Input;  // (the convolution's type, for the epilogue's rounding of y)
  extern __shared__ __align__(128) float smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + kMaxStages;
  float* stages = smem + kBarrierWords;
  uint32_t* fragments = reinterpret_cast<uint32_t*>(stages + p.stages * kBoxWords);
  const TaskGrid& grid = p.grid;
  uint32_t* operands = fragments + grid.channel_blocks * Op::kFragmentWords;  // two buffers
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;

  // the weight's fragments, once
  for (int i = threadIdx.x; i < grid.channel_blocks * Op::kFragmentWords / 4; i += kThreads) {
    reinterpret_cast<uint4*>(fragments)[i] = reinterpret_cast<const uint4*>(p.fragments)[i];
  }

  // this block's tasks: every gridDim.x-th from blockIdx.x (the blocks work on
  // neighbouring tasks at any time: the boxes' overlaps are read from L2), channel block by block (items)
  const int my_tasks = static_cast<int>(blockIdx.x) < grid.tasks ? (grid.tasks - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  const int items = my_tasks * grid.channel_blocks;
  // (item = task x channel_blocks + block, channel_blocks 1 or 2)
  static_assert(kMaxChannelBlocks == 2, "a channel block by a shift");
  const int block_bits = grid.channel_blocks - 1;
  auto task_of = [&](int item) { return static_cast<int>(blockIdx.x + (item >> block_bits) * gridDim.x); };
  auto load_item = [&](int item, int s) {
    load_box(stages + s * kBoxWords, &full[s], map, grid, task_of(item), item & block_bits);
  };
  StageRing ring{full, empty, p.stages, items};
  ring.start(kThreads, load_item);  // (its block barrier also publishes the fragments)

  // this lane's B words: channel t (+ 4 or a tap later: the second register), this warp's row of
  // windows (rows 2 rp, 2 rp + 1 of the task) and 16 columns, column g of each n8 tile
  const int rp = warp / 4, quarter = warp % 4;
  const int lane_offset = t * kOperandStride + 2 * rp * kBoxCols + grid.lead + 16 * quarter + g;
  float bias[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int o = g + 8 * h;
    bias[h] = p.bias != nullptr && o < p.O ? p.bias[o] : 0.f;
  }

  // tile j = (dd, hh, wq): output plane dd, row 2 rp + hh, columns 16 quarter + 8 wq + (0..7)
  float acc[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;

  for (int item = 0; item < items; ++item) {
    barrier_wait(&full[ring.stage], ring.phase);
    uint32_t* buffer = operands + (item % 2) * Op::kOperandWords;
    copy_operands<Mma>(stages + ring.stage * kBoxWords, buffer);
    barrier_arrive(&empty[ring.stage]);
    __syncthreads();  // (the buffer is whole; every warp is done with the one it computed on before)
    ring.refill(item, load_item);

    const int block = item & block_bits;
    const uint4* a_fragments = reinterpret_cast<const uint4*>(fragments + block * Op::kFragmentWords) + lane;
    const uint32_t* b_words = buffer + lane_offset;
#pragma unroll
    for (int step = 0; step < Op::kSteps; ++step) {
      const uint4 af = a_fragments[step * 32];
      const uint32_t a[4] = {af.x, af.y, af.z, af.w};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int tile = (j / 4) * kPlaneWords + (j / 2 % 2) * kBoxCols + 8 * (j % 2);
        uint32_t b0, b1;
        if constexpr (Op::kTf32) {
          b0 = b_words[tile + tap_offset(step)];
          b1 = b_words[tile + tap_offset(step) + 4 * kOperandStride];
        } else {
          b0 = b_words[tile + tap_offset(2 * step)];
          b1 = 2 * step + 1 < kTaps ? b_words[tile + tap_offset(2 * step + 1)] : 0u;
        }
        Mma::mma(acc[j], a, b0, b1);
      }
    }
    if (block != grid.channel_blocks - 1) continue;

    // the task's epilogue: each lane's windows (channels g, g + 8; window columns 4 wq + t of the
    // warp's 8); y = (acc + bias) / divisor rounded as PyTorch rounds the convolution's output and
    // the quotient (to the convolution's type), the pool's pick, the sum over this warp's windows
    const TaskCoords tc = task_coords(task_of(item), grid);
    const int ph = 2 * tc.row_group + rp;
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int o = g + 8 * h;
#pragma unroll
      for (int wq = 0; wq < 2; ++wq) {
        const int pw = tc.col_tile * (kTileColumns / 2) + 8 * quarter + 4 * wq + t;
        const bool inside = o < p.O && ph < grid.PH && pw < grid.PW;
        auto y = [&](float v) {
          return rounded_to<T>(__fmul_rn(rounded_to<T>(v + bias[h]), p.reciprocal));
        };
        float value;
        if (p.picks != nullptr) {
          WindowPick<float> pick;
#pragma unroll
          for (int element = 0; element < 8; ++element) {  // scan order (dd, hh, ww)
            pick.update(y(acc[(element / 2) * 2 + wq][2 * h + element % 2]), element);
          }
          value = pick.value;
          if (inside) {
            p.picks[((static_cast<int64_t>(tc.n) * p.O + o) * grid.PD + tc.pd) * grid.PH * grid.PW +
                    int64_t{ph} * grid.PW + pw] =
                static_cast<uint8_t>(pick.offset);
          }
        } else {
          float m = acc[wq][2 * h];
#pragma unroll
          for (int element = 1; element < 8; ++element) {
            m = extreme<kPositive>(m, acc[(element / 2) * 2 + wq][2 * h + element % 2]);
          }
          value = y(m);  // (y is monotone: the pick's value)
        }
        if (inside) sum[h] += value;
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 1);
      sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 2);
      if (t == 0) p.partial[(task_of(item) * kWarps + warp) * kChannels + g + 8 * h] = sum[h];
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
  }
}

// mean[n, o] = (sum over rows of partial[n, rows, o]) / windows, rounded to R (the op's mean); with a
// channel bias, + channel_bias[o] in float rounded to Out (the dtype the addition promotes to); with
// sum_channels, out[n] = the sum over o in float (lanes added in a fixed tree order) rounded to Out, else
// out[n, o]. One block an image, lane o a channel's column (sum_column: a fixed order, deterministic).
template <typename R, typename Out>
__global__ void __launch_bounds__(32 * kColumnSlices)
    mean_epilogue_kernel(const float* __restrict__ partial, int64_t rows, int O, float windows,
                         const Out* __restrict__ channel_bias, bool sum_channels, Out* __restrict__ out) {
  static_assert(kChannels <= 32, "a lane a channel");
  const int lane = threadIdx.x % 32;
  const float sum = sum_column(partial + blockIdx.x * rows * kChannels + lane, rows, kChannels, lane < O);
  if (threadIdx.x >= 32) return;
  float value = 0.f;
  if (lane < O) {
    value = static_cast<float>(static_cast<R>(sum / windows));
    if (channel_bias != nullptr) {
      value = static_cast<float>(static_cast<Out>(value + static_cast<float>(channel_bias[lane])));
    }
  }
  if (sum_channels) {
    value = warp_sum(value);
    if (lane == 0) out[blockIdx.x] = static_cast<Out>(value);
  } else if (lane < O) {
    out[int64_t{blockIdx.x} * O + lane] = static_cast<Out>(value);
  }
}

// The op's result from the fused kernel's partial sums (N, rows, kChannels): mean_epilogue_kernel where the
// channel bias (if any) has the result's dtype, else the mean by it and PyTorch's ops after.
at::Tensor mean_epilogue(const at::Tensor& partial, int O, const Conv3dPoolGeometry& g, at::ScalarType mean_dtype,
                         const std::optional<at::Tensor>& channel_bias, bool sum_channels) {
  const at::ScalarType out_dtype = channel_bias_result_dtype(mean_dtype, channel_bias);
  const bool in_kernel = !channel_bias.has_value() || (channel_bias->scalar_type() == out_dtype &&
                                                       (out_dtype == mean_dtype || out_dtype == at::kFloat));
  const int64_t batch = partial.size(0);
  const auto options = partial.options().dtype(in_kernel ? out_dtype : mean_dtype);
  at::Tensor out = in_kernel && sum_channels ? at::empty({batch}, options) : at::empty({batch, O}, options);
  const at::Tensor bias = in_kernel && channel_bias.has_value() ? channel_bias->contiguous() : at::Tensor();
  const float windows = static_cast<float>(g.pooled[0] * g.pooled[1] * g.pooled[2]);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, mean_dtype, "conv3d_max_pool3d_mean", [&] {
    auto launch = [&](auto* out_type) {
      using Out = std::remove_pointer_t<decltype(out_type)>;
      mean_epilogue_kernel<scalar_t, Out><<<static_cast<unsigned>(batch), 32 * kColumnSlices, 0, stream>>>(
          partial.const_data_ptr<float>(), partial.size(1), O, windows,
          bias.defined() ? bias.const_data_ptr<Out>() : nullptr, in_kernel && sum_channels,
          out.mutable_data_ptr<Out>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (out.scalar_type() == mean_dtype) {
      launch(static_cast<scalar_t*>(nullptr));
    } else {
      launch(static_cast<float*>(nullptr));
    }
  });
  return in_kernel ? out : add_channel_bias_and_sum(out, channel_bias, sum_channels);
}

// The tensor-core operation of the fused kernel for this call, if the kernels
// take it (kernel_takes): the weight's (with_weight_operation). f(Mma{}) is
// called with it; false if none.
template <typename F>
bool with_fused_operation(const at::Tensor& x, const at::Tensor& weight, const Conv3dPoolGeometry& g,
                          at::ScalarType operand, F&& f) {
  return kernel_takes(x, weight, g) && with_weight_operation(operand, f);
}

// The fused kernel's launch (its shared memory: the barriers, up to two
// stages, the fragments and two operand buffers), or false where it does not
// fit or the device does not run its sm_90 code.
template <typename Mma>
bool launch_fused(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  const TaskGrid& grid, double divisor, at::Tensor& partial, uint8_t* picks) {
  using Op = Operation<Mma>;
  Params p{};
  p.grid = grid;
  p.O = static_cast<int>(weight.size(0));
  p.reciprocal = ReciprocalMultiply<float>(divisor).reciprocal;
  const SharedLayout layout =
      shared_layout(int64_t{grid.channel_blocks} * Op::kFragmentWords + 2 * Op::kOperandWords, x);
  p.stages = layout.stages;
  if (p.stages < 1) return false;
  const auto kernel = p.reciprocal > 0 ? conv3d_max_pool3d_mean_kernel<Mma, true>
                                       : conv3d_max_pool3d_mean_kernel<Mma, false>;
  if (!runs_bulk_copy(kernel)) return false;

  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t fragment_words = int64_t{grid.channel_blocks} * Op::kFragmentWords;
  // (the fragments, then the rounded bias: one buffer)
  const at::Tensor fragments = at::empty({fragment_words + kChannels}, x.options().dtype(at::kInt));
  uint32_t* words = reinterpret_cast<uint32_t*>(fragments.mutable_data_ptr<int32_t>());
  float* rounded_bias = reinterpret_cast<float*>(words + fragment_words);
  auto launch = [&](auto* weight_type) {
    using W = std::remove_pointer_t<decltype(weight_type)>;
    weight_fragments_kernel<Mma, W><<<static_cast<unsigned>((fragment_words + 255) / 256), 256, 0, stream>>>(
        static_cast<const W*>(weight.const_data_ptr()),
        bias.has_value() ? static_cast<const W*>(bias->const_data_ptr()) : nullptr, p.O,
        static_cast<int>(weight.size(1)), grid.channel_blocks, words, rounded_bias);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  with_weight_storage<typename Mma::Input>(weight, launch);
  p.fragments = words;
  p.bias = bias.has_value() ? rounded_bias : nullptr;
  p.partial = partial.mutable_data_ptr<float>();
  p.picks = picks;

  allow_dynamic_shared_memory(kernel, layout.smem);
  const int64_t blocks = std::min<int64_t>(grid.tasks, resident_blocks(kernel, kThreads, layout.smem));
  kernel<<<static_cast<unsigned>(blocks), kThreads, layout.smem, stream>>>(p, ncdhw_tensor_map(x));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

// The kernels' picks (N, O, PD, PH, PW), one byte a window, where the call saves them (else empty).
at::Tensor picks_tensor(const at::Tensor& x, const at::Tensor& weight, const Conv3dPoolGeometry& g, bool save) {
  return save ? at::empty({x.size(0), weight.size(0), g.pooled[0], g.pooled[1], g.pooled[2]},
                          x.options().dtype(at::kByte))
              : x.new_empty({0}, at::kByte);
}

#ifdef FUSED_OPS_CUTLASS

// The wgmma kernel's B operands in layout L (wgmma_conv3d::Tf32Swizzled and its RS form: (tap, o, c) rows;
// Bf16Pairs and its RS form: (t, step, chunk, o, c) rows, a step's chunks taps (r, 0), (r, 1) for steps r < 3,
// (0, 2), (1, 2) for step 3, (2, 2) and zeros for step 4) from the weight (16, 8, 3, 3, 3) stored as W, each
// rounded to the operation's type T as the fused kernel's fragments are (TF32 to nearest, 16-bit to nearest
// even), then the bias rounded alike (floats, zeros without one): one thread an element.
template <class L, typename W>
__global__ void wgmma_operands_kernel(const W* __restrict__ weight, const W* __restrict__ bias,
                                     typename L::T* __restrict__ operands, float* __restrict__ rounded_bias) {
  using T = typename L::T;
  using wgmma_conv3d::kChannelsIn, wgmma_conv3d::kChannelsOut;
  constexpr int kElements = L::kWeightBytes / static_cast<int>(sizeof(T));
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < kElements) {
    const int c = i % kChannelsIn, o = i / kChannelsIn % kChannelsOut, row = i / (kChannelsIn * kChannelsOut);
    int tap = row;  // (Tf32Swizzled: the tap)
    if constexpr (std::is_base_of_v<wgmma_conv3d::Bf16Pairs, L>) {
      const int t = row / 10, step = row / 2 % 5, chunk = row % 2;
      const int r = step < 3 ? step : step == 3 ? chunk : 2, s = step < 3 ? chunk : 2;
      tap = step == 4 && chunk == 1 ? -1 : t * 9 + r * 3 + s;
    }
    const float v = tap < 0 ? 0.f : widened(weight[(o * kChannelsIn + c) * kTaps + tap]);
    if constexpr (std::is_same_v<T, float>) {
      operands[i] = round_to_tf32(v);
    } else {
      operands[i] = narrowed<T>(v);
    }
  } else if (i < kElements + kChannelsOut) {
    const int o = i - kElements;
    rounded_bias[o] = bias != nullptr ? rounded_to<T>(widened(bias[o])) : 0.f;
  }
}

// Whether calls may take the wgmma kernel: unless FUSED_OPS_CONV3D_WGMMA=0 in the environment (read once), which
// keeps them on the mma.sync kernel (a way out, and the other side of an A/B timing).
bool wgmma_allowed() {
  static const bool allowed = [] {
    const char* value = std::getenv("FUSED_OPS_CONV3D_WGMMA");
    return value == nullptr || std::string_view(value) != "0";
  }();
  return allowed;
}

// The wgmma kernel's layout for this call, if it takes it (f(L{}) called; false if not): wgmma_allowed(), an
// sm_90 device; x float32 contiguous at a 16-byte aligned address, (N, 8, D, H, 64) with D and H at least 4; a
// (16, 8, 3, 3, 3) weight, no padding, a 2 x 2 x 2 pool; TF32 (a float32 operation: with_weight_operation's
// rule) or bfloat16; its tiles within int. A from registers (wgmma's RS form: H200, SPEC's A, TF32 eval, the kernel
// 0.345 ms against 0.418 from shared memory).
template <typename F>
bool with_wgmma_layout(const at::Tensor& x, const at::Tensor& weight, const Conv3dPoolGeometry& g,
                       at::ScalarType operand, F&& f) {
  using namespace wgmma_conv3d;
  if (!wgmma_allowed()) return false;
  const bool shape = x.size(1) == kChannelsIn && x.size(4) == kRow && x.size(2) >= 4 && x.size(3) >= 4 &&
                     weight.sizes() == at::IntArrayRef({kChannelsOut, kChannelsIn, 3, 3, 3}) &&
                     g.padding == std::array<int64_t, 3>{0, 0, 0} && g.pool == std::array<int64_t, 3>{2, 2, 2};
  if (!shape || x.size(0) == 0 || x.scalar_type() != at::kFloat || !x.is_contiguous() ||
      reinterpret_cast<uintptr_t>(x.const_data_ptr()) % 16 != 0 || tile_count(x) > INT_MAX ||
      !runs_sm90a(x.get_device())) {
    return false;
  }
  if (operand == at::kFloat && at::globalContext().allowTF32CuDNN()) return f(Tf32SwizzledRegisterA{}), true;
  if (operand == at::kBFloat16) return f(Bf16PairsRegisterA{}), true;
  return false;
}

// The wgmma kernel's launch (with_wgmma_layout took the call): its partial sums (N, rows, 16), and the picks
// (where not null), as launch_fused writes them.
template <class L>
at::Tensor launch_wgmma(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        double divisor, uint8_t* picks) {
  using namespace wgmma_conv3d;
  using T = typename L::T;
  const int sms = device_attribute(cudaDevAttrMultiProcessorCount, x.get_device());
  Conv3dTiles p = tiles_of(x, sms);
  at::Tensor partial = at::empty({x.size(0), int64_t{p.tiles} / x.size(0) * 8, kChannelsOut}, x.options());
  p.reciprocal = ReciprocalMultiply<float>(divisor).reciprocal;
  p.pooled[0] = p.depth_out / 2;
  p.pooled[1] = p.height_out / 2;
  p.pooled[2] = p.width_out / 2;
  p.picks = picks;
  p.partial = partial.mutable_data_ptr<float>();
  const auto stream = c10::cuda::getCurrentCUDAStream();
  // (the operands, then the rounded bias: one buffer)
  const at::Tensor buffer = at::empty({L::kWeightBytes + kChannelsOut * 4}, x.options().dtype(at::kByte));
  auto* const operands = reinterpret_cast<T*>(buffer.mutable_data_ptr<uint8_t>());
  auto* const rounded_bias = reinterpret_cast<float*>(buffer.mutable_data_ptr<uint8_t>() + L::kWeightBytes);
  constexpr int kThreadsEach = 256, kElements = L::kWeightBytes / static_cast<int>(sizeof(T)) + kChannelsOut;
  with_weight_storage<T>(weight, [&](auto* weight_type) {
    using W = std::remove_pointer_t<decltype(weight_type)>;
    wgmma_operands_kernel<L, W><<<(kElements + kThreadsEach - 1) / kThreadsEach, kThreadsEach, 0, stream>>>(
        static_cast<const W*>(weight.const_data_ptr()),
        bias.has_value() ? static_cast<const W*>(bias->const_data_ptr()) : nullptr, operands, rounded_bias);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  // (the B box: the whole layout, innermost first)
  const at::Tensor operand_rows = buffer.narrow(0, 0, L::kWeightBytes)
                                      .view(std::is_same_v<T, float> ? at::kFloat : at::kBFloat16)
                                      .view({1, L::kWeightSteps, L::kWeightRows, L::kBoxChannels});
  const CUtensorMap w_map =
      contiguous_tensor_map(operand_rows, {L::kBoxChannels, L::kWeightRows, L::kWeightSteps, 1}, L::kSwizzle);
  const CUtensorMap x_map = contiguous_tensor_map(x, {kRow, wgmma_conv3d::kBoxRows, 1, kChannelsIn, 1});
  const auto kernel = picks != nullptr ? conv3d_wgmma_kernel<L, Epilogue::kMeanAndPicks, true>
                                       : conv3d_wgmma_kernel<L, Epilogue::kMean, true>;
  constexpr int smem = Smem<L, true>::kBytes;
  allow_dynamic_shared_memory(kernel, smem);
  const int blocks = std::min(p.columns, sms);
  kernel<<<blocks, wgmma_conv3d::kThreads, smem, stream>>>(x_map, w_map, rounded_bias, nullptr, p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return partial;
}

#endif  // FUSED_OPS_CUTLASS

std::tuple<at::Tensor, at::Tensor> conv3d_max_pool3d_mean_cuda(const at::Tensor& x, const at::Tensor& weight,
                                                               const std::optional<at::Tensor>& bias,
                                                               at::IntArrayRef padding, at::IntArrayRef pool,
                                                               double divisor, bool save_indices,
                                                               std::optional<at::ScalarType> dtype,
                                                               const std::optional<at::Tensor>& channel_bias,
                                                               bool sum_channels,
                                                               std::optional<at::ScalarType> operand_dtype) {
  constexpr const char* what = "conv3d_max_pool3d_mean";
  const Conv3dPoolGeometry g = conv3d_max_pool3d_mean_geometry(x, weight, bias, padding, pool, divisor);
  check_channel_bias(what, x, weight, channel_bias);
  const at::ScalarType operand = operand_type(what, weight, operand_dtype);
  const at::ScalarType mean_dtype = result_dtype(what, operand, dtype);
  const c10::cuda::CUDAGuard guard(x.device());
  std::optional<std::tuple<at::Tensor, at::Tensor>> result;
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const std::optional<at::Tensor> bias_c = bias.has_value() ? std::optional(bias->contiguous()) : std::nullopt;
  // (either kernel's partial sums into the result, beside its picks)
  const auto finish = [&](const at::Tensor& partial, const at::Tensor& picks) {
    result.emplace(mean_epilogue(partial, static_cast<int>(weight.size(0)), g, mean_dtype, channel_bias, sum_channels),
                   picks);
  };
#ifdef FUSED_OPS_CUTLASS
  with_wgmma_layout(xc, wc, g, operand, [&](auto layout) {
    at::Tensor picks = picks_tensor(x, weight, g, save_indices);
    finish(launch_wgmma<decltype(layout)>(xc, wc, bias_c, divisor,
                                          save_indices ? picks.mutable_data_ptr<uint8_t>() : nullptr),
           picks);
  });
  if (result.has_value()) return *result;
#endif
  with_fused_operation(xc, wc, g, operand, [&](auto mma) {
    const TaskGrid grid = task_grid(xc, wc, g);
    at::Tensor partial = at::empty({x.size(0), grid.tasks / x.size(0) * kWarps, kChannels}, x.options());
    at::Tensor picks = picks_tensor(x, weight, g, save_indices);
    if (launch_fused<decltype(mma)>(xc, wc, bias_c, grid, divisor, partial,
                                    save_indices ? picks.mutable_data_ptr<uint8_t>() : nullptr)) {
      finish(partial, picks);
    }
  });
  if (result.has_value()) return *result;
  auto [mean, indices] =
      conv3d_max_pool3d_mean_composite(x, weight, bias, g, divisor, save_indices, mean_dtype, operand);
  return {add_channel_bias_and_sum(mean, channel_bias, sum_channels), indices};
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("conv3d_max_pool3d_mean", &conv3d_max_pool3d_mean_cuda);
}

}  // namespace fused_ops
