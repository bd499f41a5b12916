// Autograd of max_pool3d_cascade_sum, in C++ (was torch.library.register_autograd
// in fused_ops/ops/: ~10 us of Python host time per call, even under no_grad).
// Backward (the math: ../max_pool3d_cascade_sum.h): each output's gradient goes,
// per channel, to that channel's cascade pick,
//   grad_x[b, c, e] = sum of grad_out[b, 0, p] over the outputs p picking e for c,
// the picks read from the saved indices or recomputed from x.
// A backward that records a graph (create_graph=True) scatters grad_out to the picks'
// positions by scatter_add, which autograd differentiates (autograd_util.h).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "../max_pool3d_cascade_sum.h"
#include "autograd_util.h"

namespace fused_ops::autograd {
namespace {

std::tuple<at::Tensor, at::Tensor> call_max_pool3d_cascade_sum(
    const at::Tensor& x, at::IntArrayRef kernel1, at::IntArrayRef stride1, at::IntArrayRef padding1,
    at::IntArrayRef kernel2, at::IntArrayRef stride2, at::IntArrayRef padding2, bool save_indices,
    std::optional<at::ScalarType> dtype) {
  static const auto op = typed_op<decltype(call_max_pool3d_cascade_sum)>("fused_ops::max_pool3d_cascade_sum");
  return op.call(x, kernel1, stride1, padding1, kernel2, stride2, padding2, save_indices, dtype);
}

at::Tensor call_max_pool3d_cascade_sum_backward(const at::Tensor& grad_out, const std::optional<at::Tensor>& indices,
                                                const std::optional<at::Tensor>& x, c10::SymIntArrayRef input_size,
                                                at::IntArrayRef kernel1, at::IntArrayRef stride1,
                                                at::IntArrayRef padding1, at::IntArrayRef kernel2,
                                                at::IntArrayRef stride2, at::IntArrayRef padding2) {
  static const auto op =
      typed_op<decltype(call_max_pool3d_cascade_sum_backward)>("fused_ops::max_pool3d_cascade_sum_backward");
  return op.call(grad_out, indices, x, input_size, kernel1, stride1, padding1, kernel2, stride2, padding2);
}

// The keys of the two stages' pooling arguments in saved_data, in the schema's order.
constexpr const char* kPoolArgs[6] = {"kernel1", "stride1", "padding1", "kernel2", "stride2", "padding2"};

// Each channel's cascade pick for each output, (B, C, P) int64 positions in x's (D, H, W)
// plane (P outputs a plane, in order): from the forward's saved pick numbers by the CPU
// kernel's geometry (PickPositions), or where it saved x instead (no indices), PyTorch's own
// picks of its two max_pool3d stages (the same: max_pool3d.h's rule).
at::Tensor cascade_pick_positions(AutogradContext* ctx, const at::Tensor& indices, const at::Tensor& x,
                                  const std::vector<int64_t>& size) {
  std::vector<int64_t> pools[6];
  for (int i = 0; i < 6; ++i) pools[i] = ctx->saved_data[kPoolArgs[i]].toIntVector();
  const MaxPool3dCascade g = max_pool3d_cascade_geometry(
      "max_pool3d_cascade_sum_backward", size, {pools[0], pools[1], pools[2], pools[3], pools[4], pools[5]});
  if (!indices.defined()) {
    const at::NoGradGuard no_grad;
    auto stage = [](const at::Tensor& t, const MaxPool3dGeometry& s) {
      return at::max_pool3d_with_indices(t, {s.d.kernel, s.h.kernel, s.w.kernel}, {s.d.stride, s.h.stride, s.w.stride},
                                         {s.d.pad, s.h.pad, s.w.pad}, {1, 1, 1}, false);
    };
    const auto [first, first_picks] = stage(x, g.first);
    const at::Tensor second_picks = std::get<1>(stage(first, g.second));
    return first_picks.flatten(2).gather(2, second_picks.flatten(2));
  }
  const PickPositions where({&g.first, &g.second}, static_cast<int>(size[0]), static_cast<int>(size[1]),
                            static_cast<int>(size[2]));
  std::vector<int64_t> delta(g.pick_volume()), base(g.outputs());
  for (int64_t pick = 0; pick < g.pick_volume(); ++pick) delta[pick] = where.delta(pick);
  for (int64_t p = 0; p < g.outputs(); ++p) base[p] = where.position(p, 0) - delta[0];
  const auto on_device = at::TensorOptions().dtype(at::kLong).device(indices.device());
  const at::Tensor picks = indices.reshape({indices.size(0), indices.size(1), -1}).to(at::kLong);
  return at::tensor(base, at::kLong).to(on_device) + at::take(at::tensor(delta, at::kLong).to(on_device), picks);
}

// Differentiable in x (the indices output is not).
class MaxPool3dCascadeSumFunction : public torch::autograd::Function<MaxPool3dCascadeSumFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, at::IntArrayRef kernel1,
                               at::IntArrayRef stride1, at::IntArrayRef padding1, at::IntArrayRef kernel2,
                               at::IntArrayRef stride2, at::IntArrayRef padding2, bool save_indices,
                               std::optional<at::ScalarType> dtype) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, indices] =
        call_max_pool3d_cascade_sum(x, kernel1, stride1, padding1, kernel2, stride2, padding2, save_indices, dtype);
    mark_non_differentiable(ctx, {indices});
    save_input_dtype(ctx, x);
    save_input_format(ctx, x);
    ctx->saved_data["input_size"] = x.sym_sizes().slice(2);
    const at::IntArrayRef pools[6] = {kernel1, stride1, padding1, kernel2, stride2, padding2};
    for (int i = 0; i < 6; ++i) ctx->saved_data[kPoolArgs[i]] = pools[i];
    // The forward's picks, or x to recompute them from where it saved none.
    const bool saved = indices.dim() == 5;
    ctx->save_for_backward({saved ? indices : at::Tensor(), saved ? at::Tensor() : x});
    return {out, indices};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto grad_x = [ctx](const at::Tensor& grad_out) {
      const auto saved = ctx->get_saved_variables();
      std::vector<int64_t> pools[6];
      for (int i = 0; i < 6; ++i) pools[i] = ctx->saved_data[kPoolArgs[i]].toIntVector();
      const at::Tensor grad_x = call_max_pool3d_cascade_sum_backward(
          grad_out, defined_or_none(saved[0]), defined_or_none(saved[1]),
          ctx->saved_data["input_size"].toSymIntVector(), pools[0], pools[1], pools[2], pools[3], pools[4], pools[5]);
      return grad_in_input_format(ctx, grad_x);
    };
    // Recording a graph: grad_x scattered from grad_out to the picks' positions (the picks
    // fixed, linear in grad_out and constant in x) by scatter_add, which autograd differentiates.
    const auto recorded_grad_x = [ctx](const at::Tensor& grad_out) {
      const auto saved = ctx->get_saved_variables();
      const auto size = C10_AS_INTARRAYREF_SLOW(ctx->saved_data["input_size"].toSymIntVector()).vec();
      const at::Tensor positions = cascade_pick_positions(ctx, saved[0], saved[1], size);
      const int64_t batch = positions.size(0), channels = positions.size(1), outputs = positions.size(2);
      const at::Tensor grad_x =
          at::zeros({batch, channels, size[0] * size[1] * size[2]}, grad_out.options())
              .scatter_add(2, positions, grad_out.reshape({batch, 1, outputs}).expand({batch, channels, outputs}));
      return grad_in_input_format(ctx, grad_x.view({batch, channels, size[0], size[1], size[2]}));
    };
    return first_input_backward(ctx, grads, 9, grad_x, recorded_grad_x);
  }

};

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, Autograd, m) {
  m.impl("max_pool3d_cascade_sum",
         &AutogradKernel<MaxPool3dCascadeSumFunction, &call_max_pool3d_cascade_sum>::kernel);
}

}  // namespace fused_ops::autograd
