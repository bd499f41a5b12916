"""batch_norm_gap: the wrapper, and the fakes of the op, its backward and
batch_norm_update_running_stats (the running statistics' update it makes in training)."""
import torch
from torch import Tensor

from ._common import (_accumulation_dtype, _check_5d_floating, _check_tensors, _empty_5d, _is_channels_last_3d, _ops,
                      _result_dtype)


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
