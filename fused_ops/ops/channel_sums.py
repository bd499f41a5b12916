"""channel_sums (D's transposed-convolution bias gradient): the wrapper and the op's fake."""
import torch
from torch import Tensor

from ._common import _check_tensors, _ops


def channel_sums(t: Tensor) -> Tensor:
    """``t.sum(dim=(0, 2, 3, ...))`` of t (N, C, ...): (C) in t's dtype (float64, float32, float16 or
    bfloat16), each sum accumulated in float32 (float64 for float64) and rounded once. On a GPU,
    where t's memory holds rows of its channels (channels-last, or (N, C) contiguous), two small
    kernels and no cuBLAS (csrc/cuda/channel_sums.cu); elsewhere ATen's reduction. Not
    differentiable (a backward's helper)."""
    _check_tensors("channel_sums", t=t)
    return _ops.channel_sums(t)


@torch.library.register_fake("fused_ops::channel_sums")
def _channel_sums_fake(t):
    torch._check(t.dim() >= 2, lambda: f"channel_sums: t must be (N, C, ...), got {tuple(t.shape)}")
    torch._check(t.dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16),
                 lambda: f"channel_sums: t must be float64, float32, float16 or bfloat16, got {t.dtype}")
    return t.new_empty((t.shape[1],))
