"""Architecture D (``fused_ops.nn.ConvTranspose3dScaleBatchNormGAP``).

In training: its stride-1 transposed convolution, the parity-class convolution's case P = 1 (a
convolution with the kernel flipped: ``_common``'s docstring), or
conv_transpose3d_stride1_channels_last's CUTLASS kernel.

In eval mode: the spatial mean of a transposed convolution
without padding is linear in the input's spatial sums: every input element
meets every tap inside the output, so
  mean_out y[n, o] = bias[o] + (sum_i (sum_t w[i, o, t]) * sum_p x[n, i, p]) / |out|.
With an infinity in x[n, i] (its sum s = +-inf) the original's mean is the sum of
the products w[i, o, t] * s over every tap: an infinity of their sign, or NaN where
they take both signs or a tap is zero, where (sum_t w) * s has one sign. So the map
also multiplies the infinite part of s (s where it is +-inf, else 0) by the signs of
the largest and the smallest tap: sign(max) * s + sign(min) * s is NaN exactly there
and s's infinity of the taps' sign elsewhere (and 0 for a finite s).
"""
import math

import torch
from torch import Tensor, nn

from .. import _autocast
from .._trace import traced
from ..ops import (channel_sums, conv_transpose3d_stride1_channels_last, conv_transpose3d_stride1_channels_last_path,
                   conv_transpose3d_weight_grad)
from ..ops._common import _accumulation_dtype, _is_channels_last_3d
from ._common import (_is_plain_conv, _op_path, _parity_conv3d, _tf32_convolutions, _transposed_axis,
                      _transposed_parity_kernel, _triple, kernel_dtype)


# The dtypes whose stride-1 transposed convolution D's rewrite runs by conv_transpose3d_stride1_channels_last's
# CUTLASS kernel where it takes the call (bench/bench_conv_transpose3d_stride1_channels_last.py, SPEC's D on an
# H200: bf16 1.43 ms against 2.40 for the parity-class convolution and cuDNN's 1.80, D's step 2.41 against 4.13
# with the parity-class one; in TF32, 2026-11-28, D's step 5.31 ms against 6.09 with the parity-class one, whose
# depth-stacked input took the step's peak over the original's before it ran in batch chunks: 469 MiB, 409 in
# chunks, against the original's 608; 128 -> 64 channels, batch 8, 16^3: 2.33 ms against 4.24)
_STRIDE1_BY_CUTLASS = (torch.float32, torch.bfloat16)


def _stride1_by_cutlass(x: Tensor, conv: nn.ConvTranspose3d, dtype: torch.dtype) -> bool:
    """Whether D's rewrite runs conv(x) in dtype by conv_transpose3d_stride1_channels_last: a dtype of
    _STRIDE1_BY_CUTLASS, a padding the op takes (below the kernel size; the rewrite takes larger
    ones too), and the op taking a CUTLASS kernel (an sm_90 GPU, channels a multiple of 16 bytes, a
    build with CUTLASS). Not in a trace (_trace.traced: while compiling or under a fake mode; the
    path is asked of real tensors; a compiled graph takes the parity-class convolution, which the
    compiler sees through)."""
    if dtype not in _STRIDE1_BY_CUTLASS or not x.is_cuda:
        return False
    if not all([0 <= p < k for p, k in zip(_triple(conv.padding), _triple(conv.kernel_size))]):
        return False
    if traced(x):
        return False
    shapes = (tuple(x.shape), tuple(conv.weight.shape), None if conv.bias is None else (conv.weight.shape[1],))
    return _op_path(conv_transpose3d_stride1_channels_last_path, x.device, dtype, shapes, (_triple(conv.padding),),
                    _tf32_convolutions()).startswith("cutlass")


def _stride1_layout(x: Tensor) -> torch.memory_format:
    """The layout of _TransposedConv3dStride1's parity-class y: channels_last_3d on a GPU (the
    convolution's own; its class docstring says why), contiguous on a CPU, and in a trace
    (_trace.traced: while compiling or under a fake mode): with a channels-last y, a compiled D's
    backward on a GPU gave the convolution's inputs zero gradients (torch 2.11; test_compile_fullgraph in
    tests/test_nn_convtranspose3d_scale_batchnorm_gap.py). Cause not found: batch_norm_gap alone
    compiles right on a channels-last CUDA input, as does D on a CPU with y forced channels-last."""
    if not x.is_cuda or traced(x):
        return torch.contiguous_format
    return torch.channels_last_3d


# The most a chunk of _TransposedConv3dStride1's parity-class convolution (its depth-stacked input and its
# output) takes, as a share of y's size: the forward then peaks under (1 + share) times y, as the original
# holds y and its batch norm's input (two y's).
_PARITY_CHUNK_SHARE = 0.5


