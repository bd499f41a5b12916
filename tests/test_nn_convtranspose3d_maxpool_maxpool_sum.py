"""fused_ops.nn.ConvTranspose3dMaxPoolMaxPoolSum against the original (fused_ops.reference)."""
import pytest
import torch

from conftest import (assert_close_to_reference, build_pair, check_drop_in, check_from_module,
                      check_matches_original, check_same_init, check_state_dict_both_ways, requires_cuda)
from fused_ops import nn as fnn

NAME = "ConvTranspose3dMaxPoolMaxPoolSum"

ARGS = [
    # (in_channels, out_channels, kernel_size, stride, padding), input (B, D, H, W)
    # architecture B's configuration at small size: 7 -> 13 -> 6 -> 2
    ((3, 4, 5, 2, 2), (2, 7, 7, 7)),
    # batch 1, tuple kernel and stride, a channel count that is not a power of two
    ((2, 7, (3, 4, 3), (2, 1, 2), (1, 0, 1)), (1, 6, 9, 7)),
    ((2, 3, 3, 1, 0), (2, 8, 9, 10)),
]


def test_same_parameters_under_same_seed():
    check_same_init(NAME, ARGS[0][0], ["conv_transpose.weight", "conv_transpose.bias"])


def test_state_dict_both_ways():
    check_state_dict_both_ways(NAME, ARGS[0][0])


def test_from_module_shares_parameters():
    check_from_module(NAME, ARGS[1][0], ["conv_transpose", "max_pool1", "max_pool2"])


@pytest.mark.parametrize("args,size", ARGS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("train", [True, False])
def test_matches_original(args, size, dtype, train, device):
    check_drop_in(NAME, args, (size[0], args[0], *size[1:]), dtype, device, train)


def test_ties_match_original_exactly(device):
    """Integer-valued weights and inputs: ties in both pools; every gradient
    equals the original's element for element."""
    original, _ = build_pair(NAME, ARGS[0][0])
    original.to(device)
    with torch.no_grad():
        for p in original.parameters():
            p.copy_(torch.randint(-1, 2, p.shape))
    fused = fnn.ConvTranspose3dMaxPoolMaxPoolSum.from_module(original)
    x = torch.randint(0, 2, (2, 3, 7, 7, 7), device=device, dtype=torch.float32)
    x_ref, x = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, ref = fused(x), original(x_ref)
    assert torch.equal(out, ref)
    out.sum().backward()
    ref.sum().backward()
    assert torch.equal(x.grad, x_ref.grad)
    for p, q in zip(fused.parameters(), original.parameters()):
        assert torch.equal(p.grad, q.grad)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_cuda(dtype):
    _, fused = build_pair(NAME, ARGS[0][0])
    fused.to("cuda", dtype)
    x = torch.rand(2, 3, 7, 7, 7, device="cuda", dtype=dtype)
    out = fused(x)
    assert out.dtype == dtype
    # the fused tail against a float64 tail of the same (low-precision) conv output
    y = fused.conv_transpose(x).double()
    ref = fused.max_pool2(fused.max_pool1(y)).sum(dim=1, keepdim=True)
    assert_close_to_reference(out, ref, dtype)


def test_compile_fullgraph(device):
    original, fused = build_pair(NAME, ARGS[0][0])
    original.to(device)
    fused.to(device)
    x = torch.rand(2, 3, 7, 7, 7, device=device)
    check_matches_original(original, torch.compile(fused, fullgraph=True), x, torch.float32)


def test_bad_input(device):
    fused = fnn.ConvTranspose3dMaxPoolMaxPoolSum(3, 4, 5, 2, 2).to(device)
    with pytest.raises(ValueError, match="channels"):
        fused(torch.rand(2, 4, 7, 7, 7, device=device))
    with pytest.raises(ValueError, match=r"4-D \(unbatched\) or 5-D \(batched\) input"):
        fused(torch.rand(3, 7, 7, device=device))
    with pytest.raises(TypeError, match="floating-point"):
        fused(torch.ones(2, 3, 7, 7, 7, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="smaller than the kernel"):
        fused(torch.rand(2, 3, 7, 2, 7, device=device))  # conv output 3: pooled to 1, then < 3
    for pool in ("max_pool1", "max_pool2"):
        fused = fnn.ConvTranspose3dMaxPoolMaxPoolSum(3, 4, 5, 2, 2).to(device)
        getattr(fused, pool).return_indices = True
        with pytest.raises(ValueError, match="indices"):
            fused(torch.rand(2, 3, 7, 7, 7, device=device))


@pytest.mark.parametrize("pool", ["max_pool1", "max_pool2"])
@pytest.mark.parametrize("attribute, value", [("dilation", 2), ("ceil_mode", True), ("padding", 1)])
def test_pools_the_fused_kernels_do_not_compute(device, pool, attribute, value):
    """A pool the fused ops do not compute (dilated, ceil_mode) or that no rewrite takes runs
    as the original's ops: the original's results."""
    original, fused = (m.to(device, torch.float64) for m in build_pair(NAME, ARGS[0][0]))
    for module in (original, fused):
        setattr(getattr(module, pool), attribute, value)
    x = torch.rand(2, 3, 11, 11, 11, device=device, dtype=torch.float64)
    torch.testing.assert_close(fused(x), original(x))


@requires_cuda
def test_mixed_devices():
    fused = fnn.ConvTranspose3dMaxPoolMaxPoolSum(3, 4, 5, 2, 2).cuda()
    with pytest.raises(RuntimeError, match="device|cuda|cpu"):
        fused(torch.rand(2, 3, 7, 7, 7))
