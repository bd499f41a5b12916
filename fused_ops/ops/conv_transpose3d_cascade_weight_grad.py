"""conv_transpose3d_cascade_weight_grad (B's weight gradient from the picks): the wrapper and the op's fake."""
import torch
from torch import Tensor

from ._common import _check_tensors, _expand, _ops


def conv_transpose3d_cascade_weight_grad(grad_out: Tensor, picks: Tensor, x: Tensor, kernel_size, stride, padding,
                                         kernel_size2, output_size, *, dtype: torch.dtype | None = None) -> Tensor:
    """The weight gradient of ``conv_transpose3d(x, w)`` (stride, padding; no dilation or
    groups; ``output_size`` its spatial size) followed by ``parity_max_pool3d_cascade_sum`` over
    its stride classes (second kernel ``kernel_size2``), from that op's picks alone.

    grad_out: (N, 1, *cells) the cascade's output gradient; picks: (N, *cells, O) uint8, the
    cascade's saved picks (off * Q + q: csrc/parity_max_pool3d.h); x: (N, I, D, H, W). Returns
    (I, O, *kernel_size) in ``dtype`` (x's for None): for each (n, cell, o) its pick's taps,
    ``grad_out[n, 0, cell] * x[n, i, p]``, summed (float64 on the CPU, float32 on a GPU for
    32- and 16-bit x), as PyTorch's dense weight gradient of y's gradient that is zero off the
    picks (NaN where that one meets a non-finite x with a zero: csrc/conv_transpose3d_cascade_weight_grad.h).
    Not differentiable.
    """
    _check_tensors("conv_transpose3d_cascade_weight_grad", grad_out=grad_out, picks=picks, x=x)
    return _ops.conv_transpose3d_cascade_weight_grad(
        grad_out, picks, x, _expand(kernel_size, 3, "kernel_size"), _expand(stride, 3, "stride"),
        _expand(padding, 3, "padding"), _expand(kernel_size2, 3, "kernel_size2"),
        _expand(output_size, 3, "output_size"), dtype or x.dtype)


@torch.library.register_fake("fused_ops::conv_transpose3d_cascade_weight_grad")
def _conv_transpose3d_cascade_weight_grad_fake(grad_out, picks, x, kernel_size, stride, padding, kernel2, output_size,
                                               dtype):
    what = "conv_transpose3d_cascade_weight_grad"
    torch._check(x.dim() == 5 and grad_out.dim() == 5 and picks.dim() == 5,
                 lambda: f"{what}: x, grad_out and picks must be 5-D, got {x.dim()}, {grad_out.dim()}, {picks.dim()}")
    torch._check(picks.dtype == torch.uint8, lambda: f"{what}: picks must be uint8, got {picks.dtype}")
    torch._check(x.dtype.is_floating_point and grad_out.dtype.is_floating_point and dtype.is_floating_point,
                 lambda: f"{what}: x, grad_out and dtype must be floating point")
    return x.new_empty((x.shape[1], picks.shape[4], *_expand(list(kernel_size), 3, "kernel_size")), dtype=dtype)
