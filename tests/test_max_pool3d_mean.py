"""fused_ops.max_pool3d_mean against PyTorch's max_pool3d(x / divisor) -> mean over (D', H', W')."""
import random

import pytest
import torch
import torch.nn.functional as F

from conftest import (DTYPES, LAYOUTS_5D, assert_close_to_reference, grad_memory_format, in_layout_5d, make_input,
                      poison_cuda_allocator, requires_cuda)
from fused_ops import max_pool3d_mean

OP = torch.ops.fused_ops.max_pool3d_mean.default
BACKWARD = torch.ops.fused_ops.max_pool3d_mean_backward.default


def eager(x, divisor, **pool):
    """Architecture A's tail up to the global average, in PyTorch eager on x's device and dtype."""
    return F.adaptive_avg_pool3d(F.max_pool3d(x / divisor, **pool), 1).flatten(1)


def reference(x, divisor, pool):
    """float64 on the CPU, from the values the pool sees: x / divisor as
    PyTorch rounds it in x's dtype on x's device. Returns (those values, mean)."""
    v = (x.detach() / divisor).cpu().double().requires_grad_()
    return v, F.max_pool3d(v, **pool).mean(dim=(2, 3, 4))


def random_config(rng: random.Random):
    """A random valid nn.MaxPool3d configuration, a divisor and an input shape."""
    k = [rng.randint(1, 3) for _ in range(3)]
    pool = dict(kernel_size=tuple(k), stride=tuple(rng.randint(1, 3) for _ in range(3)),
                padding=tuple(rng.randint(0, kd // 2) for kd in k), ceil_mode=rng.random() < 0.5)
    shape = (rng.randint(1, 3), rng.randint(1, 4), rng.randint(k[0], 7), rng.randint(k[1], 9), rng.randint(k[2], 11))
    return shape, pool, rng.choice([2.0, -1.5, 0.3, 1.0, -4.0, 7.0])


CONFIGS = [random_config(random.Random(seed)) for seed in range(20)] + [
    # architecture A's tail at small size: 2x2x2 windows, even width (vector loads on CUDA)
    ((2, 3, 6, 10, 14), dict(kernel_size=2), 2.0),
    # batch 1, sizes that 2 does not divide, odd width
    ((1, 2, 5, 7, 9), dict(kernel_size=2), -2.0),
    # 2x2x2 windows with padding (no vector loads) and ceil_mode
    ((2, 2, 5, 6, 8), dict(kernel_size=2, stride=2, padding=1, ceil_mode=True), 0.5),
    # overlapping windows
    ((2, 3, 5, 6, 7), dict(kernel_size=3, stride=1, padding=1, ceil_mode=True), -3.0),
    ((1, 2, 6, 7, 8), dict(kernel_size=(2, 3, 2), stride=(1, 2, 1)), 1.5),
    # gaps between windows (stride > kernel)
    ((2, 2, 7, 8, 9), dict(kernel_size=(1, 2, 2), stride=3), 2.0),
    # the whole input one window (a global max), and 1x1x1 windows (no pool)
    ((3, 2, 3, 4, 5), dict(kernel_size=(3, 4, 5)), 1.0),
    ((2, 3, 3, 4, 5), dict(kernel_size=1), -0.7),
    # kernel volume > 256: the backward recomputes the picks (int32 offsets)
    ((1, 2, 8, 9, 10), dict(kernel_size=7, stride=(1, 2, 3), padding=(0, 1, 2)), 2.0),
]


def check_forward_backward(x, pool, divisor, dtype):
    """Forward and grad_x of the fused op against float64 PyTorch on the same values."""
    poison_cuda_allocator()
    x = x.detach().requires_grad_()
    out = max_pool3d_mean(x, divisor=divisor, **pool)
    assert out.shape == x.shape[:2] and out.dtype == x.dtype and out.device == x.device
    v, ref = reference(x, divisor, pool)
    assert_close_to_reference(out, ref, dtype, f"forward {pool} / {divisor}")
    grad = (torch.rand(x.shape[:2], dtype=torch.float64) + 0.5).to(dtype)
    (grad_x,) = torch.autograd.grad(out, x, grad.to(x.device))
    (grad_v,) = torch.autograd.grad(ref, v, grad.double())
    assert grad_x.dtype == x.dtype and grad_x.shape == x.shape
    assert_close_to_reference(grad_x, grad_v / divisor, dtype, f"grad_x {pool} / {divisor}")
    return grad_x


@pytest.mark.parametrize("shape,pool,divisor", CONFIGS, ids=[f"{s}-{sorted(p.items())}-{d}" for s, p, d in CONFIGS])
def test_matches_pytorch(shape, pool, divisor, device):
    for dtype in DTYPES:
        check_forward_backward(make_input(shape, dtype, device, seed=len(shape)), pool, divisor, dtype)


@pytest.mark.parametrize("layout", LAYOUTS_5D)
@pytest.mark.parametrize("pool", [dict(kernel_size=2), dict(kernel_size=(3, 2, 2), stride=(2, 1, 2), padding=(1, 0, 1))],
                         ids=["2", "3x2x2"])
def test_layouts(layout, pool, device, dtype):
    base = make_input((2, 5, 6, 8, 10), dtype, device)
    x = in_layout_5d(base, layout)
    grad_x = check_forward_backward(x, pool, -2.0, dtype)
    assert grad_x.is_contiguous(memory_format=grad_memory_format(x))


def exact_pair(x, divisor, pool, eager_layout=torch.preserve_format):
    """(fused, eager) forward and grad_x for grad_out = 1 (x's dtype and device); eager on a
    copy of x in eager_layout (x's own by default)."""
    a = x.detach().clone().requires_grad_()
    b = x.detach().clone(memory_format=eager_layout).requires_grad_()
    out, ref = max_pool3d_mean(a, divisor=divisor, **pool), eager(b, divisor, **pool)
    out.sum().backward()
    ref.sum().backward()
    return out, ref, a.grad, b.grad


# Input shapes whose pooled volume D'H'W' is a power of two, so that with
# divisors that are powers of two every gradient is exact in any order of
# operations: grad_x must then equal PyTorch's element for element.
TIE_CASES = [
    ((2, 3, 4, 8, 5), dict(kernel_size=2)),
    ((2, 2, 4, 4, 4), dict(kernel_size=3, stride=1, padding=1)),
    ((1, 3, 4, 6, 7), dict(kernel_size=(2, 3, 2), stride=(2, 1, 2), ceil_mode=True)),
    ((2, 2, 7, 9, 9), dict(kernel_size=(3, 2, 4), stride=(3, 2, 4))),
]


@pytest.mark.parametrize("shape,pool", TIE_CASES, ids=[str(p) for _, p in TIE_CASES])
def test_ties_match_pytorch_exactly(shape, pool, device, dtype):
    """Integer-valued inputs: many equal maxima per window; PyTorch routes each
    window's gradient to the first one in scan order."""
    g = torch.Generator().manual_seed(1)
    for divisor in (2.0, -0.5):
        x = torch.randint(-2, 3, shape, generator=g).to(dtype=dtype, device=device)
        out, ref, grad_x, grad_ref = exact_pair(x, divisor, pool)
        torch.testing.assert_close(out, ref)
        assert torch.equal(grad_x, grad_ref), f"divisor {divisor}: picks differ from PyTorch's"


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last_3d],
                         ids=["contiguous", "channels_last_3d"])
def test_nan_and_inf_match_pytorch(memory_format, device, dtype):
    """NaN propagates and the last NaN of a window is its pick; +-inf pick
    like any value; a window of -inf picks its first element; +inf and -inf in
    one plane average to NaN. Against PyTorch on a contiguous copy: its
    channels_last_3d max_pool3d (torch 2.13 CPU) routes a window of -inf's
    gradient to the element at depth 0 of the window's (h, w), outside the window."""
    nan, inf = float("nan"), float("inf")
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-2, 3, (2, 3, 4, 4, 5), generator=g).to(dtype=dtype, device=device)
    x[0, 0, 0, 0, 0] = x[0, 0, 0, 1, 0] = x[0, 0, 1, 1, 1] = nan  # three NaNs in window (0, 0, 0)
    x[0, 0, 2, 3, 3] = nan
    x[0, 1, 2, 2, 2] = x[0, 1, 3, 3, 3] = inf  # two +inf in one window
    x[1, 0, 0:2, 0:2, 0:2] = -inf  # a window of -inf
    x[1, 1, 0, 0, 0] = inf
    x[1, 1, 2:4, 2:4, 2:4] = -inf  # maxima +inf and -inf: the mean is NaN (+inf for a negative divisor)
    x[1, 2, 1, 1, 4] = nan  # in the last column, outside every window
    x = x.contiguous(memory_format=memory_format)
    for divisor in (2.0, -0.5):
        out, ref, grad_x, grad_ref = exact_pair(x, divisor, dict(kernel_size=2), torch.contiguous_format)
        torch.testing.assert_close(out, ref, equal_nan=True)
        assert out[0, 0].isnan() and not out[1, 2].isnan()
        assert out[1, 1].isnan() if divisor > 0 else out[1, 1] == float("inf")
        assert torch.equal(grad_x, grad_ref), f"divisor {divisor}: picks differ from PyTorch's"


