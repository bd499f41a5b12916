"""depth_stacked_channels_last: the wrapper and the op's fake."""
import torch
from torch import Tensor

from ._common import _check_tensors, _expand, _ops


_KERNEL_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def depth_stacked_channels_last(x: Tensor, taps: int, stride: int, start, size, *,
                                dtype: torch.dtype | None = None) -> Tensor:
    """x cropped and zero-padded, channels last, with `taps` depths side by side: the input
    of a 2-D convolution that computes a 3-D one's depth taps as input channels
    (fused_ops.rewrites), in one pass over x.

    x: (N, I, D, H, W), float64/float32/float16/bfloat16, any strides (read in place).
    taps, stride: positive ints; start: 3 ints (or one for all), may be negative; size:
    3 non-negative ints (M, Hs, Ws). dtype: the result's dtype, any of those four (None:
    x's). Returns (N, M, Hs, Ws, taps, I), contiguous, in that dtype, with
    ``out[n, m, h, w, a, i] = x[n, i, start[0] + stride * m + a, start[1] + h, start[2] + w]``
    where that index lies inside x, else 0, each value cast as ``Tensor.to`` casts.
    Under autocast it runs as called. Not differentiable (no autograd formula): for an x
    that needs no gradient.
    """
    _check_tensors("depth_stacked_channels_last", x=x)
    if torch.is_grad_enabled() and x.requires_grad:
        raise RuntimeError("depth_stacked_channels_last: not differentiable, and x requires grad "
                           "(run it under torch.no_grad() or on a detached x)")
    return _ops.depth_stacked_channels_last(x, taps, stride, _expand(start, 3, "start"), _expand(size, 3, "size"),
                                            dtype)


@torch.library.register_fake("fused_ops::depth_stacked_channels_last")
def _depth_stacked_channels_last_fake(x, taps, stride, start, size, dtype=None):
    what = "depth_stacked_channels_last"
    torch._check(x.dim() == 5, lambda: f"{what}: expected a 5-D input x, got {x.dim()}-D")
    torch._check(x.dtype in _KERNEL_DTYPES, lambda: f"{what}: x must be a floating-point tensor, got {x.dtype}")
    torch._check(taps >= 1, lambda: f"{what}: taps must be at least 1, got {taps}")
    torch._check(stride >= 1, lambda: f"{what}: stride must be at least 1, got {stride}")
    size = _expand(list(size), 3, "size")
    torch._check(all(s >= 0 for s in size), lambda: f"{what}: size must be non-negative, got {size}")
    out_dtype = x.dtype if dtype is None else dtype
    torch._check(out_dtype in _KERNEL_DTYPES, lambda: f"{what}: dtype must be a floating-point type, got {out_dtype}")
    return x.new_empty((x.shape[0], *size, taps, x.shape[1]), dtype=out_dtype)
