// CUTLASS 3.x baseline for architecture D's weight gradient: the weight gradient of
// ConvTranspose3d(C_in -> C_out, kernel kt x kr x ks, stride 1, padding 0) (SPEC: 64 -> 128,
// kernel 5, x (16, 64, 16, 32, 32), y (16, 128, 20, 36, 36)) as Hopper (sm_90a) implicit GEMMs --
// TMA loads (im2col for the sliding operand), wgmma, a warp-specialized kernel -- built with
// CUTLASS's collective builders. A shared library with a C interface (no torch: built by nvcc
// alone, loaded by ctypes) for bench/bench_d_weight_grad_cutlass.py; not part of fused_ops.
//
//   grad_w[i, o, t, r, s] = sum_{n, z, h, w} x[n, i, z, h, w] * grad_y[n, o, z + t, h + r, w + s]
//
// 2 * N * C_in * C_out * D * H * W * kt * kr * ks FLOP (537 GFLOP at SPEC's size). Three
// formulations (the "formulation" field of a variant's description):
//
//   wgrad      CUTLASS's kWgrad, 3-D, with the roles that need no padding: x is the convolution's
//              "output" (CUTLASS's xformed activation, operand A: GEMM M = C_in, MN-major) and
//              grad_y its input (operand B, TMA im2col: GEMM N = C_out * kt * kr * ks), padding 0:
//              the filter CUTLASS writes, (C_in, kt, kr, ks, C_out) "KTRSC", is grad_w itself,
//              permuted, unflipped. GEMM 64 x 16000 x 262144 at SPEC: 537 GFLOP, no zeros.
//              Operands x NDHWC (N, D, H, W, C_in), grad_y NDHWC (N, Z, P, Q, C_out);
//              out (C_in, kt, kr, ks, C_out) float32.
//   wgrad-pad  CUTLASS's kWgrad, 3-D, of the equivalent stride-1 convolution
//              y = conv3d(x, w_conv, padding = k - 1), w_conv[o, i, t] = w[i, o, k - 1 - t]:
//              grad_y is operand A (GEMM M = C_out), x operand B (im2col, padding kt-1, kr-1, ks-1
//              done by TMA: no padded copy; GEMM N = C_in * kt * kr * ks); CUTLASS writes
//              grad_wconv (C_out, kt, kr, ks, C_in), flipped. GEMM 128 x 8000 x 414720 at SPEC:
//              849 GFLOP, 37 % of them on the zero padding. Operands as wgrad's;
//              out (C_out, kt, kr, ks, C_in) float32 with out[o, t, r, s, i] = grad_w[i, o, kt-1-t,
//              kr-1-r, ks-1-s].
//   fprop2d    for TF32, which CUTLASS's Hopper wgrad cannot do (below): the weight gradient as
//              CUTLASS kFprop 2-D convolutions, one per depth tap t, with the batch as channels:
//              "activation" grad_y' (C_out, P, Q, Z * N) -- the depth-and-batch pairs (z, n) as
//              channels: a window of D * N of them starting at t * N (a non-packed view: row
//              stride Z * N) --, "filter" x' (C_in, H, W, D * N), no padding: output
//              (C_out, kr, ks, C_in) = grad_w[:, :, t] permuted, written straight into
//              out (C_out, kt, kr, ks, C_in) (the epilogue's output strides). Both operands
//              K-major (channels contiguous), as TF32 wgmma needs. GEMM per t 3200 x 64 x 262144
//              at SPEC, 537 GFLOP over the kt launches, no zeros. Operands x (C_in, H, W, D, N)
//              "CHWDN", grad_y (C_out, P, Q, Z, N) "KPQZN"; out (C_out, kt, kr, ks, C_in) float32,
//              unflipped. (Im2col TMA limits ruled out the 3-D form of this: with a 32 x 32
//              "filter" the im2col box's upper corner, -31, is outside 3-D's [-16, 15].)
//
// What CUTLASS 4.2 refuses here, and what replaces it:
//   * TF32 kWgrad: Hopper wgrad reads both operands MN-major (channels contiguous along GEMM M
//     and N; the reduction runs over pixels), and wgmma takes tf32 operands K-major only
//     (cute/arch/mma_sm90.hpp: "MajorA must be GMMA::Major::K"): a compile-time error.
//     TF32 goes through fprop2d; bf16 has all three formulations.
//   * Split-K / stream-K: Hopper convolutions have the non-persistent
//     KernelImplicitTmaWarpSpecializedSm90 schedule only (its Cooperative and Pingpong tags
//     static_assert "Persistent schedules not support for conv yet"; the kernel takes no tile
//     scheduler but void / PersistentScheduler, i.e. one CTA per output tile, whole reduction).
//     With few output tiles (63 of 64 x 256 for SPEC's 64 x 16000 grad_w on 132 SMs) this
//     library splits the reduction itself: "splits" > 1 cuts it into that many independent
//     CUTLASS launches -- wgrad / wgrad-pad over the batch (N / splits images each), fprop2d over
//     the depth slices of the (z, n) channels -- run concurrently on internal streams forked from
//     and joined back to the caller's stream; split 0 writes `out`, the others float32 partial
//     filters in the caller's workspace (cutlass_conv3d_wgrad_workspace_bytes), then one kernel
//     adds them into `out`. fprop2d's kt per-tap launches run concurrently the same way.
//   * Persistent / 2-consumer-warp-group tiles: with one consumer warp group a CTA's
//     accumulators are tile_m * tile_n / 128 floats a thread: 128 x 256 tiles (256) do not fit
//     the register file; the largest here are 64 x 256 and 256 x 64 (128 a thread).
//
// Kernel schedule: KernelImplicitTmaWarpSpecializedSm90 (one producer warp group issuing TMA,
// one consumer warp group running wgmma and the epilogue), TMA epilogue (TmaWarpSpecialized),
// float32 accumulation and output, mainloop stages: as many as fit beside the epilogue.
// Clusters multicast the operand shared along the cluster's other dimension (1x2x1: operand A,
// the M tile, to two N tiles; 2x1x1: operand B to two M tiles).

