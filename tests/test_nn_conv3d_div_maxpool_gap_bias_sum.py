"""fused_ops.nn.Conv3dDivMaxPoolGAPBiasSum against the original (fused_ops.reference)."""
import pytest
import torch

from conftest import (assert_close_to_reference, build_pair, check_drop_in, check_from_module,
                      check_matches_original, check_same_init, check_state_dict_both_ways, requires_cuda)
from fused_ops import nn as fnn

NAME = "Conv3dDivMaxPoolGAPBiasSum"

ARGS = [
    # (in_channels, out_channels, kernel_size, divisor, pool_size, bias_shape, sum_dim), input (B, D, H, W)
    ((3, 4, 3, 2.0, 2, (4, 1, 1, 1), 1), (2, 9, 10, 11)),
    ((2, 3, (3, 2, 3), -1.5, (2, 3, 2), (3, 1, 1, 1), -4), (1, 8, 9, 7)),
    ((2, 3, 2, 0.5, 3, (1,), 0), (3, 7, 8, 9)),
    # a bias that broadcasts the result wider, a sum over it
    ((3, 2, 1, -3.0, (1, 2, 2), (2, 1, 1, 3), 4), (2, 5, 6, 7)),
]


def test_same_parameters_under_same_seed():
    check_same_init(NAME, ARGS[0][0], ["bias", "conv.weight", "conv.bias"])
    original, fused = build_pair(NAME, ARGS[0][0])
    assert fused.divisor == original.divisor and fused.sum_dim == original.sum_dim


def test_state_dict_both_ways():
    check_state_dict_both_ways(NAME, ARGS[0][0])


def test_from_module_shares_parameters():
    check_from_module(NAME, ARGS[1][0], ["conv", "divisor", "max_pool", "global_avg_pool", "bias", "sum_dim"])


@pytest.mark.parametrize("args,size", ARGS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("train", [True, False])
def test_matches_original(args, size, dtype, train, device):
    check_drop_in(NAME, args, (size[0], args[0], *size[1:]), dtype, device, train)


@pytest.mark.parametrize("sum_dim", [0, 1, 2, 3, 4, -1, -3, -5])
def test_every_sum_dim(sum_dim, device):
    check_drop_in(NAME, (2, 3, 2, -2.0, 2, (3, 1, 1, 1), sum_dim), (2, 2, 6, 7, 8), torch.float64, device)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_cuda(dtype):
    original, fused = build_pair(NAME, ARGS[0][0])
    fused.to("cuda", dtype)
    x = torch.rand(2, 3, 9, 10, 11, device="cuda", dtype=dtype)
    out = fused(x)
    assert out.dtype == dtype
    # the fused tail against a float64 tail of the same (low-precision) conv output and division
    y = (fused.conv(x) / fused.divisor).double()
    mean = torch.nn.functional.max_pool3d(y, 2).mean(dim=(2, 3, 4), keepdim=True)
    ref = torch.sum(mean + fused.bias.double(), dim=1)
    assert_close_to_reference(out, ref, dtype)


def test_compile_fullgraph(device):
    original, fused = build_pair(NAME, ARGS[0][0])
    original.to(device)
    fused.to(device)
    x = torch.rand(2, 3, 9, 10, 11, device=device)
    check_matches_original(original, torch.compile(fused, fullgraph=True), x, torch.float32)


def test_bad_input(device):
    fused = fnn.Conv3dDivMaxPoolGAPBiasSum(3, 4, 3, 2.0, 2, (4, 1, 1, 1), 1).to(device)
    with pytest.raises(ValueError, match="channels"):
        fused(torch.rand(2, 4, 9, 9, 9, device=device))
    with pytest.raises(ValueError, match=r"4-D \(unbatched\) or 5-D \(batched\) input"):
        fused(torch.rand(3, 9, 9, device=device))
    with pytest.raises(TypeError, match="floating-point"):
        fused(torch.ones(2, 3, 9, 9, 9, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="smaller than the kernel"):
        fused(torch.rand(2, 3, 9, 3, 9, device=device))
    fused.max_pool.return_indices = True
    with pytest.raises(ValueError, match="indices"):
        fused(torch.rand(2, 3, 9, 9, 9, device=device))


def test_average_pool_of_more_than_one_element(device):
    """A global average pool whose output size was changed runs as the original's ops."""
    original, fused = (m.to(device, torch.float64) for m in build_pair(NAME, ARGS[0][0]))
    for module in (original, fused):
        module.global_avg_pool.output_size = (2, 1, 2)
    x = torch.rand(2, 3, 9, 10, 11, device=device, dtype=torch.float64)
    torch.testing.assert_close(fused(x), original(x))


@pytest.mark.parametrize("attribute, value", [("dilation", 2), ("padding", 1), ("stride", 1)])
def test_pools_the_fused_kernels_do_not_compute(device, attribute, value):
    """A pool the fused ops do not compute (dilated) or that no rewrite takes runs as the
    original's ops: the original's results."""
    original, fused = (m.to(device, torch.float64) for m in build_pair(NAME, ARGS[0][0]))
    for module in (original, fused):
        setattr(module.max_pool, attribute, value)
    x = torch.rand(2, 3, 9, 9, 9, device=device, dtype=torch.float64)
    torch.testing.assert_close(fused(x), original(x))


@requires_cuda
def test_mixed_devices():
    fused = fnn.Conv3dDivMaxPoolGAPBiasSum(3, 4, 3, 2.0, 2, (4, 1, 1, 1), 1).cuda()
    with pytest.raises(RuntimeError, match="device|cuda|cpu"):
        fused(torch.rand(2, 3, 9, 9, 9))
