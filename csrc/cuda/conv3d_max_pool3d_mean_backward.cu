// CUDA backward of conv3d_max_pool3d_mean (the math: ../conv3d_max_pool3d_mean.h).
// grad_y is grad_mean[n, o] / P / divisor (g[n, o]) at each window's pick and
// zero elsewhere, so
//   grad_weight[o, c, tap] = sum over (n, windows) of g[n, o] x[n, c, pick + tap],
//   grad_bias[o] = P sum over n of g[n, o],
//   grad_channel_bias[o] = sum over n of grad_mean[n, o].
// On Hopper, for what the forward's kernel takes, the weight's gradient is one
// tensor-core kernel over x and the picks (grad_y never in memory); the bias's
// is the sum above; x's gradient, and every other case, PyTorch's convolution
// backward on grad_y (conv3d_max_pool3d_mean_backward_composite).
//
// The weight-gradient kernel: a TF32 m16n8k8 GEMM with rows = the 16 output
// channels, columns = (tap, 8 input channels of a block: an n8 tile per tap),
// k = the pixels of one window per k step: A[o][k] = g[n, o] where o's pick is
// window element k, else 0 (built in registers from the picks), B[k][c] =
// x[c] at element k + tap. Tasks and warps are the forward's
// (conv3d_max_pool3d_mean.cuh), x staged by plane pairs (units, below); each
// warp accumulates its 8 windows of every task of its block, 27 n8 tiles (108
// accumulators a lane); once per channel
// block the block adds its warps' sums in warp order in shared memory and writes
// them (one block's sums in global memory, not each warp's: 1.5 MB where each
// warp's took 12 at a batch of one, above the original's 10 MiB peak); the
// blocks' sums are added in a fixed order after (deterministic). A k step's
// lanes t read elements (dd, hh) = (t / 2, t % 2) (b0: column 0, b1: column
// 1): with channels kOperandStride = 1 mod 32 words apart, planes 16 and rows
// 8 mod 32 (an item's planes 1 and 2 too, in two slots), its 32 lanes hit
// distinct banks. x is rounded to the weight's type
// (a 16-bit value is exact in TF32), g to TF32 (already in T for m16n8k16).
// With a 16-bit operand type (bf16, f16) the same GEMM runs as m16n8k16: k = two
// windows' 8 pixels, half the instructions and B loads. Its operand buffer holds
// pairs of adjacent columns a word, rounded to the type: pairs from even columns
// and from odd ones (a window's pair starts at an odd column where the box's lead
// plus the tap's column shift is odd), rows kPairRowWords (1 mod 4), planes
// kPairPlaneWords (2 mod 4) and channels kPairChannelWords (4 mod 8) apart: lane
// (channel g, pixel pair t) of a k step reads a word t mod 4 and its channel's
// words lie 8 multiples of 4 apart mod 32, so its 32 lanes hit 32 distinct banks.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "../conv3d_max_pool3d_mean.h"
#include "block_reduce.cuh"
#include "bulk_copy.cuh"
#include "conv3d_max_pool3d_mean.cuh"
#include "mma.cuh"
#include "plane_rows.cuh"

