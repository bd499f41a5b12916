"""parity_max_pool3d_mean and parity_max_pool3d_cascade_sum (the max-pool tails over windows given
side by side, csrc/parity_max_pool3d.h): the wrappers, and the fakes of the ops and their backwards."""
import math

import torch
from torch import Tensor

from ._common import _MAX_SAVED_KERNEL_VOLUME, _check_tensors, _expand, _ops, _result_dtype


def _check_parity_input(y: Tensor, what: str) -> None:
    """The fakes' check of the kernels' input rule: a 6-D floating-point tensor, no zero sizes."""
    torch._check(y.dim() == 6, lambda: f"{what}: expected a 6-D input (batch, depth, height, width, channels, "
                 f"parity classes), got {y.dim()}-D")
    torch._check(y.dtype.is_floating_point, lambda: f"{what}: input must be a floating-point tensor, got {y.dtype}")
    torch._check(all(n > 0 for n in y.shape), lambda: f"{what}: every dimension must be non-zero, got {tuple(y.shape)}")


def parity_max_pool3d_mean(y: Tensor, *, dtype: torch.dtype | None = None) -> Tensor:
    """The mean over positions of max-pool windows given side by side.

    y: (N, Md, Mh, Mw, C, Q), float64/float32/float16/bfloat16: for each
    output position m of a max-pool and channel c, the Q elements of its
    window in scan order (csrc/parity_max_pool3d.h), as a convolution
    rewritten to compute one output channel per (c, q) gives them
    (fused_ops.rewrites). dtype: the result's dtype: y's (None) or its
    accumulation type, float32 for a 16-bit y. Returns (N, C) in that dtype:
    ``mean over m of max over q``, accumulated in float32 (float64 for
    float64 y); that is ``F.max_pool3d(x, P).mean(dim=(2, 3, 4))`` for the
    pooled tensor x.
    Differentiable in y: each window's gradient goes to the element PyTorch's
    max-pool picks (the first maximum; NaN propagates, the last NaN wins).
    """
    _check_tensors("parity_max_pool3d_mean", y=y)
    mean, _ = _ops.parity_max_pool3d_mean(y, torch.is_grad_enabled() and y.requires_grad, dtype)
    return mean


@torch.library.register_fake("fused_ops::parity_max_pool3d_mean")
def _parity_max_pool3d_mean_fake(y, save_indices, dtype=None):
    _check_parity_input(y, "parity_max_pool3d_mean")
    torch._check(y.shape[5] <= _MAX_SAVED_KERNEL_VOLUME,
                 lambda: f"parity_max_pool3d_mean: at most {_MAX_SAVED_KERNEL_VOLUME} parity classes, got {y.shape[5]}")
    mean = y.new_empty((y.shape[0], y.shape[4]), dtype=_result_dtype(y, dtype, "parity_max_pool3d_mean"))
    return mean, y.new_empty(y.shape[:5] if save_indices else (0,), dtype=torch.uint8)


@torch.library.register_fake("fused_ops::parity_max_pool3d_mean_backward")
def _parity_max_pool3d_mean_backward_fake(grad_mean, picks, parity_classes):
    return grad_mean.new_empty((*picks.shape, parity_classes))


def parity_max_pool3d_cascade_sum(y: Tensor, kernel_size2, *, dtype: torch.dtype | None = None) -> Tensor:
    """The channel sum of a second max-pool over max-pool windows given side by side.

    y: (N, Md, Mh, Mw, C, Q) as for ``parity_max_pool3d_mean``; kernel_size2:
    an int or 3 ints, the second pool's kernel (stride = kernel, no padding).
    dtype: the result's dtype: y's (None) or its accumulation type, float32
    for a 16-bit y. Returns (N, 1, Md // k2d, Mh // k2h, Mw // k2w) in that
    dtype: for the pooled tensor x, ``F.max_pool3d(F.max_pool3d(x, P),
    kernel_size2).sum(dim=1, keepdim=True)``, the channels added in float32
    (float64 for float64 y).
    Differentiable in y: each output's gradient goes, per channel, to the
    element PyTorch's cascade picks. Needs kernel volume * Q <= 256 (one byte
    per saved pick).
    """
    _check_tensors("parity_max_pool3d_cascade_sum", y=y)
    kernel2 = _expand(kernel_size2, 3, "kernel_size2")
    out, _ = _ops.parity_max_pool3d_cascade_sum(y, kernel2, torch.is_grad_enabled() and y.requires_grad, dtype)
    return out


@torch.library.register_fake("fused_ops::parity_max_pool3d_cascade_sum")
def _parity_max_pool3d_cascade_sum_fake(y, kernel2, save_indices, dtype=None):
    what = "parity_max_pool3d_cascade_sum"
    _check_parity_input(y, what)
    k = _expand(list(kernel2), 3, "kernel2")
    torch._check(all(y.shape[1 + d] >= k[d] for d in range(3)),
                 lambda: f"{what}: the stage-1 output {tuple(y.shape[1:4])} is smaller than kernel2 {k}")
    torch._check(math.prod(k) * y.shape[5] <= _MAX_SAVED_KERNEL_VOLUME,
                 lambda: f"{what}: kernel2's volume times the parity classes must be at most {_MAX_SAVED_KERNEL_VOLUME}")
    out_size = [y.shape[1 + d] // k[d] for d in range(3)]
    picks = y.new_empty((y.shape[0], *out_size, y.shape[4]) if save_indices else (0,), dtype=torch.uint8)
    return y.new_empty((y.shape[0], 1, *out_size), dtype=_result_dtype(y, dtype, what)), picks


@torch.library.register_fake("fused_ops::parity_max_pool3d_cascade_sum_backward")
def _parity_max_pool3d_cascade_sum_backward_fake(grad_out, picks, stage1_size, kernel2, parity_classes):
    return grad_out.new_empty((picks.shape[0], *stage1_size, picks.shape[4], parity_classes))
