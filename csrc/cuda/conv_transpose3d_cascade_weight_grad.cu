// CUDA kernels of conv_transpose3d_cascade_weight_grad (the math:
// ../conv_transpose3d_cascade_weight_grad.h).
//
// window (sm_90, stride 2 in every dim, a cubic kernel of 3 to 5, float32 sums,
// x's channels a multiple of 4): a block per (8 output channels, slice of the
// (n, cell) items, 32 input channels), a warp per output channel, lane i an
// input channel. Each item's x window -- every x position that reaches the
// cell's y elements, 32 channels -- lands in shared memory by the copy engine
// (zeros outside x), issued by a ninth warp up to 12 items ahead of the
// slowest computing warp. A pick's stride class fixes which taps reach it and
// where in the window their x lies, so a switch over the 8 classes runs each
// class's taps as straight-line code (their loads issue back to back), each
// tap's sum in a register of its own: sum[k] += grad_out[n, 0, c] x[n, i, p].
// A pick past its window (a byte no forward writes) adds nothing: its table entry names no class.
// A non-finite grad_out (rare) takes the taps whose x lies inside x only (the
// window's zeros would make 0 * inf). The block's sums go to its slice's
// partial, then reduce (below). (H100, SPEC's B: 0.53 ms, issue-bound at 2
// warps a scheduler: its 125 sums a lane leave room for one block.)
//
// partials (every other call): a block per (output channel o, slice of the
// batch, 32 input channels), its warps taking the slice's picks in turn; lane i
// adds a pick's value times x[n, i, p] for each tap the pick reaches into its
// own column of the warp's (taps, 32) sums in shared memory (x channels last:
// a tap's read is one 128-byte row; no atomics, no bank conflicts); then the
// block adds its warps' sums in order into its slice's partial.
//
// reduce: each weight element adds the slices' partials in order
// (deterministic). Then the non-finite x (the header's rule): their count per
// (n, i), the channels they make wholly NaN, and the taps each of the others
// reaches off the picks. Taps beyond the shared memory's room run in further passes.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/TypeCast.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <limits>
#include <utility>

#include "../conv_transpose3d_cascade_weight_grad.h"
#include "../dispatch.h"
#include "bulk_copy.cuh"
#include "plane_rows.cuh"