namespace fused_ops {
namespace {

using namespace conv3d_pool;

// The kernel stages x by units: a unit is one plane pair (2 planes, kBoxRows rows, kBoxCols columns, a channel
// block) of a column, a column being the tasks of one (channel block, n, row group, column tile) over pd in order.
// Task pd reads the column's pairs pd and pd + 1, so consecutive tasks of a column share a pair: each pair is
// staged and converted once (x's planes once, not twice as by whole 4-plane boxes). Each block takes a contiguous
// range of the (column, pd) items, channel block slowest; its units (a column's first item in the range brings
// two) are staged in a ring (kUnitStages) and converted into kSlots operand slots, unit u into slot u % kSlots: an
// item reads the slots of its two units, while the next item's one or two units are converted into the others.
constexpr int kUnitPlanes = 2;
constexpr int kUnitChannelWords = kUnitPlanes * kPlaneWords;      // one channel of a staged unit
constexpr int kUnitWords = kBlockChannels * kUnitChannelWords;     // a staged unit
constexpr int kUnitStages = 4;
constexpr int kSlots = 4;
static_assert(kUnitStages <= kBarrierWords / 4, "the stages' full and empty barriers fit");
// TF32 slots: a value a word, channels kOperandStride (1 mod 32) apart, planes kPlaneWords (16 mod 32), rows
// kBoxCols (8 mod 32); slots a multiple of 32 words apart, so that an item's plane 2 (its second slot's plane 0)
// also lies 16 mod 32 words past its plane 1, whichever slots the two are
constexpr int kOperandStride = kUnitChannelWords + 1;
constexpr int kOperandSlotWords = (kBlockChannels * kOperandStride + 31) / 32 * 32;
// 16-bit slots: pairs of adjacent columns a word, the even pairs then the odd ones; rows kPairRowWords (1 mod 4),
// planes kPairPlaneWords (2 mod 4), channels kPairChannelWords (4 mod 8) apart; slots a multiple of 4 words apart
constexpr int kPairRowWords = kBoxCols / 2 + 1, kPairPlaneWords = kBoxRows * kPairRowWords;
constexpr int kPairParityWords = kUnitPlanes * kPairPlaneWords, kPairChannelWords = 2 * kPairParityWords + 4;
constexpr int kPairSlotWords = kBlockChannels * kPairChannelWords;
static_assert(kPairRowWords % 4 == 1 && kPairPlaneWords % 4 == 2 && kPairChannelWords % 8 == 4 &&
                  kPairSlotWords % 4 == 0, "bank layout");
static_assert(kOperandStride % 32 == 1 && kPlaneWords % 32 == 16 && kBoxCols % 32 == 8 &&
                  kOperandSlotWords % 32 == 0, "bank layout");
constexpr int kGradWords = kChannels * kBlockChannels * kTaps;  // a warp's sums per channel block: (o, c, tap)
// (a Mma's slot: a value a word, or pairs)
template <class Mma>
constexpr int kSlotWords = Mma::kStepK == 16 ? kPairSlotWords : kOperandSlotWords;
static_assert(kWarps * kGradWords <= kSlots * kOperandSlotWords && kOperandSlotWords <= kPairSlotWords,
              "the warps' sums fit the slots");
// A unit's copy into a slot: each warp's lanes take 8 consecutive 16-byte chunks of 4 channels (a channel's
// chunks: its rows' 4-column chunks in order), warp w the channel quad w % 2 and every (kWarps / 2)-th block of 8
// chunks from w / 2: fixed channels a lane, chunks in steps of kChunkStep (no divisions of its own)
constexpr int kChannelChunks = kUnitChannelWords / 4;
constexpr int kChunkStep = kWarps / 2 * 8;
static_assert(kBlockChannels == 8 && kWarps % 2 == 0 && kChannelChunks % 8 == 0, "two channel quads, whole blocks");

// f(c, chunk) for each chunk of a unit this lane copies (the mapping above), chunk an Index
template <typename Index, typename F>
__device__ __forceinline__ void for_each_copied_chunk(int warp, int lane, F&& f) {
  const int c = warp % 2 * 4 + lane / 8;
  for (Index chunk = warp / 2 * 8 + lane % 8; chunk < kChannelChunks; chunk += kChunkStep) f(c, chunk);
}

struct Params {
  TaskGrid grid;
  const uint8_t* picks;  // (N, O, PD, PH, PW), the forward's
  const float* g;        // (N, kChannels): grad_mean / P / divisor, zero past O
  float* partial;        // (channel_blocks, gridDim.x, kGradWords)
  int O, stages;
  int items;                                            // channel_blocks x block_columns x PD
  int block_columns;                                    // the columns of a channel block: N x row groups x tiles
  at::cuda::detail::IntDivider<unsigned> column_pairs;  // PD + 1: a column's units
};

// A column's coordinates (row_group and col_tile as a task's; pd not set) and channel block.
struct ColumnCoords {
  TaskCoords task;
  int block;
};

__device__ __forceinline__ ColumnCoords column_coords(int column, const Params& p) {
  static_assert(kMaxChannelBlocks == 2, "a channel block by a comparison");
  const int block = column < p.block_columns ? 0 : 1;
  const auto image = p.grid.plane_tasks.divmod(static_cast<unsigned>(column - block * p.block_columns));
  const auto row = p.grid.tiles.divmod(image.mod);
  return {{static_cast<int>(image.div), 0, static_cast<int>(row.div), static_cast<int>(row.mod)}, block};
}

// The staged unit at `stage` into a 16-bit slot (kPairRowWords's layout): each lane a chunk of 4 columns (a
// 16-byte load, the next column's value a second load) into two even and two odd pairs.
template <class Mma>
__device__ __forceinline__ void copy_pairs(const float* stage, uint32_t* slot, int warp, int lane) {
  constexpr unsigned kRowChunks = kBoxCols / 4;
  static_assert(kPairPlaneWords == kBoxRows * kPairRowWords, "a channel's pair rows in the unit's row order");
  // (unsigned chunks: the divisions by constants below without a sign's fix-up)
  for_each_copied_chunk<unsigned>(warp, lane, [&](int c, unsigned chunk) {
    const float* const values = stage + c * kUnitChannelWords + 4 * chunk;
    const float4 v = *reinterpret_cast<const float4*>(values);
    const unsigned row = chunk / kRowChunks, column_chunk = chunk - row * kRowChunks;  // (row: the unit's plane, row)
    const float next = column_chunk + 1 < kRowChunks ? values[4] : 0.f;               // (column 72: none, never read)
    uint32_t* const even = slot + c * kPairChannelWords + row * kPairRowWords + 2 * column_chunk;
    even[0] = Mma::pack(v.x, v.y);
    even[1] = Mma::pack(v.z, v.w);
    even[kPairParityWords] = Mma::pack(v.y, v.z);
    even[kPairParityWords + 1] = Mma::pack(v.w, next);
  });
}

// The staged unit `stage` into a slot: x rounded to T, as TF32 words or as 16-bit pairs (copy_pairs).
template <class Mma>
__device__ __forceinline__ void copy_operands(const float* stage, uint32_t* slot, int warp, int lane) {
  using T = typename Mma::Input;
  if constexpr (Mma::kStepK == 16) {
    copy_pairs<Mma>(stage, slot, warp, lane);
  } else {
    // (a warp's lanes take 8 chunks of 4 channels: its scalar stores hit 32 distinct banks)
    for_each_copied_chunk<int>(warp, lane, [&](int c, int chunk) {
      const float4 v = reinterpret_cast<const float4*>(stage + c * kUnitChannelWords)[chunk];
      uint32_t* out = slot + c * kOperandStride + 4 * chunk;
      out[0] = Tf32Mma::pack(rounded_to<T>(v.x), 0.f);
      out[1] = Tf32Mma::pack(rounded_to<T>(v.y), 0.f);
      out[2] = Tf32Mma::pack(rounded_to<T>(v.z), 0.f);
      out[3] = Tf32Mma::pack(rounded_to<T>(v.w), 0.f);
    });
  }
}

// A lane's A-operand values of an item: g[n, o] for o = g, g + 8, and the picks of the warp's 8 windows (-1:
// none, outside the output).
struct WindowPicks {
  float grad[2];
  int pick[2][8];
};

template <class Mma>
__global__ void __launch_bounds__(kThreads, 1)
    conv3d_max_pool3d_mean_weight_grad_kernel(const Params p, const __grid_constant__ CUtensorMap map) {
  constexpr bool kPairs = Mma::kStepK == 16;
  extern __shared__ __align__(128) float smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + kUnitStages;
  float* stages = smem + kBarrierWords;
  uint32_t* slots = reinterpret_cast<uint32_t*>(stages + p.stages * kUnitWords);
  const TaskGrid& grid = p.grid;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;

  // this block's items [start, end) (item = column x PD + pd), their columns, and its units: the first column's
  // pairs from first_pair on, then PD + 1 a column
  const int start = static_cast<int>(int64_t{blockIdx.x} * p.items / gridDim.x);
  const int end = static_cast<int>(int64_t{blockIdx.x + 1} * p.items / gridDim.x);
  const int first_column = static_cast<int>(grid.planes.div(static_cast<unsigned>(start)));
  const int last_column = end > start ? static_cast<int>(grid.planes.div(static_cast<unsigned>(end - 1))) : -1;
  const int units = end > start ? end - start + last_column - first_column + 1 : 0;
  const int first_pair = start - first_column * grid.PD;
  const int lead_units = grid.PD + 1 - first_pair;  // (the first column's)
  // (a channel block without items here: its sums zero)
  for (int block = 0; block < grid.channel_blocks; ++block) {
    if (end > start && block >= column_coords(first_column, p).block && block <= column_coords(last_column, p).block)
      continue;
    for (int w = threadIdx.x; w < kGradWords; w += kThreads)
      p.partial[(int64_t{block} * gridDim.x + blockIdx.x) * kGradWords + w] = 0.f;
  }
  auto load_unit = [&](int unit, int s) {
    int column = first_column, pair = first_pair + unit;
    if (unit >= lead_units) {
      const auto later = p.column_pairs.divmod(static_cast<unsigned>(unit - lead_units));
      column += 1 + static_cast<int>(later.div);
      pair = static_cast<int>(later.mod);
    }
    const ColumnCoords cc = column_coords(column, p);
    barrier_arrive_expect(&full[s], kUnitWords * sizeof(float));
    tensor_load_5d(stages + s * kUnitWords, map, cc.task.col_tile * kTileColumns - grid.pad_w - grid.lead,
                   cc.task.row_group * 4 - grid.pad_h, 2 * pair - grid.pad_d, cc.block * kBlockChannels, cc.task.n,
                   &full[s]);
  };
  StageRing ring{full, empty, p.stages, units};
  ring.start(kThreads, load_unit);

  // this lane's B words past its plane's start in a slot: channel g, element (t / 2, t % 2, 0) of the warp's
  // windows (row of windows rp, 8 windows from column 16 quarter of the task); an item's plane P (0-3) lies in
  // the slot of its unit P / 2
  const int rp = warp / 4, quarter = warp % 4;
  const int lane_offset = g * kOperandStride + (2 * rp + t % 2) * kBoxCols + grid.lead + 16 * quarter;
  // (kPairs: this lane's pair words, window 0 of the warp's, and a column shift's: the pair from column lead +
  // shift + 16 quarter + 2 j is word (lead + shift) / 2 + 8 quarter + j of the even pairs or the odd ones)
  const int pair_offset = g * kPairChannelWords + (2 * rp + t % 2) * kPairRowWords + 8 * quarter;
  int shift_words[3];
#pragma unroll
  for (int dx = 0; dx < 3; ++dx) shift_words[dx] = (grid.lead + dx) % 2 * kPairParityWords + (grid.lead + dx) / 2;

  auto window_picks = [&](int item) {
    const auto column = grid.planes.divmod(static_cast<unsigned>(item));
    TaskCoords tc = column_coords(static_cast<int>(column.div), p).task;
    tc.pd = static_cast<int>(column.mod);
    const int ph = 2 * tc.row_group + rp;
    WindowPicks w;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int o = g + 8 * h;
      w.grad[h] = p.g[int64_t{tc.n} * kChannels + o];
      const uint8_t* picks = p.picks + ((int64_t{tc.n} * p.O + o) * grid.PD + tc.pd) * grid.PH * grid.PW +
                             int64_t{ph} * grid.PW;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int pw = tc.col_tile * (kTileColumns / 2) + 8 * quarter + j;
        w.pick[h][j] = o < p.O && ph < grid.PH && pw < grid.PW ? picks[pw] : -1;
      }
    }
    return w;
  };
  // unit `unit`, staged `ahead` (0 or 1) stages past the ring's current one, into its slot, its stage released
  // (refilled after a block barrier: ring.refill)
  auto copy_unit = [&](int unit, int ahead) {
    int stage = ring.stage + ahead;
    uint32_t phase = ring.phase;
    if (stage == p.stages) {
      stage = 0;
      phase ^= 1;
    }
    barrier_wait(&full[stage], phase);
    copy_operands<Mma>(stages + stage * kUnitWords, slots + unit % kSlots * kSlotWords<Mma>, warp, lane);
    barrier_arrive(&empty[stage]);
  };

