// wgmma (sm_90a) with both operands in shared memory by CuTe's instructions, for the kernels of our
// own that issue it directly (shifted_rows_weight_grad.cuh, transposed_cascade_sum.cuh): both
// operands K-major, swizzled as a TMA box of rows of 32 elements writes them (128 bytes of TF32,
// 64 of bfloat16), f32 accumulators.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "bulk_copy.cuh"
#include "cute/arch/mma_sm90_desc.hpp"
#include "cute/arch/mma_sm90_gmma.hpp"
#include "cute/arch/mma_sm90_gmma_ext.hpp"

namespace fused_ops {

// wgmma's m64 nN k8 TF32 instruction, both operands K-major in shared memory, f32 accumulators.
template <int N>
struct Tf32Wgmma;
template <>
struct Tf32Wgmma<64> : cute::SM90::GMMA::MMA_64x64x8_F32TF32TF32_SS_TN<> {};
template <>
struct Tf32Wgmma<96> : cute::SM90::GMMA::MMA_64x96x8_F32TF32TF32_SS_TN<> {};
template <>
struct Tf32Wgmma<128> : cute::SM90::GMMA::MMA_64x128x8_F32TF32TF32_SS_TN<> {};
template <>
struct Tf32Wgmma<160> : cute::SM90::GMMA::MMA_64x160x8_F32TF32TF32_SS_TN<> {};
template <>
struct Tf32Wgmma<192> : cute::SM90::GMMA::MMA_64x192x8_F32TF32TF32_SS_TN<> {};
template <>
struct Tf32Wgmma<256> : cute::SM90::GMMA::MMA_64x256x8_F32TF32TF32_SS_TN<> {};

// wgmma's m64 nN k16 bfloat16 instruction, both operands K-major in shared memory, f32 accumulators.
template <int N>
struct Bf16Wgmma;
template <>
struct Bf16Wgmma<96>
    : cute::SM90::GMMA::MMA_64x96x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K> {};
template <>
struct Bf16Wgmma<128>
    : cute::SM90::GMMA::MMA_64x128x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K> {};

// acc += A B^T by one wgmma of element type T (float: TF32, k8; bfloat16: k16): the descriptors'
// tiles, acc the instruction's N / 2 accumulators.
template <typename T, int N, size_t... I>
__device__ __forceinline__ void wgmma_ss(uint64_t a, uint64_t b, float* acc, std::index_sequence<I...>) {
  std::conditional_t<std::is_same_v<T, float>, Tf32Wgmma<N>, Bf16Wgmma<N>>::fma(a, b, acc[I]...);
}

// The descriptor of a K-major tile in shared memory at `tile`: rows of kRowBytes (128, 64 or 32),
// swizzled across them (as a TMA box of such rows writes it into memory aligned to 8 rows), 8-row
// groups 8 kRowBytes apart. The tile may start at any row of such a box, its base offset left 0:
// wgmma swizzles by the address, as TMA does (an H200 gave exact products at row offsets 0 to 8 so
// with 128-byte rows, wrong ones with the base offset set to the row; transposed_cascade_sum.cuh's
// taps rely on it). Adding b / 16 moves it b bytes along K (32 per instruction) or along the rows.
template <int kRowBytes = 128>
__device__ __forceinline__ uint64_t swizzled_tile_descriptor(const void* tile) {
  static_assert(kRowBytes == 128 || kRowBytes == 64 || kRowBytes == 32);
  cute::GmmaDescriptor d;
  d.bitfield.start_address_ = static_cast<uint16_t>(shared_address(tile) >> 4);
  d.bitfield.leading_byte_offset_ = 1;  // (unused by swizzled K-major layouts)
  d.bitfield.stride_byte_offset_ = (8 * kRowBytes) >> 4;
  d.bitfield.base_offset_ = 0;
  d.bitfield.layout_type_ = kRowBytes == 128 ? 1 : kRowBytes == 64 ? 2 : 3;  // SWIZZLE_128B, _64B, _32B
  return d.desc_;
}

}  // namespace fused_ops