# channels_last_3d inputs, which the CPU kernels read in vectors over channels:
# channel counts the vector width does not divide (3, 13, 37: one partial
# block, one full and a partial one, several), each backward path.
CHANNELS_LAST_CONFIGS = [
    ((2, 13, 6, 9, 11), dict(kernel_size=2), 2.0),  # disjoint windows: filled, then the picks stored
    ((1, 37, 5, 7, 9), dict(kernel_size=3, stride=2, padding=1, ceil_mode=True), -1.5),  # overlapping: counts
    ((2, 3, 7, 8, 9), dict(kernel_size=(1, 2, 2), stride=3), 0.3),  # gaps between windows
    ((1, 13, 8, 9, 10), dict(kernel_size=7, stride=(1, 2, 3), padding=(0, 1, 2)), -2.0),  # picks recomputed
    ((2, 13, 4, 5, 6), dict(kernel_size=(4, 5, 6)), 2.0),  # one window per plane: picks (2, 13, 1, 1, 1)
]


@pytest.mark.parametrize("shape,pool,divisor", CHANNELS_LAST_CONFIGS,
                         ids=[f"{s}-{sorted(p.items())}-{d}" for s, p, d in CHANNELS_LAST_CONFIGS])
def test_channels_last(shape, pool, divisor, device, dtype):
    """Forward and backward against PyTorch; grad_x channels_last_3d on the CPU; the forward
    without autograd (values only) equal to the one that saves the picks."""
    x = make_input(shape, dtype, device).to(memory_format=torch.channels_last_3d)
    grad_x = check_forward_backward(x, pool, divisor, dtype)
    assert grad_x.is_contiguous(memory_format=grad_memory_format(x))
    with torch.no_grad():
        values_only = max_pool3d_mean(x, divisor=divisor, **pool)
    saving = max_pool3d_mean(x.detach().requires_grad_(), divisor=divisor, **pool)
    assert torch.equal(values_only, saving.detach())


