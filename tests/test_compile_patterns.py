"""fused_ops.enable_compile_patterns: inside torch.compile, the chains and tails of models written
without fused_ops in mind run by the fused ops, in training and in inference, with the original's
outputs, gradients and running statistics; what must stay (an intermediate used twice, near
misses) stays."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.utils import run_and_get_code

import fused_ops
from conftest import DEVICES
from fused_ops import fusion
from fusable_models import Network, Tails, check_step, inputs, tails_inputs


@pytest.fixture
def reports(monkeypatch):
    """The patterns on; the FuseReport of each graph the pass saw (in the order compiled: Inductor's
    caches off, whose hits skip the pass)."""
    monkeypatch.setattr(torch._inductor.config, "force_disable_caches", True)
    seen = []
    real = fusion.fuse_graph

    def recording(traced, result, follow_mode):
        real(traced, result, follow_mode)
        seen.append(result)

    monkeypatch.setattr(fusion, "fuse_graph", recording)
    fused_ops.enable_compile_patterns()
    yield seen
    fused_ops.disable_compile_patterns()


def fused_names(reports) -> list[str]:
    return sorted(name for report in reports for name, _ in report.fused)


def compiled_steps(model, original, args_of, train, steps=2):
    """Steps of torch.compile(model) checked against the original eager (fusable_models.check_step);
    the generated code of the first."""
    compiled = torch.compile(model)
    code = None
    for step in range(steps):
        args = args_of()
        with torch.set_grad_enabled(train):
            if code is None:
                outputs, code = run_and_get_code(compiled, *args)
            else:
                outputs = compiled(*args)
            check_step(model, original, outputs, args, train)
    return "\n".join(code)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("device", DEVICES)
def test_the_four_chains_compile_to_the_fused_formulations(reports, train, device):
    """Network's chains (convolutions and pools as the graph's functional calls, parameters and
    buffers its inputs): each by its drop-in's formulation; float64 outputs, gradients and running
    statistics equal the original's."""
    torch.manual_seed(0)
    original = Network().double().to(device).train(train)
    model = copy.deepcopy(original)
    code = compiled_steps(model, original, lambda: inputs(device), train)
    assert fused_names(reports) == ["A", "B", "C", "D"], reports
    if device == "cuda":  # (the rules' formulations there: A's and C's convolution and tail in one op)
        for op in ("conv3d_max_pool3d_mean", "conv2d_sigmoid_sum"):
            assert f"fused_ops.{op}" in code, op


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("device", DEVICES)
def test_the_tails_compile_to_the_fused_ops(reports, train, device):
    torch.manual_seed(5)
    original = Tails().double().to(device).train(train)
    model = copy.deepcopy(original)
    code = compiled_steps(model, original, lambda: tails_inputs(device), train)
    assert fused_names(reports) == ["A-tail", "A-tail", "B-tail", "C-tail", "D-tail"], reports
    for op in ("max_pool3d_mean", "max_pool3d_cascade_sum", "avg_pool2d_sigmoid_sum", "batch_norm_gap"):
        assert f"fused_ops.{op}" in code, op


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_autocast_gives_the_originals_dtypes(reports, train):
    """Under CPU bfloat16 autocast the compiled chains return the dtype the original's do, within
    bfloat16's rounding of its values."""
    torch.manual_seed(7)
    original = Network().train(train)
    model = copy.deepcopy(original)
    args = inputs("cpu", torch.float32)
    with torch.set_grad_enabled(train), torch.autocast("cpu", torch.bfloat16):
        outputs, expected = torch.compile(model)(*args), original(*args)
    assert fused_names(reports) == ["A", "B", "C", "D"], reports
    for out, ref in zip(outputs, expected, strict=True):
        assert out.dtype == ref.dtype and out.shape == ref.shape
        torch.testing.assert_close(out.float(), ref.float(), rtol=3e-2, atol=3e-2 * ref.float().abs().max().item())


class ChainC(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)

    def forward(self, x):
        return torch.sigmoid(F.avg_pool2d(self.conv(x), 2)).sum((1, 2, 3))


def test_dynamic_shapes_stay_unfused(reports):
    """A graph compiled for dynamic shapes keeps its ops (the formulations are compiled for static
    shapes: C's rewrite broke Inductor's lowering there), with the original's results and gradients."""
    torch.manual_seed(3)
    model = ChainC()
    compiled = torch.compile(model, dynamic=True)
    for batch, height in ((2, 13), (3, 16)):
        x = torch.rand(batch, 3, height, 14, requires_grad=True)
        out = compiled(x)
        (grad,) = torch.autograd.grad(out.sum(), x)
        ref = model(x)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(grad, torch.autograd.grad(ref.sum(), x)[0])
    assert fused_names(reports) == [] and any(
        "dynamic" in why for report in reports for _, _, why in report.skipped), reports


class Twice(nn.Module):
    def forward(self, y):
        pooled = F.avg_pool2d(y, 2)
        return torch.sigmoid(pooled).sum((1, 2, 3)), pooled.amax()


def test_an_intermediate_used_twice_stays(reports):
    y = torch.rand(2, 3, 8, 8)
    outputs, code = run_and_get_code(torch.compile(Twice()), y)
    assert fused_names(reports) == [] and "fused_ops" not in "\n".join(code)
    torch.testing.assert_close(outputs, Twice()(y))


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


def test_near_misses_stay(reports):
    y, v = torch.rand(2, 3, 8, 8), torch.rand(2, 3, 8, 8, 8)
    outputs, code = run_and_get_code(torch.compile(NotOurs()), y, v)
    assert fused_names(reports) == ["A-tail"], reports
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

    config.pre_grad_custom_pass = Other()
    try:
        with pytest.raises(RuntimeError, match="already set"):
            fused_ops.enable_compile_patterns()
    finally:
        config.pre_grad_custom_pass = None
    fused_ops.enable_compile_patterns()
    fused_ops.disable_compile_patterns()
    assert config.pre_grad_custom_pass is None
