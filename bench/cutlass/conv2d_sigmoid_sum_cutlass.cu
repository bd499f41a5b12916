// CUTLASS 3.x baseline for conv2d_sigmoid_sum (architecture C's pool-folded convolution and
// tail): Hopper (sm_90a) implicit-GEMM convolutions -- TMA im2col loads, wgmma, a warp-specialized
// kernel -- built with CUTLASS's collective builders, the tail in an epilogue visitor tree (EVT).
// A shared library with a C interface (no torch: built by nvcc alone, loaded by ctypes) for
// bench/bench_cutlass_conv2d_sigmoid_sum.py; not part of fused_ops.
//
// The convolution as CUTLASS sees it (kFprop): activations NHWC (N, H, W, C), filter KRSC
// (K, R, S, C), output NHWC (N, P, Q, K); GEMM M = N*P*Q output pixels, N = K output channels,
// K = C*R*S, walked one filter tap (r, s) at a time: a k tile holds up to tile-K channels of one
// tap (TMA im2col copies one tap's channels per box), zeros past C.
//
// Variants, each for TF32 (float32 input and weight, tf32 MMA, f32 accumulation) and bf16
// (bf16 input and weight, f32 accumulation):
//   fused  sigmoid(acc + bias[k]) summed over the output channels in the epilogue: a float32
//          vector of one sum per output pixel (N*P*Q floats); no conv output is written (void D).
//          The caller adds each item's P*Q sums.
//   plain  acc + bias[k] written as NHWC float32 (N, P, Q, K); the caller's torch does the tail.
// and two readings of the same memory:
//   c8     the input as given (C = 8): one k tile per filter tap (TF32 tile K 8: exact; bf16's
//          wgmma needs K 16, so half of each bf16 k tile is zeros);
//   c16    pairs of input columns read as 16 channels: x (N, H, W, 8) viewed as (N, H, W/2, 16),
//          the filter (K, R, S, 8) as (K, R, S/2, 16), the stride along W halved (exact where W,
//          S and stride_w are even, as at SPEC's 384 / 6 / 4): half the k tiles, no zeros.
//
// Kernel schedule: KernelImplicitTmaWarpSpecializedSm90 (one producer warp group issuing TMA, one
// consumer warp group running wgmma and the epilogue; CUTLASS 4.2 has no persistent conv
// schedules), cluster 1x1x1 (the whole filter is one N tile: no operand to multicast), the
// epilogue schedule TmaWarpSpecialized to match.

// NDEBUG before any header: CUTLASS's device code asserts, and a live assert is a call to
// __assertfail inside the kernel, across which ptxas serializes every wgmma (warning C7510).
#ifndef NDEBUG
#define NDEBUG
#endif

#include <cuda_runtime.h>

#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

// (in this order: the conv collective headers use KernelHardwareInfo without including it)
#include "baseline.h"
#include "cutlass/cutlass.h"
#include "cutlass/kernel_hardware_info.hpp"
#include "cute/tensor.hpp"
#include "cutlass/conv/convnd_problem_shape.hpp"
#include "cutlass/conv/device/conv_universal_adapter.hpp"
#include "cutlass/conv/kernel/conv_universal.hpp"
#include "cutlass/conv/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/epilogue/thread/activation.h"

using namespace cutlass_baseline;  // (baseline.h)

