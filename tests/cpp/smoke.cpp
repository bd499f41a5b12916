// Loads the fused_ops library the way torch.ops.load_library does (dlopen),
// calls each op through the dispatcher and checks it against ATen.
//   fused_ops_smoke path/to/libfused_ops.so
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/SymIntArrayRef.h>
#include <torch/csrc/autograd/autograd.h>
#include <dlfcn.h>

#include <cstdio>
#include <optional>
#include <tuple>

int main(int argc, char** argv) {
  if (argc != 2 || dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL) == nullptr) {
    std::fprintf(stderr, "usage: %s libfused_ops.so (%s)\n", argv[0], dlerror());
    return 2;
  }
  const auto forward =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fused_ops::avg_pool2d_sigmoid_sum", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, at::IntArrayRef,
                                                    at::IntArrayRef, at::IntArrayRef, bool,
                                                    bool, std::optional<int64_t>, bool,
                                                    std::optional<at::ScalarType>)>();
  const auto backward =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fused_ops::avg_pool2d_sigmoid_sum_backward", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, c10::SymIntArrayRef,
                            at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, bool,
                            std::optional<int64_t>, bool)>();

  at::manual_seed(0);
  const auto x = at::rand({3, 5, 17, 19}, at::kDouble).requires_grad_();
  auto [out, sigmoid] = forward.call(x, {3, 3}, {2, 2}, {1, 1}, true, false, std::nullopt, true, std::nullopt);
  const auto ref = at::sigmoid(at::avg_pool2d(x, {3, 3}, {2, 2}, {1, 1}, true, false)).sum({1, 2, 3});
  const auto grad_out = at::rand({3}, at::kDouble);
  const auto grad_x = backward.call(grad_out, sigmoid, c10::fromIntArrayRefSlow({17, 19}),
                                    {3, 3}, {2, 2}, {1, 1}, false, std::nullopt, false);
  const auto grad_ref = torch::autograd::grad({ref}, {x}, {grad_out})[0];
  const double err_out = (out - ref).abs().max().item<double>();
  const double err_grad = (grad_x - grad_ref).abs().max().item<double>();
  std::printf("avg_pool2d_sigmoid_sum: forward error %.3g, backward error %.3g\n", err_out, err_grad);

  const auto max_pool3d_mean =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fused_ops::max_pool3d_mean", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, at::IntArrayRef,
                                                    at::IntArrayRef, at::IntArrayRef, bool,
                                                    double, bool, std::optional<at::ScalarType>)>();
  const auto x5 = at::rand({2, 3, 5, 7, 6}, at::kDouble);
  const auto mean =
      std::get<0>(max_pool3d_mean.call(x5, {2, 3, 2}, {2, 2, 1}, {1, 1, 0}, true, -2.0, false, std::nullopt));
  const auto mean_ref = at::max_pool3d(x5 / -2.0, {2, 3, 2}, {2, 2, 1}, {1, 1, 0}, 1, true).mean({2, 3, 4});
  const double err_mean = (mean - mean_ref).abs().max().item<double>();
  std::printf("max_pool3d_mean: forward error %.3g\n", err_mean);

  const auto cascade_sum =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fused_ops::max_pool3d_cascade_sum", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, at::IntArrayRef,
                                                    at::IntArrayRef, at::IntArrayRef,
                                                    at::IntArrayRef, at::IntArrayRef,
                                                    at::IntArrayRef, bool, std::optional<at::ScalarType>)>();
  const auto x6 = at::rand({2, 5, 13, 12, 14}, at::kDouble);
  const auto sum = std::get<0>(cascade_sum.call(x6, {2, 2, 2}, {2, 2, 2}, {0, 0, 0}, {3, 3, 3},
                                                {3, 3, 3}, {0, 0, 0}, false, std::nullopt));
  const auto sum_ref = at::max_pool3d(at::max_pool3d(x6, {2, 2, 2}), {3, 3, 3}).sum(1, true);
  const double err_sum = (sum - sum_ref).abs().max().item<double>();
  std::printf("max_pool3d_cascade_sum: forward error %.3g\n", err_sum);
  return err_out < 1e-12 && err_grad < 1e-12 && err_mean < 1e-12 && err_sum < 1e-12 ? 0 : 1;
}
