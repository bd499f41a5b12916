"""conv2d_sigmoid_sum: the wrapper, and the fakes of the op and its backward."""
import torch
from torch import Tensor

from ._common import _accumulation_dtype, _check_tensors, _ops, _pair, _result_dtype


def conv2d_sigmoid_sum(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0, *,
                       dtype: torch.dtype | None = None) -> Tensor:
    """``torch.sigmoid(F.conv2d(x, weight, bias, stride, padding)).sum(dim=(1, 2, 3))``; on a GPU
    (float32, TF32 convolutions allowed) the convolution and its tail in one tensor-core kernel
    whose output never reaches memory.

    x: (B, C, H, W); weight (O, C, kh, kw) and bias (O,) in x's dtype, or float16 / bfloat16 with
    a float32 x (as autocast passes them: x is rounded to the weight's dtype as it is read, no
    copy made; on a GPU the kernel takes this too). dtype: the result's: the weight's (None) or
    its accumulation type. Returns (B,). Differentiable in x, weight and bias: where one of them
    requires grad the forward saves sigmoid'(y) per output, from which the backward forms the
    gradients (on Hopper, where the forward's kernel ran on rows of whole 16-byte chunks, the
    weight's and bias's in one tensor-core kernel; else PyTorch's convolution backward).
    """
    _check_tensors("conv2d_sigmoid_sum", x=x)
    save = torch.is_grad_enabled() and (x.requires_grad or (isinstance(weight, Tensor) and weight.requires_grad)
                                        or (isinstance(bias, Tensor) and bias.requires_grad))
    out, _ = _ops.conv2d_sigmoid_sum(x, weight, bias, _pair(stride, "stride"), _pair(padding, "padding"), save,
                                     dtype)
    return out


def _conv2d_output_size(x, weight, stride, padding) -> list:
    s, p = _pair(list(stride), "stride"), _pair(list(padding), "padding")
    torch._check_value(s[0] > 0 and s[1] > 0, lambda: f"conv2d_sigmoid_sum: stride must be positive, got {stride}")
    return [(x.shape[2 + d] + 2 * p[d] - weight.shape[2 + d]) // s[d] + 1 for d in range(2)]


def _conv2d_grad_factor_shape(x, weight, stride, padding) -> list:
    return _grad_factor_shape(x.shape[0], _conv2d_output_size(x, weight, stride, padding), weight.shape[0])


def _grad_factor_shape(batch, out_size, out_channels) -> list:
    """The saved factor's shape (csrc/conv2d_sigmoid_sum.h): (N, OH, ceil(OW / 48), ceil(O / 64), 3072)."""
    oh, ow = out_size
    return [batch, oh, -(-ow // 48), -(-out_channels // 64), 3072]


@torch.library.register_fake("fused_ops::conv2d_sigmoid_sum")
def _conv2d_sigmoid_sum_fake(x, weight, bias, stride, padding, save_grad_factor, dtype=None):
    torch._check(x.dim() == 4 and weight.dim() == 4,
                 lambda: f"conv2d_sigmoid_sum: expected 4-D input and weight, got {x.dim()}-D and {weight.dim()}-D")
    rounded_input = x.dtype == torch.float32 and weight.dtype in (torch.float16, torch.bfloat16)
    torch._check(x.dtype.is_floating_point and (weight.dtype == x.dtype or rounded_input),
                 lambda: f"conv2d_sigmoid_sum: weight must have the input's floating dtype, or be 16-bit for a "
                         f"float32 input, got {x.dtype}, {weight.dtype}")
    torch._check(bias is None or bias.dtype == weight.dtype,
                 lambda: f"conv2d_sigmoid_sum: bias must have the weight's dtype, got {bias.dtype}, {weight.dtype}")
    torch._check(weight.shape[1] == x.shape[1],
                 lambda: f"conv2d_sigmoid_sum: the input has {x.shape[1]} channels, the weight expects {weight.shape[1]}")
    s, p = _pair(list(stride), "stride"), _pair(list(padding), "padding")
    for d in range(2):
        torch._check(x.shape[2 + d] + 2 * p[d] >= weight.shape[2 + d],
                     lambda: "conv2d_sigmoid_sum: the padded input is smaller than the kernel")
    _conv2d_output_size(x, weight, s, p)  # (its check of the stride)
    out = x.new_empty((x.shape[0],), dtype=_result_dtype(weight, dtype, "conv2d_sigmoid_sum"))
    factor_shape = _conv2d_grad_factor_shape(x, weight, stride, padding) if save_grad_factor else [0]
    return out, x.new_empty(factor_shape, dtype=_accumulation_dtype(weight.dtype))


@torch.library.register_fake("fused_ops::conv2d_sigmoid_sum_backward")
def _conv2d_sigmoid_sum_backward_fake(grad_out, grad_factor, x, weight, stride, padding, output_mask):
    torch._check(grad_out.dim() == 1 and grad_out.shape[0] == x.shape[0] and grad_out.dtype.is_floating_point,
                 lambda: f"conv2d_sigmoid_sum_backward: grad_out must be floating-point of shape (batch,), got "
                         f"{tuple(grad_out.shape)} {grad_out.dtype}")
    torch._check(list(grad_factor.shape) == _conv2d_grad_factor_shape(x, weight, stride, padding)
                 and grad_factor.dtype == _accumulation_dtype(weight.dtype),
                 lambda: f"conv2d_sigmoid_sum_backward: grad_factor must have the forward's shape and dtype, got "
                         f"{tuple(grad_factor.shape)} {grad_factor.dtype}")
    return (torch.empty_like(x, memory_format=torch.contiguous_format) if output_mask[0] else x.new_empty((0,)),
            torch.empty_like(weight, memory_format=torch.contiguous_format) if output_mask[1] else x.new_empty((0,)),
            weight.new_empty((weight.shape[0],)) if output_mask[2] else x.new_empty((0,)))
