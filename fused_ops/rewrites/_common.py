"""What the architectures' rewrites share: the parity-class convolution (below: A's, B's and D's
training step), the checks of a rewrite's conditions, constants kept on a device, the ops' paths.

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
"""
import functools
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _autocast
from .._members import member
from .._trace import traced
from ..ops import depth_stacked_channels_last
from ..ops._common import _accumulation_dtype, _expand, _pool_triples, _records


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


def _host_cache(fn: Callable) -> Callable:
    """fn (pure, of hashable arguments) with functools.cache on eager calls (each call's host time
    counts where a module's GPU work is small); while Dynamo traces, fn itself, which it traces as
    it would the cached one (a graph makes the call once), without its warning about the cache."""
    cached = functools.cache(fn)

    @functools.wraps(fn)
    def call(*args):
        return fn(*args) if torch.compiler.is_compiling() else cached(*args)
    return call


@_host_cache
def _conv_pool_axis(kernel: int, padding: int, classes: int) -> _Axis:
    taps = tuple([tuple([u - q if 0 <= u - q < kernel else -1 for u in range(kernel + classes - 1)])
                  for q in range(classes)])
    return _Axis(classes, classes, -padding, taps)


@_host_cache
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


def _parity_conv3d(x: Tensor, kernel: Tensor, bias: Tensor | None, axes, positions: tuple[int, int, int],
                   full_float32: bool = False) -> Tensor:
    """The parity-class convolution: (N, Md, Mh, Mw, O, Q) for `positions` = (Md, Mh, Mw),
    with `kernel` from _parity_kernel and `bias` per output channel (O Q) or None. Under
    autocast the rearranged input is written in autocast's dtype as it is copied (one pass;
    the convolution would cast it otherwise). With full_float32 cuDNN rounds nothing to TF32
    (the call's own argument, not PyTorch's global setting; autograd's backward of it would
    read the global one: for calls that autograd does not record, _full_float32)."""
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
    stride = [axes[1].stride, axes[2].stride]
    if full_float32:
        cudnn = torch.backends.cudnn
        y = torch.ops.aten._convolution(stacked, kernel, bias, stride, [0, 0], [1, 1], False, [0, 0], 1,
                                        cudnn.benchmark,
                                        cudnn.deterministic or torch.are_deterministic_algorithms_enabled(),
                                        cudnn.enabled, False)
    else:
        y = F.conv2d(stacked, kernel, bias, stride=stride)
    return y.permute(0, 2, 3, 1).reshape(n, *positions, out_channels, classes)


def conv_output_bytes(conv: nn.Module, x: Tensor) -> int:
    """The bytes of conv(x)'s output (an nn.Conv*d or nn.ConvTranspose*d; x batched or not), in the
    dtype the convolution computes in (autocast's)."""
    dims = len(conv.kernel_size)
    size = math.prod(x.shape[:-dims - 1]) * conv.out_channels
    for d, length in enumerate(x.shape[-dims:]):
        span = conv.dilation[d] * (conv.kernel_size[d] - 1)
        if conv.transposed:
            size *= (length - 1) * conv.stride[d] - 2 * conv.padding[d] + span + conv.output_padding[d] + 1
        elif conv.padding == "same":
            size *= length
        else:
            padding = 0 if conv.padding == "valid" else conv.padding[d]
            size *= (length + 2 * padding - span - 1) // conv.stride[d] + 1
    return size * _autocast.conv_dtype(x).itemsize


def _full_float32(x: Tensor) -> bool:
    """Whether a rewrite's float32 convolution of x is to round nothing to TF32 (where the original's
    does not): on a GPU, float32 outside autocast and a trace, while PyTorch's float32 matmul
    precision is "highest" (its default; "high" or "medium" ask for TF32's speed, and get it, as
    for conv_transpose3d_cascade_sum's bf16x3 or TF32 operands). cuDNN computes B's transposed
    convolution in full float32 even where TF32 is allowed; its parity-class rewrite's convolution
    with TF32 was 1.3e-4 from it at B-7to13-s2p2k5, batch 16 (H200): beyond KernelBench's 1e-4."""
    return (x.is_cuda and _autocast.conv_dtype(x) == torch.float32 and not traced(x)
            and torch.get_float32_matmul_precision() == "highest")


def _rounds_to_tf32(x: Tensor, weight: Tensor) -> bool:
    """Whether a rewrite's windows' convolution, recorded by autograd, would round to TF32 (autograd's
    convolution backward reads PyTorch's global cudnn.allow_tf32) where _full_float32 asks for none:
    the rewrite then does not hold. (Its gradients in TF32 on the rearranged taps stray further than
    the original's: A-k313's training step, H200, the weight's gradient 2.4e-4 from float64's, the
    original's 3.5e-5, with the windows' forward in TF32 or in full float32 alike.)"""
    return _full_float32(x) and torch.backends.cudnn.allow_tf32 and _records(x, weight)


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
            and max(conv.dilation) == 1 and x.dim() == member(conv, "weight").dim() and x.dtype.is_floating_point
            and x.shape[1] == conv.in_channels)


def _is_window_pool(pool: nn.MaxPool3d) -> bool:
    """A max-pool whose windows tile its input: kernel = stride, no padding, no dilation."""
    kernel, stride, padding = _pool_triples(pool.kernel_size, pool.stride, pool.padding)
    return kernel == stride and padding == [0, 0, 0] and _triple(pool.dilation) == (1, 1, 1) and not pool.return_indices


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


@_host_cache
def _op_path(path_op: Callable, device: torch.device, dtype: torch.dtype, shapes: tuple, args: tuple,
             tf32: Hashable) -> str:
    """path_op (an op's `_path` wrapper) of operands of `shapes` (None: an operand left out) in
    dtype, then `args`: asked once per key, of tensors that are one uninitialized element expanded
    (the answer depends on nothing else; `tf32`, the TF32 setting, matters for float32 alone)."""
    operands = [None if shape is None else torch.empty((), dtype=dtype, device=device).expand(shape)
                for shape in shapes]
    return path_op(*operands, *args)