namespace fused_ops {
namespace {

constexpr int kLanes = 32;
constexpr int kWarps = 4;
constexpr int kThreads = kLanes * kWarps;

// The window kernel's compiled cases: stride 2 (pool1's window: B's), cubic kernels of 3 to 5.
constexpr int kWindowStride = 2;
constexpr int kWindowClasses = kWindowStride * kWindowStride * kWindowStride;
constexpr int kWindowWarps = 8;                                // computing warps: output channels a block
constexpr int kWindowThreads = kWindowWarps * kLanes + kLanes;  // and one copying warp
constexpr int kWindowMaxStages = 12;  // (the copy engine's requests in flight)
constexpr int kWindowBarrierBytes = 2 * kWindowMaxStages * sizeof(uint64_t);
constexpr int kPickTable = 256;  // (a pick is one byte)
// the window kernel's static shared memory: the pick table, its warps' batches of picks and values
constexpr int kStaticWindowBytes = kPickTable * 4 + kWindowWarps * kLanes * (1 + 4);

// The table entry of a byte that is no pick: residues 8, which add_pick's classes (0-7) never match, so
// that its window adds nothing (no compare of its own in the kernel).
constexpr uint32_t kNoTaps = uint32_t{kWindowClasses} << 24;

struct PickWindow {
  // pick byte -> its taps' window position: bits 0-23 the window position (per dim, a byte each)
  // of the x element that tap (m, m, m) reaches (m = the pick's class residue (r + pad) mod 2 per
  // dim; tap m + 2 j reaches that position less j), bits 24-26 the residues (m_d, m_h, m_w);
  // kNoTaps for a byte past the picks' range
  uint32_t table[kPickTable];
  int extent[3];  // the window's positions per dim
  int lead[3];    // its first position less kernel2 * cell: ceil((pad - kernel + 1) / 2)
  int in[3], kernel[3], kernel2[3], cells[3];
  int in_channels, out_channels, num_cells, stages;
  int items, slice_items;  // (n, cell) items in all, per slice
};

// sum[tap] += value * x at the tap's window position, for the taps (M + 2 j per dim, kernel K
// per dim) of the pick whose residues are (MD, MH, MW); `at` points at lane i's element of
// position `base`, `step` holds the window's strides of d and h (w's: kLanes). kInsideOnly: only
// the taps whose x position lies in [inside[d][0], inside[d][1]) (else each class's taps are
// straight-line code: their loads issue back to back).
template <int K, int MD, int MH, int MW, bool kInsideOnly>
__device__ __forceinline__ void add_pick_taps(float (&sum)[K * K * K], const float* at, float value,
                                              const int (&step)[2], const int (&base)[3],
                                              const int (&inside)[3][2]) {
  constexpr int S = kWindowStride;
  auto outside = [&](int d, int j) {
    return kInsideOnly && (base[d] - j < inside[d][0] || base[d] - j >= inside[d][1]);
  };
#pragma unroll
  for (int jd = 0; jd < (K - MD + S - 1) / S; ++jd) {
#pragma unroll
    for (int jh = 0; jh < (K - MH + S - 1) / S; ++jh) {
      const float* row = at - jd * step[0] - jh * step[1];
#pragma unroll
      for (int jw = 0; jw < (K - MW + S - 1) / S; ++jw) {
        if (outside(0, jd) || outside(1, jh) || outside(2, jw)) continue;
        sum[((MD + S * jd) * K + MH + S * jh) * K + MW + S * jw] += value * row[-jw * kLanes];
      }
    }
  }
}

// add_pick_taps for residues `residues` (MD * 4 + MH * 2 + MW), one compiled body per class.
template <int K, bool kInsideOnly, int... C>
__device__ __forceinline__ void add_pick(std::integer_sequence<int, C...>, int residues, float (&sum)[K * K * K],
                                         const float* at, float value, const int (&step)[2], const int (&base)[3],
                                         const int (&inside)[3][2]) {
  ((residues == C ? add_pick_taps<K, C / 4, C / 2 % 2, C % 2, kInsideOnly>(sum, at, value, step, base, inside)
                  : void()),
   ...);
}

// Kernel K in every dim. A warp per output channel, lane i an input channel; one more warp
// issues the copies, `stages` items ahead of the slowest computing warp.
template <int K>
__global__ void __launch_bounds__(kWindowThreads, 1)
    cascade_weight_grad_window_kernel(const PickWindow p, const __grid_constant__ CUtensorMap map,
                                      const float* __restrict__ values, const uint8_t* __restrict__ picks,
                                      float* __restrict__ partials) {
  extern __shared__ __align__(128) float smem[];
  __shared__ uint32_t table[kPickTable];
  __shared__ uint8_t batch_picks[kWindowWarps][kLanes];  // a warp's next kLanes items
  __shared__ float batch_values[kWindowWarps][kLanes];
  const int stage_words = p.extent[0] * p.extent[1] * p.extent[2] * kLanes;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + p.stages * stage_words);
  uint64_t* empty = full + kWindowMaxStages;
  const int warp = threadIdx.x / kLanes, lane = threadIdx.x % kLanes;
  const int o = blockIdx.x * kWindowWarps + warp, i0 = blockIdx.z * kLanes;
  const bool computes = warp < kWindowWarps && o < p.out_channels;
  const int first = blockIdx.y * p.slice_items, items = min(p.slice_items, p.items - first);
  for (int b = threadIdx.x; b < kPickTable; b += blockDim.x) table[b] = p.table[b];  // (ring.start syncs)

