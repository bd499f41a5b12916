"""max_pool3d_cascade_sum: the wrapper, and the fakes of the op and its backward."""
import math

import torch
from torch import Tensor

from ._common import (_MAX_SAVED_KERNEL_VOLUME, _check_5d_floating, _check_tensors, _empty_5d, _ops, _pool_triples,
                      _pooled_size, _result_dtype)


def max_pool3d_cascade_sum(x: Tensor, kernel_size1, kernel_size2, *, stride1=None, padding1=0, stride2=None,
                           padding2=0, dtype: torch.dtype | None = None) -> Tensor:
    """``F.max_pool3d(F.max_pool3d(x, kernel_size1, stride1, padding1), kernel_size2, stride2,
    padding2).sum(dim=1, keepdim=True)`` in one pass over the part of x that reaches the output.

    x: (B, C, D, H, W), float64/float32/float16/bfloat16, any strides (read in
    place). Each stage takes ``nn.MaxPool3d``'s arguments (dilation 1,
    ceil_mode False). dtype: the result's dtype: x's (None) or its
    accumulation type, float32 for a 16-bit x. Returns (B, 1, D'', H'', W'')
    in that dtype, the channels added in a fixed order in float32 (float64
    for float64 input).
    Differentiable in x: each output's gradient goes, per channel, to the
    element PyTorch's cascade picks (the stage-1 pick in the window stage 2
    picks, the first maximum at each stage, NaN propagating). The forward
    saves one byte per output and channel when x requires grad (kernel
    volumes whose product is at most 256; past it the backward recomputes
    the picks from x).
    """
    _check_tensors("max_pool3d_cascade_sum", x=x)
    first = _pool_triples(kernel_size1, stride1, padding1)
    second = _pool_triples(kernel_size2, stride2, padding2)
    volume = math.prod(first[0]) * math.prod(second[0])
    save_indices = torch.is_grad_enabled() and x.requires_grad and volume <= _MAX_SAVED_KERNEL_VOLUME
    out, _ = _ops.max_pool3d_cascade_sum(x, *first, *second, save_indices, dtype)
    return out


def _cascade_output_size(input_size, kernel1, stride1, padding1, kernel2, stride2, padding2) -> list:
    pooled = [_pooled_size(input_size[d], kernel1[d], stride1[d], padding1[d], False) for d in range(3)]
    torch._check(all(o >= 1 for o in pooled), lambda: "max_pool3d_cascade_sum: input is smaller than the first kernel")
    out = [_pooled_size(pooled[d], kernel2[d], stride2[d], padding2[d], False) for d in range(3)]
    torch._check(all(o >= 1 for o in out), lambda: "max_pool3d_cascade_sum: input is smaller than the second kernel")
    return out


def _cascade_args(kernel1, stride1, padding1, kernel2, stride2, padding2) -> list[list[int]]:
    # The schema's lists (1 or 3 elements; an empty stride means the kernel size) as lists of 3.
    return [*_pool_triples(list(kernel1), list(stride1), list(padding1)),
            *_pool_triples(list(kernel2), list(stride2), list(padding2))]


@torch.library.register_fake("fused_ops::max_pool3d_cascade_sum")
def _max_pool3d_cascade_sum_fake(x, kernel1, stride1, padding1, kernel2, stride2, padding2, save_indices,
                                 dtype=None):
    _check_5d_floating(x, "max_pool3d_cascade_sum")
    args = _cascade_args(kernel1, stride1, padding1, kernel2, stride2, padding2)
    out_size = _cascade_output_size(x.shape[2:], *args)
    torch._check(
        not save_indices or math.prod(args[0]) * math.prod(args[3]) <= _MAX_SAVED_KERNEL_VOLUME,
        lambda: "max_pool3d_cascade_sum: save_indices needs the product of the two kernel volumes to be at "
        f"most {_MAX_SAVED_KERNEL_VOLUME}",
    )
    out = x.new_empty((x.shape[0], 1, *out_size), dtype=_result_dtype(x, dtype, "max_pool3d_cascade_sum"))
    if not save_indices:
        return out, x.new_empty((0,), dtype=torch.uint8)
    return out, _empty_5d((x.shape[0], x.shape[1], *out_size), x, x, dtype=torch.uint8)


@torch.library.register_fake("fused_ops::max_pool3d_cascade_sum_backward")
def _max_pool3d_cascade_sum_backward_fake(grad_out, indices, x, input_size, kernel1, stride1, padding1, kernel2,
                                          stride2, padding2):
    source = indices if indices is not None else x
    return _empty_5d((grad_out.shape[0], source.shape[1], *input_size), grad_out, source)
