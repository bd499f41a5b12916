"""fused_ops.nn.Conv2dAvgPoolSigmoidSum against the original (fused_ops.reference)."""
import pytest
import torch

from conftest import (assert_close_to_reference, build_pair, check_drop_in, check_from_module,
                      check_matches_original, check_same_init, check_state_dict_both_ways, requires_cuda)
from fused_ops import autotune
from fused_ops import nn as fnn

ARGS = [
    # (in_channels, out_channels, kernel_size, pool_kernel_size), input (B, H, W)
    ((3, 5, 3, 4), (2, 19, 23)),
    ((2, 4, (3, 2), (2, 3)), (1, 12, 17)),
    ((4, 3, 1, 5), (3, 11, 11)),
]


NAME = "Conv2dAvgPoolSigmoidSum"


def test_same_parameters_under_same_seed():
    check_same_init(NAME, ARGS[0][0], ["conv.weight", "conv.bias"])


def test_state_dict_both_ways():
    check_state_dict_both_ways(NAME, ARGS[0][0])


def test_from_module_shares_parameters():
    check_from_module(NAME, ARGS[0][0], ["conv", "avg_pool"])


@pytest.mark.parametrize("args,size", ARGS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("train", [True, False])
def test_matches_original(args, size, dtype, train, device):
    check_drop_in(NAME, args, (size[0], args[0], *size[1:]), dtype, device, train)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_cuda(dtype):
    original, fused = build_pair(NAME, ARGS[0][0])
    fused.to("cuda", dtype)
    x = torch.rand(2, 3, 19, 23, device="cuda", dtype=dtype)
    out = fused(x)
    assert out.dtype == dtype
    # the fused tail against a float64 tail of the same (low-precision) conv output
    y = fused.conv(x).double()
    ref = torch.sigmoid(torch.nn.functional.avg_pool2d(y, 4)).sum(dim=(1, 2, 3))
    assert_close_to_reference(out, ref, dtype)


def test_compile_fullgraph(device):
    original, fused = build_pair(NAME, ARGS[0][0])
    original.to(device)
    fused.to(device)
    x = torch.rand(2, 3, 19, 23, device=device)
    check_matches_original(original, torch.compile(fused, fullgraph=True), x, torch.float32)


def test_float64_rewrite_of_one_channel_on_a_cpu():
    """The rewrite (the pool folded into the kernel, over space-to-depth input) in float64 on a CPU with one
    input and one output channel and a (1, 4) pool: its backward raised "slow_conv2d: grad_weight must be
    contiguous" (a channels-last kernel there); now the original's gradients."""
    original, fused = build_pair(NAME, (1, 1, 2, (1, 4)))
    original.double()
    fused.double()
    x = torch.rand(2, 1, 32, 64, dtype=torch.float64)
    original(x).sum().backward()
    with autotune.force("rewrite"):
        fused(x).sum().backward()
        assert autotune.last_formulation() == "rewrite"
    for a, b in zip(fused.parameters(), original.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)


def test_bad_input(device):
    fused = fnn.Conv2dAvgPoolSigmoidSum(3, 5, 3, 4).to(device)
    with pytest.raises(RuntimeError, match="channels"):
        fused(torch.rand(2, 4, 19, 19, device=device))
    with pytest.raises(ValueError, match="4-D input"):
        fused(torch.rand(3, 19, 19, device=device))
    with pytest.raises(RuntimeError, match="[Tt]ype"):
        fused(torch.ones(2, 3, 19, 19, dtype=torch.int64, device=device))
    # (the pool's window larger than the convolution's output: the fused tail's message, or, where the rule
    # takes the original's ops for so small an input, PyTorch's)
    with pytest.raises((ValueError, RuntimeError), match="smaller than the kernel|Output size is too small"):
        fused(torch.rand(2, 3, 5, 19, device=device))


@requires_cuda
def test_mixed_devices():
    fused = fnn.Conv2dAvgPoolSigmoidSum(3, 5, 3, 4).cuda()
    with pytest.raises(RuntimeError, match="device|cuda|cpu"):
        fused(torch.rand(2, 3, 19, 19))
