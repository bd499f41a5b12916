"""Architecture A (``fused_ops.nn.Conv3dDivMaxPoolGAPBiasSum``): ``max_pool3d(conv3d(x) / divisor)``, a
max-pool of kernel = stride P after a stride-1 convolution, whose windows one parity-class
convolution of stride P computes side by side (``_common``'s docstring: the convolution's case)
for ``fused_ops.parity_max_pool3d_mean``; or the convolution and its tail in one op,
``fused_ops.conv3d_max_pool3d_mean``."""
import math

import torch
from torch import Tensor, nn

from .. import _autocast
from .._members import member
from ..ops import conv3d_max_pool3d_mean
from ..ops._common import _pooled_size
from ._common import (_conv_pool_axis, _is_plain_conv, _is_window_pool, _parity_conv3d, _parity_kernel,
                      _rearranged_taps_exact, _rounds_to_tf32, _triple, kernel_dtype)


def conv3d_max_pool_windows(x: Tensor, conv: nn.Conv3d, pool: nn.MaxPool3d,
                            divisor: float = 1.0) -> tuple[Tensor, Tensor | None] | None:
    """The windows of ``pool(conv(x) / divisor)`` side by side, (N, D', H', W', O, Q), less a
    constant per output channel, and that constant (O) or None; or None where the rewrite
    does not hold (a strided, dilated or grouped convolution, a pool whose windows overlap or
    leave gaps or pad, ceil_mode adding windows, more than 256 classes, autograd recording it in
    full float32: _rounds_to_tf32).

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
            or math.prod(classes) > 256 or not _rearranged_taps_exact(x) or _rounds_to_tf32(x, conv.weight):
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


def conv3d_max_pool_mean(x: Tensor, conv: nn.Conv3d, pool: nn.MaxPool3d, divisor: float = 1.0,
                         channel_bias: Tensor | None = None) -> Tensor | None:
    """``pool(conv(x) / divisor)`` averaged over its windows, (N, O), by
    fused_ops.conv3d_max_pool3d_mean: on a GPU one kernel, the convolution's output never in
    memory. In the dtype the convolution computes in (autocast's: a float32 x is rounded to it
    by the op as it reads x, another x cast first); with a channel_bias (O), that added and
    the channels summed, (N), in the dtype the addition promotes to. None where the op does not
    compute it (a strided, dilated or grouped convolution, a pool whose windows overlap, leave
    gaps or pad, ceil_mode adding windows)."""
    if not (_is_plain_conv(conv, x) and _triple(conv.stride) == (1, 1, 1) and _is_window_pool(pool)):
        return None
    cast = _autocast.cast_dtype(x)
    weight = member(conv, "weight")
    if cast is None and x.dtype != weight.dtype:  # (the original's error)
        return None
    kernel, padding = _triple(pool.kernel_size), _triple(conv.padding)
    conv_size = [x.shape[2 + d] + 2 * padding[d] - weight.shape[2 + d] + 1 for d in range(3)]
    if any([c < k or (pool.ceil_mode and c % k) for c, k in zip(conv_size, kernel)]):
        return None
    if cast is not None and x.dtype != torch.float32:
        x = x.to(cast)
    return conv3d_max_pool3d_mean(x, weight, member(conv, "bias"), padding, kernel, divisor, channel_bias=channel_bias,
                                  sum_channels=channel_bias is not None)


def _folds_exactly(divisor: float) -> bool:
    """Whether dividing the weights and bias by `divisor` divides every convolution output
    by it exactly (in any floating-point type, barring underflow): a power of two (of a
    moderate exponent) scales every product and partial sum without rounding."""
    mantissa, exponent = math.frexp(divisor)
    return abs(mantissa) == 0.5 and abs(exponent) <= 32
