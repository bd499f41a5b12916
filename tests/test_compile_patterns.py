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
from fused_ops import nn as fnn
from fusable_models import InPlace, Network, Tails, check_step, inputs, tails_inputs


@pytest.fixture
def reports(monkeypatch):
    """The patterns on; the FuseReport of each graph the pass saw (in the order compiled: Inductor's
    caches off, whose hits skip the pass)."""
    seen = []
    real = fusion.fuse_graph

    def recording(traced, result, follow_mode, **options):
        real(traced, result, follow_mode, **options)
        seen.append(result)

    monkeypatch.setattr(fusion, "fuse_graph", recording)
    fused_ops.enable_compile_patterns()
    # (the config's own patch: a monkeypatch's undo deletes a torch 2.11 Inductor option)
    with torch._inductor.config.patch(force_disable_caches=True):
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
    if device == "cuda":
        # (the rules' formulations there: A's convolution and tail in one op; C's input is launch-bound, its
        # rule's first the convolution and the fused tail)
        assert inputs(device)[1].numel() < fnn._LAUNCH_BOUND_ELEMENTS
        for op in ("conv3d_max_pool3d_mean", "avg_pool2d_sigmoid_sum"):
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


@pytest.mark.parametrize("device", DEVICES)
def test_the_autotuner_times_nothing_while_tracing(reports, device):
    """With the autotuner on (the tests turn it off), the pass's trace of the fused modules takes
    their rules' formulations: no fake tensor is timed, kept or captured in a CUDA graph, and the
    compiled training step still equals the original's. (Torch 2.11 traces the pass's calls
    outside is_compiling: there this failed on a GPU; 2.13 traces them inside it, and
    test_formulations' fake-tensor test covers the rule on any version.)"""
    from fused_ops import autotune

    autotune.clear()
    autotune.set_enabled(True)
    torch.manual_seed(3)
    original = Network().double().to(device)
    model = copy.deepcopy(original)
    compiled_steps(model, original, lambda: inputs(device), train=True, steps=1)
    assert fused_names(reports) == ["A", "B", "C", "D"], reports
    assert not autotune._TUNINGS, list(autotune._TUNINGS)


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


class Boundaries(nn.Module):
    """Chains crossing an autocast region and a grad-mode switch: the fused call, placed at a
    chain's last op, would move the convolution past them; the tails after them fuse."""

    def __init__(self):
        super().__init__()
        self.conv2d = nn.Conv2d(3, 8, 3)
        self.conv3d = nn.Conv3d(3, 8, 3)
        self.offset = nn.Parameter(torch.randn(8, 1, 1, 1))

    def forward(self, x, v):
        with torch.autocast("cpu", torch.bfloat16):
            y = self.conv2d(x)
        c = torch.sigmoid(F.avg_pool2d(y, 2)).sum((1, 2, 3))
        with torch.no_grad():
            h = self.conv3d(v)
        a = (F.adaptive_avg_pool3d(F.max_pool3d(h / 2.0, 2), 1) + self.offset).sum(1)
        return c, a


def test_chains_across_effects_stay_and_their_tails_fuse(reports):
    torch.manual_seed(4)
    model = Boundaries()
    x, v = torch.rand(2, 3, 12, 13), torch.rand(2, 3, 8, 9, 8)
    compiled = copy.deepcopy(model)
    outputs, expected = torch.compile(compiled)(x, v), model(x, v)
    assert fused_names(reports) == ["A-tail", "C-tail"], reports
    assert sum("an effect" in why for report in reports for _, _, why in report.skipped) == 2, reports
    for out, ref in zip(outputs, expected, strict=True):
        assert out.dtype == ref.dtype
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-5, atol=1e-5)
    sum(o.float().sum() for o in outputs).backward()
    sum(o.float().sum() for o in expected).backward()
    assert compiled.conv3d.weight.grad is None and model.conv3d.weight.grad is None
    for (name, p), q in zip(compiled.named_parameters(), model.parameters(), strict=True):
        if q.grad is not None:  # (conv2d's in bfloat16)
            tolerance = 2e-2 if name.startswith("conv2d") else 1e-5
            torch.testing.assert_close(p.grad, q.grad, rtol=tolerance, atol=tolerance * q.grad.abs().max(), msg=name)


def test_a_write_into_a_chains_input_keeps_it(reports):
    """Both chains read x, which the graph writes in place: both stay (torch 2.11's Inductor
    miscompiled the second's rewrite: x * 4 for x * 2), the first's tail fuses; the buffer's
    write, which neither reads, keeps nothing."""
    torch.manual_seed(6)
    model = InPlace().eval()
    x = torch.rand(2, 3, 12, 13)
    with torch.no_grad():
        outputs, expected = torch.compile(copy.deepcopy(model))(x.clone()), model(x.clone())
    assert fused_names(reports) == ["C-tail", "C-tail"], reports
    for out, ref in zip(outputs, expected, strict=True):
        torch.testing.assert_close(out, ref)


class DynamicPool(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x, v, k: int):
        return (torch.sigmoid(F.avg_pool2d(self.conv(x), k)).sum((1, 2, 3)),
                F.adaptive_avg_pool3d(F.max_pool3d(v, k), 1))


def test_a_dynamic_pool_size_stays(reports):
    """A pool size torch.compile made dynamic (a Python int argument taking a second value) is the
    graph's own value: the ops stay, with eager's results."""
    torch.manual_seed(5)
    model = DynamicPool()
    compiled = torch.compile(model)
    x, v = torch.rand(2, 3, 13, 14), torch.rand(2, 3, 7, 8, 9)
    for k in (2, 3):
        for out, ref in zip(compiled(x, v, k), model(x, v, k), strict=True):
            torch.testing.assert_close(out, ref)
    assert fused_names(reports) == ["A-tail", "C"], reports  # (the first compile's, k a constant)


def test_the_pass_uuid_follows_a_forced_formulation():
    """Inductor's caches key a compiled graph by the pass's uuid: a formulation forced while
    compiling changes what the pass inserts, so it changes the uuid."""
    from fused_ops import autotune, compile_patterns

    plain = compile_patterns._PASS.uuid()
    with autotune.force("original"):
        assert compile_patterns._PASS.uuid() != plain
    assert compile_patterns._PASS.uuid() == plain


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