  float acc[kTaps][4];
#pragma unroll
  for (int s = 0; s < kTaps; ++s)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[s][e] = 0.f;

  // the products of the item whose first unit is `unit` into acc
  auto accumulate = [&](int unit, const WindowPicks& w) {
    // this lane's words of the item's planes t / 2 + dz, for each plane shift dz of the taps
    const uint32_t* planes[3];
#pragma unroll
    for (int dz = 0; dz < 3; ++dz) {
      const int plane = t / 2 + dz;
      planes[dz] = slots + (unit + plane / 2) % kSlots * kSlotWords<Mma> +
                   plane % 2 * (kPairs ? kPairPlaneWords : kPlaneWords) + (kPairs ? pair_offset : lane_offset);
    }
    if constexpr (kPairs) {
      // k = 2t, 2t + 1: elements 2t, 2t + 1 of window 2jj (scan order), k + 8: of window 2jj + 1; g[n, o] in
      // the half of the pair its pick names (g is already in T: mean_gradient_kernel)
      const uint32_t low[2] = {Mma::pack(w.grad[0], 0.f), Mma::pack(w.grad[1], 0.f)};
      const uint32_t high[2] = {Mma::pack(0.f, w.grad[0]), Mma::pack(0.f, w.grad[1])};
      const auto a_of = [&](int h, int window) {
        return w.pick[h][window] == 2 * t ? low[h] : w.pick[h][window] == 2 * t + 1 ? high[h] : 0u;
      };
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const uint32_t a[4] = {a_of(0, 2 * jj), a_of(1, 2 * jj), a_of(0, 2 * jj + 1), a_of(1, 2 * jj + 1)};
#pragma unroll
        for (int s = 0; s < kTaps; ++s) {
          const uint32_t* const b = planes[s / 9] + shift_words[s % 3] + s / 3 % 3 * kPairRowWords;
          Mma::mma(acc[s], a, b[2 * jj], b[2 * jj + 1]);
        }
      }
    } else {
      const uint32_t a_values[2] = {Tf32Mma::pack(w.grad[0], 0.f), Tf32Mma::pack(w.grad[1], 0.f)};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        // k = t: element 2t of the window (scan order), k = t + 4: element 2t + 1
        const uint32_t a[4] = {w.pick[0][j] == 2 * t ? a_values[0] : 0u, w.pick[1][j] == 2 * t ? a_values[1] : 0u,
                               w.pick[0][j] == 2 * t + 1 ? a_values[0] : 0u,
                               w.pick[1][j] == 2 * t + 1 ? a_values[1] : 0u};
#pragma unroll
        for (int s = 0; s < kTaps; ++s) {
          const uint32_t* const b = planes[s / 9] + 2 * j + s / 3 % 3 * kBoxCols + s % 3;
          Tf32Mma::mma(acc[s], a, b[0], b[1]);
        }
      }
    }
  };

  // The next item's units are converted within the current item's block-barrier interval: warps 0-3 copy first,
  // warps 4-7 compute first, so that the two warps of each SM sub-partition (w, w + 4) overlap the copy's
  // shared-memory traffic with the other's tensor instructions. A channel block's last item is followed by its
  // sums, which take every slot: the next item's units are converted after.
  const bool copy_first = warp < kWarps / 2;
  const int block_items = p.block_columns * grid.PD;  // (the first item of channel block 1)
  int unit = 0, next_unit = 2;  // the current item's first unit, the next unit to convert
  int pd = first_pair;
  WindowPicks current{};
  if (end > start) {
    current = window_picks(start);
    copy_unit(0, 0);
    copy_unit(1, 1);
    __syncthreads();
    ring.refill(0, load_unit);
    ring.refill(1, load_unit);
  }
  for (int item = start; item < end; ++item) {
    const bool block_end = item + 1 == end || item + 1 == block_items;  // (the same for every warp)
    const bool column_end = pd + 1 == grid.PD;
    const int copies = block_end ? 0 : column_end ? 2 : 1;  // (the next item's units to convert now)
    WindowPicks next{};
    if (item + 1 < end) next = window_picks(item + 1);  // (its loads' latency under this item's work)
    auto copy_next = [&] {
      for (int c = 0; c < copies; ++c) copy_unit(next_unit + c, c);
    };
    if (copy_first) copy_next();
    accumulate(unit, current);
    if (!copy_first) copy_next();
    __syncthreads();  // (the next item's units are whole unless block_end; every warp is done with item's)
    for (int c = 0; c < copies; ++c) ring.refill(next_unit + c, load_unit);
    unit = column_end ? next_unit : unit + 1;
    next_unit += copies;
    pd = column_end ? 0 : pd + 1;
    current = next;
    if (!block_end) continue;
    // the channel block's sums: each warp's, acc[tap][e] = (o = g + 8 (e / 2), c = 2t + e % 2), into the
    // slots (kWarps, kGradWords); then added in warp order
    float* const sums = reinterpret_cast<float*>(slots);
#pragma unroll
    for (int s = 0; s < kTaps; ++s) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sums[warp * kGradWords + ((g + 8 * (e / 2)) * kBlockChannels + 2 * t + e % 2) * kTaps + s] = acc[s][e];
        acc[s][e] = 0.f;
      }
    }
    __syncthreads();
    const int block = item < block_items ? 0 : 1;
    float* const out = p.partial + (int64_t{block} * gridDim.x + blockIdx.x) * kGradWords;
    for (int w = threadIdx.x; w < kGradWords; w += kThreads) {
      float sum = sums[w];
#pragma unroll
      for (int v = 1; v < kWarps; ++v) sum += sums[v * kGradWords + w];
      out[w] = sum;
    }
    if (item + 1 < end) {  // (channel block 1's first item: a column's first)
      __syncthreads();     // (the slots hold operands again)
      copy_unit(next_unit, 0);
      copy_unit(next_unit + 1, 1);
      __syncthreads();
      ring.refill(next_unit, load_unit);
      ring.refill(next_unit + 1, load_unit);
      next_unit += 2;
    }
  }
}

