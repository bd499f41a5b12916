"""The fused ops: a thin Python wrapper per op and its fake (meta) implementation
for torch.compile.

The kernels themselves are registered by the C++ extension under
``torch.ops.fused_ops`` (schemas in csrc/ops.cpp), autograd included: each
differentiable op's Autograd kernel, wired to its handwritten backward op, is
in csrc/autograd/ (a Python one, torch.library.register_autograd, cost about
10 us of host time per call, even under no_grad).
"""
import math
from collections.abc import Sequence

import torch
from torch import Tensor

_ops = torch.ops.fused_ops


def _expand(value, n: int, name: str) -> list[int]:
    """An int, or a sequence of 1 or n ints, as a list of n ints (SymInts under torch.compile)."""
    if isinstance(value, (int, torch.SymInt)):
        return [value] * n
    if isinstance(value, Sequence) and len(value) in (1, n) and all(isinstance(v, (int, torch.SymInt)) for v in value):
        return [value[0]] * n if len(value) == 1 else list(value)
    raise TypeError(f"{name} must be an int or a sequence of 1 or {n} ints, got {value!r}")


def _pair(value, name: str) -> list[int]:
    return _expand(value, 2, name)


def _check_tensors(op: str, **tensors) -> None:
    """A TypeError naming op and the argument where one of `tensors` (name=value) is not a Tensor."""
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: {name} must be a Tensor, got {type(t).__name__}")


def _is_channels_last(x: Tensor) -> bool:
    # The C++ kernels' rule (csrc/avg_pool2d_sigmoid_sum.h, is_channels_last).
    return not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


def _is_channels_last_3d(t: Tensor) -> bool:
    """channels_last_3d and not also plainly contiguous (csrc/memory_format.h's is_channels_last_3d)."""
    return not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last_3d)


def _kernel_memory_format(x: Tensor) -> torch.memory_format:
    """The memory format a 5-D op lays out its picks and its input's gradient in, x being the
    op's input (or the picks): channels_last_3d for such an x on the CPU, whose kernels read it
    in vectors over channels (csrc/cpu/vectorized.h, grad_memory_format), else contiguous."""
    return torch.channels_last_3d if x.device.type == "cpu" and _is_channels_last_3d(x) else torch.contiguous_format


def _empty_5d(shape, like: Tensor, layout_of: Tensor | None, dtype: torch.dtype | None = None) -> Tensor:
    """An empty 5-D tensor on like's device (in like's dtype unless given), laid out by
    _kernel_memory_format(layout_of) (contiguous where layout_of is None)."""
    fmt = torch.contiguous_format if layout_of is None else _kernel_memory_format(layout_of)
    return torch.empty(shape, dtype=like.dtype if dtype is None else dtype, device=like.device, memory_format=fmt)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _result_dtype(x: Tensor, dtype: torch.dtype | None, what: str) -> torch.dtype:
    """The fakes' check of an op's `dtype` argument (csrc/dispatch.h, result_dtype):
    the result's dtype, x's (None) or its accumulation type."""
    if dtype is None:
        return x.dtype
    acc = _accumulation_dtype(x.dtype)
    torch._check(dtype in (x.dtype, acc), lambda: f"{what}: dtype must be the input's dtype ({x.dtype}) or its "
                 f"accumulation type ({acc}), got {dtype}")
    return dtype