def _stacked_numel(x: Tensor, axes, positions: tuple[int, int, int]) -> int:
    """The elements of _parity_conv3d's depth-stacked input per batch element: (Md, H', W', K'd, I)."""
    spans = [axis.input_span(count) for axis, count in zip(axes, positions)]
    return positions[0] * math.prod([last - first + 1 for first, last in spans[1:]]) * axes[0].kernel * x.shape[1]


class _TransposedConv3dStride1(torch.autograd.Function):
    """A stride-1 transposed convolution in float32, float64 or bfloat16 (the last only where
    by_cutlass), (N, O, D', H', W'): where by_cutlass by conv_transpose3d_stride1_channels_last's
    CUTLASS kernel (_STRIDE1_BY_CUTLASS); else as a convolution with the kernel flipped (the
    parity-class convolution with P = 1; on an H200 3.2 ms against cuDNN's 4.5 for architecture D),
    in batch chunks where its depth-stacked input would take more than y's size. On a GPU y is
    channels_last_3d, as both convolutions write it (batch_norm_gap reads it so in place and
    writes its gradient so, which the weight gradient reads in place in bfloat16, and relayouts
    by a kernel of its own in TF32), but for _stride1_layout's exceptions. Backward by
    PyTorch's own transposed-convolution backward (its TF32 weight gradient, 6.2 ms, is faster
    than the rewritten convolution's, 7.9), but for the weight's gradient of an unpadded one on a
    GPU: ``conv_transpose3d_weight_grad`` (CUTLASS's kernels on an H100/H200: for D's at SPEC's
    size 2.6 ms, plus 0.25 of its operands' relayout, against cuDNN's 6.4 on an H200 in TF32; 1.08
    against 2.30 in bfloat16, 0.74 from channels-last operands; cuDNN's elsewhere). A backward
    that records a graph (create_graph) takes PyTorch's backward alone, which autograd
    differentiates."""

    @staticmethod
    def forward(x, weight, bias, padding, axes, out_size, by_cutlass):
        if by_cutlass:
            return conv_transpose3d_stride1_channels_last(x, weight, bias, padding)
        kernel = _transposed_parity_kernel(weight, axes, weight.dtype)
        layout = _stride1_layout(x)
        n = x.shape[0]
        # the batch in chunks whose depth-stacked input and output copies take at most _PARITY_CHUNK_SHARE of
        # y's size (SPEC's D in float32: the stacked input alone is 2.5 times y)
        y_numel = math.prod(out_size) * weight.shape[1]  # (a batch element's)
        chunk = int(y_numel * n * _PARITY_CHUNK_SHARE) // (y_numel + _stacked_numel(x, axes, out_size))
        fit = n if traced(x) else max(1, chunk)
        if fit >= n:
            y = _parity_conv3d(x, kernel, bias, axes, out_size)
            return y.squeeze(5).permute(0, 4, 1, 2, 3).contiguous(memory_format=layout)
        y = x.new_empty((n, weight.shape[1], *out_size)).contiguous(memory_format=layout)
        size = -(-n // -(-n // fit))  # equal chunks
        for first in range(0, n, size):
            part = _parity_conv3d(x[first:first + size], kernel, bias, axes, out_size)
            y[first:first + size].copy_(part.squeeze(5).permute(0, 4, 1, 2, 3))
        return y

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, padding, _, _, _ = inputs
        ctx.save_for_backward(x, weight)
        ctx.padding = padding
        ctx.has_bias = bias is not None

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        first_order = not torch.is_grad_enabled()
        weight_op = needs[1] and x.is_cuda and tuple(ctx.padding) == (0, 0, 0) and first_order
        # (PyTorch's bias gradient copies a channels-last grad_y to NCDHW first: 0.56 ms for D's in bf16;
        # channel_sums reads it in place, as cuBLAS's gemv did, without cuBLAS's first use in the process)
        bias_sums = ctx.has_bias and needs[2] and first_order and grad_y.is_cuda and _is_channels_last_3d(grad_y)
        mask = [needs[0], needs[1] and not weight_op, ctx.has_bias and needs[2] and not bias_sums]
        grad_x = grad_weight = grad_bias = None
        if any(mask):
            grad_x, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
                grad_y, x, weight, [weight.shape[1]] if ctx.has_bias else None, [1, 1, 1], list(ctx.padding),
                [1, 1, 1], True, [0, 0, 0], 1, mask)
        if weight_op:
            grad_weight = conv_transpose3d_weight_grad(grad_y, x, weight.shape[2:])
        if bias_sums:
            grad_bias = channel_sums(grad_y)
        return grad_x, grad_weight, grad_bias, None, None, None, None