constexpr int kBatchLanes = 16;  // mean_gradient_kernel's threads a channel

// g[n, o] = grad_mean[n, o] / P * (1 / divisor) as max_pool3d_mean's backward forms it (grad_mean rounded to
// the operand type T first where the forward's mean was in T, a true division by P, then the divisor's
// reciprocal as PyTorch multiplies by a number), rounded to T, and 0 for O <= o < kChannels (the
// weight-gradient kernel's m16 operand); grad_bias[o] = (sum over n of g[n, o]) * P rounded to T, stored
// as B (the bias's dtype: T, or float32 where autocast's cast is the op's), and
// grad_channel_bias[o] = sum over n of grad_mean[n, o] in grad_mean's type, each sum over n by kBatchLanes
// strided partial sums added in lane order. grad_mean is read through its strides (autograd passes it
// expanded from the module's sum: a copy, PyTorch's division and its product would each load a module of
// PyTorch's at a process's first training step, 8-14 ms apiece on an H200).
template <typename grad_t, typename T, typename B>
__global__ void __launch_bounds__(kChannels * kBatchLanes)
    mean_gradient_kernel(const grad_t* __restrict__ grad_mean, int64_t batch, int O, int64_t batch_stride,
                         int64_t channel_stride, bool mean_in_operand_type, float windows, float reciprocal,
                         float* __restrict__ g, B* __restrict__ grad_bias, grad_t* __restrict__ grad_channel_bias) {
  using acc_t = at::opmath_type<grad_t>;
  __shared__ float partial[kBatchLanes][kChannels];
  __shared__ acc_t grad_partial[kBatchLanes][kChannels];
  const int o = threadIdx.x, lane = threadIdx.y;
  float sum = 0.f;
  acc_t grad_sum = 0;
  for (int64_t n = lane; n < batch; n += kBatchLanes) {
    float v = 0.f;
    if (o < O) {
      const grad_t grad = grad_mean[n * batch_stride + o * channel_stride];
      grad_sum += static_cast<acc_t>(grad);
      float value = static_cast<float>(grad);
      if (mean_in_operand_type) value = static_cast<float>(static_cast<T>(value));
      const float scaled = __fmul_rn(__fdiv_rn(value, windows), reciprocal);
      v = static_cast<float>(static_cast<T>(scaled));
    }
    g[n * kChannels + o] = v;
    sum += v;
  }
  partial[lane][o] = sum;
  grad_partial[lane][o] = grad_sum;
  __syncthreads();
  if (lane != 0 || o >= O) return;
  if (grad_bias != nullptr) {
    for (int l = 1; l < kBatchLanes; ++l) sum += partial[l][o];
    grad_bias[o] = static_cast<B>(static_cast<float>(static_cast<T>(__fmul_rn(sum, windows))));
  }
  if (grad_channel_bias != nullptr) {
    for (int l = 1; l < kBatchLanes; ++l) grad_sum += grad_partial[l][o];
    grad_channel_bias[o] = static_cast<grad_t>(grad_sum);
  }
}

