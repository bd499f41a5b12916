"""Architecture B (``fused_ops.nn.ConvTranspose3dMaxPoolMaxPoolSum``): a stride-P transposed convolution,
a max-pool of kernel = stride P, a second max-pool, the sum over channels. The first pool's windows
are the transposed convolution's P^3 output parity classes, which one parity-class convolution of
stride 1 computes side by side (``_common``'s docstring: the transposed convolution's case) at the
positions the second pool reads, for ``fused_ops.parity_max_pool3d_cascade_sum``; on an sm_90 GPU
the convolution and both pools in one kernel (``fused_ops.conv_transpose3d_cascade_sum``); where
autograd records the weight's gradient alone, that gradient from the cascade's picks
(``fused_ops.conv_transpose3d_cascade_weight_grad``)."""
import contextlib
import math

import torch
from torch import Tensor, nn

from .. import _autocast
from .._members import member
from .._trace import traced
from ..ops import conv_transpose3d_cascade_sum_path, conv_transpose3d_cascade_weight_grad
from ..ops._common import _records
from ._common import (_full_float32, _is_plain_conv, _is_window_pool, _op_path, _parity_conv3d,
                      _rearranged_taps_exact, _rounds_to_tf32, _tf32_convolutions, _transposed_axis,
                      _transposed_parity_kernel, _triple, kernel_dtype)


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
    if fused is not None and not _records(x, weight):
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
    """The transposed convolution's (weight's) output in parity-class layout at `positions`, in full
    float32 where _full_float32 asks it and autograd records nothing (_rounds_to_tf32)."""
    return _parity_conv3d(x, _transposed_parity_kernel(weight, axes, kernel_dtype(x, weight)), None, axes, positions,
                          full_float32=_full_float32(x) and not _records(x, weight))


def conv_transpose3d_max_pool_windows(x: Tensor, conv: nn.ConvTranspose3d, pool1: nn.MaxPool3d,
                                      pool2: nn.MaxPool3d) -> tuple[Tensor, Tensor | None] | None:
    """The windows of ``pool1(conv(x))`` side by side, (N, Md, Mh, Mw, O, Q), at the
    positions ``pool2`` (kernel = stride) reads, less the convolution's bias (O) (or None),
    which passes through both pools' maxima and is the caller's to add after them (as for
    ``conv3d_max_pool_windows``); or None where the rewrite does not hold (pool1's kernel and
    stride not the convolution's stride, a dilated or grouped convolution, a pool2 that
    overlaps or pads, no output, the stride's volume times pool2's over 256)."""
    found = _transposed_windows_geometry(x, conv, pool1, pool2)
    if found is None or not _rearranged_taps_exact(x) or _rounds_to_tf32(x, conv.weight):
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
    on the CPU always (38.9 -> 1.4 ms at batch 1, 16^3); on a GPU in full float32 always (its
    kernels sum in float32, the dense gradient's in TF32: _full_float32); else where its window kernel takes
    the call (csrc/cuda/conv_transpose3d_cascade_weight_grad.cu: compute capability 9, stride 2
    in every dim, a cubic kernel of 3 to 5, input channels a multiple of 4, x not float64), else
    the dense gradient (the op's other kernel lost to cuDNN's: 9.0 against 4.7 ms at SPEC's size).
    The kernel's further conditions (a build with sm_90 code; paddings and pool2's kernel up to 64,
    its windows fitting shared memory; under 2^31 cells in all) hold for any B of practical size;
    where one fails the op's other kernel runs, and the autotuner weighs the rewrite with it."""
    if _PICKED_WEIGHT_GRAD_FORCED is not None:
        return _PICKED_WEIGHT_GRAD_FORCED
    if x.device.type == "cpu" or _full_float32(x):
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
    weight, kernel2 = member(conv, "weight"), _triple(pool2.kernel_size)
    fused = _cascade_sum_by_kernel(x, conv, weight, kernel2)
    if (torch.is_grad_enabled() and weight.requires_grad and not x.requires_grad
            and _picked_weight_grad_is_quick(x, conv)):
        if fused is not None and _autocast.cast_dtype(x) is None:
            # x channels-last once, for the kernel and the weight gradient's (each reads it so; the copy, where x
            # is not channels-last, is kept for the backward in x's place)
            x = _channels_last(x, x.dtype)
        out, _ = _ConvTransposeCascadeSum.apply(x, weight, _triple(conv.kernel_size), _triple(conv.stride),
                                                _triple(conv.padding), kernel2, axes, positions, out_size, fused)
    elif _rounds_to_tf32(x, weight):
        return None
    else:
        out, _ = _cascade_sum(x, weight, kernel2, axes, positions, save_picks=False, fused=fused)
    return out, member(conv, "bias")


def _cascade_sum_by_kernel(x: Tensor, conv: nn.ConvTranspose3d, weight: Tensor, kernel2) -> tuple | None:
    """The convolution's (stride, padding, output_padding) where B's rewrite computes conv(x) and
    both pools by conv_transpose3d_cascade_sum's kernel (on a GPU, float32 or under bfloat16
    autocast, outside a trace, where the op's path is its kernel: an sm_90 GPU, TF32 convolutions
    for float32, stride 2, kernel2 3, 32 input and at most 64 output channels;
    bench/bench_conv_transpose3d_cascade_sum.py times it against the parity-class formulation), else None."""
    dtype = _autocast.conv_dtype(x)
    if not x.is_cuda or dtype not in (torch.float32, torch.bfloat16) or weight.dtype != x.dtype or traced(x):
        return None
    conv_args = (_triple(conv.stride), _triple(conv.padding), _triple(conv.output_padding))
    path = _op_path(conv_transpose3d_cascade_sum_path, x.device, dtype, (tuple(x.shape), tuple(weight.shape)),
                    (*conv_args, tuple(kernel2)), _tf32_convolutions())
    return tuple([list(a) for a in conv_args]) if path.endswith(" transposed cascade sum") else None
