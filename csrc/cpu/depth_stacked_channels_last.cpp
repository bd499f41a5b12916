// CPU kernel of depth_stacked_channels_last (the math:
// ../depth_stacked_channels_last.h): x read in place at its strides, out
// written in order, parallel over its (n, m, h) rows.
#include <ATen/Parallel.h>
#include <c10/util/TypeCast.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "../depth_stacked_channels_last.h"
#include "../dispatch.h"

namespace fused_ops {
namespace {

at::Tensor depth_stacked_channels_last_cpu(const at::Tensor& x, int64_t taps, int64_t stride,
                                           at::IntArrayRef start, at::IntArrayRef size,
                                           std::optional<at::ScalarType> dtype) {
  const auto args = depth_stack_setup(x, taps, stride, start, size, dtype);
  const DepthStack& s = args.stack;
  const at::Tensor& out = args.out;
  if (out.numel() == 0) return args.out;
  const int64_t M = s.size[0], Hs = s.size[1], Ws = s.size[2], I = s.channels;
  const int64_t row_elements = Ws * s.rows();
  const int64_t sn = x.stride(0), si = x.stride(1), sd = x.stride(2), sh = x.stride(3), sw = x.stride(4);
  FUSED_OPS_DISPATCH_FLOATING_TYPES(x.scalar_type(), "depth_stacked_channels_last_cpu", [&] {
    using in_t = scalar_t;
    const in_t* xp = x.const_data_ptr<in_t>();
    FUSED_OPS_DISPATCH_FLOATING_TYPES(out.scalar_type(), "depth_stacked_channels_last_cpu", [&] {
      using out_t = scalar_t;
      out_t* const op = out.mutable_data_ptr<out_t>();
      at::parallel_for(0, s.batch * M * Hs, 1, [&](int64_t begin, int64_t end) {
        for (int64_t row = begin; row < end; ++row) {  // row = (n * M + m) * Hs + h
          const int64_t h = row % Hs, m = row / Hs % M, n = row / Hs / M;
          const int64_t hh = s.start[1] + h, d0 = s.start[0] + s.stride * m;
          out_t* dst = op + row * row_elements;
          for (int64_t w = 0; w < Ws; ++w) {
            const int64_t ww = s.start[2] + w;
            for (int64_t a = 0; a < taps; ++a, dst += I) {
              const int64_t d = d0 + a;
              if (!(index_inside(d, s.input[0]) && index_inside(hh, s.input[1]) && index_inside(ww, s.input[2]))) {
                std::fill(dst, dst + I, out_t(0));
                continue;
              }
              const in_t* src = xp + n * sn + d * sd + hh * sh + ww * sw;
              for (int64_t i = 0; i < I; ++i) dst[i] = c10::convert<out_t>(src[i * si]);
            }
          }
        }
      });
    });
  });
  return args.out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("depth_stacked_channels_last", &depth_stacked_channels_last_cpu);
}

}  // namespace fused_ops
