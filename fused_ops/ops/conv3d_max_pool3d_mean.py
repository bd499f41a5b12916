"""conv3d_max_pool3d_mean: the wrapper, and the fakes of the op and its backward."""
import torch
from torch import Tensor

from ._common import _check_tensors, _expand, _ops, _result_dtype


def _triple(value, name: str) -> list[int]:
    return _expand(value, 3, name)


def conv3d_max_pool3d_mean(x: Tensor, weight: Tensor, bias: Tensor | None = None, padding=0, pool=2,
                           divisor=1.0, *, dtype: torch.dtype | None = None, channel_bias: Tensor | None = None,
                           sum_channels: bool = False, operand_dtype: torch.dtype | None = None) -> Tensor:
    """``F.max_pool3d(F.conv3d(x, weight, bias, 1, padding) / divisor, pool).mean(dim=(2, 3, 4))``
    (pool: kernel = stride, no padding, floor mode), then ``+ channel_bias`` (O) where given and
    ``.sum(1)`` where sum_channels (architecture A's module: its bias and sum in the op); on a
    GPU (float32 with TF32 convolutions allowed, or a 16-bit weight; a 3 x 3 x 3 kernel, a
    2 x 2 x 2 pool, at most 16 input and output channels, rows of whole 16-byte chunks) the
    convolution and its tail in one tensor-core kernel whose output never reaches memory.

    x: (B, C, D, H, W); weight (O, C, kd, kh, kw) and bias (O,) in x's dtype, or float16 /
    bfloat16 with a float32 x (x is rounded to the weight's dtype as it is read). operand_dtype:
    the convolution's operands' dtype, the weight's (None), or float16 / bfloat16 for a float32
    weight and bias: x, the weight and the bias rounded to it as they are read (as autocast's
    casts would round them, without their copies: what the op's autocast rule passes where it is
    None, an explicit one kept; their gradients rounded to it, in the weight's dtype). dtype: the
    mean's: the operands' (None) or its accumulation type; the channel bias is added in the dtype
    the addition promotes to, and the sum accumulated in float32 and rounded to it, as
    ``torch.sum`` does. Returns (B, O), or (B) where sum_channels.
    Differentiable in x, weight, bias and channel_bias: where one of the first three requires
    grad the forward saves each window's pick (one byte), from which the backward routes the
    gradient to the picks and runs PyTorch's convolution backward (on a GPU, the weight's
    gradient by a kernel of its own).
    """
    _check_tensors("conv3d_max_pool3d_mean", x=x)
    save = torch.is_grad_enabled() and (x.requires_grad or (isinstance(weight, Tensor) and weight.requires_grad)
                                        or (isinstance(bias, Tensor) and bias.requires_grad))
    out, _ = _ops.conv3d_max_pool3d_mean(x, weight, bias, _triple(padding, "padding"), _triple(pool, "pool"),
                                         float(divisor), save, dtype, channel_bias, bool(sum_channels), operand_dtype)
    return out


