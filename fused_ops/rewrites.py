"""Exact rewrites of the architectures' convolutions (the same functions in real
arithmetic, computed by faster convolutions), used by ``fused_ops.nn``.

Parity-class convolutions (architectures A, B and D's training step). A
max-pool of kernel = stride P after a convolution reads each output element
once; computing its windows side by side, output channel (o, q) for element q
of the window at position m, is a convolution of stride P (after a
convolution) or 1 (after a stride-P transposed convolution) whose kernel holds
the original taps, rearranged, and zeros. Its channels-last output is the
parity-class layout of ``fused_ops.parity_max_pool3d_mean`` and
``parity_max_pool3d_cascade_sum`` (csrc/parity_max_pool3d.h). A transposed
convolution of stride 1 is the case P = 1 (a convolution with the kernel
flipped). Each 3-D convolution runs as a 2-D one over depth-stacked input
(batch (n, md), channels (depth tap, input channel)), which cuDNN runs much
faster than its 3-D kernels (bench/models.py).

Along one dimension, output element P * m + q of the original is
sum over taps u in [0, K') of w'[q, u] * x[stride * m + start + u], where
  convolution (kernel k, padding p), then pool P:  stride P, start -p, K' = k + P - 1,
      w'[q, u] = w[u - q];
  transposed convolution (kernel k, stride P, padding p):  stride 1, start e0, K' = e1 - e0 + 1,
      w'[q, u] = w[q + p - P (e0 + u)],
with w[t] = 0 outside [0, k) and [e0, e1] the input offsets any q reaches.

Architecture C: ``AvgPool2d(P, stride S) o Conv2d`` is one convolution of
stride S whose kernel is the original convolved with the P x P box (divided
by P^2 or the divisor override); it runs as a convolution over the
space-to-depth input (S x S blocks as channels): a kernel of ceil(K / S) taps
over I * S * S channels.

Architecture D in eval mode: the spatial mean of a transposed convolution
without padding is linear in the input's spatial sums: every input element
meets every tap inside the output, so
  mean_out y[n, o] = bias[o] + (sum_i (sum_t w[i, o, t]) * sum_p x[n, i, p]) / |out|.
With an infinity in x[n, i] (its sum s = +-inf) the original's mean is the sum of
the products w[i, o, t] * s over every tap: an infinity of their sign, or NaN where
they take both signs or a tap is zero, where (sum_t w) * s has one sign. So the map
also multiplies the infinite part of s (s where it is +-inf, else 0) by the signs of
the largest and the smallest tap: sign(max) * s + sign(min) * s is NaN exactly there
and s's infinity of the taps' sign elsewhere (and 0 for a finite s).

Each function returns None where its rewrite does not hold for the
configuration; the module then runs the original formulation. The modules
run the depth-stacked convolutions (A, B, D's training step) on CUDA inputs
only: they were measured faster there (README), and torch.compile 2.11
cannot lower them on the CPU.
"""
import contextlib
import functools
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _autocast
from ._trace import traced
from .ops import (_accumulation_dtype, _expand, _is_channels_last_3d, _pool_triples, _pooled_size, box_fold2d,
                  conv2d_sigmoid_sum, conv3d_max_pool3d_mean, conv_transpose3d_cascade_sum_path,
                  conv_transpose3d_cascade_weight_grad,
                  conv_transpose3d_stride1_channels_last, conv_transpose3d_stride1_channels_last_path,
                  conv_transpose3d_weight_grad, depth_stacked_channels_last)


def _triple(v) -> tuple[int, int, int]:
    return tuple(_expand(v, 3, "size"))


def _pair(v) -> tuple[int, int]:
    return tuple(_expand(v, 2, "size"))


@dataclass(frozen=True)
class _Axis:
    """One dimension of a parity-class convolution (module docstring)."""
    classes: int  # P
    stride: int
    start: int  # input offset of tap 0 at m = 0 (negative: zero padding)
    taps: tuple[tuple[int, ...], ...]  # [q][u]: the original tap, or -1

    @property
    def kernel(self) -> int:
        return len(self.taps[0])

    def input_span(self, positions: int) -> tuple[int, int]:
        """The input range [first, last] that `positions` outputs read."""
        return self.start, self.stride * (positions - 1) + self.start + self.kernel - 1


@functools.cache  # (pure: each call's host time counts where a module's GPU work is small)
def _conv_pool_axis(kernel: int, padding: int, classes: int) -> _Axis:
    taps = tuple([tuple([u - q if 0 <= u - q < kernel else -1 for u in range(kernel + classes - 1)])
                  for q in range(classes)])
    return _Axis(classes, classes, -padding, taps)