namespace {

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;

constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;
using ProblemShape = cutlass::conv::ConvProblemShape<cutlass::conv::Operator::kFprop, 2>;

// ---- the epilogue visitor trees -----------------------------------------------------------------
// Per output (m = pixel, n = channel):   y[m, n] = acc[m, n] + bias[n]
// and for the fused variants            s[m]    = sum_n sigmoid(y[m, n])
// bias[n] is a row vector broadcast down M (Sm90RowBroadcast, stride (0, 1, 0)); the sum over n is
// Sm90ColReduction (it reduces across the N mode into a column, i.e. a per-M vector): within a
// thread, across the lanes holding the row's other columns by warp shuffles, then each CTA writes
// its tile's CTA_M sums. FinalReduction = false: those per-tile sums go straight to ptr_col (laid
// out (round_up(M, CTA_M), N tiles)); the tile's N = 64 is all of the channels, so they are the
// final sums: no workspace, no tile counters. Rows past M are skipped in the sum (VisitCheckOOB)
// and come out 0.

template <class TileShape>
using BiasRow = fusion::Sm90RowBroadcast<0, TileShape, float, float, Stride<_0, _1, _0>>;

template <class TileShape>
using ConvBias = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::plus, float, float, kRound>,
                                 fusion::Sm90AccFetch, BiasRow<TileShape>>;

template <class TileShape>
using SigmoidChannelSumTree = fusion::Sm90EVT<
    fusion::Sm90ColReduction<cutlass::plus, cutlass::plus, cutlass::plus, /*Stages=*/0, TileShape,
                             float, float, kRound, Stride<_1, _0, _0>, /*Alignment=*/4,
                             /*EnableNullptr=*/false, /*FinalReduction=*/false>,
    fusion::Sm90EVT<fusion::Sm90Compute<cutlass::epilogue::thread::Sigmoid, float, float, kRound>,
                    ConvBias<TileShape>>>;

// With ElementD = void the TMA epilogue still sizes a shared-memory D tile by the tree's aux
// element (which a tree without an aux store lacks); the column reduction uses that tile as its
// scratch where several warps share a row. Naming float here is all it takes.
template <class TileShape>
struct SigmoidChannelSum : SigmoidChannelSumTree<TileShape> {
  using Tree = SigmoidChannelSumTree<TileShape>;
  using Tree::Tree;
  using ElementAux = float;
};

// ---- the kernels --------------------------------------------------------------------------------

// Stages: the mainloop's shared-memory ring. kStageBytes = 0: CUTLASS's default (as many stages as
// fit beside the epilogue: one CTA per SM); else as many as fit in that many bytes (72 KB: two
// CTAs per SM where the registers allow: 128-row tiles take ~90 registers x 256 threads).
template <class Element_, int kWidthFold_, int kTileM_, int kTileK_, int kStageBytes_, bool kFused_>
struct Variant {
  using Element = Element_;                          // float (TF32 MMA) or cutlass::bfloat16_t
  static constexpr int kWidthFold = kWidthFold_;     // input columns read as one pixel: 1 (c8), 2 (c16)
  static constexpr int kTileM = kTileM_;
  static constexpr int kTileK = kTileK_;
  static constexpr int kStageBytes = kStageBytes_;
  static constexpr bool kFused = kFused_;
  using TileShape = Shape<Int<kTileM>, _64, Shape<Int<kTileK>>>;
  using ClusterShape = Shape<_1, _1, _1>;
  static constexpr int kAlignment = 128 / cutlass::sizeof_bits<Element>::value;  // 16-byte TMA rows

  using Callbacks = cute::conditional_t<kFused, SigmoidChannelSum<TileShape>, ConvBias<TileShape>>;
  using ElementD = cute::conditional_t<kFused, void, float>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, cutlass::layout::TensorNHWC, 4,       // no C
      ElementD, cutlass::layout::TensorNHWC, 4,
      cutlass::epilogue::TmaWarpSpecialized, Callbacks>::CollectiveOp;

