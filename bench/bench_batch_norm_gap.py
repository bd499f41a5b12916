"""y * scale -> BatchNorm3d -> global average (architecture D's tail) at its
default size: fused vs the eager tail vs torch.compile of the tail; the
training forward (batch statistics, running statistics updated) and its
backward, and the eval forward (running statistics)."""
import torch
import torch.nn.functional as F

import fused_ops
from timing import median_ms, time_tails

NAME = "batch_norm_gap"
# Architecture D's conv output: 16 x 128 x 20 x 36 x 36 (212 MB fp32), scale 2.0,
# BatchNorm3d(128) as initialized (weight 1, bias 0), momentum 0.1.
DEFAULT_SHAPE = (16, 128, 20, 36, 36)
SCALE = 2.0
MOMENTUM = 0.1
EPS = 1e-5


def batch_norm_state(channels, device, dtype=torch.float32):
    """weight, bias, running_mean, running_var, num_batches_tracked as nn.BatchNorm3d starts them."""
    return [torch.ones(channels, device=device, dtype=dtype), torch.zeros(channels, device=device, dtype=dtype),
            torch.zeros(channels, device=device, dtype=dtype), torch.ones(channels, device=device, dtype=dtype),
            torch.tensor(0, device=device)]


def eager_tail(y, state, training=True):
    weight, bias, running_mean, running_var, _ = state
    z = F.batch_norm(y * SCALE, running_mean, running_var, weight, bias, training, MOMENTUM, EPS)
    return F.adaptive_avg_pool3d(z, 1)


def fused_tail(y, state, training=True):
    return fused_ops.batch_norm_gap(y, SCALE, *state, training=training, momentum=MOMENTUM, eps=EPS)


def run(device, shape=DEFAULT_SHAPE, compile_tail=True):
    x = torch.rand(shape, device=device)
    channels = shape[1]
    with torch.no_grad():  # never time a wrong answer (training and eval)
        errors = []
        for training in (True, False):
            fused = fused_tail(x, batch_norm_state(channels, device), training)
            eager = eager_tail(x.double(), batch_norm_state(channels, device, torch.float64), training)
            errors.append(((fused.double() - eager).abs().max() / eager.abs().max()).item())
    max_rel_err = max(errors)
    assert max_rel_err < 1e-5, f"{NAME}: fused differs from eager by {max_rel_err:.2e} relative to the largest"
    fused_state, eager_state = batch_norm_state(channels, device), batch_norm_state(channels, device)
    nbytes = x.numel() * x.element_size()
    rows = time_tails(NAME, lambda y: fused_tail(y, fused_state), lambda y: eager_tail(y, eager_state), x, device,
                      compile_tail, max_rel_err, backward_bytes=2 * nbytes,  # the backward reads x, writes grad_x
                      eval_tails=(lambda y: fused_tail(y, fused_state, False),
                                  lambda y: eager_tail(y, eager_state, False)))
    # the training forward with autograd: saves (B, C) plane deviations and three (C) statistics
    xg = x.detach().requires_grad_()
    rows[0]["train_forward_ms"] = median_ms(lambda: fused_tail(xg, fused_state), device)
    rows[0]["saved_bytes"] = (shape[0] + 3) * channels * 4
    # the backward op alone, without autograd's bookkeeping
    weight, bias = fused_state[:2]
    _, plane_dev, mean, rstd, _ = torch.ops.fused_ops.batch_norm_gap(x, SCALE, weight, bias, None, None, EPS)
    grad = torch.rand(shape[0], channels, 1, 1, 1, device=device)
    rows[0]["backward_op_ms"] = median_ms(
        lambda: torch.ops.fused_ops.batch_norm_gap_backward(grad, x, list(shape[2:]), SCALE, weight, plane_dev, mean,
                                                            rstd, True, True),
        device)
    return rows
