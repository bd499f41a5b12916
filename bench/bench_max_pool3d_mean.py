"""max_pool3d(y / divisor) -> global average -> + bias -> sum (architecture A's
tail) at its default size: fused vs the eager tail vs torch.compile of the
tail, forward and backward."""
import torch
import torch.nn.functional as F

import fused_ops
from timing import median_ms, time_tails

NAME = "max_pool3d_mean"
# Architecture A's conv output: 128 x 16 x 14 x 62 x 62, MaxPool3d(2), divisor 2, sum over dim 1.
DEFAULT_SHAPE = (128, 16, 14, 62, 62)
POOL = 2
DIVISOR = 2.0


def eager_tail(y, bias):
    return torch.sum(F.adaptive_avg_pool3d(F.max_pool3d(y / DIVISOR, POOL), 1) + bias, dim=1)


def fused_tail(y, bias):
    return torch.sum(fused_ops.max_pool3d_mean(y, POOL, divisor=DIVISOR)[:, :, None, None, None] + bias, dim=1)


def run(device, shape=DEFAULT_SHAPE, compile_tail=True):
    x = torch.rand(shape, device=device)
    bias = torch.randn(shape[1], 1, 1, 1, device=device)
    pooled = x.shape[0] * x.shape[1] * (x.shape[2] // POOL) * (x.shape[3] // POOL) * (x.shape[4] // POOL)
    with torch.no_grad():  # never time a wrong answer
        fused, eager = fused_tail(x, bias), eager_tail(x.double(), bias.double())
    max_rel_err = ((fused.double() - eager).abs().max() / eager.abs().max()).item()
    assert max_rel_err < 1e-5, f"{NAME}: fused differs from eager by {max_rel_err:.2e} relative"
    rows = time_tails(NAME, lambda y: fused_tail(y, bias), lambda y: eager_tail(y, bias), x, device,
                      compile_tail, max_rel_err)
    # the training forward also writes the picks, one byte per pooled element
    xg = x.detach().requires_grad_()
    rows[0]["train_forward_ms"] = median_ms(lambda: fused_tail(xg, bias), device)
    rows[0]["saved_bytes"] = pooled
    # the backward op alone, without autograd's bookkeeping
    pool = ([POOL] * 3, [POOL] * 3, [0] * 3)
    mean, picks = torch.ops.fused_ops.max_pool3d_mean(x, *pool, False, DIVISOR, True)
    grad = torch.rand_like(mean)
    rows[0]["backward_op_ms"] = median_ms(
        lambda: torch.ops.fused_ops.max_pool3d_mean_backward(grad, picks, None, list(x.shape[2:]), *pool, False,
                                                             DIVISOR),
        device)
    return rows
