"""fused_ops.max_pool3d_cascade_sum against PyTorch's max_pool3d -> max_pool3d -> sum over channels."""
import math
import random

import pytest
import torch
import torch.nn.functional as F

from conftest import (DTYPES, LAYOUTS_5D, assert_close_to_reference, exact_pair, grad_memory_format, in_layout_5d,
                      make_input, poison_cuda_allocator, requires_cuda)
from fused_ops import max_pool3d_cascade_sum

OP = torch.ops.fused_ops.max_pool3d_cascade_sum.default
BACKWARD = torch.ops.fused_ops.max_pool3d_cascade_sum_backward.default


def eager(x, first, second):
    """Architecture B's tail in PyTorch eager, on x's device and dtype."""
    return F.max_pool3d(F.max_pool3d(x, **first), **second).sum(dim=1, keepdim=True)


def fused(x, first, second):
    return max_pool3d_cascade_sum(x, first["kernel_size"], second["kernel_size"], stride1=first.get("stride"),
                                  padding1=first.get("padding", 0), stride2=second.get("stride"),
                                  padding2=second.get("padding", 0))


def op_args(first, second):
    """The raw op's six pool arguments for two nn.MaxPool3d-style dicts."""
    args = []
    for pool in (first, second):
        k = pool["kernel_size"]
        args += [k, pool.get("stride") or k, pool.get("padding", 0)]
    return [[a] * 3 if isinstance(a, int) else list(a) for a in args]


