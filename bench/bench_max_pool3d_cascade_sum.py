"""max_pool3d(2) -> max_pool3d(3) -> sum over channels (architecture B's tail)
at its default size: fused vs the eager tail vs torch.compile of the tail,
forward and backward."""
import math

import torch
import torch.nn.functional as F

import fused_ops
from timing import median_ms, time_tails

NAME = "max_pool3d_cascade_sum"
# Architecture B's conv output: 16 x 64 x 63^3 (1.02 GB fp32) -> 31^3 -> 10^3.
DEFAULT_SHAPE = (16, 64, 63, 63, 63)
POOL1, POOL2 = 2, 3


def eager_tail(y):
    return F.max_pool3d(F.max_pool3d(y, POOL1), POOL2).sum(dim=1, keepdim=True)


def fused_tail(y):
    return fused_ops.max_pool3d_cascade_sum(y, POOL1, POOL2)


def run(device, shape=DEFAULT_SHAPE, compile_tail=True):
    x = torch.rand(shape, device=device)
    out_size = [s // POOL1 // POOL2 for s in shape[2:]]
    with torch.no_grad():  # never time a wrong answer
        fused, eager = fused_tail(x), eager_tail(x.double())
    max_rel_err = ((fused.double() - eager).abs().max() / eager.abs().max()).item()
    assert max_rel_err < 1e-5, f"{NAME}: fused differs from eager by {max_rel_err:.2e} relative"
    # the forward reads only the boxes of x that reach the output
    read = shape[0] * shape[1] * math.prod(o * POOL1 * POOL2 for o in out_size) * x.element_size()
    rows = time_tails(NAME, fused_tail, eager_tail, x, device, compile_tail, max_rel_err, forward_bytes=read)
    # the training forward also writes the picks, one byte per output and channel
    xg = x.detach().requires_grad_()
    rows[0]["train_forward_ms"] = median_ms(lambda: fused_tail(xg), device)
    rows[0]["saved_bytes"] = shape[0] * shape[1] * math.prod(out_size)
    # the backward op alone, without autograd's bookkeeping
    pools = ([POOL1] * 3, [POOL1] * 3, [0] * 3, [POOL2] * 3, [POOL2] * 3, [0] * 3)
    out, picks = torch.ops.fused_ops.max_pool3d_cascade_sum(x, *pools, True)
    grad = torch.rand_like(out)
    rows[0]["backward_op_ms"] = median_ms(
        lambda: torch.ops.fused_ops.max_pool3d_cascade_sum_backward(grad, picks, None, list(x.shape[2:]), *pools),
        device)
    return rows
