// Loads the drop-in modules scripted and saved by Python (tests/test_onnx_torchscript.py,
// write_scripted_modules) into a libtorch program with the fused_ops library loaded, as a C++
// application deploys them, and checks each one's output against the original's, written beside it.
//   fused_ops_load_scripted path/to/libfused_ops.so DIR
// DIR/modules.txt lists the names; DIR/<name>.pt is the scripted module, DIR/<name>.tensors.pt a
// scripted module whose buffers are the input x and the original's output `expected` (float64).
#include <torch/script.h>
#include <dlfcn.h>

#include <cstdio>
#include <fstream>
#include <string>

int main(int argc, char** argv) {
  if (argc != 3 || dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL) == nullptr) {
    std::fprintf(stderr, "usage: %s libfused_ops.so DIR (%s)\n", argv[0], argc == 3 ? dlerror() : "");
    return 2;
  }
  const std::string dir = argv[2];
  std::ifstream names(dir + "/modules.txt");
  int checked = 0, failed = 0;
  for (std::string name; names >> name; ++checked) {
    auto module = torch::jit::load(dir + "/" + name + ".pt");
    module.eval();
    const auto tensors = torch::jit::load(dir + "/" + name + ".tensors.pt");
    const auto x = tensors.attr("x").toTensor();
    const auto expected = tensors.attr("expected").toTensor();
    torch::NoGradGuard no_grad;
    const auto out = module.forward({x}).toTensor();
    const bool same_shape = out.sizes() == expected.sizes();
    const double error = same_shape ? ((out - expected).abs().max() / expected.abs().max()).item<double>() : -1.0;
    const bool ok = same_shape && error <= 1e-12;
    failed += !ok;
    std::printf("%s: batch %lld, relative error %.3g %s\n", name.c_str(), static_cast<long long>(x.size(0)), error,
                ok ? "ok" : "FAILED");
  }
  if (checked == 0) {
    std::fprintf(stderr, "no modules listed in %s/modules.txt\n", dir.c_str());
    return 1;
  }
  return failed == 0 ? 0 : 1;
}