  // item (n, cell) of this slice: n, and its window's first x position per dim
  auto window_of = [&](int item, int (&origin)[3]) {
    const int at = first + item, cell = at % p.num_cells;
    const int c[3] = {cell / (p.cells[1] * p.cells[2]), cell / p.cells[2] % p.cells[1], cell % p.cells[2]};
    for (int d = 0; d < 3; ++d) origin[d] = p.kernel2[d] * c[d] + p.lead[d];
    return at / p.num_cells;
  };
  auto load_item = [&](int64_t item, int s) {
    int origin[3];
    const int n = window_of(static_cast<int>(item), origin);
    barrier_arrive_expect(&full[s], stage_words * sizeof(float));
    tensor_load_5d(smem + s * stage_words, map, i0, origin[2], origin[1], origin[0], n, &full[s]);
  };
  StageRing ring{full, empty, p.stages, items};
  ring.start(kWindowWarps * kLanes, load_item);  // (the computing warps release the stages)
  if (warp == kWindowWarps) {  // the copying warp: item `item` into its stage once the computing warps left it
    if (lane == 0) {
      for (int item = p.stages; item < items; ++item) {
        const int s = item % p.stages;
        barrier_wait(&empty[s], (item / p.stages - 1) & 1);
        load_item(item, s);
      }
    }
    return;
  }

  float sum[K * K * K];
#pragma unroll
  for (int t = 0; t < K * K * K; ++t) sum[t] = 0.f;
  const int step[2] = {p.extent[1] * p.extent[2] * kLanes, p.extent[2] * kLanes};
  // picks and values, a batch of kLanes items ahead: lane l loads item batch + kLanes + l's
  uint8_t next_pick = 0;
  float next_value = 0.f;
  auto load_batch = [&](int batch) {
    const int item = batch + lane;
    next_pick = item < items && computes ? picks[(int64_t{first} + item) * p.out_channels + o] : 0;
    next_value = item < items ? values[first + item] : 0.f;
  };
  load_batch(0);
  for (int item = 0; item < items; ++item) {
    const int slot = item % kLanes;
    if (slot == 0) {
      __syncwarp();
      batch_picks[warp][lane] = next_pick;
      batch_values[warp][lane] = next_value;
      __syncwarp();
      load_batch(item + kLanes);
    }
    barrier_wait(&full[ring.stage], ring.phase);
    if (computes) {
      const uint32_t entry = table[batch_picks[warp][slot]];
      const float v = batch_values[warp][slot];
      const int base[3] = {static_cast<int>(entry & 255), static_cast<int>(entry >> 8 & 255),
                           static_cast<int>(entry >> 16 & 255)};
      const float* at = smem + ring.stage * stage_words + base[0] * step[0] + base[1] * step[1] + base[2] * kLanes + lane;
      const int residues = static_cast<int>(entry >> 24);
      int inside[3][2];
      if (::isfinite(v)) {  // (the window's zeros outside x add 0)
        add_pick<K, false>(std::make_integer_sequence<int, kWindowClasses>{}, residues, sum, at, v, step, base, inside);
      } else {
        int origin[3];
        window_of(item, origin);
        for (int d = 0; d < 3; ++d) {
          inside[d][0] = max(0, -origin[d]);
          inside[d][1] = min(p.extent[d], p.in[d] - origin[d]);
        }
        add_pick<K, true>(std::make_integer_sequence<int, kWindowClasses>{}, residues, sum, at, v, step, base, inside);
      }
    }
    barrier_arrive(&empty[ring.stage]);
    ring.advance();
  }