def conv_transpose3d_stride1(x: Tensor, conv: nn.ConvTranspose3d) -> Tensor | None:
    """``conv(x)`` for a stride-1 transposed convolution, (N, O, D', H', W'): by
    conv_transpose3d_stride1_channels_last's CUTLASS kernel (_stride1_by_cutlass), else as a
    convolution with the kernel flipped; channels_last_3d on a GPU (but for _stride1_layout's
    exceptions, and 16-bit without the CUTLASS kernel: contiguous), contiguous on a CPU; None for
    other configurations."""
    if not (_is_plain_conv(conv, x) and _triple(conv.stride) == (1, 1, 1) and _triple(conv.output_padding) == (0, 0, 0)):
        return None
    kernel, padding = _triple(conv.kernel_size), _triple(conv.padding)
    out_size = tuple([x.shape[2 + d] - 1 - 2 * padding[d] + kernel[d] for d in range(3)])
    if min(out_size) < 1:
        return None
    axes = tuple([_transposed_axis(kernel[d], 1, padding[d]) for d in range(3)])
    weight, bias, dtype = conv.weight, conv.bias, _autocast.cast_dtype(x)
    conv_dtype = _autocast.conv_dtype(x)
    by_cutlass = _stride1_by_cutlass(x, conv, conv_dtype)
    if conv_dtype in (torch.float16, torch.bfloat16) and not by_cutlass:
        # 16-bit without the CUTLASS kernel: backward through the rewritten convolution, whose
        # weight gradient cuDNN computes with a Hopper kernel (architecture D, bf16, H200: 1.04 ms
        # against 2.14 for the transposed convolution's; the whole training step 4.18 against 4.83 ms)
        y = _parity_conv3d(x, _transposed_parity_kernel(weight, axes, kernel_dtype(x, weight)), bias, axes, out_size)
        return y.squeeze(5).permute(0, 4, 1, 2, 3).contiguous()
    if by_cutlass:  # (both CUTLASS kernels read x channels-last: made so once, cast in the same pass)
        x = x.to(conv_dtype, memory_format=torch.channels_last_3d)
    if dtype is None:
        return _TransposedConv3dStride1.apply(x, weight, bias, padding, axes, out_size, by_cutlass)
    # Under autocast: the convolution's inputs cast as autocast casts them (the casts' backward
    # gives the parameters their gradients in their own dtype), the function itself run without
    # autocast, so that its backward sees the dtypes it computed in.
    x, weight, bias = x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
    with torch.autocast(x.device.type, enabled=False):
        return _TransposedConv3dStride1.apply(x, weight, bias, padding, axes, out_size, by_cutlass)


def spatial_mean_holds(x: Tensor, conv: nn.ConvTranspose3d) -> bool:
    """Whether conv(x)'s spatial mean is affine in x's spatial sums (module docstring): a transposed
    convolution without padding, dilation or groups, and an input it takes."""
    return _is_plain_conv(conv, x) and _triple(conv.padding) == (0, 0, 0)


def conv_transpose3d_spatial_mean_map(x: Tensor, conv: nn.ConvTranspose3d) -> tuple[Tensor, Tensor] | None:
    """(W (3 I, O), b (O)) in float64 with ``conv(x).mean(dim=(2, 3, 4)) = spatial_sums(x) @ W + b``
    (module docstring): W's rows the taps' sums over the output's volume (I, O), then the signs of each
    (i, o)'s largest and smallest tap (which meet the infinite part of the sums: the signs, so that a
    finite sum meets no infinite weight); or None where that does not hold (spatial_mean_holds)."""
    if not spatial_mean_holds(x, conv):
        return None
    stride, kernel, extra = _triple(conv.stride), _triple(conv.kernel_size), _triple(conv.output_padding)
    out_volume = math.prod([(x.shape[2 + d] - 1) * stride[d] + kernel[d] + extra[d] for d in range(3)])
    taps = conv.weight.double().flatten(2)
    signs = [extreme.detach().sign() for extreme in (taps.amax(2), taps.amin(2))]  # (classes: no gradient)
    weight = torch.cat([taps.sum(2) / out_volume, *signs])
    bias = conv.bias.double() if conv.bias is not None else weight.new_zeros(weight.shape[1])
    return weight, bias


def spatial_sums(x: Tensor) -> Tensor:
    """x's sums s over (D, H, W), (N, C) in float64, then their infinite part twice (s where it is
    +-inf, else 0): (N, 3 C), what conv_transpose3d_spatial_mean_map's W multiplies. The sums are
    accumulated in x's accumulation type (a float64 reduction of float32 input would first convert
    the whole input), then widened."""
    sums = x.sum(dim=(2, 3, 4), dtype=_accumulation_dtype(x.dtype)).double()
    infinite = torch.where(sums.isinf(), sums, 0.0).detach()  # (a class, not a value: no gradient)
    return torch.cat([sums, infinite, infinite], 1)


def conv_transpose3d_spatial_mean(x: Tensor, conv: nn.ConvTranspose3d) -> Tensor | None:
    """The spatial mean of ``conv(x)``, (N, O) in x's dtype, from x's spatial sums and
    ``conv_transpose3d_spatial_mean_map`` in float64, or None where that does not hold."""
    mapped = conv_transpose3d_spatial_mean_map(x, conv)
    if mapped is None:
        return None
    return torch.addmm(mapped[1], spatial_sums(x), mapped[0]).to(x.dtype)