@functools.cache
def _transposed_axis(kernel: int, stride: int, padding: int) -> _Axis:
    first = min([-((kernel - 1 - q - padding) // stride) for q in range(stride)])  # ceil((q + p - k + 1) / s)
    last = max([(q + padding) // stride for q in range(stride)])
    taps = tuple([tuple([q + padding - stride * e if 0 <= q + padding - stride * e < kernel else -1
                         for e in range(first, last + 1)]) for q in range(stride)])
    return _Axis(stride, 1, first, taps)


_DEVICE_CONSTANTS: dict = {}  # _device_constant's

# The most output positions (N M H' W') depth_stacked_channels_last's CUDA kernel takes
# (csrc/cuda/depth_stacked_channels_last.cu).
_STACK_POSITIONS = 2**31 - 1


def _stacked_in_one_pass(x: Tensor, positions: int) -> bool:
    """Whether depth_stacked_channels_last writes x's rearranged copy (`positions` output
    positions): not where x records a gradient (the op has none) or while compiling (the
    compiler fuses the plain copies itself), nor past its CUDA kernel's positions."""
    return ((not x.is_cuda or positions <= _STACK_POSITIONS)
            and not (torch.is_grad_enabled() and x.requires_grad or torch.compiler.is_compiling()))


def _device_constant(key: Hashable, build: Callable[[], Tensor], device) -> Tensor:
    """build() (a tensor made on the host) on `device`, kept per key and device: made once (a
    host-to-device copy per call would wait for the device), outside inference mode (an
    inference tensor could not be saved for a backward later); made anew and not kept while
    compiling or under a fake mode (the tensor would be the trace's)."""
    if torch.compiler.is_compiling() or torch._guards.detect_fake_mode() is not None:
        return build().to(device)
    key = (key, torch.device(device))
    if key not in _DEVICE_CONSTANTS:
        with torch.inference_mode(False):
            _DEVICE_CONSTANTS[key] = build().to(device)
    return _DEVICE_CONSTANTS[key]


def _gather_index(axes: tuple[_Axis, _Axis, _Axis], kernel: tuple[int, int, int], device) -> Tensor:
    """(Q, K'd, K'h, K'w) indices into an original kernel flattened to k_d k_h k_w taps plus a
    zero last, on `device` (a constant: _device_constant)."""
    return _device_constant(("gather_index", axes, kernel), lambda: _build_gather_index(axes, kernel), device)


def _build_gather_index(axes: tuple[_Axis, _Axis, _Axis], kernel: tuple[int, int, int]) -> Tensor:
    volume = math.prod(kernel)
    d, h, w = axes
    return torch.tensor([[[[(td * kernel[1] + th) * kernel[2] + tw if min(td, th, tw) >= 0 else volume
                            for tw in w.taps[qw]] for th in h.taps[qh]] for td in d.taps[qd]]
                         for qd in range(d.classes) for qh in range(h.classes) for qw in range(w.classes)])


def _parity_kernel(weight: Tensor, axes) -> Tensor:
    """The parity-class convolution's 2-D kernel (O Q, K'd I, K'h, K'w), channels last:
    output channel (o, q), input channel (tap a, i), from `weight` (O, I, k_d, k_h, k_w),
    the original's taps as a convolution's."""
    out_channels, in_channels, *kernel = weight.shape
    classes = math.prod([axis.classes for axis in axes])
    if classes == 1 and all([axis.taps[0] == tuple(range(axis.kernel - 1, -1, -1)) for axis in axes]):
        # a stride-1 transposed convolution's: the taps flipped (no gather, whose backward scatters)
        combined = weight.flip(2, 3, 4).transpose(1, 2).reshape(out_channels, -1, axes[1].kernel, axes[2].kernel)
    else:  # (O, I, Q, K'd, K'h, K'w) gathered, the taps no class reaches zero
        index = _gather_index(axes, tuple(kernel), weight.device)
        weight_taps = torch.cat([weight.reshape(out_channels, in_channels, -1),
                                 weight.new_zeros(out_channels, in_channels, 1)], 2)
        combined = weight_taps[:, :, index].permute(0, 2, 3, 1, 4, 5).reshape(
            out_channels * classes, axes[0].kernel * in_channels, axes[1].kernel, axes[2].kernel)
    return combined.contiguous(memory_format=torch.channels_last)


def kernel_dtype(x: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype a rearranged kernel is built in: autocast's for x's convolution (the convolution
    would cast it on every call), else the weight's own."""
    return _autocast.cast_dtype(x) or weight.dtype


def _stacked_numel(x: Tensor, axes, positions: tuple[int, int, int]) -> int:
    """The elements of _parity_conv3d's depth-stacked input per batch element: (Md, H', W', K'd, I)."""
    spans = [axis.input_span(count) for axis, count in zip(axes, positions)]
    return positions[0] * math.prod([last - first + 1 for first, last in spans[1:]]) * axes[0].kernel * x.shape[1]


def _parity_conv3d(x: Tensor, kernel: Tensor, bias: Tensor | None, axes, positions: tuple[int, int, int]) -> Tensor:
    """The parity-class convolution: (N, Md, Mh, Mw, O, Q) for `positions` = (Md, Mh, Mw),
    with `kernel` from _parity_kernel and `bias` per output channel (O Q) or None. Under
    autocast the rearranged input is written in autocast's dtype as it is copied (one pass;
    the convolution would cast it otherwise)."""
    classes = math.prod([axis.classes for axis in axes])
    out_channels = kernel.shape[0] // classes
    # x cropped (or zero-padded) to the input span the outputs read, channels last, depth-stacked:
    # (N, Md, H', W', K'd, I), written in the convolution's dtype
    n, in_channels = x.shape[:2]
    dtype = _autocast.conv_dtype(x)
    spans = [axis.input_span(count) for axis, count in zip(axes, positions)]
    depth, stride, taps = positions[0], axes[0].stride, axes[0].kernel
    height, width = [last - first + 1 for first, last in spans[1:]]
    if _stacked_in_one_pass(x, n * depth * height * width):
        stacked = depth_stacked_channels_last(x, taps, stride, [first for first, _ in spans], [depth, height, width],
                                              dtype=dtype)
    else:  # differentiable, and what a compiler fuses itself: a view or a padded copy, then a
        # copy tap by tap into slices (not Tensor.unfold, whose backward torch.compile 2.13 gets
        # wrong on the CPU, nor torch.stack, which torch.compile 2.11 cannot lower into a CPU
        # convolution)
        inside = [slice(max(first, 0), min(last, x.shape[2 + d] - 1) + 1) for d, (first, last) in enumerate(spans)]
        to = [slice(r.start - first, r.stop - first) for r, (first, _) in zip(inside, spans)]
        padded = x[:, :, inside[0], inside[1], inside[2]].permute(0, 2, 3, 4, 1)
        if any([first < 0 or last >= x.shape[2 + d] for d, (first, last) in enumerate(spans)]):
            padded, inner = x.new_zeros((n, spans[0][1] - spans[0][0] + 1, height, width, in_channels),
                                        dtype=dtype), padded
            padded[:, to[0], to[1], to[2]] = inner
        stacked = x.new_empty(n, depth, height, width, taps, in_channels, dtype=dtype)
        for a in range(taps):
            stacked[:, :, :, :, a] = padded[:, a:a + stride * (depth - 1) + 1:stride]
    if traced(x):  # (a compiler's sizes may be symbolic: _channels_last_copy)
        stacked = _channels_last_copy(stacked.permute(0, 1, 4, 5, 2, 3).reshape(n * depth, taps * in_channels,
                                                                                 height, width))
    else:
        stacked = stacked.reshape(n * depth, height, width, -1).permute(0, 3, 1, 2)
    y = F.conv2d(stacked, kernel, bias, stride=(axes[1].stride, axes[2].stride))
    return y.permute(0, 2, 3, 1).reshape(n, *positions, out_channels, classes)


def _channels_last_copy(t: Tensor) -> Tensor:
    """t (N, C, H, W) copied channels last (contiguous first: a channels-last view's channels-last
    contiguous() is the view itself), a rewritten convolution's input in a trace, where the compiler
    fuses the copies into what writes t. Under dynamic shapes Inductor 2.13 fails on a convolution's
    input that is a view with symbolic channels-last strides (a ValueRangeError as it lowers the
    convolution: at the second size of an automatic-dynamic compile, at the first with
    dynamic=True), and on such a view saved for the backward (a sympy comparison in a training
    graph); a copy's strides are its own to choose. (Dynamo shows a symbolic size to isinstance as
    an int: every trace takes the copy.)"""
    return t.contiguous().contiguous(memory_format=torch.channels_last)


def _rearranged_taps_exact(x: Tensor) -> bool:
    """Whether a rewrite whose convolution multiplies x by taps the original's does not have (the
    parity classes' zeros, the space-to-depth kernel's zero padding: elements the original never
    multiplies) or by sums of its taps (C's pool-folded kernel) gives the original's result for x:
    where x holds no NaN or infinity (0 * inf = NaN, and (w1 + w2) * inf is an infinity where
    w1 * inf + w2 * inf is NaN). Checked on a CPU, where reading x waits for no device: one pass, x's
    sum, finite unless x holds a NaN or an infinity (or its values overflow the sum, which only passes
    the call on to the next formulation). Assumed on other devices, in a trace and under torch.func's
    transforms, where the check would wait for the device or make the graph depend on x's values
    (NOTES.md, "Non-finite values")."""
    if (x.device.type != "cpu" or traced(x) or torch.jit.is_tracing()
            or torch._C._functorch.is_functorch_wrapped_tensor(x)):
        return True
    return bool(x.detach().sum(dtype=_accumulation_dtype(x.dtype)).isfinite())


def _is_plain_conv(conv: nn.Module, x: Tensor) -> bool:
    """An ungrouped, undilated, zero-padded convolution, and an input it takes (else the
    original formulation runs, and raises where the input is wrong)."""
    return (conv.groups == 1 and conv.padding_mode == "zeros" and not isinstance(conv.padding, str)
            and max(conv.dilation) == 1 and x.dim() == conv.weight.dim() and x.dtype.is_floating_point
            and x.shape[1] == conv.in_channels)


def _is_window_pool(pool: nn.MaxPool3d) -> bool:
    """A max-pool whose windows tile its input: kernel = stride, no padding, no dilation."""
    kernel, stride, padding = _pool_triples(pool.kernel_size, pool.stride, pool.padding)
    return kernel == stride and padding == [0, 0, 0] and _triple(pool.dilation) == (1, 1, 1) and not pool.return_indices


def conv3d_max_pool_windows(x: Tensor, conv: nn.Conv3d, pool: nn.MaxPool3d,
                            divisor: float = 1.0) -> tuple[Tensor, Tensor | None] | None:
    """The windows of ``pool(conv(x) / divisor)`` side by side, (N, D', H', W', O, Q), less a
    constant per output channel, and that constant (O) or None; or None where the rewrite
    does not hold (a strided, dilated or grouped convolution, a pool whose windows overlap or
    leave gaps or pad, ceil_mode adding windows, more than 256 classes).

    The constant is the convolution's bias over the divisor where the divisor folds exactly
    (below): the same for every element of a channel's windows, it passes through their
    maxima (and their mean) unchanged, so the caller adds it to the pooled (N, O) result
    rather than to every window element (an elementwise pass over the convolution's
    output, which cuDNN does not fuse). Where PyTorch's values are exact, so are the
    shifted ones: the picks are the same."""
    if not (_is_plain_conv(conv, x) and _triple(conv.stride) == (1, 1, 1) and _is_window_pool(pool)):
        return None
    classes, kernel, padding = _triple(pool.kernel_size), _triple(conv.kernel_size), _triple(conv.padding)
    conv_size = [x.shape[2 + d] + 2 * padding[d] - kernel[d] + 1 for d in range(3)]
    positions = tuple([_pooled_size(s, p, p, 0, pool.ceil_mode) for s, p in zip(conv_size, classes)])
    # every window whole (ceil_mode may add a partial last one)
    if min(positions) < 1 or any([m * p > s for s, p, m in zip(conv_size, classes, positions)]) \
            or math.prod(classes) > 256 or not _rearranged_taps_exact(x):
        return None
    axes = tuple([_conv_pool_axis(kernel[d], padding[d], classes[d]) for d in range(3)])
    weight, bias, dtype = conv.weight, conv.bias, kernel_dtype(x, conv.weight)
    if not _folds_exactly(divisor):
        # conv(x) / d rounds twice where d is not a power of two: divide where PyTorch
        # divides, so that values PyTorch computes exactly (and their ties) are ours too
        class_bias = None if bias is None else bias.repeat_interleave(math.prod(classes))
        return _parity_conv3d(x, _parity_kernel(weight.to(dtype), axes), class_bias, axes, positions) / divisor, None
    taps = _parity_kernel((weight / divisor).to(dtype), axes)
    return _parity_conv3d(x, taps, None, axes, positions), None if bias is None else bias / divisor


def conv3d_max_pool_mean(x: Tensor, conv: nn.Conv3d, pool: nn.MaxPool3d, divisor: float = 1.0) -> Tensor | None:
    """``pool(conv(x) / divisor)`` averaged over its windows, (N, O), by
    fused_ops.conv3d_max_pool3d_mean: on a GPU one kernel, the convolution's output never in
    memory. In the dtype the convolution computes in (autocast's: a float32 x is rounded to it
    by the op as it reads x, another x cast first); None where the op does not compute it (a
    strided, dilated or grouped convolution, a pool whose windows overlap, leave gaps or pad,
    ceil_mode adding windows)."""
    if not (_is_plain_conv(conv, x) and _triple(conv.stride) == (1, 1, 1) and _is_window_pool(pool)):
        return None
    cast = _autocast.cast_dtype(x)
    if cast is None and x.dtype != conv.weight.dtype:  # (the original's error)
        return None
    kernel, padding = _triple(pool.kernel_size), _triple(conv.padding)
    conv_size = [x.shape[2 + d] + 2 * padding[d] - conv.weight.shape[2 + d] + 1 for d in range(3)]
    if any([c < k or (pool.ceil_mode and c % k) for c, k in zip(conv_size, kernel)]):
        return None
    if cast is not None and x.dtype != torch.float32:
        x = x.to(cast)
    return conv3d_max_pool3d_mean(x, conv.weight, conv.bias, padding, kernel, divisor)


def _folds_exactly(divisor: float) -> bool:
    """Whether dividing the weights and bias by `divisor` divides every convolution output
    by it exactly (in any floating-point type, barring underflow): a power of two (of a
    moderate exponent) scales every product and partial sum without rounding."""
    mantissa, exponent = math.frexp(divisor)
    return abs(mantissa) == 0.5 and abs(exponent) <= 32


def _transposed_windows_geometry(x: Tensor, conv: nn.ConvTranspose3d, pool1: nn.MaxPool3d, pool2: nn.MaxPool3d):
    """The parity-class axes, the stage-1 positions pool2 reads and the output's size of
    ``pool1(conv(x))`` computed side by side, or None where that rewrite does not hold
    (conv_transpose3d_max_pool_windows)."""
    stride = _triple(conv.stride)
    if not (_is_plain_conv(conv, x) and _is_window_pool(pool1) and _is_window_pool(pool2)
            and _triple(pool1.kernel_size) == stride and not pool1.ceil_mode and not pool2.ceil_mode):
        return None
    kernel, padding, extra = _triple(conv.kernel_size), _triple(conv.padding), _triple(conv.output_padding)
    kernel2 = _triple(pool2.kernel_size)
    out_size = tuple([(x.shape[2 + d] - 1) * stride[d] - 2 * padding[d] + kernel[d] + extra[d] for d in range(3)])
    positions = tuple([o // s // k2 * k2 for o, s, k2 in zip(out_size, stride, kernel2)])
    if min(positions) < 1 or math.prod(stride) * math.prod(kernel2) > 256:
        return None
    return tuple([_transposed_axis(kernel[d], stride[d], padding[d]) for d in range(3)]), positions, out_size


class _ConvTransposeCascadeSum(torch.autograd.Function):
    """The cascade sum of B's windows (conv_transpose3d_max_pool_cascade_sum) where autograd
    records the weight's gradient and not x's: the windows computed without recording, the
    cascade saving its picks, and the weight's gradient from the picks alone
    (``conv_transpose3d_cascade_weight_grad``: the dense weight gradient's work over the picked
    elements, one in P^3 k2^3 per channel). A backward that records a graph (create_graph)
    recomputes the windows and differentiates them as the dense formulation does."""

    @staticmethod
    def forward(x, weight, kernel, stride, padding, kernel2, axes, positions, out_size, fused):
        with torch.no_grad():
            return _cascade_sum(x, weight, kernel2, axes, positions, save_picks=True, fused=fused)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, kernel, stride, padding, kernel2, axes, positions, out_size, _ = inputs
        ctx.save_for_backward(x, weight, output[1])
        ctx.mark_non_differentiable(output[1])
        ctx.geometry = (kernel, stride, padding, kernel2, out_size)
        ctx.windows = (axes, positions)
        ctx.autocast = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else None

    @staticmethod
    def backward(ctx, grad_out, _):
        x, weight, picks = ctx.saved_tensors
        if not torch.is_grad_enabled():
            # under autocast as the windows' convolution computed: x and y's gradient in its dtype, the
            # weight's gradient rounded to it before autocast's cast back to the weight's dtype
            cast = ctx.autocast if ctx.autocast is not None and x.dtype == torch.float32 else None
            grad_weight = conv_transpose3d_cascade_weight_grad(
                grad_out if cast is None else grad_out.to(cast), picks, x if cast is None else x.to(cast),
                *ctx.geometry, dtype=cast or weight.dtype)
            return None, grad_weight.to(weight.dtype), *[None] * 8
        with torch.enable_grad(), torch.autocast(x.device.type, ctx.autocast or torch.float32,
                                                 enabled=ctx.autocast is not None):
            weight_ = weight.detach().requires_grad_()
            out, _ = _cascade_sum(x, weight_, ctx.geometry[3], *ctx.windows, save_picks=True)
        # (the dense formulation's graph, which autograd differentiates in grad_out)
        (grad_weight,) = torch.autograd.grad(out, weight_, grad_out, create_graph=True)
        return None, grad_weight, *[None] * 8


def _cascade_sum(x: Tensor, weight: Tensor, kernel2, axes, positions, save_picks: bool,
                 fused: tuple | None = None) -> tuple[Tensor, Tensor]:
    """parity_max_pool3d_cascade_sum of the transposed convolution's windows side by side, and
    its picks where save_picks (autograd records the op's own backward otherwise); by
    conv_transpose3d_cascade_sum (the convolution and both pools in one kernel) where `fused` (its
    stride, padding, output_padding: _cascade_sum_by_kernel) and autograd records nothing."""
    if fused is not None and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        # x in the convolution's dtype and channels-last, as the kernel reads it (one copy, none where it lies so)
        dtype = _autocast.conv_dtype(x)
        x_kernel = _channels_last(x, dtype)
        return torch.ops.fused_ops.conv_transpose3d_cascade_sum(x_kernel, weight.to(dtype), *fused, list(kernel2),
                                                                save_picks, None)
    windows = _transposed_windows(x, weight, axes, positions)
    return torch.ops.fused_ops.parity_max_pool3d_cascade_sum(
        windows, list(kernel2), save_picks or (torch.is_grad_enabled() and windows.requires_grad), None)


def _channels_last(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x (N, C, D, H, W) on a GPU in `dtype`, channels-last: x itself where it lies so; where
    depth_stacked_channels_last's plain transpose holds (csrc/cuda/depth_stacked_channels_last.cu:
    x contiguous and 16-byte aligned, channels a multiple of 32, planes of a multiple of 16 bytes, a
    batch under 2^16; the op's own bound, under 2^31 positions N D H W) by it (SPEC's B on an H200,
    float32 to bfloat16: 0.059 ms a call against Tensor.to's 0.073); anything else by Tensor.to."""
    if x.dtype == dtype and x.is_contiguous(memory_format=torch.channels_last_3d):
        return x
    channels, plane = x.shape[1], math.prod(x.shape[2:])
    if (x.is_contiguous() and channels > 0 and channels % 32 == 0 and plane * x.element_size() % 16 == 0
            and x.data_ptr() % 16 == 0 and x.shape[0] <= 65535 and x.shape[0] * plane < 2**31):
        stacked = torch.ops.fused_ops.depth_stacked_channels_last(x, 1, 1, [0, 0, 0], list(x.shape[2:]), dtype)
        return stacked.squeeze(4).permute(0, 4, 1, 2, 3)
    return x.to(dtype, memory_format=torch.channels_last_3d)


def _transposed_windows(x: Tensor, weight: Tensor, axes, positions) -> Tensor:
    """The transposed convolution's (weight's) output in parity-class layout at `positions`."""
    return _parity_conv3d(x, _transposed_parity_kernel(weight, axes, kernel_dtype(x, weight)), None, axes, positions)


def conv_transpose3d_max_pool_windows(x: Tensor, conv: nn.ConvTranspose3d, pool1: nn.MaxPool3d,
                                      pool2: nn.MaxPool3d) -> tuple[Tensor, Tensor | None] | None:
    """The windows of ``pool1(conv(x))`` side by side, (N, Md, Mh, Mw, O, Q), at the
    positions ``pool2`` (kernel = stride) reads, less the convolution's bias (O) (or None),
    which passes through both pools' maxima and is the caller's to add after them (as for
    ``conv3d_max_pool_windows``); or None where the rewrite does not hold (pool1's kernel and
    stride not the convolution's stride, a dilated or grouped convolution, a pool2 that
    overlaps or pads, no output, the stride's volume times pool2's over 256)."""
    found = _transposed_windows_geometry(x, conv, pool1, pool2)
    if found is None or not _rearranged_taps_exact(x):
        return None
    axes, positions, _ = found
    return _transposed_windows(x, conv.weight, axes, positions), conv.bias


# None: B's rewrite takes the picked weight gradient by _picked_weight_grad_is_quick; True or
# False: always or never (forced_picked_weight_grad: tests, benchmarks)
_PICKED_WEIGHT_GRAD_FORCED: bool | None = None


@contextlib.contextmanager
def forced_picked_weight_grad(on: bool | None):
    """B's rewrite with (True) or without (False) the picked weight gradient wherever it holds,
    or by its rule (None), inside the block."""
    global _PICKED_WEIGHT_GRAD_FORCED
    before, _PICKED_WEIGHT_GRAD_FORCED = _PICKED_WEIGHT_GRAD_FORCED, on
    try:
        yield
    finally:
        _PICKED_WEIGHT_GRAD_FORCED = before


def _picked_weight_grad_is_quick(x: Tensor, conv: nn.ConvTranspose3d) -> bool:
    """Whether B's rewrite takes conv_transpose3d_cascade_weight_grad for the weight's gradient:
    on the CPU always (38.9 -> 1.4 ms at batch 1, 16^3); on a GPU where its window kernel takes
    the call (csrc/cuda/conv_transpose3d_cascade_weight_grad.cu: compute capability 9, stride 2
    in every dim, a cubic kernel of 3 to 5, input channels a multiple of 4, x not float64), else
    the dense gradient (the op's other kernel lost to cuDNN's: 9.0 against 4.7 ms at SPEC's size).
    The kernel's further conditions (a build with sm_90 code; paddings and pool2's kernel up to 64,
    its windows fitting shared memory; under 2^31 cells in all) hold for any B of practical size;
    where one fails the op's other kernel runs, and the autotuner weighs the rewrite with it."""
    if _PICKED_WEIGHT_GRAD_FORCED is not None:
        return _PICKED_WEIGHT_GRAD_FORCED
    if x.device.type == "cpu":
        return True
    return (x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0] >= 9
            and _triple(conv.stride) == (2, 2, 2) and _triple(conv.kernel_size) in ((3,) * 3, (4,) * 3, (5,) * 3)
            and x.shape[1] % 4 == 0 and x.dtype != torch.float64)


def conv_transpose3d_max_pool_cascade_sum(x: Tensor, conv: nn.ConvTranspose3d, pool1: nn.MaxPool3d,
                                          pool2: nn.MaxPool3d) -> tuple[Tensor, Tensor | None] | None:
    """``pool2(pool1(conv(x))).sum(1, keepdim=True)`` less the convolution's bias (O) (or None),
    which passes through both pools' maxima and is the caller's to add (its channel sum) after
    them: ``parity_max_pool3d_cascade_sum`` of conv_transpose3d_max_pool_windows; where autograd
    records the weight's gradient and not x's (a training step on data), that gradient from the
    cascade's picks alone (_ConvTransposeCascadeSum), else autograd through the windows'
    convolution. In the cascade's dtype (autocast's rules for its op). None where the rewrite does
    not hold (conv_transpose3d_max_pool_windows)."""
    found = _transposed_windows_geometry(x, conv, pool1, pool2)
    if found is None or not _rearranged_taps_exact(x):
        return None
    axes, positions, out_size = found
    weight, kernel2 = conv.weight, _triple(pool2.kernel_size)
    fused = _cascade_sum_by_kernel(x, conv, kernel2)
    if (torch.is_grad_enabled() and weight.requires_grad and not x.requires_grad
            and _picked_weight_grad_is_quick(x, conv)):
        if fused is not None and _autocast.cast_dtype(x) is None:
            # x channels-last once, for the kernel and the weight gradient's (each reads it so; the copy, where x
            # is not channels-last, is kept for the backward in x's place)
            x = _channels_last(x, x.dtype)
        out, _ = _ConvTransposeCascadeSum.apply(x, weight, _triple(conv.kernel_size), _triple(conv.stride),
                                                _triple(conv.padding), kernel2, axes, positions, out_size, fused)
    else:
        out, _ = _cascade_sum(x, weight, kernel2, axes, positions, save_picks=False, fused=fused)
    return out, conv.bias


def _cascade_sum_by_kernel(x: Tensor, conv: nn.ConvTranspose3d, kernel2) -> tuple | None:
    """The convolution's (stride, padding, output_padding) where B's rewrite computes conv(x) and
    both pools by conv_transpose3d_cascade_sum's kernel (on a GPU, float32 or under bfloat16
    autocast, outside a trace, where the op's path is its kernel: an sm_90 GPU, TF32 convolutions
    for float32, stride 2, kernel2 3, 32 input and at most 64 output channels;
    bench/bench_conv_transpose3d_cascade_sum.py times it against the parity-class formulation), else None."""
    dtype = _autocast.conv_dtype(x)
    if not x.is_cuda or dtype not in (torch.float32, torch.bfloat16) or conv.weight.dtype != x.dtype or traced(x):
        return None
    conv_args = (_triple(conv.stride), _triple(conv.padding), _triple(conv.output_padding))
    path = _op_path(conv_transpose3d_cascade_sum_path, x.device, dtype, (tuple(x.shape), tuple(conv.weight.shape)),
                    (*conv_args, tuple(kernel2)), _tf32_convolutions())
    return tuple([list(a) for a in conv_args]) if path.endswith(" transposed cascade sum") else None


def _transposed_parity_kernel(weight: Tensor, axes, dtype: torch.dtype) -> Tensor:
    """_parity_kernel of a transposed convolution's weight (I, O, k_d, k_h, k_w) in `dtype`."""
    return _parity_kernel(weight.transpose(0, 1).to(dtype), axes)


def _tf32_convolutions() -> Hashable:
    """PyTorch's settings of TF32 for cuDNN's convolutions and for float32 matrix products (the
    cascade kernel's bf16x3 or TF32 operands), as a key (they pick the ops' paths)."""
    cudnn = torch.backends.cudnn
    conv = getattr(cudnn, "conv", None)
    return (cudnn.enabled, conv.fp32_precision if conv is not None else cudnn.allow_tf32,
            torch.get_float32_matmul_precision())


@functools.cache
def _op_path(path_op: Callable, device: torch.device, dtype: torch.dtype, shapes: tuple, args: tuple,
             tf32: Hashable) -> str:
    """path_op (an op's `_path` wrapper) of operands of `shapes` (None: an operand left out) in
    dtype, then `args`: asked once per key, of tensors that are one uninitialized element expanded
    (the answer depends on nothing else; `tf32`, the TF32 setting, matters for float32 alone)."""
    operands = [None if shape is None else torch.empty((), dtype=dtype, device=device).expand(shape)
                for shape in shapes]
    return path_op(*operands, *args)


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
        # (PyTorch's bias gradient copies a channels-last grad_y to NCDHW first: 0.56 ms for D's in bf16)
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
            grad_bias = _channels_last_channel_sums(grad_y)
        return grad_x, grad_weight, grad_bias, None, None, None, None


def _channels_last_channel_sums(t: Tensor) -> Tensor:
    """A channels_last_3d CUDA t (N, C, D, H, W) summed over every dim but C, (C) in t's dtype: a
    product of the ones vector and t's memory as an (N D H W) x C matrix by cuBLAS, 16-bit summed
    into float32 by a matrix product, else by a matrix-vector product (cuBLAS's gemv: no TF32,
    where a float32 matrix product may round to it). torch.sum's reduction over the outer dims
    takes 4 to 6 times as long (D's grad_y on an H200: bf16 0.18 against 0.03 ms, float32 0.23
    against 0.056)."""
    rows = t.permute(0, 2, 3, 4, 1).reshape(-1, t.shape[1])
    if t.dtype not in (torch.float16, torch.bfloat16):
        return torch.mv(rows.t(), rows.new_ones(rows.shape[0]))
    return torch.mm(rows.new_ones(1, rows.shape[0]), rows, out_dtype=torch.float32).view(t.shape[1]).to(t.dtype)


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


@dataclass(frozen=True)
class _PoolFold:
    """avg_pool2d(conv2d(x)) as one convolution: the pool's box and stride, its divisor, the
    folded kernel's size, the convolution's padding and the output's size."""
    box: tuple[int, int]
    stride: tuple[int, int]
    divisor: float
    folded: tuple[int, int]
    padding: tuple[int, int]
    out: tuple[int, int]


def _pool_fold(x: Tensor, conv: nn.Conv2d, pool: nn.AvgPool2d) -> _PoolFold | None:
    """How ``pool(conv(x))`` folds into one convolution, or None where it does not (a strided,
    dilated or grouped convolution, a padding pool, ceil_mode adding windows)."""
    if not (_is_plain_conv(conv, x) and _pair(conv.stride) == (1, 1)):
        return None
    box = _pair(pool.kernel_size)
    stride = _pair(pool.stride if pool.stride is not None else pool.kernel_size)
    if _pair(pool.padding) != (0, 0):
        return None
    kernel, padding = _pair(conv.kernel_size), _pair(conv.padding)
    folded = tuple([kernel[d] + box[d] - 1 for d in range(2)])
    padded = [x.shape[2 + d] + 2 * padding[d] for d in range(2)]
    out = tuple([(padded[d] - folded[d]) // stride[d] + 1 for d in range(2)])
    conv_size = [padded[d] - kernel[d] + 1 for d in range(2)]
    # the folded convolution's windows are the pool's (ceil_mode may add a partial last one)
    if min(out) < 1 or list(out) != [_pooled_size(c, b, s, 0, pool.ceil_mode)
                                     for c, b, s in zip(conv_size, box, stride)]:
        return None
    return _PoolFold(box, stride, pool.divisor_override or box[0] * box[1], folded, padding, out)


def _pool_folded_bias(bias: Tensor | None, fold: _PoolFold) -> Tensor | None:
    """The box's average of a constant: the bias itself where the divisor is the box's area."""
    scale = fold.box[0] * fold.box[1] / fold.divisor
    return bias if bias is None or scale == 1 else bias * scale


def conv2d_avg_pool_sigmoid_sum(x: Tensor, conv: nn.Conv2d, pool: nn.AvgPool2d) -> Tensor | None:
    """``torch.sigmoid(pool(conv(x))).sum(dim=(1, 2, 3))`` by fused_ops.conv2d_sigmoid_sum over the
    pool-folded kernel (stride the pool's): on a GPU one kernel, the convolution's output never
    in memory. In the dtype the convolution computes in (autocast's: a float32 x is rounded to
    it by the op as it reads x, another x cast first); None where the fold does not hold."""
    fold = _pool_fold(x, conv, pool)
    cast = _autocast.cast_dtype(x)
    if fold is None or (cast is None and x.dtype != conv.weight.dtype):  # (the latter: the original's error)
        return None
    if not _rearranged_taps_exact(x):
        return None
    dtype = kernel_dtype(x, conv.weight)
    weight = box_fold2d(conv.weight, fold.box, fold.divisor, dtype=dtype)
    bias = None if conv.bias is None else _pool_folded_bias(conv.bias, fold).to(dtype)
    if cast is not None and x.dtype != torch.float32:
        x = x.to(cast)
    return conv2d_sigmoid_sum(x, weight, bias, fold.stride, fold.padding)


def conv2d_avg_pool(x: Tensor, conv: nn.Conv2d, pool: nn.AvgPool2d) -> Tensor | None:
    """``pool(conv(x))`` as one convolution over the space-to-depth input, (N, O, H', W')
    channels last, or None where the rewrite does not hold (_pool_fold)."""
    fold = _pool_fold(x, conv, pool)
    if fold is None or not _rearranged_taps_exact(x):
        return None
    box, stride, padding, out = fold.box, fold.stride, fold.padding, fold.out
    padded = [x.shape[2 + d] + 2 * padding[d] for d in range(2)]
    taps = [-(-fold.folded[d] // stride[d]) for d in range(2)]
    weight, bias, dtype = conv.weight, conv.bias, kernel_dtype(x, conv.weight)
    s2d_kernel, bias = _space_to_depth_kernel(weight, fold, taps, dtype), _pool_folded_bias(bias, fold)
    # Pad (or crop) x to the blocks the outputs read, then blocks of S x S as channels (Sw, Sh, I),
    # channels last.
    blocks = [out[d] - 1 + taps[d] for d in range(2)]
    pad = (padding[1], blocks[1] * stride[1] - padded[1] + padding[1],
           padding[0], blocks[0] * stride[0] - padded[0] + padding[0])
    if any([p > 0 for p in pad]):
        x = F.pad(x, pad)
    elif any(pad):  # only cropping: a view, read by the one copy below
        x = x[:, :, :x.shape[2] + pad[3], :x.shape[3] + pad[1]]
    # one copy, in the dtype the convolution computes in (autocast's: cast as it is copied)
    n, i = x.shape[:2]
    dtype = _autocast.conv_dtype(x)
    if traced(x):  # (a compiler's sizes may be symbolic: _channels_last_copy)
        blocked = x.reshape(n, i, blocks[0], stride[0], blocks[1], stride[1]).permute(0, 5, 3, 1, 2, 4)
        s2d = blocked.reshape(n, stride[1] * stride[0] * i, blocks[0], blocks[1]).to(dtype)
        return F.conv2d(_channels_last_copy(s2d), s2d_kernel, bias)
    if _stacked_in_one_pass(x, n * blocks[0] * x.shape[3]):
        # the rows of each block stacked as depth taps of x (N, I, H, Bw, Sw): (N, Bh, Bw, Sw, Sh, I)
        s2d = depth_stacked_channels_last(x.unflatten(3, (blocks[1], stride[1])), stride[0], stride[0], 0,
                                          [blocks[0], blocks[1], stride[1]], dtype=dtype)
    else:  # differentiable, and what a compiler fuses itself
        s2d = x.new_empty(n, blocks[0], blocks[1], stride[1], stride[0], i, dtype=dtype)
        s2d.copy_(x.reshape(n, i, blocks[0], stride[0], blocks[1], stride[1]).permute(0, 2, 4, 5, 3, 1))
    s2d = s2d.reshape(n, blocks[0], blocks[1], -1).permute(0, 3, 1, 2)
    return F.conv2d(s2d, s2d_kernel, bias)


def _space_to_depth_kernel(weight: Tensor, fold: _PoolFold, taps: list[int], dtype: torch.dtype) -> Tensor:
    """(O, Sw Sh I, Th, Tw) channels last, in `dtype`: the pool-folded kernel (box_fold2d)
    zero-padded to taps x stride and split into the space-to-depth input's channels (Sw, Sh, I)."""
    o, i = weight.shape[:2]
    stride = fold.stride
    kernel_folded = box_fold2d(weight, fold.box, fold.divisor, dtype=dtype)
    kernel_folded = F.pad(kernel_folded, (0, taps[1] * stride[1] - fold.folded[1], 0, taps[0] * stride[0] - fold.folded[0]))
    # (O, I, Th, Sh, Tw, Sw) -> (O, (Sw, Sh, I), Th, Tw)
    return kernel_folded.reshape(o, i, taps[0], stride[0], taps[1], stride[1]).permute(0, 5, 3, 1, 2, 4).reshape(
        o, i * stride[0] * stride[1], *taps).contiguous(memory_format=torch.channels_last)