  if (!computes || i0 + lane >= p.in_channels) return;
  float* out = partials + (int64_t{blockIdx.y} * p.out_channels + o) * (K * K * K) * p.in_channels + i0 + lane;
#pragma unroll
  for (int t = 0; t < K * K * K; ++t) out[t * int64_t{p.in_channels}] = sum[t];
}

template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads)
    cascade_weight_grad_partials_kernel(const CascadeWeightGrad g, const acc_t* __restrict__ values,
                                        const uint8_t* __restrict__ picks, const scalar_t* __restrict__ x_last,
                                        int64_t tap_begin, int64_t tap_count, int64_t slice_batch,
                                        acc_t* __restrict__ partials) {
  extern __shared__ __align__(128) float smem[];
  acc_t* sums = reinterpret_cast<acc_t*>(smem);  // [warp][tap - tap_begin][lane]
  const int64_t o = blockIdx.x, slice = blockIdx.y, i = blockIdx.z * int64_t{kLanes} + threadIdx.x % kLanes;
  const int warp = threadIdx.x / kLanes, lane = threadIdx.x % kLanes;
  const bool active = i < g.in_channels;
  acc_t* mine = sums + warp * tap_count * kLanes + lane;  // this lane's column
  for (int64_t t = 0; t < tap_count; ++t) mine[t * kLanes] = 0;

  const int64_t first_n = slice * slice_batch, cells = g.num_cells();
  const int pick_volume = static_cast<int>(g.pick_volume());  // (at most 256: the setup's check)
  const int64_t items = (min(g.batch, first_n + slice_batch) - first_n) * cells;
  for (int64_t item = warp; item < items; item += kWarps) {
    const int64_t n = first_n + item / cells, cell = item % cells;
    const acc_t value = values[n * cells + cell];
    const uint8_t pick = picks[(n * cells + cell) * g.out_channels + o];
    if (!is_window_element(pick, pick_volume)) continue;  // (its window's gradient dropped)
    int64_t y[3];
    g.picked(pick, cell, y);
    g.for_each_reaching_tap(n, y, [&](int64_t tap, int64_t row) {
      tap -= tap_begin;
      if (active && tap >= 0 && tap < tap_count) {
        mine[tap * kLanes] += value * static_cast<acc_t>(x_last[row * g.in_channels + i]);
      }
    });
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < tap_count * kLanes; e += kThreads) {
    const int64_t column = blockIdx.z * int64_t{kLanes} + e % kLanes;
    if (column >= g.in_channels) continue;
    acc_t total = 0;
    for (int w = 0; w < kWarps; ++w) total += sums[w * tap_count * kLanes + e];
    partials[((slice * g.out_channels + o) * g.taps() + tap_begin + e / kLanes) * g.in_channels + column] = total;
  }
}

template <typename acc_t, typename out_t>
__global__ void cascade_weight_grad_reduce_kernel(const CascadeWeightGrad g, const acc_t* __restrict__ partials,
                                                  int64_t slices, out_t* __restrict__ grad_w) {
  const int64_t taps = g.taps(), total = g.in_channels * g.out_channels * taps;
  // (e in the partials' order, (o, tap, i): their reads coalesce)
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total; e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t o = e / (taps * g.in_channels), tap = e / g.in_channels % taps, i = e % g.in_channels;
    acc_t sum = 0;
    for (int64_t s = 0; s < slices; ++s) sum += partials[s * total + e];
    grad_w[(i * g.out_channels + o) * taps + tap] = c10::convert<out_t>(sum);
  }
}

// The non-finite x (the header's rule): count[n, i] of x[n, i, :] (a thread per element).
template <typename scalar_t>
__global__ void cascade_weight_grad_count_kernel(const CascadeWeightGrad g, const scalar_t* __restrict__ x_last,
                                                 int* __restrict__ count) {
  const int64_t volume = g.in_volume(), total = g.batch * volume * g.in_channels;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total; e += int64_t{gridDim.x} * blockDim.x) {
    if (!::isfinite(static_cast<at::opmath_type<scalar_t>>(x_last[e]))) {
      atomicAdd(count + e / (g.in_channels * volume) * g.in_channels + e % g.in_channels, 1);
    }
  }
}

