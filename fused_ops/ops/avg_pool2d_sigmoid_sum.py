"""avg_pool2d_sigmoid_sum: the wrapper, and the fakes of the op and its backward."""
from collections.abc import Sequence

import torch
from torch import Tensor

from ._common import (_accumulation_dtype, _check_tensors, _is_channels_last, _ops, _pair, _pooled_size,
                      _result_dtype)


def avg_pool2d_sigmoid_sum(
    x: Tensor,
    kernel_size,
    stride=None,
    padding=0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """``torch.sigmoid(F.avg_pool2d(x, ...)).sum(dim=(1, 2, 3))`` in one pass over x.

    x: (B, C, H, W), float64/float32/float16/bfloat16, contiguous or channels_last
    (any other strides are read as they are). The pooling arguments are those of
    ``nn.AvgPool2d``. dtype: the result's dtype: x's (None) or its accumulation
    type, float32 for a 16-bit x. Returns (B,) in that dtype, accumulated in
    float32 (float64 for float64 input). Differentiable in x, to any order: where x requires
    grad the forward saves each pooled element's sigmoid (the pooled size, not x's).
    """
    _check_tensors("avg_pool2d_sigmoid_sum", x=x)
    kernel_size = _pair(kernel_size, "kernel_size")
    stride = kernel_size if stride is None or (isinstance(stride, Sequence) and len(stride) == 0) else _pair(stride, "stride")
    padding = _pair(padding, "padding")
    save_sigmoid = torch.is_grad_enabled() and x.requires_grad
    out, _ = _ops.avg_pool2d_sigmoid_sum(
        x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, save_sigmoid, dtype
    )
    return out


@torch.library.register_fake("fused_ops::avg_pool2d_sigmoid_sum")
def _avg_pool2d_sigmoid_sum_fake(
    x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, save_sigmoid, dtype=None
):
    torch._check(x.dim() == 4, lambda: f"avg_pool2d_sigmoid_sum: expected a 4-D input, got {x.dim()}-D")
    torch._check(
        x.dtype.is_floating_point,
        lambda: f"avg_pool2d_sigmoid_sum: input must be a floating-point tensor, got {x.dtype}",
    )
    k, s, p = (_pair(list(v), n) for v, n in ((kernel_size, "kernel_size"), (stride or kernel_size, "stride"), (padding, "padding")))
    oh, ow = (_pooled_size(x.shape[2 + d], k[d], s[d], p[d], ceil_mode) for d in range(2))
    torch._check(oh >= 1 and ow >= 1, lambda: "avg_pool2d_sigmoid_sum: input is smaller than the kernel")
    out = x.new_empty((x.shape[0],), dtype=_result_dtype(x, dtype, "avg_pool2d_sigmoid_sum"))
    acc = _accumulation_dtype(x.dtype)
    if not save_sigmoid:
        return out, x.new_empty((0,), dtype=acc)
    fmt = torch.channels_last if _is_channels_last(x) else torch.contiguous_format
    return out, torch.empty((x.shape[0], x.shape[1], oh, ow), dtype=acc, device=x.device, memory_format=fmt)


@torch.library.register_fake("fused_ops::avg_pool2d_sigmoid_sum_backward")
def _avg_pool2d_sigmoid_sum_backward_fake(grad_out, sigmoid, input_hw, kernel_size, stride, padding, count_include_pad,
                                          divisor_override, channels_last):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    shape = (sigmoid.shape[0], sigmoid.shape[1], input_hw[0], input_hw[1])
    return torch.empty(shape, dtype=grad_out.dtype, device=grad_out.device, memory_format=fmt)