// {g (N, kChannels) float32, grad_bias (O) in the weight's type, grad_channel_bias (O) in grad_mean's (each
// undefined where not asked for)} by mean_gradient_kernel.
std::tuple<at::Tensor, at::Tensor, at::Tensor> mean_gradient(const at::Tensor& grad_mean, const at::Tensor& weight,
                                                             at::ScalarType operand, const Conv3dPoolGeometry& geometry,
                                                             double divisor, std::optional<at::ScalarType> mean_dtype,
                                                             bool bias, bool channel_bias) {
  const int64_t batch = grad_mean.size(0);
  const int O = static_cast<int>(weight.size(0));
  const float windows = static_cast<float>(geometry.pooled[0] * geometry.pooled[1] * geometry.pooled[2]);
  at::Tensor g = at::empty({batch, kChannels}, grad_mean.options().dtype(at::kFloat));
  at::Tensor grad_bias = bias ? at::empty({O}, weight.options()) : at::Tensor();
  at::Tensor grad_channel_bias = channel_bias ? at::empty({O}, grad_mean.options()) : at::Tensor();
  const bool mean_in_operand_type = mean_dtype == operand;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  FUSED_OPS_DISPATCH_FLOATING_TYPES(grad_mean.scalar_type(), "conv3d_max_pool3d_mean_backward", [&] {
    using grad_t = scalar_t;
    FUSED_OPS_DISPATCH_FLOATING_TYPES(operand, "mean_gradient", [&] {
      auto launch = [&](auto* bias_type) {
        using B = std::remove_pointer_t<decltype(bias_type)>;
        mean_gradient_kernel<grad_t, scalar_t, B><<<1, dim3(kChannels, kBatchLanes), 0, stream>>>(
            grad_mean.const_data_ptr<grad_t>(), batch, O, grad_mean.stride(0), grad_mean.stride(1),
            mean_in_operand_type, windows, ReciprocalMultiply<float>(divisor).reciprocal, g.mutable_data_ptr<float>(),
            bias ? grad_bias.mutable_data_ptr<B>() : nullptr,
            channel_bias ? grad_channel_bias.mutable_data_ptr<grad_t>() : nullptr);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      with_weight_storage<scalar_t>(weight, launch);
    });
  });
  return {g, grad_bias, grad_channel_bias};
}

// grad_weight[o, c, tap] = sum over the kernel's blocks b of partial[c / kBlockChannels, b, (o, c % kBlockChannels,
// tap)] (sum_column: a fixed order, deterministic), rounded to the operand type T as autocast's cast of a 16-bit
// weight's gradient would, stored in the weight's type W: a block per (32 words, channel block), straight into the
// weight's layout (no copy by PyTorch after it).
template <typename T, typename W>
__global__ void __launch_bounds__(32 * kColumnSlices)
    weight_gradient_sum_kernel(const float* __restrict__ partial, int64_t blocks, int O, int C,
                               W* __restrict__ grad_weight) {
  const int word = blockIdx.x * 32 + threadIdx.x % 32;
  const int o = word / (kBlockChannels * kTaps), tap = word % kTaps;
  const int c = blockIdx.y * kBlockChannels + word / kTaps % kBlockChannels;
  const bool active = o < O && c < C;  // (o < O <= kChannels: word < kGradWords)
  const float sum = sum_column(partial + blockIdx.y * blocks * kGradWords + word, blocks, kGradWords, active);
  if (threadIdx.x < 32 && active) {
    grad_weight[(int64_t{o} * C + c) * kTaps + tap] = narrowed<W>(rounded_to<T>(sum));
  }
}

// grad_weight (O, C, 3, 3, 3) by the kernel from g (N, kChannels), rounded to the operand type and stored in the
// weight's, or an undefined tensor where it does not run.
at::Tensor weight_grad_by_kernel(const at::Tensor& g, const at::Tensor& indices, const at::Tensor& x,
                                 const at::Tensor& weight, at::ScalarType operand,
                                 const Conv3dPoolGeometry& geometry) {
  at::Tensor grad_weight;
  if (!kernel_takes(x, weight, geometry)) return grad_weight;
  with_weight_operation(operand, [&](auto mma) {  // (TF32, or the 16-bit type's m16n8k16)
    using Mma = decltype(mma);
    using T = typename Mma::Input;
    const auto kernel = conv3d_max_pool3d_mean_weight_grad_kernel<Mma>;
    const SharedLayout layout = shared_layout(kSlots * kSlotWords<Mma>, x, kUnitWords, kUnitStages);
    if (layout.stages < 2 || !runs_bulk_copy(kernel)) return;  // (an item may convert two units ahead)
    Params p{};
    p.grid = task_grid(x, weight, geometry);
    p.O = static_cast<int>(weight.size(0));
    p.stages = layout.stages;
    if (p.grid.tasks == 0) return;  // (an empty batch: PyTorch's ops)
    p.block_columns = p.grid.tasks / p.grid.PD;
    p.items = p.grid.channel_blocks * p.grid.tasks;  // (kernel_takes bounds the tasks far below INT_MAX / 2)
    p.column_pairs = at::cuda::detail::IntDivider<unsigned>(static_cast<unsigned>(p.grid.PD + 1));
    const at::Tensor picks = indices.contiguous();
    p.g = g.const_data_ptr<float>();
    p.picks = picks.const_data_ptr<uint8_t>();
    const int64_t blocks = std::min<int64_t>(p.items, resident_blocks(kernel, kThreads, layout.smem));
    at::Tensor partial = at::empty({p.grid.channel_blocks, blocks, kGradWords}, x.options());
    p.partial = partial.mutable_data_ptr<float>();
    const auto stream = c10::cuda::getCurrentCUDAStream();
    allow_dynamic_shared_memory(kernel, layout.smem);
    const CUtensorMap units = contiguous_tensor_map(x, {kBoxCols, kBoxRows, kUnitPlanes, kBlockChannels, 1});
    kernel<<<static_cast<unsigned>(blocks), kThreads, layout.smem, stream>>>(p, units);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    grad_weight = at::empty(weight.sizes(), weight.options());
    with_weight_storage<T>(weight, [&](auto* weight_type) {
      using W = std::remove_pointer_t<decltype(weight_type)>;
      weight_gradient_sum_kernel<T, W>
          <<<dim3((kGradWords + 31) / 32, static_cast<unsigned>(p.grid.channel_blocks)), 32 * kColumnSlices, 0,
             stream>>>(partial.const_data_ptr<float>(), blocks, p.O, static_cast<int>(weight.size(1)),
                       static_cast<W*>(grad_weight.mutable_data_ptr()));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return grad_weight;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> conv3d_max_pool3d_mean_backward_cuda(
    const at::Tensor& grad_mean, const at::Tensor& indices, const at::Tensor& x, const at::Tensor& weight,
    at::IntArrayRef padding, at::IntArrayRef pool, double divisor, std::array<bool, 4> output_mask,
    std::optional<at::ScalarType> mean_dtype, std::optional<at::ScalarType> operand_dtype) {
  const Conv3dPoolGeometry geometry =
      check_conv3d_max_pool3d_mean_backward(grad_mean, indices, x, weight, padding, pool, divisor, mean_dtype);
  const at::ScalarType operand = operand_type("conv3d_max_pool3d_mean_backward", weight, operand_dtype);
  const c10::cuda::CUDAGuard guard(x.device());
  if ((output_mask[1] || output_mask[2]) && kernel_takes(x, weight, geometry)) {
    const auto [g, grad_bias, grad_channel_bias] =
        mean_gradient(grad_mean, weight, operand, geometry, divisor, mean_dtype, output_mask[2], output_mask[3]);
    const at::Tensor grad_weight =
        output_mask[1] ? weight_grad_by_kernel(g, indices, x, weight, operand, geometry) : at::Tensor();
    if (!output_mask[1] || grad_weight.defined()) {
      const at::Tensor grad_x =
          output_mask[0] ? std::get<0>(conv3d_max_pool3d_mean_backward_composite(grad_mean, indices, x, weight,
                                                                                 geometry, divisor,
                                                                                 {true, false, false, false},
                                                                                 mean_dtype, operand))
                         : x.new_empty({0});
      return {grad_x, output_mask[1] ? grad_weight : x.new_empty({0}),
              output_mask[2] ? grad_bias : x.new_empty({0}),
              output_mask[3] ? grad_channel_bias : x.new_empty({0})};
    }
  }
  return conv3d_max_pool3d_mean_backward_composite(grad_mean, indices, x, weight, geometry, divisor, output_mask,
                                                   mean_dtype, operand);
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("conv3d_max_pool3d_mean_backward", &conv3d_max_pool3d_mean_backward_cuda);
}

}  // namespace fused_ops