// NDEBUG before any header: CUTLASS's device code asserts, and a live assert is a call to
// __assertfail inside the kernel, across which ptxas serializes every wgmma (warning C7510).
#ifndef NDEBUG
#define NDEBUG
#endif

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
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
#include "cutlass/util/packed_stride.hpp"

// (outside the anonymous namespace: a kernel there clashes, in nvcc's host stub, with the
// anonymous namespace cute's headers open inside namespace cute)
using namespace cutlass_baseline;  // (baseline.h)

namespace conv3d_wgrad_cutlass {

// out[i] += sum_p partials[p][i], i < count (a multiple of 4; 16-byte aligned pointers).
__global__ void add_partials(float* __restrict__ out, const float* __restrict__ partials, int64_t count,
                             int num_partials) {
  const int64_t vectors = count / 4;
  for (int64_t v = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; v < vectors; v += int64_t(gridDim.x) * blockDim.x) {
    float4 sum = reinterpret_cast<const float4*>(out)[v];
    for (int p = 0; p < num_partials; ++p) {
      const float4 part = reinterpret_cast<const float4*>(partials + p * count)[v];
      sum.x += part.x;
      sum.y += part.y;
      sum.z += part.z;
      sum.w += part.w;
    }
    reinterpret_cast<float4*>(out)[v] = sum;
  }
}

}  // namespace conv3d_wgrad_cutlass

