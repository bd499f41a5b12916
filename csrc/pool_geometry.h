// Pooling-window geometry shared by every op and by the CPU and CUDA kernels.
//
// One pooled dimension of length `out` over an input of length `in`: window o
// covers input positions [o*stride - pad, o*stride - pad + kernel), the part
// outside [0, in) being padding. This is PyTorch's geometry (dilation 1).
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <array>
#include <cstdint>

namespace fused_ops {

struct PoolDim {
  int in = 0;
  int out = 0;
  int kernel = 1;
  int stride = 1;
  int pad = 0;

  // First input position of window o, before clipping (may be negative).
  C10_HOST_DEVICE int origin(int o) const { return o * stride - pad; }
  // Window o clipped to the input: [begin, end).
  C10_HOST_DEVICE int begin(int o) const {
    const int s = origin(o);
    return s < 0 ? 0 : s;
  }
  C10_HOST_DEVICE int end(int o) const {
    const int e = origin(o) + kernel;
    return e < in ? e : in;
  }
  // Window o's length counting the padding, as avg-pool's count_include_pad
  // counts it: clipped at in + pad (only a ceil_mode window reaches past it).
  C10_HOST_DEVICE int padded_length(int o) const {
    const int e = origin(o) + kernel;
    return (e < in + pad ? e : in + pad) - origin(o);
  }
  // Every window lies wholly inside the input (no padding, no ceil_mode overhang).
  C10_HOST_DEVICE bool windows_inside() const {
    return pad == 0 && origin(out - 1) + kernel <= in;
  }
  // The windows that contain input position i: [first_window, last_window).
  // o*stride - pad <= i < o*stride - pad + kernel, with 0 <= o < out.
  C10_HOST_DEVICE int first_window(int i) const {
    const int t = i + pad - kernel;
    return t < 0 ? 0 : t / stride + 1;
  }
  C10_HOST_DEVICE int last_window(int i) const {
    const int t = (i + pad) / stride + 1;
    return t < out ? t : out;
  }
};

// PyTorch's pooling_output_shape (dilation 1): in ceil_mode the last window
// must start inside the input or its left padding.
inline int64_t pooled_size(int64_t in, int64_t kernel, int64_t stride,
                           int64_t pad, bool ceil_mode) {
  const int64_t span = in + 2 * pad - kernel + (ceil_mode ? stride - 1 : 0);
  // floor division (span may be negative when the kernel is too large)
  int64_t out = (span >= 0 ? span / stride : -((-span + stride - 1) / stride)) + 1;
  if (ceil_mode && out > 0 && (out - 1) * stride >= in + pad) {
    --out;
  }
  return out;
}

// Validates one pooled dimension the way nn.*Pool*d does and returns it.
// `what` names the op and `dim` the dimension in messages.
inline PoolDim make_pool_dim(const char* what, const char* dim, int64_t in,
                             int64_t kernel, int64_t stride, int64_t pad,
                             bool ceil_mode) {
  TORCH_CHECK_VALUE(kernel > 0, what, ": kernel_size must be positive, got ",
                    kernel, " for ", dim);
  TORCH_CHECK_VALUE(stride > 0, what, ": stride must be positive, got ",
                    stride, " for ", dim);
  TORCH_CHECK_VALUE(pad >= 0, what, ": padding must be non-negative, got ",
                    pad, " for ", dim);
  TORCH_CHECK_VALUE(2 * pad <= kernel, what,
                    ": padding should be at most half of the kernel size, got padding ",
                    pad, " and kernel_size ", kernel, " for ", dim);
  TORCH_CHECK_VALUE(in < (int64_t{1} << 30) && kernel < (int64_t{1} << 30) &&
                        stride < (int64_t{1} << 30),
                    what, ": ", dim, " sizes of 2^30 or more are not supported");
  const int64_t out = pooled_size(in, kernel, stride, pad, ceil_mode);
  TORCH_CHECK_VALUE(out >= 1, what, ": input ", dim, " size ", in,
                    " is smaller than the kernel (kernel_size ", kernel,
                    ", padding ", pad, "): the output would be empty");
  return PoolDim{static_cast<int>(in), static_cast<int>(out),
                 static_cast<int>(kernel), static_cast<int>(stride),
                 static_cast<int>(pad)};
}

// Expands a 1- or n-element int list (PyTorch's `int[n]` convention).
template <size_t N>
inline std::array<int64_t, N> expand_param(const char* what, const char* name,
                                           c10::IntArrayRef v) {
  TORCH_CHECK_VALUE(v.size() == 1 || v.size() == N, what, ": ", name,
                    " must have 1 or ", N, " elements, got ", v.size());
  std::array<int64_t, N> r{};
  for (size_t i = 0; i < N; ++i) r[i] = v[v.size() == 1 ? 0 : i];
  return r;
}

}  // namespace fused_ops