def _conv3d_pooled_size(x, weight, padding, pool) -> list:
    p, k = _triple(list(padding), "padding"), _triple(list(pool), "pool")
    torch._check_value(min(k) > 0 and min(p) >= 0,
                       lambda: f"conv3d_max_pool3d_mean: pool must be positive and padding non-negative, got "
                               f"{pool}, {padding}")
    conv = [x.shape[2 + d] + 2 * p[d] - weight.shape[2 + d] + 1 for d in range(3)]
    for d in range(3):
        torch._check_value(conv[d] >= k[d],
                           lambda: f"conv3d_max_pool3d_mean: the pool {pool} is larger than the convolution's output")
    return [conv[d] // k[d] for d in range(3)]


def _operand_dtype(weight, operand_dtype, what: str) -> torch.dtype:
    """The convolution's operand dtype (csrc/conv3d_max_pool3d_mean.h, operand_type)."""
    if operand_dtype is None or operand_dtype == weight.dtype:
        return weight.dtype
    torch._check_value(weight.dtype == torch.float32 and operand_dtype in (torch.bfloat16, torch.float16),
                       lambda: f"{what}: operand_dtype must be the weight's dtype, or bfloat16 or float16 for a "
                               f"float32 weight, got {operand_dtype} for a {weight.dtype} weight")
    return operand_dtype


@torch.library.register_fake("fused_ops::conv3d_max_pool3d_mean")
def _conv3d_max_pool3d_mean_fake(x, weight, bias, padding, pool, divisor, save_indices, dtype=None,
                                 channel_bias=None, sum_channels=False, operand_dtype=None):
    torch._check(x.dim() == 5 and weight.dim() == 5,
                 lambda: f"conv3d_max_pool3d_mean: expected 5-D input and weight, got {x.dim()}-D and "
                         f"{weight.dim()}-D")
    rounded_input = x.dtype == torch.float32 and weight.dtype in (torch.float16, torch.bfloat16)
    torch._check(x.dtype.is_floating_point and (weight.dtype == x.dtype or rounded_input),
                 lambda: f"conv3d_max_pool3d_mean: weight must have the input's floating dtype, or be 16-bit for "
                         f"a float32 input, got {x.dtype}, {weight.dtype}")
    torch._check(bias is None or bias.dtype == weight.dtype,
                 lambda: f"conv3d_max_pool3d_mean: bias must have the weight's dtype, got {bias.dtype}, "
                         f"{weight.dtype}")
    torch._check(weight.shape[1] == x.shape[1],
                 lambda: f"conv3d_max_pool3d_mean: the input has {x.shape[1]} channels, the weight expects "
                         f"{weight.shape[1]}")
    torch._check_value(divisor != 0, lambda: "conv3d_max_pool3d_mean: divisor must be non-zero")
    pooled = _conv3d_pooled_size(x, weight, padding, pool)
    out_dtype = _result_dtype(_operand_dtype(weight, operand_dtype, "conv3d_max_pool3d_mean"), dtype,
                              "conv3d_max_pool3d_mean")
    if channel_bias is not None:
        torch._check_value(channel_bias.dim() == 1 and channel_bias.shape[0] == weight.shape[0],
                           lambda: f"conv3d_max_pool3d_mean: channel_bias must have shape (out_channels,) = "
                                   f"({weight.shape[0]},), got {tuple(channel_bias.shape)}")
        torch._check(channel_bias.dtype.is_floating_point,
                     lambda: f"conv3d_max_pool3d_mean: channel_bias must be a floating-point tensor, got "
                             f"{channel_bias.dtype}")
        out_dtype = torch.promote_types(out_dtype, channel_bias.dtype)
    out_shape = (x.shape[0],) if sum_channels else (x.shape[0], weight.shape[0])
    indices_shape = [x.shape[0], weight.shape[0], *pooled] if save_indices else [0]
    return x.new_empty(out_shape, dtype=out_dtype), x.new_empty(indices_shape, dtype=torch.uint8)


@torch.library.register_fake("fused_ops::conv3d_max_pool3d_mean_backward")
def _conv3d_max_pool3d_mean_backward_fake(grad_mean, indices, x, weight, padding, pool, divisor, output_mask,
                                          mean_dtype=None, operand_dtype=None):
    _operand_dtype(weight, operand_dtype, "conv3d_max_pool3d_mean_backward")
    torch._check(grad_mean.dim() == 2 and grad_mean.dtype.is_floating_point,
                 lambda: f"conv3d_max_pool3d_mean_backward: grad_mean must be floating-point (batch, out_channels), "
                         f"got {tuple(grad_mean.shape)} {grad_mean.dtype}")
    torch._check(list(indices.shape) == [x.shape[0], weight.shape[0], *_conv3d_pooled_size(x, weight, padding, pool)]
                 and indices.dtype == torch.uint8,
                 lambda: f"conv3d_max_pool3d_mean_backward: indices must be the forward's, got "
                         f"{tuple(indices.shape)} {indices.dtype}")
    return (torch.empty_like(x, memory_format=torch.contiguous_format) if output_mask[0] else x.new_empty((0,)),
            torch.empty_like(weight, memory_format=torch.contiguous_format) if output_mask[1] else x.new_empty((0,)),
            weight.new_empty((weight.shape[0],)) if output_mask[2] else x.new_empty((0,)),
            grad_mean.new_empty((weight.shape[0],)) if output_mask[3] else x.new_empty((0,)))