// NaN where PyTorch's dense gradient adds 0 * a non-finite x: every (o, tap) of a channel with
// more than `cells` of them in one item (a thread per weight element), else the taps each one
// reaches off the picks (a thread per x element). Every writer of an element writes NaN.
template <typename out_t>
__global__ void cascade_weight_grad_whole_channel_kernel(const CascadeWeightGrad g, const int* __restrict__ count,
                                                         out_t* __restrict__ grad_w) {
  const int64_t taps = g.taps(), total = g.in_channels * g.out_channels * taps;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total; e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = e / (g.out_channels * taps);
    for (int64_t n = 0; n < g.batch; ++n) {
      if (count[n * g.in_channels + i] > g.num_cells()) {
        grad_w[e] = std::numeric_limits<out_t>::quiet_NaN();
        break;
      }
    }
  }
}

template <typename scalar_t, typename out_t>
__global__ void cascade_weight_grad_nonfinite_kernel(const CascadeWeightGrad g, const uint8_t* __restrict__ picks,
                                                     const scalar_t* __restrict__ x_last,
                                                     const int* __restrict__ count, out_t* __restrict__ grad_w) {
  const int64_t volume = g.in_volume(), total = g.batch * volume * g.in_channels, taps = g.taps();
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total; e += int64_t{gridDim.x} * blockDim.x) {
    if (::isfinite(static_cast<at::opmath_type<scalar_t>>(x_last[e]))) continue;
    const int64_t i = e % g.in_channels, p = e / g.in_channels % volume, n = e / (g.in_channels * volume);
    if (count[n * g.in_channels + i] > g.num_cells()) continue;  // (the whole channel's)
    for (int64_t o = 0; o < g.out_channels; ++o) {
      for (int64_t tap = 0; tap < taps; ++tap) {
        if (g.zero_product(picks, n, p, o, tap)) {
          grad_w[(i * g.out_channels + o) * taps + tap] = std::numeric_limits<out_t>::quiet_NaN();
        }
      }
    }
  }
}

// The window kernel's geometry for a call it takes (window_kernel_takes).
PickWindow pick_window(const CascadeWeightGrad& g) {
  PickWindow p{};
  const auto ceil_half = [](int64_t a) { return a >= 0 ? (a + 1) / 2 : -((-a) / 2); };
  for (int d = 0; d < 3; ++d) {
    p.lead[d] = static_cast<int>(ceil_half(g.padding[d] - g.kernel[d] + 1));
    p.extent[d] = static_cast<int>((2 * g.kernel2[d] - 1 + g.padding[d]) / 2 - p.lead[d] + 1);
    p.in[d] = static_cast<int>(g.in[d]);
    p.kernel[d] = static_cast<int>(g.kernel[d]);
    p.kernel2[d] = static_cast<int>(g.kernel2[d]);
    p.cells[d] = static_cast<int>(g.cells[d]);
  }
  // pick = off * 8 + q (CascadeWeightGrad::picked): y = 2 (kernel2 c + off) + r per dim, whose
  // taps m + 2 j (m = (r + pad) mod 2) reach x at kernel2 c + off + (r + pad) div 2 - j
  const int pick_volume = static_cast<int>(g.pick_volume());
  for (int pick = 0; pick < kPickTable; ++pick) {
    if (!is_window_element(pick, pick_volume)) {
      p.table[pick] = kNoTaps;
      continue;
    }
    const int64_t q = pick % kWindowClasses, off = pick / kWindowClasses;
    const int64_t r[3] = {q / 4, q / 2 % 2, q % 2};
    const int64_t o[3] = {off / (g.kernel2[1] * g.kernel2[2]), off / g.kernel2[2] % g.kernel2[1], off % g.kernel2[2]};
    uint32_t entry = 0;
    for (int d = 0; d < 3; ++d) {
      const int64_t base = o[d] + (r[d] + g.padding[d]) / 2 - p.lead[d];
      entry |= static_cast<uint32_t>(base) << (8 * d) | static_cast<uint32_t>((r[d] + g.padding[d]) % 2) << (26 - d);
    }
    p.table[pick] = entry;
  }
  p.in_channels = static_cast<int>(g.in_channels);
  p.out_channels = static_cast<int>(g.out_channels);
  p.num_cells = static_cast<int>(g.num_cells());
  p.items = static_cast<int>(g.batch * g.num_cells());
  return p;
}

