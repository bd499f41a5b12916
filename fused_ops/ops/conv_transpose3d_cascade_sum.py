"""conv_transpose3d_cascade_sum (B's forward less the bias): the wrapper, conv_transpose3d_cascade_sum_path
(which implementation a call takes) and the op's fake."""
import torch
from torch import Tensor

from ._common import _check_tensors, _check_transposed_convolution_fake, _expand, _ops, _result_dtype


def conv_transpose3d_cascade_sum(x: Tensor, weight: Tensor, stride, padding=0, output_padding=0, kernel_size2=3, *,
                                 dtype: torch.dtype | None = None) -> Tensor:
    """``F.max_pool3d(F.max_pool3d(F.conv_transpose3d(x, weight, None, stride, padding, output_padding),
    stride), kernel_size2).sum(1, keepdim=True)`` (architecture B's forward less the bias) in one op.

    x: (N, I, D, H, W); weight: (I, O, kt, kr, ks) of x's dtype; stride, padding, output_padding,
    kernel_size2: an int or 3 ints (the first pool's kernel is the stride; both pools without
    padding). dtype: the result's, x's (None) or its accumulation type. On an sm_90 GPU (H100,
    H200) in a build with CUTLASS's headers, for float32 where PyTorch's convolutions use TF32 and
    for bfloat16, stride 2, kernel_size2 3, kernels of at most 3 taps a parity class and dim, 32
    input and at most 64 output channels: the convolution and both pools in one TF32 (bfloat16)
    kernel that never writes y
    (csrc/cuda/conv_transpose3d_cascade_sum.cu). Everything else: aten.conv_transpose3d then
    ``parity_max_pool3d_cascade_sum`` (``conv_transpose3d_cascade_sum_path`` says which). Not
    differentiable (B's module takes the weight's gradient from the picks).
    """
    _check_tensors("conv_transpose3d_cascade_sum", x=x, weight=weight)
    out, _ = _ops.conv_transpose3d_cascade_sum(x, weight, *_cascade_sum_args(stride, padding, output_padding,
                                                                             kernel_size2), False, dtype)
    return out


def conv_transpose3d_cascade_sum_path(x: Tensor, weight: Tensor, stride, padding=0, output_padding=0,
                                      kernel_size2=3) -> str:
    """Which implementation conv_transpose3d_cascade_sum takes for these arguments (under the
    current TF32 setting): its kernel's name ("tf32 transposed cascade sum"), or the composite's
    ("aten.conv_transpose3d + parity_max_pool3d_cascade_sum"; on a GPU with " (built without
    CUTLASS)" where the build has no CUTLASS kernels)."""
    return _ops.conv_transpose3d_cascade_sum_path(x, weight, *_cascade_sum_args(stride, padding, output_padding,
                                                                                kernel_size2))


def _cascade_sum_args(stride, padding, output_padding, kernel2) -> list[list[int]]:
    """conv_transpose3d_cascade_sum's int-or-3 arguments as the schema's lists of 3."""
    named = ((stride, "stride"), (padding, "padding"), (output_padding, "output_padding"), (kernel2, "kernel_size2"))
    return [_expand(v, 3, name) for v, name in named]


@torch.library.register_fake("fused_ops::conv_transpose3d_cascade_sum")
def _conv_transpose3d_cascade_sum_fake(x, weight, stride, padding, output_padding, kernel2, save_indices, dtype=None):
    what = "conv_transpose3d_cascade_sum"
    _check_transposed_convolution_fake(x, weight, what)
    s, p, op, k2 = _cascade_sum_args(stride, padding, output_padding, kernel2)
    torch._check(min(s) >= 1 and min(k2) >= 1, lambda: f"{what}: stride and kernel2 must be positive, got {s} and {k2}")
    out = [(x.shape[2 + d] - 1) * s[d] - 2 * p[d] + weight.shape[2 + d] + op[d] for d in range(3)]
    cells = [o // s[d] // k2[d] for d, o in enumerate(out)]
    torch._check(all(c >= 1 for c in cells), lambda: f"{what}: the input is too small for a second-stage window")
    result = x.new_empty((x.shape[0], 1, *cells), dtype=_result_dtype(x, dtype, what))
    if not save_indices:
        return result, x.new_empty((0,), dtype=torch.uint8)
    return result, x.new_empty((x.shape[0], *cells, weight.shape[1]), dtype=torch.uint8)
