"""box_fold2d (C's pool folded into the convolution's kernel): the wrapper, and the fakes of the op and its backward."""
import math

import torch
from torch import Tensor

from ._common import _check_tensors, _ops, _pair


def box_fold2d(weight: Tensor, box, divisor: float, *, dtype: torch.dtype | None = None) -> Tensor:
    """A 2-D convolution kernel followed by an average pool's box as one kernel: ``conv2d(x,
    weight)`` then ``avg_pool2d`` with kernel ``box`` (the sum over each window divided by
    ``divisor``) equals ``conv2d(x, box_fold2d(weight, box, divisor))`` at the pool's stride.

    weight: (..., kh, kw) floating point. Returns (..., kh + bh - 1, kw + bw - 1) in ``dtype``
    (the weight's for None; any floating type), each tap the sum in float64 of the kernel's taps
    under it over the divisor (exact for a power-of-two divisor where the taps span fewer than
    about 29 binary orders of magnitude: any 16-bit weight), then converted as ``.to(dtype)``
    converts a float64 tensor.
    Differentiable (twice and more: linear both ways); one kernel launch each way on a GPU.
    """
    _check_tensors("box_fold2d", weight=weight)
    # the weight's own dtype passed as None, the schema's default: torch 2.11's AOTInductor hands a
    # custom op a dtype argument as another type (float32 as float64: pytorch/pytorch#169157)
    return _ops.box_fold2d(weight, _pair(box, "box"), float(divisor), None if dtype == weight.dtype else dtype)


def _box_fold_checks(box, divisor, what: str) -> list[int]:
    b = list(box)  # (two sizes, as the kernels take them: the wrapper expands one)
    # (RuntimeError, as the kernels' checks raise)
    torch._check(len(b) == 2 and b[0] > 0 and b[1] > 0, lambda: f"{what}: box must be two positive sizes, got {box}")
    torch._check(math.isfinite(divisor) and divisor != 0,
                 lambda: f"{what}: divisor must be finite and non-zero, got {divisor}")
    return b


@torch.library.register_fake("fused_ops::box_fold2d")
def _box_fold2d_fake(weight, box, divisor, dtype=None):
    torch._check(weight.dim() >= 2 and weight.shape[-2] > 0 and weight.shape[-1] > 0,
                 lambda: f"box_fold2d: weight must be (..., kh, kw) with a non-empty kernel, got {tuple(weight.shape)}")
    torch._check(weight.dtype.is_floating_point and (dtype is None or dtype.is_floating_point),
                 lambda: f"box_fold2d: weight and dtype must be floating point, got {weight.dtype}, {dtype}")
    b = _box_fold_checks(box, divisor, "box_fold2d")
    shape = (*weight.shape[:-2], weight.shape[-2] + b[0] - 1, weight.shape[-1] + b[1] - 1)
    return weight.new_empty(shape, dtype=dtype or weight.dtype)


@torch.library.register_fake("fused_ops::box_fold2d_backward")
def _box_fold2d_backward_fake(grad, kernel_size, box, divisor, dtype):
    b = _box_fold_checks(box, divisor, "box_fold2d_backward")
    k = _pair(list(kernel_size), "kernel_size")
    torch._check(grad.dim() >= 2 and list(grad.shape[-2:]) == [k[0] + b[0] - 1, k[1] + b[1] - 1],
                 lambda: f"box_fold2d_backward: grad must be (..., {k[0] + b[0] - 1}, {k[1] + b[1] - 1}), "
                         f"got {tuple(grad.shape)}")
    return grad.new_empty((*grad.shape[:-2], *k), dtype=dtype)