@pytest.mark.parametrize("channels", [3, 13, 37])
@pytest.mark.parametrize("shape,pool", TIE_CASES, ids=[str(p) for _, p in TIE_CASES])
def test_channels_last_ties_match_pytorch_exactly(shape, pool, channels, device, dtype):
    """test_ties_match_pytorch_exactly on channels_last_3d inputs, PyTorch's in the same layout."""
    g = torch.Generator().manual_seed(5)
    for divisor in (2.0, -0.5):
        x = torch.randint(-2, 3, (shape[0], channels, *shape[2:]), generator=g).to(dtype=dtype, device=device)
        x = x.to(memory_format=torch.channels_last_3d)
        out, ref, grad_x, grad_ref = exact_pair(x, divisor, pool)
        torch.testing.assert_close(out, ref)
        assert torch.equal(grad_x, grad_ref), f"divisor {divisor}: picks differ from PyTorch's"


def test_gradcheck(device):
    for pool, divisor in [(dict(kernel_size=2), 2.0),
                          (dict(kernel_size=3, stride=2, padding=1, ceil_mode=True), -1.5),
                          (dict(kernel_size=(2, 1, 3), stride=1), 0.7)]:
        for fmt in [torch.contiguous_format, torch.channels_last_3d]:
            x = make_input((2, 2, 4, 5, 5), torch.float64, device).to(memory_format=fmt).requires_grad_()
            assert torch.autograd.gradcheck(lambda t: max_pool3d_mean(t, divisor=divisor, **pool), (x,))
    # kernel volume > 256: picks recomputed in the backward
    x = make_input((1, 1, 7, 7, 8), torch.float64, device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: max_pool3d_mean(t, 7, stride=1, divisor=-2.0), (x,))


