"""avg_pool2d -> sigmoid -> sum (architecture C's tail) at its default size:
fused vs the eager tail vs torch.compile of the tail, forward and backward."""
import torch
import torch.nn.functional as F

import fused_ops
from timing import median_ms, time_tails

NAME = "avg_pool2d_sigmoid_sum"
# Architecture C's conv output: 128 x 64 x 382 x 382, AvgPool2d(4).
DEFAULT_SHAPE = (128, 64, 382, 382)
POOL = 4


def eager_tail(x):
    return torch.sigmoid(F.avg_pool2d(x, POOL)).sum(dim=[1, 2, 3])


def fused_tail(x):
    return fused_ops.avg_pool2d_sigmoid_sum(x, POOL)


def run(device, shape=DEFAULT_SHAPE, compile_tail=True):
    x = torch.rand(shape, device=device)
    pooled = x.numel() // POOL**2  # grad_factor elements saved (float32)
    with torch.no_grad():  # never time a wrong answer
        fused, eager = fused_tail(x), eager_tail(x.double())
    max_rel_err = ((fused.double() - eager).abs() / eager.abs()).max().item()
    assert max_rel_err < 1e-5, f"{NAME}: fused differs from eager by {max_rel_err:.2e} relative"
    rows = time_tails(NAME, fused_tail, eager_tail, x, device, compile_tail, max_rel_err)
    # the training forward also writes the saved factor
    xg = x.detach().requires_grad_()
    rows[0]["train_forward_ms"] = median_ms(lambda: fused_tail(xg), device)
    rows[0]["saved_bytes"] = pooled * 4
    # the backward op alone, without autograd's bookkeeping
    pool = ([POOL] * 2, [POOL] * 2, [0, 0])
    out, grad_factor = torch.ops.fused_ops.avg_pool2d_sigmoid_sum(x, *pool, False, True, None, True)
    grad = torch.rand_like(out)
    rows[0]["backward_op_ms"] = median_ms(
        lambda: torch.ops.fused_ops.avg_pool2d_sigmoid_sum_backward(grad, grad_factor, list(x.shape[2:]), *pool, False),
        device)
    return rows