  static constexpr int kBytesPerStage = (kTileM + 64) * kTileK * int(sizeof(Element));  // A and B tiles
  using StageCountType = cute::conditional_t<
      kStageBytes == 0,
      cutlass::conv::collective::StageCountAutoCarveout<int(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::conv::collective::StageCount<cute::max(2, kStageBytes / kBytesPerStage)>>;

  using CollectiveMainloop = typename cutlass::conv::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::conv::Operator::kFprop,
      Element, cutlass::layout::TensorNHWC, kAlignment,
      Element, cutlass::layout::TensorNHWC, kAlignment,
      float, TileShape, ClusterShape,
      StageCountType, cutlass::conv::KernelImplicitTmaWarpSpecializedSm90>::CollectiveOp;
  static constexpr int kStages = CollectiveMainloop::DispatchPolicy::Stages;

  using Kernel = cutlass::conv::kernel::ConvUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Conv = cutlass::conv::device::ConvUniversalAdapter<Kernel>;
};


// The problem as the caller passes it: x (N, H, W, C) and weight (K, R, S, C) contiguous on the
// device, bias (K,) float32; stride (sh, sw), no padding; `out` sized by the caller
// (bench_cutlass_conv2d_sigmoid_sum.py's CutlassConv2dSigmoidSum.run).
struct Problem {
  int n, h, w, c, k, r, s, stride_h, stride_w;
};

// The (possibly folded: kWidthFold input columns as one pixel) problem, a view of the same memory.
template <class V>
ProblemShape folded(const Problem& pr) {
  constexpr int fold = V::kWidthFold;
  if (pr.w % fold || pr.s % fold || pr.stride_w % fold) {
    throw std::invalid_argument("reads " + std::to_string(fold) + " input columns as one pixel: W, S and "
                                "stride_w must be divisible by it");
  }
  if (pr.h < pr.r || pr.w < pr.s) throw std::invalid_argument("the input is smaller than the filter");
  if (V::kFused && pr.k > 64) throw std::invalid_argument("the channel sums are one N tile's: at most 64 channels");
  return ProblemShape(cutlass::conv::Mode::kCrossCorrelation, {pr.n, pr.h, pr.w / fold, pr.c * fold},
                      {pr.k, pr.r, pr.s / fold, pr.c * fold}, {0, 0}, {0, 0}, {pr.stride_h, pr.stride_w / fold},
                      {1, 1}, 1);
}

// fused: out (round_up(N*P*Q, tile M),) the per-pixel sums over channels of sigmoid(conv + bias)
// (the rows past N*P*Q 0); plain: out (N, P, Q, K) = conv + bias.
template <class V>
void run_variant(const Problem& pr, const void* x, const void* weight, const float* bias, float* out,
                 cudaStream_t stream) {
  using Element = typename V::Element;
  using Kernel = typename V::Kernel;
  const ProblemShape problem = folded<V>(pr);
  int device = 0;
  cudaGetDevice(&device);
  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = device;
  hw_info.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);

