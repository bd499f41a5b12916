// The memory format the CPU kernels read in vectors over channels and write
// gradients in, as batch_norm_gap's CUDA kernels do too (host only).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace fused_ops {

// The layout the CPU kernels vectorize over channels: channels_last_3d and
// not also plainly contiguous (then the plain layout is taken).
inline bool is_channels_last_3d(const at::Tensor& t) {
  return t.dim() == 5 && !t.is_contiguous() && t.is_contiguous(at::MemoryFormat::ChannelsLast3d);
}

// The memory format a CPU kernel writes a gradient of `like`'s shape in (and
// lays out a max-pool's picks in): channels_last_3d for such a tensor, as
// PyTorch's max_pool3d backward returns its input's format; else contiguous.
inline at::MemoryFormat grad_memory_format(const at::Tensor& like) {
  return is_channels_last_3d(like) ? at::MemoryFormat::ChannelsLast3d : at::MemoryFormat::Contiguous;
}

// A max-pool backward's layout of its picks and grad_x: the forward's saved
// picks' (laid out as its x), else that of x, which they are recomputed from.
inline at::MemoryFormat picks_memory_format(const std::optional<at::Tensor>& indices,
                                            const std::optional<at::Tensor>& x) {
  if (indices.has_value() && indices->defined()) return grad_memory_format(*indices);
  if (x.has_value() && x->defined()) return grad_memory_format(*x);
  return at::MemoryFormat::Contiguous;
}

}  // namespace fused_ops
