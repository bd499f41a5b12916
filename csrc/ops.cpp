// Every op schema of the library, declared once. Kernels register themselves
// per backend beside their sources: cpu/<op>.cpp, cuda/<op>.cu; the forwards'
// autocast kernels in autocast/autocast.cpp.
//
// Each forward takes the dtype of its result last, as torch.sum does: None
// for the input's, or the input's accumulation type (float32 for a float16 or
// bfloat16 input, which the kernels write unrounded); the other outputs
// (saved picks, factors, statistics) keep their own dtypes.
// depth_stacked_channels_last, a copy, takes any floating dtype.
#include <torch/library.h>

TORCH_LIBRARY(fused_ops, m) {
  // sum over (C, OH, OW) of sigmoid(avg_pool2d(x)) -> (B,); with save_sigmoid,
  // also each pooled element's sigmoid (for the backward), else an empty tensor.
  m.def(
      "avg_pool2d_sigmoid_sum(Tensor x, int[2] kernel_size, int[2] stride, int[2] padding, "
      "bool ceil_mode, bool count_include_pad, int? divisor_override, "
      "bool save_sigmoid, ScalarType? dtype=None) -> (Tensor, Tensor)");
  m.def(
      "avg_pool2d_sigmoid_sum_backward(Tensor grad_out, Tensor sigmoid, SymInt[2] input_hw, "
      "int[2] kernel_size, int[2] stride, int[2] padding, bool count_include_pad, int? divisor_override, "
      "bool channels_last) -> Tensor");

  // sum over (O, OH, OW) of sigmoid(conv2d(x, weight, bias, stride, padding)) -> (B,):
  // the convolution and its tail in one kernel on a GPU (conv2d_sigmoid_sum.h). With
  // save_grad_factor, also sigmoid'(y) per output in the layout conv2d_sigmoid_sum.h
  // gives (N, OH, ceil(OW / 48), ceil(O / 64), 3072), else an empty tensor.
  m.def(
      "conv2d_sigmoid_sum(Tensor x, Tensor weight, Tensor? bias, int[2] stride, int[2] padding, "
      "bool save_grad_factor, ScalarType? dtype=None) -> (Tensor, Tensor)");
  // grad_x (x's shape and dtype), grad_weight, grad_bias (the weight's dtype) from the
  // forward's factor, each where output_mask asks for it, else an empty tensor.
  m.def(
      "conv2d_sigmoid_sum_backward(Tensor grad_out, Tensor grad_factor, Tensor x, Tensor weight, "
      "int[2] stride, int[2] padding, bool[3] output_mask) -> (Tensor, Tensor, Tensor)");

  // mean over (D', H', W') of max_pool3d(conv3d(x, weight, bias, 1, padding) / divisor,
  // kernel = stride = pool) -> (B, O): the convolution and its tail in one kernel on a GPU
  // (conv3d_max_pool3d_mean.h); with channel_bias (O), that added to it, and with
  // sum_channels, the sum over O -> (B). With save_indices, also each window's pick as
  // max_pool3d_mean saves it (uint8, (B, O, D', H', W')), else an empty tensor. With
  // operand_dtype (16-bit, a float32 weight and bias: autocast's), x, the weight and the bias
  // are rounded to it as they are read.
  m.def(
      "conv3d_max_pool3d_mean(Tensor x, Tensor weight, Tensor? bias, int[3] padding, int[3] pool, "
      "float divisor, bool save_indices, ScalarType? dtype=None, Tensor? channel_bias=None, "
      "bool sum_channels=False, ScalarType? operand_dtype=None) -> (Tensor, Tensor)");
  // grad_x (x's shape and dtype), grad_weight, grad_bias (the weight's dtype) from the
  // forward's picks, and grad_channel_bias (grad_mean's dtype), each where output_mask asks
  // for it, else an empty tensor. grad_mean (B, O), of any strides, is rounded to
  // mean_dtype (the forward's mean's, before its channel bias) first; operand_dtype the forward's
  // (the weight's and bias's gradients rounded to it, stored in the weight's dtype).
  m.def(
      "conv3d_max_pool3d_mean_backward(Tensor grad_mean, Tensor indices, Tensor x, Tensor weight, "
      "int[3] padding, int[3] pool, float divisor, bool[4] output_mask, ScalarType? mean_dtype=None, "
      "ScalarType? operand_dtype=None) -> (Tensor, Tensor, Tensor, Tensor)");

  // mean over (D', H', W') of max_pool3d(x / divisor) -> (B, C); with
  // save_indices, also each window's pick as a uint8 offset in scan order
  // (B, C, D', H', W'), else an empty tensor. An empty stride means kernel_size.
  m.def(
      "max_pool3d_mean(Tensor x, int[3] kernel_size, int[3] stride, int[3] padding, "
      "bool ceil_mode, float divisor, bool save_indices, ScalarType? dtype=None) -> (Tensor, Tensor)");
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
      "int[3] kernel2, int[3] stride2, int[3] padding2, bool save_indices, ScalarType? dtype=None) "
      "-> (Tensor, Tensor)");
  // grad_x (B, C, *input_size), contiguous, from the forward's saved indices
  // or, given x instead, from picks recomputed from x.
  m.def(
      "max_pool3d_cascade_sum_backward(Tensor grad_out, Tensor? indices, Tensor? x, "
      "SymInt[3] input_size, int[3] kernel1, int[3] stride1, int[3] padding1, int[3] kernel2, "
      "int[3] stride2, int[3] padding2) -> Tensor");

  // Max-pools over y (N, Md, Mh, Mw, C, Q) in parity-class layout: each
  // (position, channel)'s Q elements are one max-pool window in scan order
  // (parity_max_pool3d.h). mean over positions of each window's max -> (N, C);
  // with save_indices, also each window's pick q as uint8 (N, Md, Mh, Mw, C),
  // else an empty tensor.
  m.def("parity_max_pool3d_mean(Tensor y, bool save_indices, ScalarType? dtype=None) -> (Tensor, Tensor)");
  // grad_y (N, Md, Mh, Mw, C, Q), contiguous, from the forward's saved picks.
  m.def("parity_max_pool3d_mean_backward(Tensor grad_mean, Tensor picks, int parity_classes) -> Tensor");
  // sum over channels, keepdim, of a second max-pool (kernel2 = stride, no
  // padding) over the windows' maxima -> (N, 1, Md // k2d, Mh // k2h, Mw // k2w);
  // with save_indices, also each output's pick per channel as uint8
  // (stage-2 scan offset * Q + q) (N, D2, H2, W2, C), else an empty tensor.
  m.def(
      "parity_max_pool3d_cascade_sum(Tensor y, int[3] kernel2, bool save_indices, ScalarType? dtype=None) "
      "-> (Tensor, Tensor)");
  // grad_y (N, *stage1_size, C, Q), contiguous, from the forward's saved picks.
  m.def(
      "parity_max_pool3d_cascade_sum_backward(Tensor grad_out, Tensor picks, SymInt[3] stage1_size, "
      "int[3] kernel2, int parity_classes) -> Tensor");
  // The weight gradient (I, O, *kernel_size) in `dtype` of conv_transpose3d(x, w)
  // (stride, padding; y's spatial size output_size) followed by
  // parity_max_pool3d_cascade_sum over y's stride classes (kernel2), from that
  // op's picks (N, cells, O) and grad_out (N, 1, cells): the picked elements'
  // taps alone (conv_transpose3d_cascade_weight_grad.h).
  m.def(
      "conv_transpose3d_cascade_weight_grad(Tensor grad_out, Tensor picks, Tensor x, int[3] kernel_size, "
      "int[3] stride, int[3] padding, int[3] kernel2, SymInt[3] output_size, ScalarType dtype) -> Tensor");
  // The weight gradient (I, O, *kernel_size), contiguous, in x's dtype, of a stride-1 transposed
  // 3-D convolution without padding, dilation or groups, y = conv_transpose3d(x, w), from x
  // (N, I, D, H, W) and grad_y (N, O, D + kt - 1, H + kr - 1, W + ks - 1)
  // (conv_transpose3d_weight_grad.h). Not differentiable.
  m.def("conv_transpose3d_weight_grad(Tensor grad_y, Tensor x, int[3] kernel_size) -> Tensor");
  // t (N, C, ...) summed over every dim but C: (C) in t's dtype, accumulated in its opmath type
  // (channel_sums.h: D's bias gradient from a channels-last grad_y). Not differentiable.
  m.def("channel_sums(Tensor t) -> Tensor");
  // Which implementation conv_transpose3d_weight_grad takes for these arguments: a CUTLASS
  // kernel's name, or "aten.convolution_backward" (for tests and benchmarks).
  m.def("conv_transpose3d_weight_grad_path(Tensor grad_y, Tensor x, int[3] kernel_size) -> str");
  // A stride-1 transposed 3-D convolution without dilation or groups, conv_transpose3d(x, weight,
  // bias, 1, padding), returned channels_last_3d in x's dtype (conv_transpose3d_stride1_channels_last.h).
  // Not differentiable.
  m.def("conv_transpose3d_stride1_channels_last(Tensor x, Tensor weight, Tensor? bias, int[3] padding) -> Tensor");
  // Which implementation it takes for these arguments: a CUTLASS kernel's name, or
  // "aten.conv_transpose3d" (for tests and benchmarks).
  m.def(
      "conv_transpose3d_stride1_channels_last_path(Tensor x, Tensor weight, Tensor? bias, int[3] padding) -> str");
  // B's forward less the bias: sum over channels, keepdim, of max_pool3d(max_pool3d(conv_transpose3d(x,
  // weight, stride, padding, output_padding), stride), kernel2) -> (N, 1, D2, H2, W2), at the stage-1
  // positions stage 2 reads; with save_indices, also each output's pick per channel as
  // parity_max_pool3d_cascade_sum saves it (uint8 (N, D2, H2, W2, O)), else an empty tensor
  // (conv_transpose3d_cascade_sum.h). The convolution and its tail in one kernel on a GPU where it
  // applies. Not differentiable (B's rewrite takes the weight's gradient from the picks).
  m.def(
      "conv_transpose3d_cascade_sum(Tensor x, Tensor weight, int[3] stride, int[3] padding, "
      "int[3] output_padding, int[3] kernel2, bool save_indices, ScalarType? dtype=None) -> (Tensor, Tensor)");
  // Which implementation it takes for these arguments: its kernel's name, or the composite's
  // (for tests and benchmarks).
  m.def(
      "conv_transpose3d_cascade_sum_path(Tensor x, Tensor weight, int[3] stride, int[3] padding, "
      "int[3] output_padding, int[3] kernel2) -> str");

  // The input of a 2-D convolution computing a 3-D one's depth taps as input
  // channels (fused_ops/rewrites/): for x (N, I, D, H, W), out (N, size[0],
  // size[1], size[2], taps, I), contiguous, in `dtype` (any floating type; x's
  // for None), with
  //   out[n, m, h, w, a, i] = x[n, i, start[0] + stride * m + a, start[1] + h, start[2] + w]
  // where that index lies inside x, else 0 (zero padding on every side; start
  // may be negative). A copy with a cast; no autograd formula.
  m.def(
      "depth_stacked_channels_last(Tensor x, int taps, int stride, int[3] start, SymInt[3] size, "
      "ScalarType? dtype=None) -> Tensor");

  // adaptive_avg_pool3d(batch_norm(x * scale), 1) -> out (B, C, 1, 1, 1), as
  // nn.BatchNorm3d normalizes: with running_mean and running_var given, with
  // them; else with the batch's statistics (biased variance). Also, in the
  // accumulation type, for the backward and the running-statistics update:
  // plane_dev (B, C), each plane's mean of x * scale minus the channel's mean;
  // mean, rstd = 1 / sqrt(var + eps) and var (C), the statistics it normalized
  // with (the batch mean rounded to the accumulation type).
  m.def(
      "batch_norm_gap(Tensor x, float scale, Tensor? weight, Tensor? bias, Tensor? running_mean, "
      "Tensor? running_var, float eps, ScalarType? dtype=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // grad_x (B, C, *input_size) contiguous (an empty tensor without grad_input),
  // grad_weight, grad_bias (C). batch_stats: the forward normalized with batch
  // statistics; x is then read for grad_x (else it may be None).
  m.def(
      "batch_norm_gap_backward(Tensor grad_out, Tensor? x, SymInt[3] input_size, float scale, "
      "Tensor? weight, Tensor plane_dev, Tensor mean, Tensor rstd, bool batch_stats, "
      "bool grad_input) -> (Tensor, Tensor, Tensor)");
  // nn.BatchNorm3d's update of its running statistics from a batch of `count`
  // values per channel with statistics mean and var (biased), in place, on
  // the device: num_batches_tracked (when given) is incremented; the factor
  // is momentum, or with momentum None 1 / num_batches_tracked; running_var
  // takes the unbiased variance. An empty batch (count 0) changes only the counter.
  m.def(
      "batch_norm_update_running_stats(Tensor(a!) running_mean, Tensor(b!) running_var, "
      "Tensor(c!)? num_batches_tracked, Tensor mean, Tensor var, SymInt count, float? momentum) -> ()");

  // D's eval forward: the spatial mean (N, O) of batch_norm(scale * conv_transpose3d(x, weight, bias, stride,
  // 0, output_padding)) normalized with running_mean and running_var, for a transposed convolution without
  // padding, from x's spatial sums (conv_transpose3d_batch_norm_eval_mean.h). Not differentiable.
  m.def(
      "conv_transpose3d_batch_norm_eval_mean(Tensor x, Tensor weight, Tensor? bias, Tensor? bn_weight, "
      "Tensor? bn_bias, Tensor running_mean, Tensor running_var, int[3] stride, int[3] output_padding, "
      "float scale, float eps, ScalarType? dtype=None) -> Tensor");

  // A 2-D convolution kernel (..., kh, kw) followed by an average pool's box,
  // as one kernel (..., kh + bh - 1, kw + bw - 1) in `dtype` (weight's for
  // None; any floating type): box_fold2d.h. Its backward takes the folded
  // kernel's gradient to the kernel's (kernel_size, in `dtype`); each is the
  // other's adjoint, so both are differentiable.
  m.def("box_fold2d(Tensor weight, int[2] box, float divisor, ScalarType? dtype=None) -> Tensor");
  m.def(
      "box_fold2d_backward(Tensor grad, int[2] kernel_size, int[2] box, float divisor, ScalarType dtype) -> Tensor");
}
