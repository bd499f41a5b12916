"""fused_ops.enable_compile_patterns: inside torch.compile (Inductor), the fused tails of a model
written without fused_ops in mind replaced by the fused ops in inference graphs (the generated
code calls them), with the compiled model's results; what must stay (an intermediate used twice,
a training graph) stays."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.utils import run_and_get_code

import fused_ops
from conftest import DEVICES


class Heads(nn.Module):
    """C's chain, C's tail after another producer, A's tail with a division, B's cascade tail."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.other = nn.Conv2d(3, 5, 3, stride=2)
        self.conv3d = nn.Conv3d(3, 6, 3)

    def forward(self, image, volume):
        c = torch.sigmoid(F.avg_pool2d(self.conv(image), 4)).sum(dim=(1, 2, 3))
        c_tail = torch.sigmoid(F.avg_pool2d(torch.relu(self.other(image)), 3, stride=2, padding=1)).sum((1, 2, 3))
        h = self.conv3d(volume)
        a = F.adaptive_avg_pool3d(F.max_pool3d(h / -1.5, 2), 1)
        b = F.max_pool3d(F.max_pool3d(torch.relu(h), 2), 2, stride=1).sum(1, keepdim=True)
        return c, c_tail, a, b


@pytest.fixture
def patterns():
    fused_ops.enable_compile_patterns()
    yield
    fused_ops.disable_compile_patterns()


def inputs(device):
    g = torch.Generator().manual_seed(0)
    return (torch.rand(2, 3, 23, 27, generator=g).to(device), torch.rand(2, 3, 9, 11, 12, generator=g).to(device))


@pytest.mark.parametrize("device", DEVICES)
def test_inference_graphs_call_the_fused_ops(patterns, device):
    """(Full float32 convolutions: the fused kernels' TF32 is the fused ops' own tests' business.)"""
    torch.manual_seed(0)
    model = Heads().to(device).eval()
    args = inputs(device)
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        expected = model(*args)
        outputs, code = run_and_get_code(torch.compile(model), *args)
    code = "\n".join(code)
    for op in ("box_fold2d", "conv2d_sigmoid_sum", "avg_pool2d_sigmoid_sum", "max_pool3d_mean",
               "max_pool3d_cascade_sum"):
        assert f"fused_ops.{op}" in code, op
    for out, ref in zip(outputs, expected, strict=True):
        assert out.shape == ref.shape and out.dtype == ref.dtype
        torch.testing.assert_close(out, ref, rtol=2e-5, atol=1e-5)


def test_an_intermediate_used_twice_stays(patterns):
    class Twice(nn.Module):
        def forward(self, y):
            pooled = F.avg_pool2d(y, 2)
            return torch.sigmoid(pooled).sum((1, 2, 3)), pooled.amax()

    y = torch.rand(2, 3, 8, 8)
    with torch.no_grad():
        outputs, code = run_and_get_code(torch.compile(Twice()), y)
    assert "fused_ops" not in "\n".join(code)
    torch.testing.assert_close(outputs, Twice()(y))


def test_training_graphs_stay(patterns):
    """A training graph saves the forward's intermediates for the backward: nothing matches, and
    the gradients are the eager model's."""
    torch.manual_seed(1)
    model = Heads()
    image, volume = inputs("cpu")
    compiled = torch.compile(model)

    def step():
        loss = sum(o.sum() for o in compiled(image, volume))
        return torch.autograd.grad(loss, list(model.parameters()))

    grads, code = run_and_get_code(step)
    assert "fused_ops" not in "\n".join(code)
    expected = torch.autograd.grad(sum(o.sum() for o in model(image, volume)), list(model.parameters()))
    for grad, ref in zip(grads, expected, strict=True):
        torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-5)


class NotOurs(nn.Module):
    """Near misses: a sum with a dtype (the fused ops' result would drop it), one max-pool before
    B's channel sum, a max-pool after another op; and A's tail after an integer tensor's division
    (fused on the quotient: the division stays)."""

    def forward(self, y, v):
        c = torch.sigmoid(F.avg_pool2d(y, 2)).sum((1, 2, 3), dtype=torch.float64)
        b = F.max_pool3d(v, 2).sum(1, keepdim=True)
        b2 = F.max_pool3d(F.avg_pool3d(v, 2), 2).sum(1, keepdim=True)
        a = F.adaptive_avg_pool3d(F.max_pool3d((v * 8).int() / 2, 2), 1)  # (the division stays)
        return c, b, b2, a


def test_near_misses_stay(patterns):
    y, v = torch.rand(2, 3, 8, 8), torch.rand(2, 3, 8, 8, 8)
    with torch.no_grad():
        outputs, code = run_and_get_code(torch.compile(NotOurs()), y, v)
    code = "\n".join(code)
    assert "fused_ops.max_pool3d_mean" in code  # (A's tail, on the quotient)
    assert "avg_pool2d_sigmoid_sum" not in code and "max_pool3d_cascade_sum" not in code
    for out, ref in zip(outputs, NotOurs()(y, v), strict=True):
        assert out.dtype == ref.dtype
        torch.testing.assert_close(out, ref)


def test_enable_refuses_to_replace_another_pass():
    import torch._inductor.config as config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Other(CustomGraphPass):
        def __call__(self, graph):
            pass

        def uuid(self):
            return b"other"

    config.post_grad_custom_pre_pass = Other()
    try:
        with pytest.raises(RuntimeError, match="already set"):
            fused_ops.enable_compile_patterns()
    finally:
        config.post_grad_custom_pre_pass = None
    fused_ops.enable_compile_patterns()
    fused_ops.disable_compile_patterns()
    assert config.post_grad_custom_pre_pass is None
