// Variants of conv_transpose3d_stride1_channels_last's CUTLASS Hopper fprop (csrc/cuda/
// conv_transpose3d_stride1_fprop.cuh) for bench/bench_conv_transpose3d_stride1_variants.py, which builds
// this file as a torch extension of its own (not part of fused_ops): the op's tiles, each with clusters of
// 1, 2 and 4 CTAs along M (the filter's tile, the same for every CTA where the output channels are one
// tile, loaded once a cluster by TMA multicast), and clusters of 2 with tile K doubled; TF32 and bf16.
// SPEC's D: GEMM M = 414,720 output positions, N = 128 channels (one tile), K = 125 taps x 64 channels;
// each CTA reads its whole K of both operands from L2 (8 MB a tile in TF32, 26 GB in all), the filter's
// half of it what a cluster shares.
#ifndef NDEBUG
#define NDEBUG  // before any header (csrc/cuda/cutlass_conv.cuh says why)
#endif

#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

#include "conv_transpose3d_stride1_fprop.cuh"

namespace fused_ops {
namespace {

template <int kClusterM, int kTileK = 32>
using Tf32 = CutlassConv<Operator::kFprop, 3, float, float, 128, 128, kTileK, /*kBias=*/true, kClusterM>;
template <int kClusterM, int kTileK = 64>
using Bf16 = CutlassConv<Operator::kFprop, 3, cutlass::bfloat16_t, cutlass::bfloat16_t, 128, 128, kTileK, true,
                         kClusterM>;
// (the op's first in each dtype; then its tile K doubled: half the barriers a K, fewer stages)
using Variants =
    std::tuple<Tf32<1>, Tf32<2>, Tf32<4>, Tf32<2, 64>, Bf16<1>, Bf16<2>, Bf16<4>, Bf16<2, 128>>;

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

}  // namespace
}  // namespace fused_ops

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("names", &fused_ops::names, "the variants' names, in order");
  m.def("run", &fused_ops::run, "y by a variant (None where it does not take the call)");
}
