"""Every op's autograd and its outputs that carry no gradient (saved factors,
picks, batch statistics): no zero gradients are filled for them before a
backward, and a backward whose differentiable output got no gradient from the
graph after it gives none to the inputs. Each op's Autograd kernel is C++
(csrc/autograd/), and records no graph where no input requires grad."""
import pytest
import torch

import fused_ops
from conftest import make_input

# op: (input shape, the fused op on x)
OPS = {
    "avg_pool2d_sigmoid_sum": ((2, 3, 9, 10), lambda x: fused_ops.avg_pool2d_sigmoid_sum(x, 2)),
    "max_pool3d_mean": ((2, 3, 6, 7, 8), lambda x: fused_ops.max_pool3d_mean(x, 2)),
    "max_pool3d_cascade_sum": ((2, 3, 12, 13, 12), lambda x: fused_ops.max_pool3d_cascade_sum(x, 2, 3)),
    "parity_max_pool3d_mean": ((2, 3, 4, 5, 3, 8), fused_ops.parity_max_pool3d_mean),
    "parity_max_pool3d_cascade_sum": ((2, 6, 6, 3, 3, 8),
                                      lambda y: fused_ops.parity_max_pool3d_cascade_sum(y, 3)),
    "batch_norm_gap": ((2, 3, 4, 5, 6), lambda x: fused_ops.batch_norm_gap(
        x, 0.5, torch.rand(3, dtype=x.dtype, device=x.device), torch.rand(3, dtype=x.dtype, device=x.device),
        training=True)),
}


class NoGradient(torch.autograd.Function):
    """Identity whose backward gives its input no gradient."""

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


@pytest.mark.parametrize("op", OPS)
def test_no_zero_gradients_filled(op, device):
    shape, fn = OPS[op]
    x = make_input(shape, torch.float64, device, requires_grad=True)
    out = fn(x)
    grad = torch.rand_like(out)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.autograd.grad(out, x, grad)
    fills = [e.name for e in prof.events() if e.name in ("aten::zeros", "aten::zeros_like", "aten::zero_")]
    assert not fills, f"{op}: the backward filled {fills}"


@pytest.mark.parametrize("op", OPS)
def test_no_gradient_from_the_graph_after(op, device):
    shape, fn = OPS[op]
    x = make_input(shape, torch.float64, device, requires_grad=True)
    (NoGradient.apply(fn(x)).sum() + x.sum()).backward()
    assert torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("op", OPS)
def test_autograd_kernel_in_cpp(op):
    """The op's Autograd kernel is registered from its C++ file (csrc/autograd/<op>.cpp), not
    from Python (torch.library.register_autograd: ~10 us of host time per call)."""
    dump = torch._C._dispatch_dump(f"fused_ops::{op}")
    autograd = [line for line in dump.splitlines() if line.startswith("Autograd")]
    assert len(autograd) == 1 and f"csrc/autograd/{op}.cpp" in autograd[0], dump


@pytest.mark.parametrize("op", OPS)
def test_no_graph_without_grad(op, device):
    shape, fn = OPS[op]
    x = make_input(shape, torch.float64, device, requires_grad=True)
    with torch.no_grad():
        assert not fn(x).requires_grad
    assert not fn(x.detach()).requires_grad
    assert fn(x).requires_grad