def _pooled_size(size, kernel: int, stride: int, padding: int, ceil_mode: bool):
    # PyTorch's pooling_output_shape with dilation 1 (csrc/pool_geometry.h).
    out = (size + 2 * padding - kernel + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out -= 1
    return out


def _pool_triples(kernel_size, stride, padding) -> tuple[list[int], list[int], list[int]]:
    """nn.MaxPool3d's kernel_size, stride (None: the kernel size) and padding as lists of 3 ints."""
    kernel_size = _expand(kernel_size, 3, "kernel_size")
    no_stride = stride is None or (isinstance(stride, Sequence) and len(stride) == 0)
    return kernel_size, kernel_size if no_stride else _expand(stride, 3, "stride"), _expand(padding, 3, "padding")


def _check_5d_floating(x: Tensor, what: str) -> None:
    """The fakes' check of the kernels' first input rule: a 5-D floating-point tensor."""
    torch._check(x.dim() == 5, lambda: f"{what}: expected a 5-D input, got {x.dim()}-D")
    torch._check(x.dtype.is_floating_point, lambda: f"{what}: input must be a floating-point tensor, got {x.dtype}")


# --------------------------------------------------------------------------
# avg_pool2d_sigmoid_sum
# --------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# conv2d_sigmoid_sum


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
    """The saved factor's shape (csrc/conv2d_sigmoid_sum.h): (N, OH, ceil(OW / 48), ceil(O / 64), 3072)."""
    oh, ow = _conv2d_output_size(x, weight, stride, padding)
    return [x.shape[0], oh, -(-ow // 48), -(-weight.shape[0] // 64), 3072]


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


# ---------------------------------------------------------------------------
# conv3d_max_pool3d_mean


def _triple(value, name: str) -> list[int]:
    return _expand(value, 3, name)


def conv3d_max_pool3d_mean(x: Tensor, weight: Tensor, bias: Tensor | None = None, padding=0, pool=2,
                           divisor=1.0, *, dtype: torch.dtype | None = None) -> Tensor:
    """``F.max_pool3d(F.conv3d(x, weight, bias, 1, padding) / divisor, pool).mean(dim=(2, 3, 4))``
    (pool: kernel = stride, no padding, floor mode); on a GPU (float32 with TF32 convolutions
    allowed, or a 16-bit weight; a 3 x 3 x 3 kernel, a 2 x 2 x 2 pool, at most 16 input and
    output channels, rows of whole 16-byte chunks) the convolution and its tail in one
    tensor-core kernel whose output never reaches memory.

    x: (B, C, D, H, W); weight (O, C, kd, kh, kw) and bias (O,) in x's dtype, or float16 /
    bfloat16 with a float32 x (as autocast passes them: x is rounded to the weight's dtype as
    it is read). dtype: the result's: the weight's (None) or its accumulation type. Returns
    (B, O). Differentiable in x, weight and bias: where one of them requires grad the forward
    saves each window's pick (one byte), from which the backward routes the gradient to the
    picks and runs PyTorch's convolution backward.
    """
    _check_tensors("conv3d_max_pool3d_mean", x=x)
    save = torch.is_grad_enabled() and (x.requires_grad or (isinstance(weight, Tensor) and weight.requires_grad)
                                        or (isinstance(bias, Tensor) and bias.requires_grad))
    mean, _ = _ops.conv3d_max_pool3d_mean(x, weight, bias, _triple(padding, "padding"), _triple(pool, "pool"),
                                          float(divisor), save, dtype)
    return mean


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


@torch.library.register_fake("fused_ops::conv3d_max_pool3d_mean")
def _conv3d_max_pool3d_mean_fake(x, weight, bias, padding, pool, divisor, save_indices, dtype=None):
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
    mean = x.new_empty((x.shape[0], weight.shape[0]), dtype=_result_dtype(weight, dtype, "conv3d_max_pool3d_mean"))
    indices_shape = [x.shape[0], weight.shape[0], *pooled] if save_indices else [0]
    return mean, x.new_empty(indices_shape, dtype=torch.uint8)


@torch.library.register_fake("fused_ops::conv3d_max_pool3d_mean_backward")
def _conv3d_max_pool3d_mean_backward_fake(grad_mean, indices, x, weight, padding, pool, divisor, output_mask):
    torch._check(grad_mean.dim() == 2 and grad_mean.dtype.is_floating_point,
                 lambda: f"conv3d_max_pool3d_mean_backward: grad_mean must be floating-point (batch, out_channels), "
                         f"got {tuple(grad_mean.shape)} {grad_mean.dtype}")
    torch._check(list(indices.shape) == [x.shape[0], weight.shape[0], *_conv3d_pooled_size(x, weight, padding, pool)]
                 and indices.dtype == torch.uint8,
                 lambda: f"conv3d_max_pool3d_mean_backward: indices must be the forward's, got "
                         f"{tuple(indices.shape)} {indices.dtype}")
    return (torch.empty_like(x, memory_format=torch.contiguous_format) if output_mask[0] else x.new_empty((0,)),
            torch.empty_like(weight, memory_format=torch.contiguous_format) if output_mask[1] else x.new_empty((0,)),
            weight.new_empty((weight.shape[0],)) if output_mask[2] else x.new_empty((0,)))


# --------------------------------------------------------------------------
# max_pool3d_mean
# --------------------------------------------------------------------------


# The largest kernel volume whose picks the forward saves, one byte each
# (csrc/max_pool3d_mean.h); past it the backward recomputes them from x.
_MAX_SAVED_KERNEL_VOLUME = 256


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


# --------------------------------------------------------------------------
# max_pool3d_cascade_sum
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# parity_max_pool3d_mean, parity_max_pool3d_cascade_sum
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# depth_stacked_channels_last
# --------------------------------------------------------------------------

_KERNEL_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def depth_stacked_channels_last(x: Tensor, taps: int, stride: int, start, size, *,
                                dtype: torch.dtype | None = None) -> Tensor:
    """x cropped and zero-padded, channels last, with `taps` depths side by side: the input
    of a 2-D convolution that computes a 3-D one's depth taps as input channels
    (fused_ops.rewrites), in one pass over x.

    x: (N, I, D, H, W), float64/float32/float16/bfloat16, any strides (read in place).
    taps, stride: positive ints; start: 3 ints (or one for all), may be negative; size:
    3 non-negative ints (M, Hs, Ws). dtype: the result's dtype, any of those four (None:
    x's). Returns (N, M, Hs, Ws, taps, I), contiguous, in that dtype, with
    ``out[n, m, h, w, a, i] = x[n, i, start[0] + stride * m + a, start[1] + h, start[2] + w]``
    where that index lies inside x, else 0, each value cast as ``Tensor.to`` casts.
    Under autocast it runs as called. Not differentiable (no autograd formula): for an x
    that needs no gradient.
    """
    _check_tensors("depth_stacked_channels_last", x=x)
    if torch.is_grad_enabled() and x.requires_grad:
        raise RuntimeError("depth_stacked_channels_last: not differentiable, and x requires grad "
                           "(run it under torch.no_grad() or on a detached x)")
    return _ops.depth_stacked_channels_last(x, taps, stride, _expand(start, 3, "start"), _expand(size, 3, "size"),
                                            dtype)


@torch.library.register_fake("fused_ops::depth_stacked_channels_last")
def _depth_stacked_channels_last_fake(x, taps, stride, start, size, dtype=None):
    what = "depth_stacked_channels_last"
    torch._check(x.dim() == 5, lambda: f"{what}: expected a 5-D input x, got {x.dim()}-D")
    torch._check(x.dtype in _KERNEL_DTYPES, lambda: f"{what}: x must be a floating-point tensor, got {x.dtype}")
    torch._check(taps >= 1, lambda: f"{what}: taps must be at least 1, got {taps}")
    torch._check(stride >= 1, lambda: f"{what}: stride must be at least 1, got {stride}")
    size = _expand(list(size), 3, "size")
    torch._check(all(s >= 0 for s in size), lambda: f"{what}: size must be non-negative, got {size}")
    out_dtype = x.dtype if dtype is None else dtype
    torch._check(out_dtype in _KERNEL_DTYPES, lambda: f"{what}: dtype must be a floating-point type, got {out_dtype}")
    return x.new_empty((x.shape[0], *size, taps, x.shape[1]), dtype=out_dtype)


# --------------------------------------------------------------------------
# batch_norm_gap
# --------------------------------------------------------------------------


def _check_number(name: str, value, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"batch_norm_gap: {name} must be a number{' or None' if optional else ''}, got {value!r}")


def batch_norm_gap(x: Tensor, scale=1.0, weight: Tensor | None = None, bias: Tensor | None = None,
                   running_mean: Tensor | None = None, running_var: Tensor | None = None,
                   num_batches_tracked: Tensor | None = None, training: bool = False, momentum=0.1,
                   eps=1e-5, *, dtype: torch.dtype | None = None) -> Tensor:
    """``F.adaptive_avg_pool3d(F.batch_norm(x * scale, ...), 1)`` in one pass over x, as
    ``nn.BatchNorm3d`` normalizes and updates its running statistics.

    x: (B, C, D, H, W), float64/float32/float16/bfloat16, any strides (read in
    place); ``x * scale`` is rounded to x's dtype as PyTorch computes it.
    Normalizes with the batch's statistics over (B, D, H, W) (biased
    variance) when training or when no running statistics are given, else
    with running_mean and running_var. Training with running statistics
    updates them in place as nn.BatchNorm3d does, on the device and without a
    host synchronization: num_batches_tracked (when given) is incremented,
    the factor is momentum, or with momentum None 1 / num_batches_tracked
    (a cumulative average), and running_var takes the unbiased variance.
    weight, bias, running_mean, running_var: (C,) in x's dtype (or float32
    for a float16 or bfloat16 x); num_batches_tracked: an int64 scalar
    tensor. dtype: the result's dtype: x's (None) or its accumulation type,
    float32 for a 16-bit x. Returns (B, C, 1, 1, 1) in that dtype; the
    statistics are taken without cancellation (shifted by an element of each
    channel) in float32 (float64 for float64 x). Differentiable in x, weight
    and bias, through the batch statistics where it uses them.
    """
    _check_tensors("batch_norm_gap", x=x)
    _check_number("scale", scale)
    _check_number("momentum", momentum, optional=True)
    _check_number("eps", eps)
    if (running_mean is None) != (running_var is None):
        raise ValueError("batch_norm_gap: pass both running_mean and running_var or neither")
    batch_stats = training or running_mean is None
    update = training and running_mean is not None
    if batch_stats and x.dim() == 5 and x.shape[0] * x.shape[2] * x.shape[3] * x.shape[4] == 1:
        # one value per channel; nn.BatchNorm3d counts the batch before F.batch_norm refuses it
        if update and num_batches_tracked is not None:
            num_batches_tracked.add_(1)
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {x.size()}")
    out, _, mean, _, var = _ops.batch_norm_gap(
        x, float(scale), weight, bias, None if batch_stats else running_mean, None if batch_stats else running_var,
        float(eps), dtype)
    if update:
        count = x.shape[0] * x.shape[2] * x.shape[3] * x.shape[4]
        _ops.batch_norm_update_running_stats(running_mean, running_var, num_batches_tracked, mean, var, count,
                                             None if momentum is None else float(momentum))
        if not torch.compiler.is_compiling():
            # the op writes them below autograd: their versions advanced as an in-place op's
            # would (autograd's check of the tensors a backward saved)
            torch.autograd.graph.increment_version([t for t in (running_mean, running_var, num_batches_tracked)
                                                    if t is not None and not t.is_inference()])
    return out


@torch.library.register_fake("fused_ops::batch_norm_gap")
def _batch_norm_gap_fake(x, scale, weight, bias, running_mean, running_var, eps, dtype=None):
    _check_5d_floating(x, "batch_norm_gap")
    batch, channels = x.shape[:2]
    acc = _accumulation_dtype(x.dtype)
    channel_stat = [x.new_empty((channels,), dtype=acc) for _ in range(3)]
    out = x.new_empty((batch, channels, 1, 1, 1), dtype=_result_dtype(x, dtype, "batch_norm_gap"))
    return out, x.new_empty((batch, channels), dtype=acc), *channel_stat


@torch.library.register_fake("fused_ops::batch_norm_gap_backward")
def _batch_norm_gap_backward_fake(grad_out, x, input_size, scale, weight, plane_dev, mean, rstd, batch_stats,
                                  grad_input):
    batch, channels = plane_dev.shape
    # (laid out as the kernels lay it out: a channels_last_3d x's gradient channels_last_3d on the CPU,
    # and on a GPU where it goes through batch statistics)
    shape = (batch, channels, *input_size)
    if not grad_input:
        grad_x = grad_out.new_empty((0,))
    elif x is not None and x.is_cuda and batch_stats and _is_channels_last_3d(x):
        grad_x = torch.empty(shape, dtype=grad_out.dtype, device=grad_out.device, memory_format=torch.channels_last_3d)
    else:
        grad_x = _empty_5d(shape, grad_out, x)
    param_dtype = grad_out.dtype if weight is None else weight.dtype
    return grad_x, grad_out.new_empty((channels,), dtype=param_dtype), grad_out.new_empty((channels,), dtype=param_dtype)


@torch.library.register_fake("fused_ops::batch_norm_update_running_stats")
def _batch_norm_update_running_stats_fake(running_mean, running_var, num_batches_tracked, mean, var, count, momentum):
    return None



# ---------------------------------------------------------------------------
# conv_transpose3d_batch_norm_eval_mean


def conv_transpose3d_batch_norm_eval_mean(x: Tensor, weight: Tensor, bias: Tensor | None, bn_weight: Tensor | None,
                                          bn_bias: Tensor | None, running_mean: Tensor, running_var: Tensor,
                                          stride=1, output_padding=0, scale=1.0, eps: float = 1e-5, *,
                                          dtype: torch.dtype | None = None) -> Tensor:
    """``F.adaptive_avg_pool3d(F.batch_norm(scale * F.conv_transpose3d(x, weight, bias, stride, 0,
    output_padding), running_mean, running_var, bn_weight, bn_bias, False, 0, eps), 1)`` as (N, O): architecture
    D's eval forward, for a transposed convolution without padding, dilation or groups. Affine in x's spatial
    sums there (every input element meets every tap inside the output): x summed over its planes, then one
    kernel maps the sums by the weight's tap sums, the bias, the scale and the batch norm, in float64
    (csrc/conv_transpose3d_batch_norm_eval_mean.h); nothing derived from the parameters is kept between calls.

    x: (N, I, D, H, W); weight (I, O, kt, kr, ks) and bias (O) of x's dtype; bn_weight, bn_bias, running_mean,
    running_var (O) of one floating dtype (x's, or float32 for a 16-bit x). scale: finite (the mean of
    scale * y is scale * mean(y) for a finite scale only). dtype: the result's, x's (None) or its accumulation
    type. Not differentiable.
    """
    _check_tensors("conv_transpose3d_batch_norm_eval_mean", x=x, weight=weight, running_mean=running_mean,
                   running_var=running_var)
    if not torch.compiler.is_compiling() and not math.isfinite(scale):  # (a compiler's scale may be symbolic)
        raise ValueError(f"conv_transpose3d_batch_norm_eval_mean: scale must be finite, got {scale}")
    return _ops.conv_transpose3d_batch_norm_eval_mean(x, weight, bias, bn_weight, bn_bias, running_mean, running_var,
                                                      _expand(stride, 3, "stride"),
                                                      _expand(output_padding, 3, "output_padding"), float(scale),
                                                      float(eps), dtype)


@torch.library.register_fake("fused_ops::conv_transpose3d_batch_norm_eval_mean")
def _conv_transpose3d_batch_norm_eval_mean_fake(x, weight, bias, bn_weight, bn_bias, running_mean, running_var, stride,
                                                output_padding, scale, eps, dtype=None):
    what = "conv_transpose3d_batch_norm_eval_mean"
    _check_transposed_convolution_fake(x, weight, what)
    for name, t in (("bias", bias), ("bn_weight", bn_weight), ("bn_bias", bn_bias), ("running_mean", running_mean),
                    ("running_var", running_var)):
        torch._check(t is None or (t.dim() == 1 and t.shape[0] == weight.shape[1]),
                     lambda: f"{what}: {name} must be 1-D with one element per output channel ({weight.shape[1]})")
    return x.new_empty((x.shape[0], weight.shape[1]), dtype=_result_dtype(x, dtype, what))



# ---------------------------------------------------------------------------
# conv_transpose3d_cascade_weight_grad


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



# ---------------------------------------------------------------------------
# conv_transpose3d_weight_grad


def conv_transpose3d_weight_grad(grad_y: Tensor, x: Tensor, kernel_size) -> Tensor:
    """The weight gradient of ``conv_transpose3d(x, w)`` of stride 1 without padding, dilation or
    groups (w (I, O, *kernel_size)): ``grad_w[i, o, t, r, s]`` = the sum over n, z, h, w of
    ``x[n, i, z, h, w] * grad_y[n, o, z + t, h + r, w + s]``, (I, O, *kernel_size) contiguous in
    x's dtype, as ``aten.convolution_backward`` returns the weight's.

    grad_y: (N, O, D + kt - 1, H + kr - 1, W + ks - 1); x: (N, I, D, H, W), of grad_y's dtype.
    On an sm_90 GPU (H100, H200) in a build with CUTLASS's headers (setup.py), CUTLASS Hopper
    kernels (csrc/cuda/conv_transpose3d_weight_grad.cu), sums in float32: float32 where PyTorch's
    convolutions use TF32 (``torch.backends.cudnn.allow_tf32``) as per-depth-tap TF32 2-D
    convolutions, bfloat16 as a 3-D weight-gradient convolution; SPEC's D on an H200, the op
    (its layout copies included): 3.04 ms against cuDNN's 6.40 in TF32 (2.94 from channels-last
    operands), 1.08 against 2.30 in bfloat16 (bench/bench_conv_transpose3d_weight_grad.py). Everything else (float16, float64,
    float32 without TF32, other devices, sizes the kernels do not take, a build without CUTLASS:
    ``conv_transpose3d_weight_grad_path`` says which) by ``aten.convolution_backward`` (cuDNN's
    on a GPU). Not differentiable.
    """
    _check_tensors("conv_transpose3d_weight_grad", grad_y=grad_y, x=x)
    return _ops.conv_transpose3d_weight_grad(grad_y, x, _expand(kernel_size, 3, "kernel_size"))


def conv_transpose3d_weight_grad_path(grad_y: Tensor, x: Tensor, kernel_size) -> str:
    """Which implementation conv_transpose3d_weight_grad takes for these arguments (under the
    current TF32 setting): a kernel's name ("tf32 shifted rows 5 shifts split5",
    "cutlass bf16 wgrad 64x128x64"), or "aten.convolution_backward" (on a GPU, with " (built
    without CUTLASS)" where the build has no CUTLASS kernels)."""
    return _ops.conv_transpose3d_weight_grad_path(grad_y, x, _expand(kernel_size, 3, "kernel_size"))


@torch.library.register_fake("fused_ops::conv_transpose3d_weight_grad")
def _conv_transpose3d_weight_grad_fake(grad_y, x, kernel_size):
    what = "conv_transpose3d_weight_grad"
    torch._check(x.dim() == 5 and grad_y.dim() == 5,
                 lambda: f"{what}: x and grad_y must be 5-D, got {x.dim()} and {grad_y.dim()}")
    torch._check(x.dtype.is_floating_point and grad_y.dtype == x.dtype,
                 lambda: f"{what}: x and grad_y must have one floating dtype, got {x.dtype} and {grad_y.dtype}")
    k = _expand(list(kernel_size), 3, "kernel_size")
    torch._check(grad_y.shape[0] == x.shape[0] and all(grad_y.shape[2 + d] == x.shape[2 + d] + k[d] - 1
                                                       for d in range(3)),
                 lambda: f"{what}: grad_y's shape {tuple(grad_y.shape)} does not suit x's {tuple(x.shape)} and "
                         f"kernel_size {k}")
    return x.new_empty((x.shape[1], grad_y.shape[1], *k))



# ---------------------------------------------------------------------------
# conv_transpose3d_stride1_channels_last


def conv_transpose3d_stride1_channels_last(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                                           padding=0) -> Tensor:
    """``F.conv_transpose3d(x, weight, bias, stride=1, padding=padding)`` (no dilation or groups),
    returned channels_last_3d (memory (N, D', H', W', O)) in x's dtype.

    x: (N, I, D, H, W); weight: (I, O, kt, kr, ks) and bias (O) or None, of x's dtype; padding:
    an int or 3 ints, 0 <= padding < kernel. On an sm_90 GPU (H100, H200) in a build with
    CUTLASS's headers (setup.py), CUTLASS's Hopper implicit-GEMM 3-D convolution of x with the
    kernel flipped (csrc/cuda/conv_transpose3d_stride1_channels_last.cu), the bias added in its
    epilogue, sums in float32: float32 where PyTorch's convolutions use TF32
    (``torch.backends.cudnn.allow_tf32``), bfloat16 (bench/bench_conv_transpose3d_stride1_channels_last.py
    times it). Everything else (float16, float64, float32 without TF32, other devices, channels not
    a multiple of 16 bytes, a build without CUTLASS: ``conv_transpose3d_stride1_channels_last_path``
    says which) by ``aten.conv_transpose3d``, on the CPU 16-bit operands in float32 (y rounded once:
    aten's CPU float16 convolution does not accumulate in float32 everywhere). Not differentiable.
    """
    _check_tensors("conv_transpose3d_stride1_channels_last", x=x, weight=weight)
    return _ops.conv_transpose3d_stride1_channels_last(x, weight, bias, _expand(padding, 3, "padding"))


def conv_transpose3d_stride1_channels_last_path(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                                                padding=0) -> str:
    """Which implementation conv_transpose3d_stride1_channels_last takes for these arguments (under
    the current TF32 setting): a CUTLASS kernel's name ("cutlass tf32 fprop3d 128x128x32"), or
    "aten.conv_transpose3d" (on a GPU, with " (built without CUTLASS)" where the build has no
    CUTLASS kernels)."""
    return _ops.conv_transpose3d_stride1_channels_last_path(x, weight, bias, _expand(padding, 3, "padding"))


def _check_transposed_convolution_fake(x: Tensor, weight: Tensor, what: str) -> None:
    """The fakes' check of a 3-D transposed convolution's operands (csrc/convolution_checks.h)."""
    torch._check(x.dim() == 5 and weight.dim() == 5,
                 lambda: f"{what}: x and weight must be 5-D, got {x.dim()} and {weight.dim()}")
    torch._check(x.dtype.is_floating_point and weight.dtype == x.dtype,
                 lambda: f"{what}: x and weight must have one floating dtype, got {x.dtype} and {weight.dtype}")
    torch._check(weight.shape[0] == x.shape[1],
                 lambda: f"{what}: x has {x.shape[1]} channels, the weight's first dim is {weight.shape[0]}")


@torch.library.register_fake("fused_ops::conv_transpose3d_stride1_channels_last")
def _conv_transpose3d_stride1_channels_last_fake(x, weight, bias, padding):
    what = "conv_transpose3d_stride1_channels_last"
    _check_transposed_convolution_fake(x, weight, what)
    p = _expand(list(padding), 3, "padding")
    size = [x.shape[2 + d] + weight.shape[2 + d] - 1 - 2 * p[d] for d in range(3)]
    return x.new_empty((x.shape[0], *size, weight.shape[1])).permute(0, 4, 1, 2, 3)


# ---------------------------------------------------------------------------
# conv_transpose3d_cascade_sum


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


# ---------------------------------------------------------------------------
# box_fold2d


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