def random_pool(rng: random.Random):
    k = [rng.randint(1, 3) for _ in range(3)]
    return dict(kernel_size=tuple(k), stride=tuple(rng.randint(1, 3) for _ in range(3)),
                padding=tuple(rng.randint(0, kd // 2) for kd in k))


def random_config(rng: random.Random):
    """Two random valid nn.MaxPool3d configurations and an input shape they fit."""
    first, second = random_pool(rng), random_pool(rng)
    shape = (rng.randint(1, 3), rng.choice([1, 3, 5, 6, 9, 10]), *(rng.randint(6, 13) for _ in range(3)))
    return shape, first, second


def fits(shape, first, second):
    try:
        eager(torch.zeros(shape, dtype=torch.float64), first, second)
        return True
    except RuntimeError:
        return False


_rng = random.Random(4)
CONFIGS = [c for c in (random_config(_rng) for _ in range(30)) if fits(*c)][:16] + [
    # architecture B's tail at small size: 2 then 3, sizes that truncate (63 -> 31 -> 10 is below)
    ((2, 3, 13, 14, 15), dict(kernel_size=2), dict(kernel_size=3)),
    ((1, 5, 12, 12, 12), dict(kernel_size=2), dict(kernel_size=3)),
    # the other cubic pairs with their own fast CUDA forward, and one without (3 then 3)
    ((2, 3, 13, 12, 14), dict(kernel_size=3), dict(kernel_size=2)),
    ((1, 9, 9, 8, 11), dict(kernel_size=2), dict(kernel_size=2)),
    ((1, 2, 10, 9, 11), dict(kernel_size=3), dict(kernel_size=3)),
    # tiled but not cubic (fast backward, general forward)
    ((2, 3, 9, 8, 14), dict(kernel_size=(1, 2, 2)), dict(kernel_size=(3, 2, 3))),
    # overlapping windows in both stages, padding in both
    ((2, 3, 9, 10, 11), dict(kernel_size=3, stride=1, padding=1), dict(kernel_size=3, stride=2, padding=1)),
    # gaps between windows (stride > kernel)
    ((1, 3, 11, 12, 13), dict(kernel_size=2, stride=3), dict(kernel_size=2, stride=3)),
    # 1x1x1 stages (no pool)
    ((2, 3, 4, 5, 6), dict(kernel_size=1), dict(kernel_size=2)),
    # kernel volumes whose product is over 256: the backward recomputes the picks (int32 numbers)
    ((1, 3, 12, 11, 12), dict(kernel_size=3, stride=2), dict(kernel_size=(3, 2, 3))),
    ((1, 2, 16, 16, 17), dict(kernel_size=4), dict(kernel_size=2, stride=1)),
    ((1, 3, 25, 24, 26), dict(kernel_size=4), dict(kernel_size=3)),  # tiled
]


def check_forward_backward(x, first, second, dtype):
    """Forward and grad_x of the fused op against float64 PyTorch on the CPU."""
    poison_cuda_allocator()
    x = x.detach().requires_grad_()
    out = fused(x, first, second)
    v = x.detach().cpu().double().requires_grad_()
    ref = eager(v, first, second)
    assert out.shape == ref.shape and out.dtype == x.dtype and out.device == x.device
    assert_close_to_reference(out, ref, dtype, f"forward {first} {second}")
    grad = (torch.rand(ref.shape, dtype=torch.float64) + 0.5).to(dtype)
    (grad_x,) = torch.autograd.grad(out, x, grad.to(x.device))
    (grad_v,) = torch.autograd.grad(ref, v, grad.double())
    assert grad_x.dtype == x.dtype and grad_x.shape == x.shape
    assert_close_to_reference(grad_x, grad_v, dtype, f"grad_x {first} {second}")
    return grad_x


@pytest.mark.parametrize("shape,first,second", CONFIGS,
                         ids=[f"{s}-{sorted(a.items())}-{sorted(b.items())}" for s, a, b in CONFIGS])
def test_matches_pytorch(shape, first, second, device):
    for dtype in DTYPES:
        check_forward_backward(make_input(shape, dtype, device, seed=len(shape)), first, second, dtype)


@pytest.mark.parametrize("layout", LAYOUTS_5D)
@pytest.mark.parametrize("pools", [(dict(kernel_size=2), dict(kernel_size=3)),
                                   (dict(kernel_size=(3, 2, 2), stride=(2, 1, 2), padding=(1, 0, 1)),
                                    dict(kernel_size=2, stride=1))], ids=["2-3", "overlapping"])
def test_layouts(layout, pools, device, dtype):
    base = make_input((2, 5, 12, 13, 14), dtype, device)
    x = in_layout_5d(base, layout, sliced=(slice(None), slice(1, 4), slice(None), slice(1, None), slice(None, None, 1)))
    grad_x = check_forward_backward(x, *pools, dtype)
    assert grad_x.is_contiguous(memory_format=grad_memory_format(x))


TIE_CASES = [
    ((2, 3, 13, 14, 15), dict(kernel_size=2), dict(kernel_size=3)),
    ((1, 3, 12, 12, 13), dict(kernel_size=3), dict(kernel_size=2)),
    ((2, 2, 9, 10, 11), dict(kernel_size=3, stride=1, padding=1), dict(kernel_size=3, stride=2, padding=1)),
    ((1, 3, 9, 8, 9), dict(kernel_size=(2, 3, 2), stride=(2, 1, 2)), dict(kernel_size=(3, 2, 2), stride=(1, 2, 2))),
]


@pytest.mark.parametrize("shape,first,second", TIE_CASES, ids=[f"{a}-{b}" for _, a, b in TIE_CASES])
def test_ties_match_pytorch_exactly(shape, first, second, device, dtype):
    """Integer-valued inputs and constant regions: many equal maxima in both
    stages; grad_x must equal PyTorch's cascade element for element."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-2, 3, shape, generator=g).to(dtype=dtype, device=device)
    x[:, :1, 2:8, 1:7, :] = 1.0  # a constant region over whole windows of both stages
    x[-1, -1] = 0.0  # a constant channel
    out, ref, grad_x, grad_ref = exact_pair(x, lambda t: fused(t, first, second), lambda t: eager(t, first, second))
    torch.testing.assert_close(out, ref)
    assert torch.equal(grad_x, grad_ref), "picks differ from PyTorch's"


@pytest.mark.parametrize("pools", [(dict(kernel_size=2), dict(kernel_size=3)),
                                   (dict(kernel_size=3, stride=1, padding=1), dict(kernel_size=2, stride=2, padding=1))],
                         ids=["2-3", "overlapping"])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last_3d],
                         ids=["contiguous", "channels_last_3d"])
def test_nan_and_inf_match_pytorch(pools, memory_format, device, dtype):
    """NaN propagates and the last NaN wins at each stage (several NaNs in one
    stage-1 window, and in several stage-1 windows of one stage-2 window); +-inf
    pick like any value; a region of -inf picks its first element; +inf and
    -inf in one output's channel sum give NaN. Against PyTorch on a contiguous
    copy: its channels_last_3d max_pool3d (torch 2.13 CPU) routes a window of
    -inf's gradient to the element at depth 0 of the window's (h, w), outside
    the window."""
    nan, inf = float("nan"), float("inf")
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-2, 3, (2, 3, 12, 12, 13), generator=g).to(dtype=dtype, device=device)
    x[0, 0, 0, 0, 0] = x[0, 0, 0, 1, 0] = x[0, 0, 1, 1, 1] = nan  # three NaNs in one stage-1 window
    x[0, 0, 2, 3, 3] = x[0, 0, 4, 0, 5] = nan  # more NaNs in other stage-1 windows of the same output
    x[0, 1, 2, 2, 2] = x[0, 1, 3, 3, 3] = inf  # two +inf in one output's box
    x[1, 0, 0:6, 0:6, 0:6] = -inf  # a box of -inf
    x[1, 1, 6:12, 0:6, 0:6] = inf
    x[1, 2, 6:12, 0:6, 0:6] = -inf  # +inf and -inf summed: NaN
    x[1, 2, 1, 1, 12] = nan  # in the last column, outside every box of 2 then 3
    x = x.contiguous(memory_format=memory_format)
    out, ref, grad_x, grad_ref = exact_pair(x, lambda t: fused(t, *pools), lambda t: eager(t.contiguous(), *pools))
    torch.testing.assert_close(out, ref, equal_nan=True)
    assert out[0, 0, 0, 0, 0].isnan()
    assert torch.equal(grad_x, grad_ref), "picks differ from PyTorch's"


@pytest.mark.parametrize("shape,first,second", [
    ((1, 3, 63, 63, 63), dict(kernel_size=2), dict(kernel_size=3)),  # 63 -> 31 -> 10
    ((2, 5, 17, 23, 29), dict(kernel_size=2), dict(kernel_size=3)),  # 17 -> 8 -> 2, 23 -> 11 -> 3, 29 -> 14 -> 4
    ((1, 7, 20, 19, 35), dict(kernel_size=3), dict(kernel_size=2)),
])
def test_truncating_sizes(shape, first, second, device):
    """Only the part of x that reaches the output has a gradient; the rest is zero."""
    x = make_input(shape, torch.float32, device)
    grad_x = check_forward_backward(x, first, second, torch.float32)
    box = [(s // first["kernel_size"]) // second["kernel_size"] * first["kernel_size"] * second["kernel_size"]
           for s in shape[2:]]
    outside = grad_x.clone()
    outside[:, :, :box[0], :box[1], :box[2]] = 0
    assert not outside.any()


def test_reads_only_what_reaches_the_output(device):
    """NaN outside every box (63 -> 31 -> 10 reads 60 of 63 per dim) changes nothing."""
    x = make_input((1, 2, 63, 63, 63), torch.float32, device)
    clean = fused(x, dict(kernel_size=2), dict(kernel_size=3))
    x[:, :, 60:] = x[:, :, :, 60:] = x[:, :, :, :, 60:] = float("nan")
    assert torch.equal(fused(x, dict(kernel_size=2), dict(kernel_size=3)), clean)


# channels_last_3d inputs, which the CPU kernels read in vectors over channels:
# channel counts the vector width does not divide (3, 13, 37), each backward path.
CHANNELS_LAST_CONFIGS = [
    ((1, 37, 13, 12, 14), dict(kernel_size=2), dict(kernel_size=3)),  # B's tail: disjoint, stored over zeros
    ((2, 13, 9, 10, 11), dict(kernel_size=3, stride=1, padding=1), dict(kernel_size=3, stride=2, padding=1)),
    ((2, 3, 17, 18, 19), dict(kernel_size=2, stride=3), dict(kernel_size=2, stride=3)),  # gaps
    ((1, 13, 12, 11, 12), dict(kernel_size=3, stride=2), dict(kernel_size=(3, 2, 3))),  # picks recomputed
    ((2, 13, 11, 12, 13), dict(kernel_size=2, stride=3), dict(kernel_size=2, stride=3)),  # one output per plane
]


@pytest.mark.parametrize("shape,first,second", CHANNELS_LAST_CONFIGS,
                         ids=[f"{s}-{sorted(a.items())}-{sorted(b.items())}" for s, a, b in CHANNELS_LAST_CONFIGS])
def test_channels_last(shape, first, second, device, dtype):
    """Forward and backward against PyTorch; grad_x channels_last_3d on the CPU; the forward
    without autograd (values only) equal to the one that saves the picks."""
    x = make_input(shape, dtype, device).to(memory_format=torch.channels_last_3d)
    grad_x = check_forward_backward(x, first, second, dtype)
    assert grad_x.is_contiguous(memory_format=grad_memory_format(x))
    with torch.no_grad():
        values_only = fused(x, first, second)
    saving = fused(x.detach().requires_grad_(), first, second)
    assert torch.equal(values_only, saving.detach())


@pytest.mark.parametrize("channels", [3, 13, 37])
@pytest.mark.parametrize("shape,first,second", TIE_CASES, ids=[f"{a}-{b}" for _, a, b in TIE_CASES])
def test_channels_last_ties_match_pytorch_exactly(shape, first, second, channels, device, dtype):
    """test_ties_match_pytorch_exactly on channels_last_3d inputs, PyTorch's in the same layout."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-2, 3, (shape[0], channels, *shape[2:]), generator=g).to(dtype=dtype, device=device)
    x[:, :1, 2:8, 1:7, :] = 1.0
    x[-1, -1] = 0.0
    x = x.to(memory_format=torch.channels_last_3d)
    out, ref, grad_x, grad_ref = exact_pair(x, lambda t: fused(t, first, second), lambda t: eager(t, first, second))
    torch.testing.assert_close(out, ref)
    assert torch.equal(grad_x, grad_ref), "picks differ from PyTorch's"


def test_gradcheck(device):
    for first, second in [(dict(kernel_size=2), dict(kernel_size=3)),
                          (dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=2, stride=1, padding=1)),
                          (dict(kernel_size=(2, 1, 3), stride=1), dict(kernel_size=(1, 2, 2)))]:
        for fmt in [torch.contiguous_format, torch.channels_last_3d]:
            x = make_input((2, 3, 7, 6, 8), torch.float64, device).to(memory_format=fmt).requires_grad_()
            assert torch.autograd.gradcheck(lambda t: fused(t, first, second), (x,))
    # kernel volumes whose product is over 256: picks recomputed in the backward
    x = make_input((1, 2, 7, 7, 8), torch.float64, device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: max_pool3d_cascade_sum(t, 3, 3, stride1=1, stride2=2), (x,))


def test_opcheck(device):
    x = make_input((2, 3, 12, 13, 14), torch.float32, device, requires_grad=True)
    xl = make_input((2, 3, 9, 10, 11), torch.float64, device, requires_grad=True).to(memory_format=torch.channels_last_3d)
    overlapping = op_args(dict(kernel_size=(3, 2, 3), stride=(1, 2, 2), padding=(1, 1, 0)),
                          dict(kernel_size=2, stride=1, padding=1))
    for t, args in [(x, op_args(dict(kernel_size=2), dict(kernel_size=3))), (xl, overlapping)]:
        torch.library.opcheck(OP, (t, *args, True))
        # without saved picks the backward recomputes them from x
        torch.library.opcheck(OP, (t, *args, False))
    args = op_args(dict(kernel_size=2), dict(kernel_size=3))
    # x contiguous and channels_last_3d: the picks and grad_x laid out as x on the CPU
    for t in (x, x.to(memory_format=torch.channels_last_3d)):
        out, indices = OP(t, *args, True)
        grad_out = torch.rand(out.shape, device=device)
        torch.library.opcheck(BACKWARD, (grad_out, indices, None, [12, 13, 14], *args))
        torch.library.opcheck(BACKWARD, (grad_out, None, t.detach(), [12, 13, 14], *args))


def test_empty_batch(device):
    x = torch.rand(0, 3, 12, 12, 12, device=device, requires_grad=True)
    out = max_pool3d_cascade_sum(x, 2, 3)
    assert out.shape == (0, 1, 2, 2, 2)
    out.sum().backward()
    assert x.grad.shape == x.shape


def test_no_grad_saves_nothing(device):
    x = make_input((2, 3, 12, 12, 12), torch.float32, device)
    args = op_args(dict(kernel_size=2), dict(kernel_size=3))
    _, indices = OP(x, *args, False)
    assert indices.numel() == 0 and indices.dtype == torch.uint8
    _, indices = OP(x, *args, True)
    assert indices.shape == (2, 3, 2, 2, 2) and indices.dtype == torch.uint8


@requires_cuda
def test_cuda_large_and_tiled():
    """Shapes past the CUDA kernels' tiles: many output columns (several
    segments; more than a warp's 32, which the backward gathers by row bands),
    rows wider than a warp, many channel groups, odd channel counts."""
    for shape, first, second in [
        ((1, 2, 6, 6, 1100), dict(kernel_size=2), dict(kernel_size=3)),
        ((2, 67, 12, 30, 31), dict(kernel_size=2), dict(kernel_size=3)),
        ((2, 19, 24, 25, 70), dict(kernel_size=3), dict(kernel_size=2)),
        ((2, 33, 16, 17, 40), dict(kernel_size=2), dict(kernel_size=2)),
        ((1, 9, 14, 300, 7), dict(kernel_size=(1, 2, 1)), dict(kernel_size=(2, 3, 1))),
    ]:
        check_forward_backward(make_input(shape, torch.float32, "cuda"), first, second, torch.float32)


@requires_cuda
def test_cuda_default_shape_matches_cpu_and_is_deterministic():
    """Architecture B's tail at batch 1 of the default size (64 x 63^3):
    forward bit for bit repeatable, and close to the CPU's; the picks equal."""
    x = make_input((1, 64, 63, 63, 63), torch.float32, "cuda")
    args = op_args(dict(kernel_size=2), dict(kernel_size=3))
    a, picks = OP(x, *args, True)
    b, _ = OP(x, *args, True)
    assert torch.equal(a, b)
    cpu, cpu_picks = OP(x.cpu(), *args, True)
    torch.testing.assert_close(a.cpu(), cpu, rtol=1e-5, atol=0)
    assert torch.equal(picks.cpu(), cpu_picks)


@requires_cuda
def test_cuda_forward_materializes_nothing_of_x_size():
    x = make_input((2, 64, 63, 63, 63), torch.float32, "cuda", requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = max_pool3d_cascade_sum(x, 2, 3)
    torch.cuda.synchronize()
    # the saved picks (one byte per output and channel), the result and the partial sums
    assert torch.cuda.max_memory_allocated() - before < x.numel() * x.element_size() // 64
    del out


@pytest.mark.parametrize(
    "shape,dtype,args,error,match",
    [
        ((3, 8, 8, 8), torch.float32, dict(), ValueError, "5-D input"),
        ((1, 2, 3, 8, 8, 8), torch.float32, dict(), ValueError, "5-D input"),
        ((1, 2, 8, 8, 8), torch.int64, dict(), TypeError, "floating-point"),
        ((1, 2, 5, 8, 8), torch.float32, dict(), ValueError, "second pool.*smaller than the kernel"),
        ((1, 2, 1, 8, 8), torch.float32, dict(), ValueError, "first pool.*smaller than the kernel"),
        ((1, 2, 8, 8, 8), torch.float32, dict(padding1=2), ValueError, "at most half"),
        ((1, 2, 8, 8, 8), torch.float32, dict(stride2=0), ValueError, "stride must be positive"),
        ((1, 2, 8, 8, 8), torch.float32, dict(kernel_size1=0), ValueError, "kernel_size must be positive"),
        ((1, 0, 8, 8, 8), torch.float32, dict(), ValueError, "non-zero"),
        ((1, 2, 8, 8, 8), torch.float32, dict(kernel_size2=(1, 2)), TypeError, "kernel_size"),
    ],
)
def test_bad_input(shape, dtype, args, error, match, device):
    x = torch.ones(shape, dtype=dtype, device=device)
    kw = dict(kernel_size1=2, kernel_size2=3) | args
    with pytest.raises(error, match=match):
        max_pool3d_cascade_sum(x, **kw)


def test_bad_backward_input(device):
    x = make_input((2, 3, 12, 12, 12), torch.float32, device, requires_grad=True)
    args = op_args(dict(kernel_size=2), dict(kernel_size=3))
    out, indices = OP(x, *args, True)
    grad = torch.ones(out.shape, device=device)
    with pytest.raises(ValueError, match="does not match"):
        BACKWARD(torch.ones(2, 3, 2, 2, 2, device=device), indices, None, [12, 12, 12], *args)
    with pytest.raises(ValueError, match="does not match"):
        BACKWARD(grad, indices, None, [18, 12, 12], *args)
    with pytest.raises(ValueError, match="do not match"):
        BACKWARD(grad, indices[:1], None, [12, 12, 12], *args)
    with pytest.raises(ValueError, match="exactly one"):
        BACKWARD(grad, None, None, [12, 12, 12], *args)
    with pytest.raises(ValueError, match="exactly one"):
        BACKWARD(grad, indices, x.detach(), [12, 12, 12], *args)
    with pytest.raises(TypeError, match="uint8"):
        BACKWARD(grad, indices.long(), None, [12, 12, 12], *args)
    with pytest.raises(TypeError, match="dtype"):
        BACKWARD(grad, None, x.detach().double(), [12, 12, 12], *args)
    with pytest.raises(ValueError, match="at most 256"):
        OP(x, [3, 3, 3], [1, 1, 1], [1, 1, 1], [3, 3, 3], [1, 1, 1], [1, 1, 1], True)


def test_picks_past_their_window_refused():
    """On the CPU a saved pick past the cascade's 8 x 27 = 216 pick numbers (kernels 2 and 3) is refused, not
    followed past the windows."""
    x = make_input((2, 3, 12, 12, 12), torch.float32, "cpu")
    args = op_args(dict(kernel_size=2), dict(kernel_size=3))
    out, indices = OP(x, *args, True)
    for bad in (216, 255):
        picks = indices.clone()
        picks.view(-1)[1] = bad
        with pytest.raises(ValueError, match=f"must each name an element of its window of 216"
                           f", as the forward's do, got {bad}"):
            BACKWARD(torch.ones(out.shape), picks, None, [12, 12, 12], *args)


@requires_cuda
@pytest.mark.parametrize("shape,first,second", [
    ((2, 3, 12, 12, 12), dict(kernel_size=2), dict(kernel_size=3)),  # tiled, 2 output columns: aligned runs
    ((1, 2, 6, 6, 204), dict(kernel_size=2), dict(kernel_size=3)),   # tiled, 34 output columns: row bands
    ((2, 5, 12, 13, 14), dict(kernel_size=(3, 2, 2), stride=(2, 1, 2), padding=(1, 0, 1)),
     dict(kernel_size=2, stride=1)),                                   # overlapping: a thread per element
], ids=["aligned-tiled", "tiled", "any"])
def test_cuda_picks_past_their_window_add_nothing(shape, first, second):
    """On a GPU a saved pick past the cascade's pick numbers (a byte of their count, or 255) adds nothing, without
    an error (refusing it would wait for the device): with every channel's pick of the first, a middle and the
    last output (b, p) replaced, grad_x is the forward's picks' with those outputs' grad_out zeroed, bit for bit
    (each of the three gathers)."""
    x = make_input(shape, torch.float32, "cuda")
    args = op_args(first, second)
    out, indices = OP(x, *args, True)
    volume = math.prod(args[0]) * math.prod(args[3])
    batch, channels, outputs = indices.shape[0], indices.shape[1], out[0, 0].numel()
    grad = make_input(out.shape, torch.float32, "cuda", seed=1)
    picks, zeroed = indices.clone(), grad.clone()
    bad = torch.tensor([volume, 255], dtype=torch.uint8, device="cuda")[torch.arange(channels) % 2]
    for b, p in [(0, 0), (batch // 2, outputs // 2), (batch - 1, outputs - 1)]:
        picks.view(batch, channels, outputs)[b, :, p] = bad
        zeroed.view(batch, outputs)[b, p] = 0
    grad_x = BACKWARD(grad, picks, None, list(shape[2:]), *args)
    assert torch.equal(grad_x, BACKWARD(zeroed, indices, None, list(shape[2:]), *args))


@requires_cuda
def test_mixed_devices():
    x = make_input((2, 3, 12, 12, 12), torch.float32, "cuda", requires_grad=True)
    args = op_args(dict(kernel_size=2), dict(kernel_size=3))
    out, indices = OP(x, *args, True)
    with pytest.raises(ValueError, match="same device"):
        BACKWARD(torch.ones(out.shape), indices, None, [12, 12, 12], *args)
