"""Architecture C (``fused_ops.nn.Conv2dAvgPoolSigmoidSum``): ``AvgPool2d(P, stride S) o Conv2d``
is one convolution of stride S whose kernel is the original convolved with the P x P box (divided
by P^2 or the divisor override); it runs as a convolution over the space-to-depth input (S x S
blocks as channels): a kernel of ceil(K / S) taps over I * S * S channels. With C's tail, the
pool-folded convolution is fused_ops.conv2d_sigmoid_sum's (conv2d_avg_pool_sigmoid_sum).
"""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _autocast
from .._members import member
from .._trace import traced
from ..ops import box_fold2d, conv2d_sigmoid_sum, depth_stacked_channels_last
from ..ops._common import _accumulation_dtype, _pooled_size, _records
from ..ops.conv2d_sigmoid_sum import _grad_factor_shape
from ._common import (_channels_last_copy, _is_plain_conv, _pair, _rearranged_taps_exact, _stacked_in_one_pass,
                      conv_output_bytes, kernel_dtype)


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
    weight, bias = member(conv, "weight"), member(conv, "bias")
    if fold is None or (cast is None and x.dtype != weight.dtype):  # (the latter: the original's error)
        return None
    if not _rearranged_taps_exact(x) or _saves_more_than_the_original(x, conv, fold):
        return None
    dtype = kernel_dtype(x, weight)
    weight = box_fold2d(weight, fold.box, fold.divisor, dtype=dtype)
    bias = None if bias is None else _pool_folded_bias(bias, fold).to(dtype)
    if cast is not None and x.dtype != torch.float32:
        x = x.to(cast)
    return conv2d_sigmoid_sum(x, weight, bias, fold.stride, fold.padding)


def _saves_more_than_the_original(x: Tensor, conv: nn.Conv2d, fold: _PoolFold) -> bool:
    """Whether, where autograd records it, conv2d_sigmoid_sum would save a gradient factor (float32
    tiles of 48 output columns by 64 output channels: _grad_factor_shape) larger than the
    convolution's output, which the original keeps for its pool's backward: with few output channels
    (3 -> 16, kernel 3, pool 2, 128 x 255 x 255 on an H200: the training step's peak 1260 MiB against
    the original's 1124)."""
    weight = member(conv, "weight")
    if traced(x) or not _records(x, weight, member(conv, "bias")):
        return False  # (nothing saved; or a compiler's sizes, whose memory it plans itself)
    factor_dtype = _accumulation_dtype(kernel_dtype(x, weight))
    factor = math.prod(_grad_factor_shape(x.shape[0], fold.out, weight.shape[0])) * factor_dtype.itemsize
    return factor > conv_output_bytes(conv, x)


def conv2d_avg_pool(x: Tensor, conv: nn.Conv2d, pool: nn.AvgPool2d) -> Tensor | None:
    """``pool(conv(x))`` as one convolution over the space-to-depth input, (N, O, H', W')
    channels last, or None where the rewrite does not hold (_pool_fold)."""
    fold = _pool_fold(x, conv, pool)
    if fold is None or not _rearranged_taps_exact(x):
        return None
    stride, padding, out = fold.stride, fold.padding, fold.out
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
    zero-padded to taps x stride and split into the space-to-depth input's channels (Sw, Sh, I).
    Contiguous in float64 on a CPU, whose convolution (slow_conv2d, not oneDNN) takes no layout from it
    and whose backward refused a channels-last weight of one output channel ("grad_weight must be
    contiguous")."""
    o, i = weight.shape[:2]
    stride = fold.stride
    kernel_folded = box_fold2d(weight, fold.box, fold.divisor, dtype=dtype)
    kernel_folded = F.pad(kernel_folded, (0, taps[1] * stride[1] - fold.folded[1], 0, taps[0] * stride[0] - fold.folded[0]))
    # (O, I, Th, Sh, Tw, Sw) -> (O, (Sw, Sh, I), Th, Tw)
    return kernel_folded.reshape(o, i, taps[0], stride[0], taps[1], stride[1]).permute(0, 5, 3, 1, 2, 4).reshape(
        o, i * stride[0] * stride[1], *taps).contiguous(memory_format=_kernel_layout(weight, dtype))


def _kernel_layout(weight: Tensor, dtype: torch.dtype) -> torch.memory_format:
    return torch.contiguous_format if dtype == torch.float64 and not weight.is_cuda else torch.channels_last
