"""max_pool3d_mean: the wrapper, and the fakes of the op and its backward."""
import math

import torch
from torch import Tensor

from ._common import (_MAX_SAVED_KERNEL_VOLUME, _check_5d_floating, _check_tensors, _empty_5d, _ops, _pool_triples,
                      _pooled_size, _result_dtype)


def max_pool3d_mean(x: Tensor, kernel_size, stride=None, padding=0, ceil_mode: bool = False, divisor=1.0, *,
                    dtype: torch.dtype | None = None) -> Tensor:
    """``F.max_pool3d(x / divisor, ...).mean(dim=(2, 3, 4))`` in one pass over x.

    x: (B, C, D, H, W), float64/float32/float16/bfloat16, any strides (read in
    place). The pooling arguments are those of ``nn.MaxPool3d`` (dilation 1).
    ``x / divisor`` is rounded to x's dtype before the pool, as PyTorch
    computes it, and the gradient goes to the element PyTorch's max_pool3d
    picks (the first maximum in scan order; NaN propagates, the last NaN
    wins). dtype: the result's dtype: x's (None) or its accumulation type,
    float32 for a 16-bit x. Returns (B, C) in that dtype, accumulated in
    float32 (float64 for float64 input). Differentiable in x: the forward
    saves one byte per pooled element when x requires grad (kernel volumes up
    to 256; larger ones make the backward recompute the picks from x).
    """
    _check_tensors("max_pool3d_mean", x=x)
    if isinstance(divisor, bool) or not isinstance(divisor, (int, float)):
        raise TypeError(f"max_pool3d_mean: divisor must be a number, got {divisor!r}")
    kernel_size, stride, padding = _pool_triples(kernel_size, stride, padding)
    save_indices = torch.is_grad_enabled() and x.requires_grad and math.prod(kernel_size) <= _MAX_SAVED_KERNEL_VOLUME
    mean, _ = _ops.max_pool3d_mean(x, kernel_size, stride, padding, ceil_mode, float(divisor), save_indices, dtype)
    return mean


@torch.library.register_fake("fused_ops::max_pool3d_mean")
def _max_pool3d_mean_fake(x, kernel_size, stride, padding, ceil_mode, divisor, save_indices, dtype=None):
    _check_5d_floating(x, "max_pool3d_mean")
    k, s, p = _pool_triples(list(kernel_size), list(stride), list(padding))
    pooled = [_pooled_size(x.shape[2 + d], k[d], s[d], p[d], ceil_mode) for d in range(3)]
    torch._check(all(o >= 1 for o in pooled), lambda: "max_pool3d_mean: input is smaller than the kernel")
    torch._check(
        not save_indices or math.prod(k) <= _MAX_SAVED_KERNEL_VOLUME,
        lambda: f"max_pool3d_mean: save_indices needs a kernel volume of at most {_MAX_SAVED_KERNEL_VOLUME}",
    )
    mean = x.new_empty((x.shape[0], x.shape[1]), dtype=_result_dtype(x, dtype, "max_pool3d_mean"))
    if not save_indices:
        return mean, x.new_empty((0,), dtype=torch.uint8)
    return mean, _empty_5d((x.shape[0], x.shape[1], *pooled), x, x, dtype=torch.uint8)


@torch.library.register_fake("fused_ops::max_pool3d_mean_backward")
def _max_pool3d_mean_backward_fake(grad_mean, indices, x, input_size, kernel_size, stride, padding, ceil_mode, divisor):
    return _empty_5d((grad_mean.shape[0], grad_mean.shape[1], *input_size), grad_mean,
                     indices if indices is not None else x)
