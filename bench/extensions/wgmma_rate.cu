// How fast wgmma runs at small N (issue 46, A's kernel: its m64n16k8 TF32 instructions ran the tensor pipe at 29 %
// of its elapsed cycles): each CTA (one an SM) runs `warpgroups` warp groups, each `batches` batches of kAcc
// independent TF32 m64nNk8 instructions, A from registers (RS, as A's kernel), B from shared memory (nonzero:
// never time zeros), at most two batches in flight (wait<1> before each next batch, as A's consumers run). Each
// CTA's thread 0 writes the clock64 cycles from its first batch to its last wait; the bench divides by the
// instructions.
#ifndef NDEBUG
#define NDEBUG  // before any header (csrc/cuda/cutlass_conv.cuh says why)
#endif

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cstdint>
#include <utility>

#include "conv3d_wgmma_pool.cuh"  // (interleaved_tile_descriptor; CuTe's wgmma, bulk_copy.cuh before it)
#include "cute/arch/mma_sm90_gmma_ext.hpp"

namespace {

template <int N>
struct Tf32Rs;
template <>
struct Tf32Rs<16> : cute::SM90::GMMA::MMA_64x16x8_F32TF32TF32_RS_TN<> {};
template <>
struct Tf32Rs<32> : cute::SM90::GMMA::MMA_64x32x8_F32TF32TF32_RS_TN<> {};
template <>
struct Tf32Rs<48> : cute::SM90::GMMA::MMA_64x48x8_F32TF32TF32_RS_TN<> {};
template <>
struct Tf32Rs<64> : cute::SM90::GMMA::MMA_64x64x8_F32TF32TF32_RS_TN<> {};

template <int N, size_t... I>
__device__ __forceinline__ void mma(const uint32_t (&a)[4], uint64_t b, float (&d)[N / 2], std::index_sequence<I...>) {
  Tf32Rs<N>::fma(a[0], a[1], a[2], a[3], b, d[I]...);
}

template <int N, int kAcc>
__global__ void __launch_bounds__(256, 1) wgmma_rate_kernel(int batches, int64_t* cycles, float* sink) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem[];
  for (int i = threadIdx.x; i < N * 8; i += blockDim.x) reinterpret_cast<float*>(smem)[i] = 1.f / (1 + i % 7);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  // B: N rows x 8 TF32 (two 16-byte K chunks), K-major without swizzle: the 8-row groups 128 bytes apart, the K
  // chunks N x 16 bytes apart
  const uint64_t b = fused_ops::wgmma_conv3d::interleaved_tile_descriptor(smem, N * 16, 128);
  const float a0 = 1.f + 1e-3f * threadIdx.x;
  const uint32_t a[4] = {__float_as_uint(a0), __float_as_uint(-a0), __float_as_uint(a0 * 0.5f),
                         __float_as_uint(a0 * 0.25f)};
  float acc[kAcc][N / 2];
#pragma unroll
  for (int i = 0; i < kAcc; ++i)
#pragma unroll
    for (int e = 0; e < N / 2; ++e) acc[i][e] = 0.f;
  __syncthreads();
  const int64_t start = clock64();
  for (int batch = 0; batch < batches; ++batch) {
#pragma unroll
    for (int i = 0; i < kAcc; ++i)
#pragma unroll
      for (int e = 0; e < N / 2; ++e) cute::warpgroup_fence_operand(acc[i][e]);
    cute::warpgroup_arrive();
#pragma unroll
    for (int i = 0; i < kAcc; ++i) mma<N>(a, b, acc[i], std::make_index_sequence<N / 2>{});
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<1>();
  }
  cute::warpgroup_wait<0>();
#pragma unroll
  for (int i = 0; i < kAcc; ++i)
#pragma unroll
    for (int e = 0; e < N / 2; ++e) cute::warpgroup_fence_operand(acc[i][e]);
  __syncthreads();
  if (threadIdx.x == 0) cycles[blockIdx.x] = clock64() - start;
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kAcc; ++i)
#pragma unroll
    for (int e = 0; e < N / 2; ++e) total += acc[i][e];
  if (total == 1234.5f) sink[0] = total;  // (never for these operands; keeps the instructions)
#else
  __trap();
#endif
}

template <int N, int kAcc>
void launch(int64_t warpgroups, int64_t batches, at::Tensor& cycles, at::Tensor& sink) {
  wgmma_rate_kernel<N, kAcc><<<static_cast<unsigned>(cycles.size(0)), static_cast<unsigned>(128 * warpgroups),
                               N * 32, c10::cuda::getCurrentCUDAStream()>>>(static_cast<int>(batches),
                                                                            cycles.mutable_data_ptr<int64_t>(),
                                                                            sink.mutable_data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// cycles (ctas,) int64: each CTA's clock64 cycles over its batches.
void wgmma_rate(int64_t n, int64_t accumulators, int64_t warpgroups, int64_t batches, at::Tensor cycles,
                at::Tensor sink) {
  TORCH_CHECK(warpgroups == 1 || warpgroups == 2, "wgmma_rate: 1 or 2 warp groups");
  // (at most 128 accumulator floats a thread: A's kernel holds 64)
  const auto with_acc = [&](auto n_tag) {
    constexpr int kN = decltype(n_tag)::value;
    if constexpr (kN * 4 <= 128) {
      if (accumulators == 8) return launch<kN, 8>(warpgroups, batches, cycles, sink);
    }
    if (accumulators == 4) return launch<kN, 4>(warpgroups, batches, cycles, sink);
    if (accumulators == 2) return launch<kN, 2>(warpgroups, batches, cycles, sink);
    TORCH_CHECK(false, "wgmma_rate: 2, 4 or (n <= 32) 8 accumulators");
  };
  if (n == 16) return with_acc(std::integral_constant<int, 16>{});
  if (n == 32) return with_acc(std::integral_constant<int, 32>{});
  if (n == 48) return with_acc(std::integral_constant<int, 48>{});
  if (n == 64) return with_acc(std::integral_constant<int, 64>{});
  TORCH_CHECK(false, "wgmma_rate: n of 16, 32, 48 or 64");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("wgmma_rate", &wgmma_rate); }