// f(kernel) with the window kernel compiled for a call's cubic kernel of 3 to 5; false for
// another kernel.
template <typename F>
bool with_window_kernel(const CascadeWeightGrad& g, F&& f) {
  if (g.kernel[1] != g.kernel[0] || g.kernel[2] != g.kernel[0]) return false;
  switch (g.kernel[0]) {
    case 3: f(cascade_weight_grad_window_kernel<3>); return true;
    case 4: f(cascade_weight_grad_window_kernel<4>); return true;
    case 5: f(cascade_weight_grad_window_kernel<5>); return true;
    default: return false;
  }
}

// Whether the window kernel takes a call: a device that runs its sm_90 code (the copy engine),
// x not float64 (float32 sums), stride 2 in every dim, a kernel it is compiled for, input
// channels a multiple of 4 (the copy engine's 16-byte rows), windows within a byte per dim, two
// stages of them in shared memory, sizes its int fields hold.
bool window_kernel_takes(const CascadeWeightGrad& g, const at::Tensor& x) {
  if (x.scalar_type() == at::kDouble || g.in_channels % 4 != 0 || g.batch * g.num_cells() == 0 || g.in_volume() == 0) {
    return false;  // (no x: the copy engine's map needs every dim)
  }
  for (int d = 0; d < 3; ++d) {
    if (g.stride[d] != kWindowStride || g.padding[d] > 64 || g.kernel2[d] > 64 || g.in[d] > INT_MAX / 2) return false;
  }
  if (g.batch * g.num_cells() > INT_MAX || g.in_channels > INT_MAX / 2 || g.out_channels > INT_MAX / 2 ||
      g.batch * g.in_volume() * g.in_channels >= (int64_t{1} << 38)) {  // (the copy engine's strides: under 2^40 bytes)
    return false;
  }
  const PickWindow p = pick_window(g);
  const int64_t stage_bytes = int64_t{p.extent[0]} * p.extent[1] * p.extent[2] * kLanes * sizeof(float);
  const int64_t room = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, x.get_device());
  if (std::max({p.extent[0], p.extent[1], p.extent[2]}) > 255 ||
      2 * stage_bytes + kWindowBarrierBytes + kStaticWindowBytes > room) {
    return false;
  }
  bool runs = false;
  return with_window_kernel(g, [&](auto kernel) { runs = runs_bulk_copy(kernel); }) && runs &&
         device_attribute(cudaDevAttrComputeCapabilityMajor, x.get_device()) >= 9;
}

