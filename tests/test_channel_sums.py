"""channel_sums (D's transposed-convolution bias gradient without cuBLAS): against float64 sums, every
dtype, channels-last and other layouts, odd sizes, non-finite values, empty inputs, opcheck, bad input."""
import pytest
import torch

from conftest import cuda_kernel_names, requires_cuda
from fused_ops import channel_sums

# (shape, layout): D's grad_y-like, odd channel counts (a partial tile of 32), 2-D and 4-D
CASES = [((4, 64, 5, 9, 9), torch.channels_last_3d), ((3, 37, 2, 3, 5), torch.channels_last_3d),
         ((5, 70, 3, 7), torch.channels_last), ((9, 33), torch.contiguous_format),
         ((2, 5, 3, 4, 6), torch.contiguous_format), ((1, 130, 1, 1, 1), torch.channels_last_3d)]
IDS = ["d-like", "odd-channels", "4d", "2d", "ncdhw", "one-position"]


def float64_sums(t):
    return t.double().sum(dim=[0, *range(2, t.dim())])


@pytest.mark.parametrize("shape,layout", CASES, ids=IDS)
def test_sums_are_float64s_rounded(shape, layout, device, dtype):
    """Within the accumulation's rounding (float32's, or float64's, per term) of the float64 sums, in t's
    dtype; integer-valued data, whose sums every accumulation keeps exact: equal after the one rounding."""
    t = torch.randn(shape, device=device).to(dtype).contiguous(memory_format=layout)
    out = channel_sums(t)
    assert out.dtype == dtype and out.shape == (shape[1],) and out.device == t.device
    expected = float64_sums(t)
    terms = t.numel() // shape[1]
    unit = 2.0 ** -53 if dtype == torch.float64 else 2.0 ** -24  # (the accumulation's unit roundoff)
    rounding = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}.get(dtype, 0.0)  # (the result's)
    sums_error = terms * unit * float64_sums(t.abs())
    bound = sums_error + rounding * (expected.abs() + sums_error)
    assert ((out.double() - expected).abs() <= bound).all()
    whole = torch.randint(-8, 9, shape, device=device).to(dtype).contiguous(memory_format=layout)
    torch.testing.assert_close(channel_sums(whole), float64_sums(whole).to(dtype), rtol=0, atol=0)


def test_non_finite_values_as_torch_sum(device):
    """NaN and infinities as torch.sum gives them: a channel with a NaN or both infinities NaN, one
    infinity that infinity."""
    t = torch.rand(3, 6, 4, 5, 6, device=device).contiguous(memory_format=torch.channels_last_3d)
    t[0, 0, 1, 2, 3] = float("nan")
    t[1, 1, 0, 0, 0] = float("inf")
    t[2, 2, 3, 4, 5] = float("-inf")
    t[0, 3, 0, 1, 1], t[2, 3, 2, 2, 2] = float("inf"), float("-inf")
    torch.testing.assert_close(channel_sums(t), t.sum(dim=(0, 2, 3, 4)), equal_nan=True)


def test_empty(device):
    """No positions: zeros; no channels: an empty result."""
    assert torch.equal(channel_sums(torch.empty(0, 7, 3, 3, 3, device=device)), torch.zeros(7, device=device))
    assert channel_sums(torch.empty(2, 0, 3, device=device)).shape == (0,)


@requires_cuda
def test_channels_last_on_a_gpu_by_its_kernels():
    """A channels-last CUDA t by the op's two kernels, no cuBLAS (its first use in a process took 85 ms of
    D's first training step); an NCDHW one by ATen's reduction."""
    t = torch.rand(4, 64, 5, 9, 9, device="cuda").contiguous(memory_format=torch.channels_last_3d)
    names = cuda_kernel_names(lambda: channel_sums(t))
    assert any("channel_partial_sums_kernel" in n for n in names), names
    assert not any("gemv" in n.lower() or "gemm" in n.lower() for n in names), names
    names = cuda_kernel_names(lambda: channel_sums(t.contiguous()))
    assert not any("channel_partial_sums_kernel" in n for n in names), names


def test_opcheck(device):
    t = torch.randn(3, 37, 2, 3, 5, device=device).contiguous(memory_format=torch.channels_last_3d)
    torch.library.opcheck(torch.ops.fused_ops.channel_sums, (t,))


def test_bad_input_raises_clearly(device):
    with pytest.raises(ValueError, match="channel_sums: t must be"):
        channel_sums(torch.rand(5, device=device))
    with pytest.raises(TypeError, match="channel_sums: t must be float64"):
        channel_sums(torch.ones(2, 3, dtype=torch.int64, device=device))
    with pytest.raises(TypeError, match="channel_sums: t must be a Tensor"):
        channel_sums([1.0, 2.0])
