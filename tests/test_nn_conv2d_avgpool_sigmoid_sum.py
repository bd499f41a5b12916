"""fused_ops.nn.Conv2dAvgPoolSigmoidSum against the original (fused_ops.reference)."""
import pytest
import torch

from conftest import assert_close_to_reference, requires_cuda
from fused_ops import nn as fnn
from fused_ops import reference

ARGS = [
    # (in_channels, out_channels, kernel_size, pool_kernel_size), input (B, H, W)
    ((3, 5, 3, 4), (2, 19, 23)),
    ((2, 4, (3, 2), (2, 3)), (1, 12, 17)),
    ((4, 3, 1, 5), (3, 11, 11)),
]


def build_pair(args, seed=0):
    torch.manual_seed(seed)
    original = reference.Conv2dAvgPoolSigmoidSum(*args)
    torch.manual_seed(seed)
    fused = fnn.Conv2dAvgPoolSigmoidSum(*args)
    return original, fused


def test_same_parameters_under_same_seed():
    original, fused = build_pair(ARGS[0][0])
    a, b = original.state_dict(), fused.state_dict()
    assert list(a) == list(b) == ["conv.weight", "conv.bias"]
    for k in a:
        assert torch.equal(a[k], b[k])
    # and both drew the same amount from the generator
    after_fused = torch.rand(3)
    build_pair(ARGS[0][0])
    torch.manual_seed(0)
    reference.Conv2dAvgPoolSigmoidSum(*ARGS[0][0])
    assert torch.equal(after_fused, torch.rand(3))


def test_state_dict_both_ways():
    original, fused = build_pair(ARGS[0][0], seed=1)
    other = fnn.Conv2dAvgPoolSigmoidSum(*ARGS[0][0])
    other.load_state_dict(original.state_dict(), strict=True)
    original.load_state_dict(fused.state_dict(), strict=True)
    assert torch.equal(other.conv.weight, original.conv.weight)


def test_from_module_shares_parameters():
    original = reference.Conv2dAvgPoolSigmoidSum(*ARGS[0][0]).eval()
    fused = fnn.Conv2dAvgPoolSigmoidSum.from_module(original)
    assert fused.conv is original.conv and fused.avg_pool is original.avg_pool
    assert not fused.training
    assert [p.data_ptr() for p in fused.parameters()] == [p.data_ptr() for p in original.parameters()]
    with pytest.raises(TypeError, match="from_module: expected a module with a Conv2d"):
        fnn.Conv2dAvgPoolSigmoidSum.from_module(torch.nn.Sequential())


@pytest.mark.parametrize("args,size", ARGS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("train", [True, False])
def test_matches_original(args, size, dtype, train, device):
    original, fused = build_pair(args)
    original.to(device, dtype).train(train)
    fused.to(device, dtype).train(train)
    x = torch.rand(size[0], args[0], *size[1:], dtype=dtype, device=device)
    x_ref = x.clone().requires_grad_()
    x = x.requires_grad_()
    out, ref = fused(x), original(x_ref)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert_close_to_reference(out, ref, dtype)
    grad = torch.rand_like(ref)
    out.backward(grad)
    ref.backward(grad)
    assert_close_to_reference(x.grad, x_ref.grad, dtype, "grad input")
    for (name, p), q in zip(fused.named_parameters(), original.parameters()):
        assert_close_to_reference(p.grad, q.grad, dtype, f"grad {name}")


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_cuda(dtype):
    original, fused = build_pair(ARGS[0][0])
    fused.to("cuda", dtype)
    x = torch.rand(2, 3, 19, 23, device="cuda", dtype=dtype)
    out = fused(x)
    assert out.dtype == dtype
    # the fused tail against a float64 tail of the same (low-precision) conv output
    y = fused.conv(x).double()
    ref = torch.sigmoid(torch.nn.functional.avg_pool2d(y, 4)).sum(dim=(1, 2, 3))
    assert_close_to_reference(out, ref, dtype)


def test_compile_fullgraph(device):
    original, fused = build_pair(ARGS[0][0])
    original.to(device)
    fused.to(device)
    compiled = torch.compile(fused, fullgraph=True)
    x = torch.rand(2, 3, 19, 23, device=device)
    x_ref = x.clone().requires_grad_()
    x.requires_grad_()
    out, ref = compiled(x), original(x_ref)
    assert_close_to_reference(out, ref, torch.float32)
    out.sum().backward()
    ref.sum().backward()
    assert_close_to_reference(x.grad, x_ref.grad, torch.float32)
    assert_close_to_reference(fused.conv.weight.grad, original.conv.weight.grad, torch.float32)


def test_bad_input(device):
    fused = fnn.Conv2dAvgPoolSigmoidSum(3, 5, 3, 4).to(device)
    with pytest.raises(RuntimeError, match="channels"):
        fused(torch.rand(2, 4, 19, 19, device=device))
    with pytest.raises(ValueError, match="4-D input"):
        fused(torch.rand(3, 19, 19, device=device))
    with pytest.raises(RuntimeError, match="[Tt]ype"):
        fused(torch.ones(2, 3, 19, 19, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="smaller than the kernel"):
        fused(torch.rand(2, 3, 5, 19, device=device))


@requires_cuda
def test_mixed_devices():
    fused = fnn.Conv2dAvgPoolSigmoidSum(3, 5, 3, 4).cuda()
    with pytest.raises(RuntimeError, match="device|cuda|cpu"):
        fused(torch.rand(2, 3, 19, 19))
