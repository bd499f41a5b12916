// Every op schema of the library, declared once. Kernels register themselves
// per backend beside their sources: cpu/<op>.cpp, cuda/<op>.cu.
#include <torch/library.h>

TORCH_LIBRARY(fused_ops, m) {
  // sum over (C, OH, OW) of sigmoid(avg_pool2d(x)) -> (B,); with
  // save_grad_factor, also sigmoid'(p) / divisor per pooled element (for the
  // backward), else an empty tensor.
  m.def(
      "avg_pool2d_sigmoid_sum(Tensor x, int[2] kernel_size, int[2] stride, int[2] padding, "
      "bool ceil_mode, bool count_include_pad, int? divisor_override, "
      "bool save_grad_factor) -> (Tensor, Tensor)");
  m.def(
      "avg_pool2d_sigmoid_sum_backward(Tensor grad_out, Tensor grad_factor, SymInt[2] input_hw, "
      "int[2] kernel_size, int[2] stride, int[2] padding, bool channels_last) -> Tensor");

  // mean over (D', H', W') of max_pool3d(x / divisor) -> (B, C); with
  // save_indices, also each window's pick as a uint8 offset in scan order
  // (B, C, D', H', W'), else an empty tensor. An empty stride means kernel_size.
  m.def(
      "max_pool3d_mean(Tensor x, int[3] kernel_size, int[3] stride, int[3] padding, "
      "bool ceil_mode, float divisor, bool save_indices) -> (Tensor, Tensor)");
  // grad_x (B, C, *input_size), contiguous, from the forward's saved indices
  // or, given x instead, from picks recomputed from x.
  m.def(
      "max_pool3d_mean_backward(Tensor grad_mean, Tensor? indices, Tensor? x, "
      "SymInt[3] input_size, int[3] kernel_size, int[3] stride, int[3] padding, "
      "bool ceil_mode, float divisor) -> Tensor");

  // sum over channels, keepdim, of max_pool3d_2(max_pool3d_1(x)) -> (B, 1, D'', H'', W''):
  // two stages of nn.MaxPool3d (dilation 1, ceil_mode False; an empty stride
  // means the kernel size). With save_indices, also each output's pick per
  // channel as a uint8 (stage-2 scan offset * stage-1 kernel volume + stage-1
  // scan offset) (B, C, D'', H'', W''), else an empty tensor.
  m.def(
      "max_pool3d_cascade_sum(Tensor x, int[3] kernel1, int[3] stride1, int[3] padding1, "
      "int[3] kernel2, int[3] stride2, int[3] padding2, bool save_indices) -> (Tensor, Tensor)");
  // grad_x (B, C, *input_size), contiguous, from the forward's saved indices
  // or, given x instead, from picks recomputed from x.
  m.def(
      "max_pool3d_cascade_sum_backward(Tensor grad_out, Tensor? indices, Tensor? x, "
      "SymInt[3] input_size, int[3] kernel1, int[3] stride1, int[3] padding1, int[3] kernel2, "
      "int[3] stride2, int[3] padding2) -> Tensor");
}