def test_opcheck(device):
    x = make_input((2, 3, 5, 6, 7), torch.float32, device, requires_grad=True)
    xl = make_input((2, 3, 5, 6, 7), torch.float64, device, requires_grad=True).to(memory_format=torch.channels_last_3d)
    for t, args in [(x, ([2, 2, 2], [2, 2, 2], [0, 0, 0], False, 2.0)),
                    (x, ([3, 2, 3], [1, 2, 2], [1, 1, 0], True, -0.5)),
                    (xl, ([2, 3, 2], [2, 2, 1], [1, 1, 1], True, 3.0))]:
        torch.library.opcheck(OP, (t, *args, True))
        # without saved picks the backward recomputes them from x
        torch.library.opcheck(OP, (t, *args, False))
    grad_mean = torch.rand(2, 3, device=device)
    # x contiguous and channels_last_3d: the picks and grad_x laid out as x on the CPU
    for t in (x, x.to(memory_format=torch.channels_last_3d)):
        indices = OP(t, [2, 2, 2], [2, 2, 2], [0, 0, 0], False, 2.0, True)[1]
        torch.library.opcheck(BACKWARD, (grad_mean, indices, None, [5, 6, 7], [2, 2, 2], [2, 2, 2], [0, 0, 0], False,
                                         2.0))
        torch.library.opcheck(BACKWARD, (grad_mean, None, t.detach(), [5, 6, 7], [3, 2, 3], [1, 2, 2], [1, 1, 0], True,
                                         -0.5))


def test_empty_batch(device):
    x = torch.rand(0, 3, 4, 4, 4, device=device, requires_grad=True)
    out = max_pool3d_mean(x, 2)
    assert out.shape == (0, 3)
    out.sum().backward()
    assert x.grad.shape == x.shape


def test_no_grad_saves_nothing(device):
    """Without grad the op is asked for no picks (and the raw op returns an empty tensor)."""
    x = make_input((2, 3, 4, 4, 4), torch.float32, device)
    _, indices = OP(x, [2, 2, 2], [2, 2, 2], [0, 0, 0], False, 2.0, False)
    assert indices.numel() == 0 and indices.dtype == torch.uint8
    _, indices = OP(x, [2, 2, 2], [2, 2, 2], [0, 0, 0], False, 2.0, True)
    assert indices.shape == (2, 3, 2, 2, 2) and indices.dtype == torch.uint8


@requires_cuda
def test_cuda_large_and_tiled():
    """Shapes past the CUDA kernels' tiles: pooled rows wider than a block,
    several bands of pooled and input rows, many channels, channels_last_3d."""
    for shape, pool, fmt in [
        ((1, 2, 4, 6, 1100), dict(kernel_size=2), torch.contiguous_format),
        ((2, 3, 3, 300, 8), dict(kernel_size=(1, 2, 2)), torch.contiguous_format),
        ((2, 16, 14, 62, 62), dict(kernel_size=2), torch.contiguous_format),
        ((2, 64, 6, 9, 10), dict(kernel_size=3, stride=2, padding=1), torch.channels_last_3d),
        ((1, 3, 40, 40, 3), dict(kernel_size=(2, 2, 1)), torch.contiguous_format),
    ]:
        x = make_input(shape, torch.float32, "cuda").to(memory_format=fmt)
        check_forward_backward(x, pool, 2.0, torch.float32)


@requires_cuda
def test_cuda_matches_cpu_and_is_deterministic():
    x = make_input((4, 16, 14, 30, 31), torch.float32, "cuda")
    a = max_pool3d_mean(x, 2, divisor=2.0)
    b = max_pool3d_mean(x, 2, divisor=2.0)
    assert torch.equal(a, b)
    torch.testing.assert_close(a.cpu(), max_pool3d_mean(x.cpu(), 2, divisor=2.0), rtol=1e-5, atol=0)