// The window kernel's partial sums (slices, O, taps, I) over x_last (N, D, H, W, I) float32.
at::Tensor window_partials(const CascadeWeightGrad& g, const at::Tensor& values, const at::Tensor& picks,
                           const at::Tensor& x_last) {
  PickWindow p = pick_window(g);
  const int64_t stage_words = int64_t{p.extent[0]} * p.extent[1] * p.extent[2] * kLanes;  // (128-byte multiples)
  const int64_t room = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, x_last.get_device()) -
                       kStaticWindowBytes - kWindowBarrierBytes;
  p.stages = static_cast<int>(std::min<int64_t>(kWindowMaxStages, room / (stage_words * sizeof(float))));
  // slices: one block per multiprocessor (a warp holds an output channel's K^3 sums a lane)
  const int64_t sms = device_attribute(cudaDevAttrMultiProcessorCount, x_last.get_device());
  const int64_t channel_groups = (g.out_channels + kWindowWarps - 1) / kWindowWarps;
  const int64_t lane_groups = (g.in_channels + kLanes - 1) / kLanes;
  TORCH_CHECK(channel_groups <= INT_MAX && lane_groups <= 65535, "conv_transpose3d_cascade_weight_grad: ",
              g.in_channels, " input channels are too many for the GPU kernel");
  const int64_t slices =
      std::clamp<int64_t>(sms / (channel_groups * lane_groups), 1, std::min<int64_t>(p.items, 65535));
  p.slice_items = static_cast<int>((p.items + slices - 1) / slices);
  const int64_t used = (p.items + p.slice_items - 1) / p.slice_items;
  at::Tensor partials = at::empty({used, g.out_channels, g.taps(), g.in_channels}, values.options());
  const cuuint64_t dims[5] = {static_cast<cuuint64_t>(g.in_channels), static_cast<cuuint64_t>(g.in[2]),
                              static_cast<cuuint64_t>(g.in[1]), static_cast<cuuint64_t>(g.in[0]),
                              static_cast<cuuint64_t>(g.batch)};
  cuuint64_t strides[4];
  cuuint64_t stride = sizeof(float);
  for (int d = 0; d < 4; ++d) strides[d] = stride *= dims[d];
  const cuuint32_t box[5] = {kLanes, static_cast<cuuint32_t>(p.extent[2]), static_cast<cuuint32_t>(p.extent[1]),
                             static_cast<cuuint32_t>(p.extent[0]), 1};
  const CUtensorMap map =
      tiled_tensor_map(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, x_last.const_data_ptr(), 5, dims, strides, box);
  const size_t smem = static_cast<size_t>(p.stages * stage_words) * sizeof(float) + kWindowBarrierBytes;
  with_window_kernel(g, [&](auto kernel) {
    allow_dynamic_shared_memory(kernel, smem);
    kernel<<<dim3(static_cast<unsigned>(channel_groups), static_cast<unsigned>(used),
                  static_cast<unsigned>(lane_groups)),
             kWindowThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(
        p, map, values.const_data_ptr<float>(), picks.const_data_ptr<uint8_t>(), partials.mutable_data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return partials;
}

// The partials kernel's partial sums (slices, O, taps, I) over x_last (N, D, H, W, I) in x's dtype.
template <typename x_t, typename acc_t>
at::Tensor pick_partials(const CascadeWeightGrad& g, const at::Tensor& values, const at::Tensor& picks,
                         const at::Tensor& x_last) {
  const int64_t I = g.in_channels, O = g.out_channels, taps = g.taps();
  const int64_t sms = device_attribute(cudaDevAttrMultiProcessorCount, x_last.get_device());
  // slices of the batch: blocks for two waves of the multiprocessors at least
  const int64_t channel_blocks = (I + kLanes - 1) / kLanes;
  TORCH_CHECK(channel_blocks <= 65535, "conv_transpose3d_cascade_weight_grad: at most ", 65535 * kLanes,
              " input channels on a GPU, got ", I);
  const int64_t wanted = std::clamp<int64_t>((2 * sms + O * channel_blocks - 1) / (O * channel_blocks), 1,
                                             std::min<int64_t>(g.batch, 65535));
  const int64_t slice_batch = (g.batch + wanted - 1) / wanted, slices = (g.batch + slice_batch - 1) / slice_batch;
  at::Tensor partials = at::empty({slices, O, taps, I}, values.options());
  const int64_t room = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, x_last.get_device());
  const int64_t tap_chunk = std::min<int64_t>(taps, room / (kThreads * int64_t{sizeof(acc_t)}));
  const auto kernel = cascade_weight_grad_partials_kernel<x_t, acc_t>;
  for (int64_t tap_begin = 0; tap_begin < taps; tap_begin += tap_chunk) {
    const int64_t count = std::min(tap_chunk, taps - tap_begin);
    const size_t smem = static_cast<size_t>(count * kThreads) * sizeof(acc_t);
    allow_dynamic_shared_memory(kernel, smem);
    kernel<<<dim3(static_cast<unsigned>(O), static_cast<unsigned>(slices), static_cast<unsigned>(channel_blocks)),
             kThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(
        g, values.const_data_ptr<acc_t>(), picks.const_data_ptr<uint8_t>(), x_last.const_data_ptr<x_t>(), tap_begin,
        count, slice_batch, partials.mutable_data_ptr<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return partials;
}

at::Tensor conv_transpose3d_cascade_weight_grad_cuda(const at::Tensor& grad_out, const at::Tensor& picks_,
                                                     const at::Tensor& x, at::IntArrayRef kernel_size,
                                                     at::IntArrayRef stride, at::IntArrayRef padding,
                                                     at::IntArrayRef kernel2, at::IntArrayRef output_size,
                                                     at::ScalarType dtype) {
  const CascadeWeightGrad g =
      cascade_weight_grad_setup(grad_out, picks_, x, kernel_size, stride, padding, kernel2, output_size, dtype);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t I = g.in_channels, O = g.out_channels;
  at::Tensor grad_w = at::empty({I, O, g.kernel[0], g.kernel[1], g.kernel[2]}, x.options().dtype(dtype));
  if (grad_w.numel() == 0) return grad_w;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor picks = picks_.contiguous();
  const bool window = window_kernel_takes(g, x);
  // x channels last, (N, D, H, W, I) in memory: float32 for the window kernel, else in its dtype
  at::Tensor x_last = x.to(window ? at::kFloat : x.scalar_type(), /*non_blocking=*/false, /*copy=*/false,
                           at::MemoryFormat::ChannelsLast3d);
  if (window && reinterpret_cast<uintptr_t>(x_last.const_data_ptr()) % 16 != 0) {
    x_last = x_last.clone(at::MemoryFormat::ChannelsLast3d);  // (the copy engine reads from 16-byte boundaries)
  }
  const int64_t sms = device_attribute(cudaDevAttrMultiProcessorCount, x.get_device());
  FUSED_OPS_DISPATCH_FLOATING_TYPES(x_last.scalar_type(), "conv_transpose3d_cascade_weight_grad_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    using x_t = scalar_t;
    const at::Tensor values = grad_out.to(c10::CppTypeToScalarType<acc_t>::value).contiguous();
    FUSED_OPS_DISPATCH_FLOATING_TYPES(dtype, "conv_transpose3d_cascade_weight_grad_cuda", [&] {
      if (g.batch == 0 || g.num_cells() == 0) {
        grad_w.zero_();
      } else {
        const at::Tensor partials =
            window ? window_partials(g, values, picks, x_last) : pick_partials<x_t, acc_t>(g, values, picks, x_last);
        const int64_t blocks = std::min<int64_t>((grad_w.numel() + 255) / 256, 4 * sms);
        cascade_weight_grad_reduce_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
            g, partials.const_data_ptr<acc_t>(), partials.size(0), grad_w.mutable_data_ptr<scalar_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      if (x.numel() == 0) return;
      const at::Tensor count = at::zeros({g.batch, I}, x.options().dtype(at::kInt));
      const int64_t x_blocks = std::min<int64_t>((x.numel() + 255) / 256, 8 * sms);
      cascade_weight_grad_count_kernel<<<static_cast<unsigned>(x_blocks), 256, 0, stream>>>(
          g, x_last.const_data_ptr<x_t>(), count.mutable_data_ptr<int>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      const int64_t w_blocks = std::min<int64_t>((grad_w.numel() + 255) / 256, 4 * sms);
      cascade_weight_grad_whole_channel_kernel<<<static_cast<unsigned>(w_blocks), 256, 0, stream>>>(
          g, count.const_data_ptr<int>(), grad_w.mutable_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      cascade_weight_grad_nonfinite_kernel<<<static_cast<unsigned>(x_blocks), 256, 0, stream>>>(
          g, picks.const_data_ptr<uint8_t>(), x_last.const_data_ptr<x_t>(), count.const_data_ptr<int>(),
          grad_w.mutable_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return grad_w;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("conv_transpose3d_cascade_weight_grad", &conv_transpose3d_cascade_weight_grad_cuda);
}

}  // namespace fused_ops