namespace {

using namespace cute;
using bf16 = cutlass::bfloat16_t;
using cutlass::conv::Operator;

enum class Formulation { kWgrad, kWgradPad, kFprop2d };

const char* formulation_name(Formulation f) {
  switch (f) {
    case Formulation::kWgrad: return "wgrad";
    case Formulation::kWgradPad: return "wgrad-pad";
    default: return "fprop2d";
  }
}

// ---- the kernels --------------------------------------------------------------------------------

// One CUTLASS 3.x Hopper implicit-GEMM convolution: operator Op over Rank spatial dimensions,
// Element operands (float: TF32 MMA; bf16), float32 accumulation and output, no C.
// Wgrad's tile shape wraps N in a Shape (its N mode is (C, S, R, T)); all wrap K.
template <Operator Op, int Rank, class Element_, int kTileM_, int kTileN_, int kTileK_, int kClusterM_,
          int kClusterN_>
struct Kernel3x {
  using Element = Element_;
  static constexpr int kTileM = kTileM_, kTileN = kTileN_, kTileK = kTileK_;
  static constexpr int kClusterM = kClusterM_, kClusterN = kClusterN_;
  static constexpr int kAlignment = 128 / cutlass::sizeof_bits<Element>::value;  // 16-byte TMA rows
  using TileN = cute::conditional_t<Op == Operator::kWgrad, Shape<Int<kTileN>>, Int<kTileN>>;
  using TileShape = Shape<Int<kTileM>, TileN, Shape<Int<kTileK>>>;
  using ClusterShape = Shape<Int<kClusterM>, Int<kClusterN>, _1>;
  // activations NDHWC / NHWC; the output: wgrad's a filter (KTRSC), fprop's activations
  using LayoutAB = cute::conditional_t<Rank == 3, cutlass::layout::TensorNDHWC, cutlass::layout::TensorNHWC>;
  using LayoutD = cute::conditional_t<Op == Operator::kWgrad, cutlass::layout::TensorKCSRT, LayoutAB>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD, 4,  // no C
      float, LayoutD, 4,
      cutlass::epilogue::TmaWarpSpecialized>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::conv::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Op,
      Element, LayoutAB, kAlignment,
      Element, LayoutAB, kAlignment,
      float, TileShape, ClusterShape,
      cutlass::conv::collective::StageCountAutoCarveout<int(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::conv::KernelImplicitTmaWarpSpecializedSm90>::CollectiveOp;
  static constexpr int kStages = CollectiveMainloop::DispatchPolicy::Stages;

  using ProblemShape = cutlass::conv::ConvProblemShape<Op, Rank>;
  using Kernel = cutlass::conv::kernel::ConvUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Conv = cutlass::conv::device::ConvUniversalAdapter<Kernel>;
  using StrideD = typename Kernel::StrideD;
};

template <class Element, int M, int N, int K, int CM, int CN>
using WgradKernel = Kernel3x<Operator::kWgrad, 3, Element, M, N, K, CM, CN>;
template <class Element, int M, int N, int K, int CM, int CN>
using FpropKernel = Kernel3x<Operator::kFprop, 2, Element, M, N, K, CM, CN>;

// ---- errors, streams ----------------------------------------------------------------------------

// Streams to run independent launches on concurrently (per device, made on first use, kept).
struct StreamPool {
  cudaEvent_t fork = nullptr;
  std::vector<cudaStream_t> streams;
  std::vector<cudaEvent_t> joins;
};

StreamPool& stream_pool(int workers) {
  static std::map<int, StreamPool> pools;
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  StreamPool& pool = pools[device];
  if (pool.fork == nullptr) check_cuda(cudaEventCreateWithFlags(&pool.fork, cudaEventDisableTiming), "event");
  while (static_cast<int>(pool.streams.size()) < workers) {
    cudaStream_t stream;
    cudaEvent_t join;
    check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    check_cuda(cudaEventCreateWithFlags(&join, cudaEventDisableTiming), "event");
    pool.streams.push_back(stream);
    pool.joins.push_back(join);
  }
  return pool;
}

// jobs[0] on `origin`, the others each on a stream of its own that waits for what `origin` has
// queued; `origin` then waits for all of them (also where a job throws: rethrown after the join).
void run_concurrently(cudaStream_t origin, const std::vector<std::function<void(cudaStream_t)>>& jobs) {
  if (jobs.size() == 1) {
    jobs[0](origin);
    return;
  }
  const int workers = static_cast<int>(jobs.size()) - 1;
  StreamPool& pool = stream_pool(workers);
  check_cuda(cudaEventRecord(pool.fork, origin), "cudaEventRecord");
  std::string failure;
  int forked = 0;
  for (; forked < workers && failure.empty(); ++forked) {
    check_cuda(cudaStreamWaitEvent(pool.streams[forked], pool.fork, 0), "cudaStreamWaitEvent");
    try {
      jobs[forked + 1](pool.streams[forked]);
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  if (failure.empty()) {
    try {
      jobs[0](origin);
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  for (int j = 0; j < forked; ++j) {
    check_cuda(cudaEventRecord(pool.joins[j], pool.streams[j]), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(origin, pool.joins[j], 0), "cudaStreamWaitEvent");
  }
  if (!failure.empty()) throw std::runtime_error(failure);
}

// ---- the problem --------------------------------------------------------------------------------

// The transposed convolution as the caller passes it: x (N, C_in, D, H, W) logically (its layout
// is the formulation's), weight (C_in, C_out, kt, kr, ks), stride 1, no padding, so that grad_y is
// (N, C_out, D + kt - 1, H + kr - 1, W + ks - 1) logically.
struct Problem {
  int n, c_in, d, h, w, c_out, kt, kr, ks;
  int z() const { return d + kt - 1; }
  int p() const { return h + kr - 1; }
  int q() const { return w + ks - 1; }
  int64_t filter_numel() const { return int64_t(c_in) * c_out * kt * kr * ks; }
};

template <class Array, class... T>
Array make_array(T... values) {
  Array a{};
  int i = 0;
  ((a[i++] = values), ...);
  return a;
}

// One CUTLASS launch: D (float32) = the convolution of A and B, on `stream`.
template <class K>
void launch(const typename K::ProblemShape& problem, const void* ptr_a, const void* ptr_b, float* ptr_d,
            const typename K::StrideD& stride_d, cudaStream_t stream) {
  using Element = typename K::Element;
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = device;
  hw_info.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);

  typename K::Kernel::MainloopArguments mainloop{static_cast<const Element*>(ptr_a), static_cast<const Element*>(ptr_b)};
  typename K::Kernel::EpilogueArguments epilogue{};
  epilogue.thread.alpha = 1.f;
  epilogue.thread.beta = 0.f;
  epilogue.ptr_C = nullptr;
  epilogue.dC = stride_d;
  epilogue.ptr_D = ptr_d;
  epilogue.dD = stride_d;
  run_convolution<typename K::Conv>(typename K::Conv::Arguments(problem, mainloop, epilogue, hw_info), stream);
}

// ---- the formulations ---------------------------------------------------------------------------

// A variant's shape checks (std::invalid_argument: the caller's problem does not suit it).
template <class K>
void check_wgrad(const Problem& pr, int splits, Formulation f) {
  if (pr.n % splits) throw std::invalid_argument("the batch must divide into " + std::to_string(splits) + " splits");
  // operand B's channels are read 64 (bf16; 32 tf32) at a time by each im2col box, along the
  // GEMM's (c, s, r, t) N mode: a box must not run past a filter tap's channels
  const int b_channels = f == Formulation::kWgrad ? pr.c_out : pr.c_in;
  const int box = 128 / int(sizeof(typename K::Element));
  if (b_channels % box) {
    throw std::invalid_argument(std::string(f == Formulation::kWgrad ? "C_out" : "C_in") + " must be a multiple of " +
                                std::to_string(box));
  }
  if (f == Formulation::kWgradPad && (pr.kt > 17 || pr.kr > 17 || pr.ks > 17)) {
    throw std::invalid_argument("TMA im2col pads at most 16 in 3-D");
  }
}

// wgrad: A = x (the "output", NDHWC), B = grad_y (the "input", NDHWC), no padding:
// out (C_in, kt, kr, ks, C_out). wgrad-pad: A = grad_y, B = x padded by k - 1:
// out (C_out, kt, kr, ks, C_in), flipped. Split j: images [j * N / splits, (j + 1) * N / splits).
template <class K>
void run_wgrad(Formulation f, const Problem& pr, int splits, const void* x, const void* grad_y, float* out,
               float* workspace, cudaStream_t stream) {
  check_wgrad<K>(pr, splits, f);
  using PS = typename K::ProblemShape;
  using Extent = typename PS::TensorExtent;
  using Spatial = typename PS::SpatialExtent;
  const int images = pr.n / splits;
  const bool pad = f == Formulation::kWgradPad;
  // CUTLASS's "activation" (operand B) and filter: the convolution whose output is operand A
  const Extent act = pad ? make_array<Extent>(images, pr.d, pr.h, pr.w, pr.c_in)
                         : make_array<Extent>(images, pr.z(), pr.p(), pr.q(), pr.c_out);
  const Extent flt = pad ? make_array<Extent>(pr.c_out, pr.kt, pr.kr, pr.ks, pr.c_in)
                         : make_array<Extent>(pr.c_in, pr.kt, pr.kr, pr.ks, pr.c_out);
  const Spatial padding = pad ? make_array<Spatial>(pr.kt - 1, pr.kr - 1, pr.ks - 1) : make_array<Spatial>(0, 0, 0);
  const PS problem(cutlass::conv::Mode::kCrossCorrelation, act, flt, padding, padding, make_array<Spatial>(1, 1, 1),
                   make_array<Spatial>(1, 1, 1), 1);
  const auto stride_d = cutlass::make_cute_packed_stride(typename K::StrideD{}, problem.shape_C, problem.stride_C,
                                                         Operator::kWgrad);
  using Element = typename K::Element;
  const int64_t x_images = int64_t(images) * pr.d * pr.h * pr.w * pr.c_in;
  const int64_t gy_images = int64_t(images) * pr.z() * pr.p() * pr.q() * pr.c_out;
  std::vector<std::function<void(cudaStream_t)>> jobs;
  for (int j = 0; j < splits; ++j) {
    const Element* xj = static_cast<const Element*>(x) + j * x_images;
    const Element* gj = static_cast<const Element*>(grad_y) + j * gy_images;
    float* dj = j == 0 ? out : workspace + (j - 1) * pr.filter_numel();
    jobs.push_back([=](cudaStream_t s) {
      launch<K>(problem, pad ? static_cast<const void*>(gj) : xj, pad ? static_cast<const void*>(xj) : gj, dj,
                stride_d, s);
    });
  }
  run_concurrently(stream, jobs);
}

// fprop2d: per depth tap t and split j (depth slices [j * D / splits, (j + 1) * D / splits) of
// the (z, n) channels), a 2-D fprop: activation grad_y' (C_out, P, Q, window of D / splits * N
// channels at (t + j * D / splits) * N, row stride Z * N), filter x' (C_in, H, W, the window at
// j * D / splits * N, row stride D * N), no padding; output (C_out, kr, ks, C_in) at tap t of
// out's (C_out, kt, kr, ks, C_in) (split 0; the others in the workspace).
template <class K>
void run_fprop2d(const Problem& pr, int splits, const void* x, const void* grad_y, float* out, float* workspace,
                 cudaStream_t stream) {
  using Element = typename K::Element;
  if (pr.d % splits) throw std::invalid_argument("the depth must divide into " + std::to_string(splits) + " splits");
  const int depth = pr.d / splits;
  const int64_t window = int64_t(depth) * pr.n;  // channels of one split
  const int64_t align = 16 / sizeof(Element);
  if (pr.n % align) throw std::invalid_argument("the batch must be a multiple of " + std::to_string(align));
  if (window % K::kTileK) throw std::invalid_argument("D / splits * N must be a multiple of the tile's K");
  using PS = typename K::ProblemShape;
  using Extent = typename PS::TensorExtent;
  using Stride = typename PS::TensorStride;
  using Spatial = typename PS::SpatialExtent;
  const int64_t gy_row = int64_t(pr.z()) * pr.n, x_row = int64_t(pr.d) * pr.n;
  const PS problem(cutlass::conv::Mode::kCrossCorrelation,
                   make_array<Extent>(pr.c_out, pr.p(), pr.q(), int(window)),
                   make_array<Stride>(int64_t(pr.p()) * pr.q() * gy_row, int64_t(pr.q()) * gy_row, gy_row, int64_t(1)),
                   make_array<Extent>(pr.c_in, pr.h, pr.w, int(window)),
                   make_array<Stride>(int64_t(pr.h) * pr.w * x_row, int64_t(pr.w) * x_row, x_row, int64_t(1)),
                   make_array<Spatial>(0, 0), make_array<Spatial>(0, 0), make_array<Spatial>(1, 1),
                   make_array<Spatial>(1, 1), 1);
  if (problem.shape_C[1] != pr.kr || problem.shape_C[2] != pr.ks) throw std::logic_error("fprop2d: output shape");
  // D: M = (q, p, n) = (s, r, o), N = i: the strides of out (C_out, kt, kr, ks, C_in)
  typename K::StrideD stride_d{};
  cute::get<0, 0>(stride_d) = pr.c_in;
  cute::get<0, 1>(stride_d) = int64_t(pr.ks) * pr.c_in;
  cute::get<0, 2>(stride_d) = int64_t(pr.kt) * pr.kr * pr.ks * pr.c_in;
  const int64_t tap = int64_t(pr.kr) * pr.ks * pr.c_in;
  std::vector<std::function<void(cudaStream_t)>> jobs;
  for (int j = 0; j < splits; ++j) {
    for (int t = 0; t < pr.kt; ++t) {
      const Element* aj = static_cast<const Element*>(grad_y) + int64_t(t + j * depth) * pr.n;
      const Element* bj = static_cast<const Element*>(x) + int64_t(j) * depth * pr.n;
      float* dj = (j == 0 ? out : workspace + (j - 1) * pr.filter_numel()) + t * tap;
      jobs.push_back([=](cudaStream_t s) { launch<K>(problem, aj, bj, dj, stride_d, s); });
    }
  }
  run_concurrently(stream, jobs);
}

// ---- the registry -------------------------------------------------------------------------------

struct Entry {
  // "name;dtype;formulation;x_layout;grad_y_layout;out_layout;tile;cluster;splits;stages;smem_bytes;threads"
  std::string description;
  int splits;
  std::function<void(const Problem&, const void*, const void*, float*, float*, cudaStream_t)> run;
};

template <class K>
Entry make_entry(Formulation f, int splits) {
  const std::string dtype = std::is_same_v<typename K::Element, float> ? "tf32" : "bf16";
  const std::string tile = std::to_string(K::kTileM) + "x" + std::to_string(K::kTileN) + "x" + std::to_string(K::kTileK);
  const std::string cluster = std::to_string(K::kClusterM) + "x" + std::to_string(K::kClusterN) + "x1";
  // e.g. "bf16 wgrad 64x256x64 c1x2x1 split2"
  const std::string name = dtype + " " + formulation_name(f) + " " + tile + " c" + cluster + " split" +
                           std::to_string(splits);
  const bool fprop = f == Formulation::kFprop2d;
  const std::string layouts = fprop ? "CHWDN;KPQZN;OTRSI" : (f == Formulation::kWgrad ? "NDHWC;NDHWC;ITRSO"
                                                                                     : "NDHWC;NDHWC;OTRSI-flipped");
  std::function<void(const Problem&, const void*, const void*, float*, float*, cudaStream_t)> run;
  if constexpr (K::ProblemShape::RankS == 2) {
    run = [splits](const Problem& pr, const void* x, const void* gy, float* out, float* ws, cudaStream_t s) {
      run_fprop2d<K>(pr, splits, x, gy, out, ws, s);
    };
  } else {
    run = [f, splits](const Problem& pr, const void* x, const void* gy, float* out, float* ws, cudaStream_t s) {
      run_wgrad<K>(f, pr, splits, x, gy, out, ws, s);
    };
  }
  return {name + ";" + dtype + ";" + formulation_name(f) + ";" + layouts + ";" + tile + ";" + cluster + ";" +
              std::to_string(splits) + ";" + std::to_string(K::kStages) + ";" +
              std::to_string(int(K::Kernel::SharedStorageSize)) + ";" + std::to_string(int(K::Kernel::MaxThreadsPerBlock)),
          splits, run};
}

// SPEC's GEMMs: wgrad 64 x 16000 (C_in x C_out*125): 64 x 256 tiles 63 CTAs, 64 x 128 125;
// wgrad-pad 128 x 8000: 128 x 128 tiles 63 CTAs, 64 x 256 64; fprop2d 3200 x 64 a tap, five taps:
// 128 x 64 tiles 125 CTAs, 256 x 64 65. Splits 2 double those.
const std::vector<Entry>& registry() {
  using F = Formulation;
  static const std::vector<Entry> entries = {
      //                                       element  M    N    K  cluster
      make_entry<WgradKernel<bf16, 64, 128, 64, 1, 1>>(F::kWgrad, 1),
      make_entry<WgradKernel<bf16, 64, 128, 64, 1, 1>>(F::kWgrad, 2),
      make_entry<WgradKernel<bf16, 64, 128, 64, 1, 2>>(F::kWgrad, 1),
      make_entry<WgradKernel<bf16, 64, 256, 64, 1, 1>>(F::kWgrad, 1),
      make_entry<WgradKernel<bf16, 64, 256, 64, 1, 1>>(F::kWgrad, 2),
      make_entry<WgradKernel<bf16, 64, 256, 64, 1, 2>>(F::kWgrad, 2),
      make_entry<WgradKernel<bf16, 64, 256, 64, 1, 2>>(F::kWgrad, 4),
      make_entry<WgradKernel<bf16, 128, 128, 64, 1, 1>>(F::kWgradPad, 1),
      make_entry<WgradKernel<bf16, 128, 128, 64, 1, 1>>(F::kWgradPad, 2),
      make_entry<WgradKernel<bf16, 64, 256, 64, 2, 1>>(F::kWgradPad, 1),
      make_entry<WgradKernel<bf16, 64, 256, 64, 2, 1>>(F::kWgradPad, 2),
      make_entry<FpropKernel<float, 128, 64, 32, 1, 1>>(F::kFprop2d, 1),
      make_entry<FpropKernel<float, 128, 64, 32, 1, 1>>(F::kFprop2d, 2),
      make_entry<FpropKernel<float, 128, 64, 32, 2, 1>>(F::kFprop2d, 1),
      make_entry<FpropKernel<float, 256, 64, 32, 1, 1>>(F::kFprop2d, 1),
      make_entry<FpropKernel<float, 256, 64, 32, 1, 1>>(F::kFprop2d, 2),
      make_entry<FpropKernel<bf16, 128, 64, 64, 1, 1>>(F::kFprop2d, 1),
      make_entry<FpropKernel<bf16, 128, 64, 64, 1, 1>>(F::kFprop2d, 2),
      make_entry<FpropKernel<bf16, 256, 64, 64, 1, 1>>(F::kFprop2d, 2),
  };
  return entries;
}

bool valid_problem(const Problem& pr) {
  return pr.n > 0 && pr.c_in > 0 && pr.d > 0 && pr.h > 0 && pr.w > 0 && pr.c_out > 0 && pr.kt > 0 && pr.kr > 0 &&
         pr.ks > 0;
}

}  // namespace

// ---- the C interface (ctypes) -------------------------------------------------------------------

extern "C" {

int cutlass_conv3d_wgrad_variant_count() { return static_cast<int>(registry().size()); }

// Variant i's "name;dtype;formulation;x_layout;grad_y_layout;out_layout;tile;cluster;splits;stages;
// smem_bytes;threads" into description; 0, or -1 for no variant i.
int cutlass_conv3d_wgrad_describe(int i, char* description, int size) {
  return describe(registry(), i, description, size);
}

// The bytes of device workspace variant i needs for the problem (the transposed convolution's
// x (n, c_in, d, h, w), weight (c_in, c_out, kt, kr, ks)): (splits - 1) float32 filters; -1 for no
// variant i or an invalid problem.
long long cutlass_conv3d_wgrad_workspace_bytes(int i, int n, int c_in, int d, int h, int w, int c_out, int kt, int kr,
                                               int ks) {
  if (i < 0 || i >= cutlass_conv3d_wgrad_variant_count()) return -1;
  const Problem pr{n, c_in, d, h, w, c_out, kt, kr, ks};
  if (!valid_problem(pr)) return -1;
  return static_cast<long long>(registry()[i].splits - 1) * pr.filter_numel() * static_cast<long long>(sizeof(float));
}

// Variant i's weight gradient on the device pointers, on `stream`: x and grad_y in the variant's
// layouts and element type (tf32: float32, bf16: bfloat16), out float32 in its out_layout,
// workspace of at least cutlass_conv3d_wgrad_workspace_bytes (may be null where that is 0).
// 0, or -1 with the reason in `error`.
int cutlass_conv3d_wgrad_run(int i, const void* x, const void* grad_y, float* out, void* workspace,
                             long long workspace_bytes, int n, int c_in, int d, int h, int w, int c_out, int kt, int kr,
                             int ks, void* stream, char* error, int error_size) {
  try {
    if (i < 0 || i >= cutlass_conv3d_wgrad_variant_count()) throw std::invalid_argument("no such variant");
    const Problem pr{n, c_in, d, h, w, c_out, kt, kr, ks};
    if (!valid_problem(pr)) throw std::invalid_argument("invalid problem");
    const Entry& entry = registry()[i];
    const long long needed = cutlass_conv3d_wgrad_workspace_bytes(i, n, c_in, d, h, w, c_out, kt, kr, ks);
    if (workspace_bytes < needed || (needed > 0 && workspace == nullptr)) {
      throw std::invalid_argument("needs a workspace of " + std::to_string(needed) + " bytes");
    }
    if (pr.filter_numel() % 4) throw std::invalid_argument("C_in * C_out * kt * kr * ks must be a multiple of 4");
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    float* partials = static_cast<float*>(workspace);
    entry.run(pr, x, grad_y, out, partials, s);
    if (entry.splits > 1) {
      const int64_t vectors = pr.filter_numel() / 4;
      const int blocks = static_cast<int>(std::min<int64_t>((vectors + 255) / 256, 4096));
      conv3d_wgrad_cutlass::add_partials<<<blocks, 256, 0, s>>>(out, partials, pr.filter_numel(), entry.splits - 1);
      check_cuda(cudaGetLastError(), "add_partials launch");
    }
    return 0;
  } catch (const std::exception& e) {
    write_message(error, error_size, e.what());
    return -1;
  }
}

}  // extern "C"
