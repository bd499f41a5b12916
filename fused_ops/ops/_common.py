"""What several ops' wrappers and fakes share: the extension's op namespace, the expansion and
checks of their arguments, the layouts the kernels choose, the result's and the accumulation's
dtypes, pooled sizes."""
from collections.abc import Sequence

import torch
from torch import Tensor

_ops = torch.ops.fused_ops


def _records(*tensors: Tensor | None) -> bool:
    """Whether autograd records a call on these tensors (None skipped): grad mode on, and one of them
    requires grad."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False


def _expand(value, n: int, name: str) -> list[int]:
    """An int, or a sequence of 1 or n ints, as a list of n ints (SymInts under torch.compile)."""
    if isinstance(value, (int, torch.SymInt)):
        return [value] * n
    if type(value) is tuple and len(value) == n and set(map(type, value)) == {int}:  # (a module's own: fast)
        return list(value)
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


def _result_dtype(x: Tensor | torch.dtype, dtype: torch.dtype | None, what: str) -> torch.dtype:
    """The fakes' check of an op's `dtype` argument (csrc/dispatch.h, result_dtype):
    the result's dtype, x's (None; x a tensor or its dtype) or its accumulation type."""
    input_dtype = x if isinstance(x, torch.dtype) else x.dtype
    if dtype is None:
        return input_dtype
    acc = _accumulation_dtype(input_dtype)
    torch._check(dtype in (input_dtype, acc), lambda: f"{what}: dtype must be the input's dtype ({input_dtype}) or "
                 f"its accumulation type ({acc}), got {dtype}")
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


# The largest kernel volume whose picks the forward saves, one byte each
# (csrc/max_pool3d_mean.h); past it the backward recomputes them from x.
_MAX_SAVED_KERNEL_VOLUME = 256


def _check_transposed_convolution_fake(x: Tensor, weight: Tensor, what: str) -> None:
    """The fakes' check of a 3-D transposed convolution's operands (csrc/convolution_checks.h)."""
    torch._check(x.dim() == 5 and weight.dim() == 5,
                 lambda: f"{what}: x and weight must be 5-D, got {x.dim()} and {weight.dim()}")
    torch._check(x.dtype.is_floating_point and weight.dtype == x.dtype,
                 lambda: f"{what}: x and weight must have one floating dtype, got {x.dtype} and {weight.dtype}")
    torch._check(weight.shape[0] == x.shape[1],
                 lambda: f"{what}: x has {x.shape[1]} channels, the weight's first dim is {weight.shape[0]}")
