"""fused_ops.avg_pool2d_sigmoid_sum against PyTorch's avg_pool2d -> sigmoid -> sum."""
import random

import pytest
import torch
import torch.nn.functional as F

from conftest import DTYPES, assert_close_to_reference, make_input, poison_cuda_allocator, requires_cuda
from fused_ops import avg_pool2d_sigmoid_sum

OP = torch.ops.fused_ops.avg_pool2d_sigmoid_sum.default
BACKWARD = torch.ops.fused_ops.avg_pool2d_sigmoid_sum_backward.default


def reference(x, **pool):
    return torch.sigmoid(F.avg_pool2d(x, **pool)).sum(dim=(1, 2, 3))


def random_config(rng: random.Random):
    """A random valid nn.AvgPool2d configuration and an input shape for it."""
    k = (rng.randint(1, 5), rng.randint(1, 5))
    s = (rng.randint(1, 5), rng.randint(1, 5))
    p = (rng.randint(0, k[0] // 2), rng.randint(0, k[1] // 2))
    pool = dict(kernel_size=k, stride=s, padding=p, ceil_mode=rng.random() < 0.5,
                count_include_pad=rng.random() < 0.5,
                divisor_override=rng.choice([None, None, rng.randint(1, 7), -3]))
    shape = (rng.randint(1, 3), rng.randint(1, 6), rng.randint(k[0], 23), rng.randint(k[1], 23))
    return shape, pool


CONFIGS = [random_config(random.Random(seed)) for seed in range(24)] + [
    # architecture C's tail at small size, batch 1, non-divisible sizes
    ((1, 3, 17, 19), dict(kernel_size=4)),
    ((2, 5, 382 // 8, 382 // 8), dict(kernel_size=4)),
    # overlapping windows, all options
    ((2, 3, 11, 13), dict(kernel_size=3, stride=1, padding=1, ceil_mode=True, count_include_pad=False)),
    # kernel the whole input (global average)
    ((3, 4, 7, 9), dict(kernel_size=(7, 9))),
]


def check_forward_backward(x, pool, dtype):
    """Forward and grad_x of the fused op against float64 PyTorch on the same values."""
    poison_cuda_allocator()
    x = x.detach().requires_grad_()
    out = avg_pool2d_sigmoid_sum(x, **pool)
    assert out.shape == (x.shape[0],) and out.dtype == x.dtype and out.device == x.device
    # float64 references on the CPU: torch 2.11's CUDA float64 channels_last
    # avg_pool2d backward is itself off (seen 4e-2 on an H200)
    x64 = x.detach().cpu().double().contiguous().requires_grad_()
    ref = reference(x64, **pool)
    assert_close_to_reference(out, ref, dtype, f"forward {pool}")
    grad_out = torch.rand(x.shape[0], dtype=torch.float64) + 0.5
    (grad_x,) = torch.autograd.grad(out, x, grad_out.to(dtype=dtype, device=x.device))
    (grad_ref,) = torch.autograd.grad(ref, x64, grad_out)
    assert grad_x.dtype == x.dtype and grad_x.shape == x.shape
    assert_close_to_reference(grad_x, grad_ref, dtype, f"grad_x {pool}")
    return grad_x


@pytest.mark.parametrize("shape,pool", CONFIGS, ids=[f"{s}-{sorted(p.items())}" for s, p in CONFIGS])
def test_matches_pytorch(shape, pool, device):
    for dtype in DTYPES:
        check_forward_backward(make_input(shape, dtype, device, seed=len(shape)), pool, dtype)


@pytest.mark.parametrize("layout", ["channels_last", "transposed", "sliced", "misaligned"])
def test_layouts(layout, device, dtype):
    base = make_input((2, 6, 21, 26), dtype, device)
    if layout == "channels_last":
        x = base.to(memory_format=torch.channels_last)
    elif layout == "transposed":
        x = base.transpose(2, 3)
    elif layout == "sliced":
        x = base[:, 1:5, 2:, 1::2]
    else:  # contiguous, but the data starts one element past an aligned address
        x = torch.empty(base.numel() + 1, dtype=dtype, device=device)[1:].view(base.shape).copy_(base)
    pool = dict(kernel_size=(3, 2), stride=(2, 2), padding=(1, 0))
    grad_x = check_forward_backward(x, pool, dtype)
    if layout == "channels_last":
        assert grad_x.is_contiguous(memory_format=torch.channels_last)


def test_gradcheck(device):
    for pool in [dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
                 dict(kernel_size=(3, 2), stride=1, divisor_override=4)]:
        for fmt in [torch.contiguous_format, torch.channels_last]:
            x = make_input((2, 3, 7, 6), torch.float64, device).to(memory_format=fmt).requires_grad_()
            assert torch.autograd.gradcheck(lambda t: avg_pool2d_sigmoid_sum(t, **pool), (x,))


def test_opcheck(device):
    x = make_input((2, 3, 9, 10), torch.float32, device, requires_grad=True)
    xl = make_input((2, 5, 9, 10), torch.float64, device, requires_grad=True).to(memory_format=torch.channels_last)
    for t, args in [(x, ([4, 4], [4, 4], [0, 0], False, True, None)),
                    (x, ([3, 2], [2, 1], [1, 1], True, False, 3)),
                    (xl, ([3, 3], [2, 2], [1, 1], True, True, None))]:
        torch.library.opcheck(OP, (t, *args, True))
        # without the saved factor the op is not differentiable: inference only
        torch.library.opcheck(OP, (t.detach(), *args, False))
    sigmoid = OP(x, [3, 2], [2, 1], [1, 1], False, True, None, True)[1].detach()
    grad_out = torch.rand(2, device=device)
    torch.library.opcheck(BACKWARD, (grad_out, sigmoid, [9, 10], [3, 2], [2, 1], [1, 1], True, None, False))
    torch.library.opcheck(BACKWARD, (grad_out, sigmoid, [9, 10], [3, 2], [2, 1], [1, 1], False, 5, False))


def test_special_values(device, dtype):
    x = make_input((2, 3, 8, 8), dtype, device)
    x[0, 0, 0, 0] = float("nan")
    x[0, 1, 4, 4] = float("inf")
    x[1, 2, 3, 3] = float("-inf")
    x[1, 0, 0:2, 0:2] = torch.tensor([[float("inf"), float("-inf")], [1.0, 1.0]])  # inf - inf = nan
    out = avg_pool2d_sigmoid_sum(x, 2)
    ref = reference(x.cpu().double(), kernel_size=2)
    assert_close_to_reference(out, ref, dtype)
    assert out.isnan().tolist() == [True, True]
    # without NaN: +-inf saturate the sigmoid to exactly 1 and 0
    x = make_input((1, 2, 4, 4), dtype, device)
    x[0, 0, :2, :2] = float("inf")
    x[0, 1, :2, :2] = float("-inf")
    assert_close_to_reference(avg_pool2d_sigmoid_sum(x, 2), reference(x.cpu().double(), kernel_size=2), dtype)


def test_empty_batch(device):
    x = torch.rand(0, 3, 8, 8, device=device, requires_grad=True)
    out = avg_pool2d_sigmoid_sum(x, 2)
    assert out.shape == (0,)
    out.sum().backward()
    assert x.grad.shape == x.shape


@requires_cuda
def test_cuda_large_and_tiled():
    """Shapes that exercise the CUDA kernels' tiling: rows wider than a tile,
    channels_last rows of many channels, many pooled rows per block."""
    for shape, pool, fmt in [
        ((1, 2, 5, 9000), dict(kernel_size=(3, 7), stride=(2, 5)), torch.contiguous_format),
        ((2, 300, 9, 40), dict(kernel_size=4, stride=3, padding=1), torch.channels_last),
        ((3, 7, 300, 5), dict(kernel_size=(2, 5)), torch.contiguous_format),
        ((2, 64, 95, 95), dict(kernel_size=4), torch.channels_last),
    ]:
        x = make_input(shape, torch.float32, "cuda").to(memory_format=fmt)
        check_forward_backward(x, pool, torch.float32)


@requires_cuda
def test_cuda_aligned_runs_backward():
    """Contiguous inputs with non-overlapping windows and rows longer than a
    512-byte block but not whole blocks take the CUDA backward that writes runs
    aligned to such blocks (rows of exactly one block, the first case, the
    row-group one): runs starting and ending mid-row, rows and windows with
    gaps, odd rows of 16-byte packs, row lengths of every shift class of
    16-byte packs, an odd element count, more items than resident warps, and
    planes whose factor rows take several of its shared-memory loads (long
    factor rows: the last load of a plane holds fewer rows)."""
    for shape, dtype, pool in [
        ((2, 3, 9, 128), torch.float32, dict(kernel_size=4)),
        ((1, 2, 13, 131), torch.float32, dict(kernel_size=(3, 2), stride=(4, 3), padding=(1, 1), ceil_mode=True)),
        ((2, 3, 9, 380), torch.float32, dict(kernel_size=(2, 4), stride=(3, 4))),
        ((3, 5, 7, 300), torch.float16, dict(kernel_size=2, stride=(2, 3), count_include_pad=False, padding=1)),
        ((1, 1, 3, 257), torch.float16, dict(kernel_size=(1, 2))),
        ((2, 2, 5, 259), torch.bfloat16, dict(kernel_size=(2, 3), ceil_mode=True)),
        ((2, 3, 6, 65), torch.float64, dict(kernel_size=(2, 3), stride=3, divisor_override=5)),
        ((17, 128, 66, 130), torch.float32, dict(kernel_size=4)),
        ((1, 2, 301, 1000), torch.float32, dict(kernel_size=1)),
        ((2, 1, 50, 700), torch.float64, dict(kernel_size=(1, 2))),
    ]:
        check_forward_backward(make_input(shape, dtype, "cuda"), pool, dtype)


@requires_cuda
def test_cuda_matches_cpu_and_is_deterministic():
    x = make_input((4, 16, 61, 67), torch.float32, "cuda")
    a = avg_pool2d_sigmoid_sum(x, 4)
    b = avg_pool2d_sigmoid_sum(x, 4)
    assert torch.equal(a, b)
    torch.testing.assert_close(a.cpu(), avg_pool2d_sigmoid_sum(x.cpu(), 4), rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    "shape,dtype,pool,error,match",
    [
        ((3, 8, 8), torch.float32, dict(kernel_size=2), ValueError, "4-D input"),
        ((1, 2, 3, 8, 8), torch.float32, dict(kernel_size=2), ValueError, "4-D input"),
        ((1, 2, 8, 8), torch.int64, dict(kernel_size=2), TypeError, "floating-point"),
        ((1, 2, 3, 8), torch.float32, dict(kernel_size=4), ValueError, "smaller than the kernel"),
        ((1, 2, 8, 8), torch.float32, dict(kernel_size=2, padding=2), ValueError, "at most half"),
        ((1, 2, 8, 8), torch.float32, dict(kernel_size=2, stride=0), ValueError, "stride must be positive"),
        ((1, 2, 8, 8), torch.float32, dict(kernel_size=0), ValueError, "kernel_size must be positive"),
        ((1, 2, 8, 8), torch.float32, dict(kernel_size=2, divisor_override=0), ValueError, "divisor_override"),
        ((1, 0, 8, 8), torch.float32, dict(kernel_size=2), ValueError, "non-zero"),
        ((1, 2, 8, 8), torch.float32, dict(kernel_size=(1, 2, 3)), TypeError, "kernel_size"),
    ],
)
def test_bad_input(shape, dtype, pool, error, match, device):
    x = torch.ones(shape, dtype=dtype, device=device)
    with pytest.raises(error, match=match):
        avg_pool2d_sigmoid_sum(x, **pool)


def test_bad_backward_input(device):
    x = make_input((2, 3, 8, 8), torch.float32, device, requires_grad=True)
    sigmoid = OP(x, [2, 2], [2, 2], [0, 0], False, True, None, True)[1]
    pool = ([2, 2], [2, 2], [0, 0], True, None, False)
    with pytest.raises(ValueError, match="grad_out must have shape"):
        BACKWARD(torch.ones(3, device=device), sigmoid, [8, 8], *pool)
    with pytest.raises(TypeError, match="sigmoid must be"):
        BACKWARD(torch.ones(2, device=device, dtype=torch.float64), sigmoid, [8, 8], *pool)
    with pytest.raises(ValueError, match="does not match"):
        BACKWARD(torch.ones(2, device=device), sigmoid, [12, 8], *pool)
    with pytest.raises(ValueError, match="divisor_override must be non-zero"):
        BACKWARD(torch.ones(2, device=device), sigmoid, [8, 8], [2, 2], [2, 2], [0, 0], True, 0, False)
    # the raw op without save_sigmoid cannot be differentiated
    out, _ = OP(x, [2, 2], [2, 2], [0, 0], False, True, None, False)
    with pytest.raises(RuntimeError, match="save_sigmoid"):
        out.sum().backward()


@requires_cuda
def test_mixed_devices():
    x = make_input((2, 3, 8, 8), torch.float32, "cuda", requires_grad=True)
    sigmoid = OP(x, [2, 2], [2, 2], [0, 0], False, True, None, True)[1]
    with pytest.raises(ValueError, match="same device"):
        BACKWARD(torch.ones(2), sigmoid, [8, 8], [2, 2], [2, 2], [0, 0], True, None, False)