@requires_cuda
def test_cuda_forward_materializes_nothing_of_x_size():
    x = make_input((4, 16, 14, 62, 62), torch.float32, "cuda", requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = max_pool3d_mean(x, 2, divisor=2.0)
    torch.cuda.synchronize()
    # the saved picks (one byte per pooled element), the mean and the partial sums
    assert torch.cuda.max_memory_allocated() - before < x.numel() * x.element_size() // 16
    del out


@pytest.mark.parametrize(
    "shape,dtype,args,error,match",
    [
        ((3, 8, 8, 8), torch.float32, dict(kernel_size=2), ValueError, "5-D input"),
        ((1, 2, 3, 8, 8, 8), torch.float32, dict(kernel_size=2), ValueError, "5-D input"),
        ((1, 2, 8, 8, 8), torch.int64, dict(kernel_size=2), TypeError, "floating-point"),
        ((1, 2, 3, 8, 8), torch.float32, dict(kernel_size=4), ValueError, "smaller than the kernel"),
        ((1, 2, 8, 8, 8), torch.float32, dict(kernel_size=2, padding=2), ValueError, "at most half"),
        ((1, 2, 8, 8, 8), torch.float32, dict(kernel_size=2, stride=0), ValueError, "stride must be positive"),
        ((1, 2, 8, 8, 8), torch.float32, dict(kernel_size=0), ValueError, "kernel_size must be positive"),
        ((1, 0, 8, 8, 8), torch.float32, dict(kernel_size=2), ValueError, "non-zero"),
        ((1, 2, 8, 8, 8), torch.float32, dict(kernel_size=(1, 2)), TypeError, "kernel_size"),
        ((1, 2, 8, 8, 8), torch.float32, dict(kernel_size=2, divisor=0.0), ValueError, "divisor must be non-zero"),
        ((1, 2, 8, 8, 8), torch.float32, dict(kernel_size=2, divisor="2"), TypeError, "divisor must be a number"),
    ],
)
def test_bad_input(shape, dtype, args, error, match, device):
    x = torch.ones(shape, dtype=dtype, device=device)
    with pytest.raises(error, match=match):
        max_pool3d_mean(x, **args)


def test_bad_backward_input(device):
    x = make_input((2, 3, 4, 4, 4), torch.float32, device, requires_grad=True)
    indices = OP(x, [2, 2, 2], [2, 2, 2], [0, 0, 0], False, 2.0, True)[1]
    grad = torch.ones(2, 3, device=device)
    pool = ([2, 2, 2], [2, 2, 2], [0, 0, 0], False, 2.0)
    with pytest.raises(ValueError, match="do not match"):
        BACKWARD(torch.ones(3, 3, device=device), indices, None, [4, 4, 4], *pool)
    with pytest.raises(ValueError, match="do not match"):
        BACKWARD(grad, indices, None, [6, 4, 4], *pool)
    with pytest.raises(ValueError, match="exactly one"):
        BACKWARD(grad, None, None, [4, 4, 4], *pool)
    with pytest.raises(ValueError, match="exactly one"):
        BACKWARD(grad, indices, x.detach(), [4, 4, 4], *pool)
    with pytest.raises(TypeError, match="uint8"):
        BACKWARD(grad, indices.long(), None, [4, 4, 4], *pool)
    with pytest.raises(TypeError, match="dtype"):
        BACKWARD(grad, None, x.detach().double(), [4, 4, 4], *pool)
    with pytest.raises(ValueError, match="at most 256"):
        OP(x, [7, 7, 7], [1, 1, 1], [3, 3, 3], False, 2.0, True)


def test_picks_past_their_window_refused():
    """On the CPU a saved pick past its window (8 elements: a 2 x 2 x 2 kernel) is refused, not followed past
    the window's end (the picks must be the forward's); the last element's is taken."""
    x = make_input((2, 3, 4, 4, 4), torch.float32, "cpu")
    indices = OP(x, [2, 2, 2], [2, 2, 2], [0, 0, 0], False, 2.0, True)[1]
    pool = ([2, 2, 2], [2, 2, 2], [0, 0, 0], False, 2.0)
    for bad in (8, 255):
        picks = indices.clone()
        picks.view(-1)[5] = bad
        with pytest.raises(ValueError, match=f"must each name an element of its window of 8"
                           f", as the forward's do, got {bad}"):
            BACKWARD(torch.ones(2, 3), picks, None, [4, 4, 4], *pool)
    grad_x = BACKWARD(torch.ones(2, 3), torch.full_like(indices, 7), None, [4, 4, 4], *pool)
    assert torch.equal(grad_x[..., 1::2, 1::2, 1::2], torch.full((2, 3, 2, 2, 2), 1 / 8 / 2.0))


def routed_grad_x(picks, grad_mean, input_size, kernel, stride, padding, divisor):
    """float64 grad_x on the CPU from saved picks (B, C, D', H', W'), scan offsets in their windows: each window's
    grad_mean[b, c] / (D' H' W') / divisor added at its pick, none from a pick past its window (a byte of the
    kernel's volume or more)."""
    picks = picks.long().cpu()
    (batch, channels, *pooled), (kd, kh, kw) = picks.shape, kernel
    od, oh, ow = torch.meshgrid(*(torch.arange(n) for n in pooled), indexing="ij")
    d = od * stride[0] - padding[0] + picks // (kh * kw)
    h = oh * stride[1] - padding[1] + picks // kw % kh
    w = ow * stride[2] - padding[2] + picks % kw
    keep = picks < kd * kh * kw
    depth, height, width = input_size
    at = torch.where(keep, (d * height + h) * width + w, 0).flatten(2)
    value = keep * (grad_mean.double().cpu() / picks[0, 0].numel() / divisor)[:, :, None, None, None]
    grad_x = torch.zeros(batch, channels, depth * height * width, dtype=torch.float64)
    return grad_x.scatter_add_(2, at, value.flatten(2)).view(batch, channels, *input_size)


@requires_cuda
@pytest.mark.parametrize("shape,kernel,stride,padding,ceil_mode", [
    ((2, 3, 6, 10, 14), [2, 2, 2], [2, 2, 2], [0, 0, 0], False),  # disjoint windows, vectors of 2 along w
    ((2, 2, 5, 6, 8), [2, 2, 2], [2, 2, 2], [1, 1, 1], True),     # disjoint, clipped by the padding
    ((2, 3, 5, 6, 7), [3, 3, 3], [1, 1, 1], [1, 1, 1], True),     # overlapping windows (an element's count)
], ids=["disjoint", "padded", "overlapping"])
def test_cuda_picks_past_their_window_add_nothing(shape, kernel, stride, padding, ceil_mode):
    """On a GPU a saved pick past its window (a byte of the kernel's volume, or 255: at the first, a middle and the
    last window) adds nothing, without an error (refusing it would wait for the device): grad_x is every other
    window's gradient at its pick, exactly (grad_mean a multiple of D'H'W', divisor 2); with the forward's picks,
    every window's."""
    x = make_input(shape, torch.float32, "cuda")
    pool = (kernel, stride, padding, ceil_mode, 2.0)
    indices = OP(x, *pool, True)[1]
    grad_mean = (torch.randint(1, 5, shape[:2]) * indices[0, 0].numel()).float()
    volume = kernel[0] * kernel[1] * kernel[2]
    picks = indices.clone()
    n = picks.numel()
    picks.view(-1)[[0, n // 2, n - 1]] = torch.tensor([volume, 255, volume], dtype=torch.uint8, device="cuda")
    for saved in (indices, picks):
        grad_x = BACKWARD(grad_mean.cuda(), saved, None, list(shape[2:]), *pool)
        assert torch.equal(grad_x.double().cpu(), routed_grad_x(saved, grad_mean, shape[2:], kernel, stride, padding,
                                                                2.0))


@requires_cuda
def test_mixed_devices():
    x = make_input((2, 3, 4, 4, 4), torch.float32, "cuda", requires_grad=True)
    indices = OP(x, [2, 2, 2], [2, 2, 2], [0, 0, 0], False, 2.0, True)[1]
    with pytest.raises(ValueError, match="same device"):
        BACKWARD(torch.ones(2, 3), indices, None, [4, 4, 4], [2, 2, 2], [2, 2, 2], [0, 0, 0], False, 2.0)