  typename Kernel::MainloopArguments mainloop{static_cast<const Element*>(x), static_cast<const Element*>(weight)};
  typename Kernel::EpilogueArguments epilogue{};
  if constexpr (V::kFused) {
    epilogue.thread = {                                  // children's arguments, then the node's
        {                                                // sigmoid(.)
            {{}, {bias, 0.f, {}}, {}},                   // acc + bias[n]
            {}},
        {out, 0.f, {}}};                                 // sum over n (identity 0)
  } else {
    epilogue.thread = {{}, {bias, 0.f, {}}, {}};
    epilogue.ptr_D = out;
    // D's stride ((Q, P, N), K, L): the packed NHWC output's
    cute::for_each(cute::make_seq<3>{}, [&](auto i) {
      cute::get<0, i>(epilogue.dD) = problem.stride_C[ProblemShape::RankT - 2 - i];
    });
  }
  run_convolution<typename V::Conv>(typename V::Conv::Arguments(problem, mainloop, epilogue, hw_info), stream);
}

// ---- the registry -------------------------------------------------------------------------------

struct Entry {
  std::string description;  // "name;fused;dtype;tile_m;stages;smem_bytes;threads"
  std::function<void(const Problem&, const void*, const void*, const float*, float*, cudaStream_t)> run;
};

template <class V>
Entry make_entry() {
  const std::string dtype = std::is_same_v<typename V::Element, float> ? "tf32" : "bf16";
  const std::string tile = std::to_string(V::kTileM) + "x64x" + std::to_string(V::kTileK);
  // e.g. "fused tf32 c8 128x64x8 s12": tail, MMA type, channels per GEMM pixel, CTA tile, stages
  const std::string name = std::string(V::kFused ? "fused " : "plain ") + dtype + " c" +
                           std::to_string(8 * V::kWidthFold) + " " + tile + " s" + std::to_string(V::kStages);
  return {name + ";" + (V::kFused ? "1" : "0") + ";" + dtype + ";" + std::to_string(V::kTileM) + ";" +
              std::to_string(V::kStages) + ";" + std::to_string(int(V::Kernel::SharedStorageSize)) + ";" +
              std::to_string(int(V::Kernel::MaxThreadsPerBlock)),
          run_variant<V>};
}

using bf16 = cutlass::bfloat16_t;

// bf16 c8 and c16 of one tile share a kernel (the fold is only the problem shape the host passes).
// Fused: 128-row tiles two CTAs per SM (72 KB of stages) or one with CUTLASS's default stages;
// 256-row tiles (162 registers: one CTA per SM); 64-row tiles (48 KB of stages).
const std::vector<Entry>& registry() {
  constexpr int k48KB = 48 * 1024, k72KB = 72 * 1024, kAuto = 0;
  static const std::vector<Entry> entries = {
      //                 element fold tileM tileK stage bytes fused
      make_entry<Variant<float, 1, 128, 8, k72KB, true>>(),
      make_entry<Variant<float, 2, 128, 16, k72KB, true>>(),
      make_entry<Variant<float, 2, 128, 16, kAuto, true>>(),
      make_entry<Variant<float, 2, 256, 16, kAuto, true>>(),
      make_entry<Variant<float, 2, 64, 16, k48KB, true>>(),
      make_entry<Variant<bf16, 1, 128, 16, k72KB, true>>(),
      make_entry<Variant<bf16, 2, 128, 16, k72KB, true>>(),
      make_entry<Variant<bf16, 2, 128, 16, kAuto, true>>(),
      make_entry<Variant<bf16, 2, 256, 16, kAuto, true>>(),
      make_entry<Variant<bf16, 2, 64, 16, k48KB, true>>(),
      make_entry<Variant<float, 1, 128, 8, k72KB, false>>(),
      make_entry<Variant<float, 2, 128, 16, k72KB, false>>(),
      make_entry<Variant<bf16, 1, 128, 16, k72KB, false>>(),
      make_entry<Variant<bf16, 2, 128, 16, k72KB, false>>(),
  };
  return entries;
}

}  // namespace

// ---- the C interface (ctypes) -------------------------------------------------------------------

extern "C" {

int cutlass_conv2d_sigmoid_sum_variant_count() { return static_cast<int>(registry().size()); }

// Variant i's "name;fused;dtype;tile_m;stages;smem_bytes;threads" into description; 0, or -1 for no variant i.
int cutlass_conv2d_sigmoid_sum_describe(int i, char* description, int size) {
  return describe(registry(), i, description, size);
}

// Variant i on the device pointers, on `stream`; 0, or -1 with the reason in `error`.
int cutlass_conv2d_sigmoid_sum_run(int i, const void* x, const void* weight, const float* bias, float* out, int n,
                                   int h, int w, int c, int k, int r, int s, int stride_h, int stride_w, void* stream,
                                   char* error, int error_size) {
  try {
    if (i < 0 || i >= cutlass_conv2d_sigmoid_sum_variant_count()) throw std::invalid_argument("no such variant");
    registry()[i].run({n, h, w, c, k, r, s, stride_h, stride_w}, x, weight, bias, out,
                      static_cast<cudaStream_t>(stream));
    return 0;
  } catch (const std::exception& e) {
    write_message(error, error_size, e.what());
    return -1;
  }
}

}  // extern "C"
