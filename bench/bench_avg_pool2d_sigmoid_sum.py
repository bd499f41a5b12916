"""avg_pool2d -> sigmoid -> sum (architecture C's tail) at its default size:
fused vs the eager tail vs torch.compile of the tail, forward and backward."""
import torch
import torch.nn.functional as F

import fused_ops
from timing import median_ms

NAME = "avg_pool2d_sigmoid_sum"
# Architecture C's conv output: 128 x 64 x 382 x 382, AvgPool2d(4).
DEFAULT_SHAPE = (128, 64, 382, 382)
POOL = 4


def eager_tail(x):
    return torch.sigmoid(F.avg_pool2d(x, POOL)).sum(dim=[1, 2, 3])


def fused_tail(x):
    return fused_ops.avg_pool2d_sigmoid_sum(x, POOL)


def backward_ms(fn, x, device):
    """Time of the backward alone: one forward, then autograd.grad repeated."""
    x = x.detach().requires_grad_()
    out = fn(x)
    grad = torch.rand_like(out)
    ms = median_ms(lambda: torch.autograd.grad(out, x, grad, retain_graph=True), device)
    del out
    return ms


def run(device, shape=DEFAULT_SHAPE, compile_tail=True):
    x = torch.rand(shape, device=device)
    nbytes = x.numel() * x.element_size()
    pooled = x.numel() // POOL**2  # grad_factor elements saved (float32)
    with torch.no_grad():  # never time a wrong answer
        fused, eager = fused_tail(x), eager_tail(x.double())
    max_rel_err = ((fused.double() - eager).abs() / eager.abs()).max().item()
    assert max_rel_err < 1e-5, f"{NAME}: fused differs from eager by {max_rel_err:.2e} relative"
    variants = {"fused": fused_tail, "eager": eager_tail}
    if compile_tail:
        variants["compile"] = torch.compile(eager_tail)
    rows = []
    for name, fn in variants.items():
        with torch.no_grad():
            fwd = median_ms(lambda: fn(x), device)
        bwd = backward_ms(fn, x, device)
        rows.append(dict(op=NAME, variant=name, shape=list(shape), dtype="float32",
                         forward_ms=fwd, backward_ms=bwd, max_rel_err=max_rel_err,
                         # the fewest bytes each pass must move: read x / write grad_x
                         forward_bytes=nbytes, backward_bytes=nbytes))
    # the training forward also writes the saved factor
    xg = x.detach().requires_grad_()
    rows[0]["train_forward_ms"] = median_ms(lambda: fused_tail(xg), device)
    rows[0]["saved_bytes"] = pooled * 4
    return rows
