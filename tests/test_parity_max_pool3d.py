"""fused_ops.parity_max_pool3d_mean and parity_max_pool3d_cascade_sum (the parity-class layout) against
PyTorch's max_pool3d -> mean and max_pool3d -> max_pool3d -> sum over channels on the interleaved 5-D tensor.

y (N, Md, Mh, Mw, C, Q) holds, per first-stage window position and channel, the Q elements of that window
in scan order: for any Q = Pd * Ph * Pw, y is the de-interleaved x (N, C, Md * Pd, Mh * Ph, Mw * Pw) with
x[n, c, Pd * md + qd, Ph * mh + qh, Pw * mw + qw] = y[n, md, mh, mw, c, (qd * Ph + qh) * Pw + qw].
"""
import itertools
import math
import random

import pytest
import torch
import torch.nn.functional as F

from conftest import DTYPES, RTOL, assert_close_to_reference, exact_pair, make_input, poison_cuda_allocator, requires_cuda
from fused_ops import parity_max_pool3d_cascade_sum, parity_max_pool3d_mean

MEAN = torch.ops.fused_ops.parity_max_pool3d_mean.default
MEAN_BACKWARD = torch.ops.fused_ops.parity_max_pool3d_mean_backward.default
CASCADE = torch.ops.fused_ops.parity_max_pool3d_cascade_sum.default
CASCADE_BACKWARD = torch.ops.fused_ops.parity_max_pool3d_cascade_sum_backward.default

BAD = (ValueError, TypeError, RuntimeError)


# --------------------------------------------------------------------------
# The layout and the eager references
# --------------------------------------------------------------------------


def interleave(y, P):
    """y (N, Md, Mh, Mw, C, Q) as x (N, C, Md*Pd, Mh*Ph, Mw*Pw), Pd*Ph*Pw == Q (differentiable)."""
    n, md, mh, mw, c, q = y.shape
    pd, ph, pw = P
    assert pd * ph * pw == q, (P, q)
    return (y.reshape(n, md, mh, mw, c, pd, ph, pw)
            .permute(0, 4, 1, 5, 2, 6, 3, 7)
            .reshape(n, c, md * pd, mh * ph, mw * pw))


def deinterleave(x, P):
    """interleave's inverse: x (N, C, Md*Pd, Mh*Ph, Mw*Pw) as y (N, Md, Mh, Mw, C, Pd*Ph*Pw)."""
    n, c, d, h, w = x.shape
    pd, ph, pw = P
    md, mh, mw = d // pd, h // ph, w // pw
    assert (md * pd, mh * ph, mw * pw) == (d, h, w), (x.shape, P)
    return (x.reshape(n, c, md, pd, mh, ph, mw, pw)
            .permute(0, 2, 4, 6, 1, 3, 5, 7)
            .reshape(n, md, mh, mw, c, pd * ph * pw))


def eager_mean(y, P):
    """F.max_pool3d(interleave(y, P), P).mean(dim=(2, 3, 4)), on y's device and dtype."""
    return F.max_pool3d(interleave(y, P), P).mean(dim=(2, 3, 4))


def eager_cascade(y, P, kernel2):
    """F.max_pool3d(F.max_pool3d(interleave(y, P), P), kernel2).sum(dim=1, keepdim=True)."""
    return F.max_pool3d(F.max_pool3d(interleave(y, P), P), kernel2).sum(dim=1, keepdim=True)


def triple(k):
    return (k, k, k) if isinstance(k, int) else tuple(k)


def factorizations(q):
    """Every (Pd, Ph, Pw) with Pd * Ph * Pw == q."""
    return [(a, b, q // (a * b)) for a in range(1, q + 1) if q % a == 0
            for b in range(1, q // a + 1) if (q // a) % b == 0]


def distinct_input(shape, dtype, device, seed=0, requires_grad=False):
    """Values k / numel for a random permutation k of 0..numel-1: no two equal, at least 1/numel apart
    (no ties, and gradcheck's perturbation never reorders a window)."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    y = (torch.randperm(n, generator=g).to(torch.float64) / n).reshape(shape)
    return y.to(dtype=dtype, device=device).requires_grad_(requires_grad)


def block_stage2(t, kernel2):
    """t (N, Md, Mh, Mw, C, ...) cut to the stage-2 windows and grouped as
    (N, D2, H2, W2, C, k2d * k2h * k2w, ...), the last-but-trailing dim in scan order of the window."""
    n, md, mh, mw, c = t.shape[:5]
    rest = t.shape[5:]
    kd, kh, kw = kernel2
    d2, h2, w2 = md // kd, mh // kh, mw // kw
    t = t[:, :d2 * kd, :h2 * kh, :w2 * kw]
    t = t.reshape(n, d2, kd, h2, kh, w2, kw, c, *rest)
    t = t.permute(0, 1, 3, 5, 7, 2, 4, 6, *range(8, 8 + len(rest)))
    return t.reshape(n, d2, h2, w2, c, kd * kh * kw, *rest)


# --------------------------------------------------------------------------
# Configurations
# --------------------------------------------------------------------------


def random_config(rng: random.Random):
    """(shape of y, a factorization P of Q, kernel2) with kernel2 <= the stage-1 size and k2vol * Q <= 256."""
    q = rng.choice([1, 2, 4, 8, 12])
    shape = (rng.choice([1, 2]), rng.randint(1, 7), rng.randint(1, 7), rng.randint(1, 7), rng.choice([1, 3, 5, 16]), q)
    while True:
        kernel2 = tuple(rng.randint(1, min(3, m)) for m in shape[1:4])
        if math.prod(kernel2) * q <= 256:
            break
    return shape, rng.choice(factorizations(q)), kernel2


_rng = random.Random(7)
CONFIGS = [random_config(_rng) for _ in range(10)] + [
    # architecture-like: 2x2x2 windows, then 3 (an int kernel2), sizes that 3 does not divide
    ((2, 7, 5, 4, 3, 8), (2, 2, 2), 3),
    # twelve classes as 3x2x2 and 1x3x4, kernel2 volume * Q = 18 * 12 = 216
    ((1, 6, 7, 5, 5, 12), (3, 2, 2), (3, 3, 2)),
    ((2, 3, 4, 6, 16, 12), (1, 3, 4), (1, 2, 3)),
    # Q = 1: no first pool
    ((2, 5, 6, 7, 3, 1), (1, 1, 1), (2, 3, 2)),
    # kernel2 volume * Q = 256 exactly; Q = 256 (the mean op's largest)
    ((1, 3, 2, 3, 3, 64), (4, 4, 4), (2, 2, 1)),
    ((1, 2, 1, 3, 2, 256), (8, 8, 4), 1),
    # many channels: the cascade's channel sum, accumulated in float32 and rounded once
    ((1, 2, 3, 2, 256, 2), (1, 1, 2), (2, 1, 2)),
    # a single window everywhere
    ((1, 1, 1, 1, 1, 8), (2, 2, 2), 1),
]
CONFIG_IDS = [f"{s}-P{p}-k{k}" for s, p, k in CONFIGS]


def test_interleave_helper():
    """The helpers against the layout's definition, element by element; the references do not depend on
    the factorization of Q."""
    y = torch.arange(2 * 2 * 3 * 1 * 3 * 12, dtype=torch.float64).reshape(2, 2, 3, 1, 3, 12)
    for P in [(3, 2, 2), (1, 3, 4), (12, 1, 1), (2, 1, 6)]:
        x = interleave(y, P)
        pd, ph, pw = P
        assert x.shape == (2, 3, 2 * pd, 3 * ph, pw)
        xl, yl = x.tolist(), y.tolist()
        for n, md, mh, mw, c, qd, qh, qw in itertools.product(range(2), range(2), range(3), range(1), range(3),
                                                               range(pd), range(ph), range(pw)):
            q = (qd * ph + qh) * pw + qw
            assert xl[n][c][pd * md + qd][ph * mh + qh][pw * mw + qw] == yl[n][md][mh][mw][c][q]
        assert torch.equal(deinterleave(x, P), y)
    assert sorted(factorizations(12)) == sorted(set(itertools.permutations((1, 1, 12)))
                                                | set(itertools.permutations((1, 2, 6)))
                                                | set(itertools.permutations((1, 3, 4)))
                                                | set(itertools.permutations((2, 2, 3))))
    z = make_input((2, 3, 4, 2, 5, 12), torch.float64, "cpu")
    means = [eager_mean(z, P) for P in [(3, 2, 2), (1, 3, 4), (12, 1, 1), (2, 6, 1)]]
    cascades = [eager_cascade(z, P, (2, 3, 1)) for P in [(3, 2, 2), (1, 1, 12), (4, 3, 1)]]
    assert all(torch.equal(m, means[0]) for m in means) and all(torch.equal(c, cascades[0]) for c in cascades)
    # stage 1 is the max over q; the cascade's picks from block_stage2 are those of max_pool3d
    torch.testing.assert_close(means[0], z.amax(-1).mean(dim=(1, 2, 3)))
    blocks = block_stage2(z.amax(-1), (2, 3, 1))
    torch.testing.assert_close(cascades[0][:, 0], blocks.amax(-1).sum(-1))


# --------------------------------------------------------------------------
# Values and gradients against the float64 references
# --------------------------------------------------------------------------


def check_against_eager(fused, eager, y, dtype, seed, what):
    """Forward and grad_y of fused(y) against eager(v), v = y in float64 on the CPU
    (same shape, y's dtype and device); returns the forward and grad_y."""
    poison_cuda_allocator()
    y = y.detach().requires_grad_()
    out = fused(y)
    v = y.detach().cpu().double().requires_grad_()
    ref = eager(v)
    assert out.shape == ref.shape and out.dtype == y.dtype and out.device == y.device
    assert_close_to_reference(out, ref, dtype, f"forward {what}")
    g = torch.Generator().manual_seed(seed)
    grad = (torch.rand(ref.shape, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    (grad_y,) = torch.autograd.grad(out, y, grad.to(y.device))
    (grad_v,) = torch.autograd.grad(ref, v, grad.double())
    assert grad_y.shape == y.shape and grad_y.dtype == y.dtype and grad_y.device == y.device
    assert_close_to_reference(grad_y, grad_v, dtype, f"grad_y {what}")
    return out, grad_y


def check_mean(y, P, dtype, seed=0):
    """Forward and grad_y of parity_max_pool3d_mean against float64 PyTorch on the CPU."""
    out, grad_y = check_against_eager(parity_max_pool3d_mean, lambda v: eager_mean(v, P), y, dtype, seed,
                                      f"{tuple(y.shape)} P={P}")
    assert out.shape == (y.shape[0], y.shape[4])
    return out, grad_y


def check_cascade(y, P, kernel2, dtype, seed=0):
    """Forward and grad_y of parity_max_pool3d_cascade_sum against float64 PyTorch on the CPU."""
    out, grad_y = check_against_eager(lambda t: parity_max_pool3d_cascade_sum(t, kernel2),
                                      lambda v: eager_cascade(v, P, kernel2), y, dtype, seed,
                                      f"{tuple(y.shape)} P={P} kernel2={kernel2}")
    k = triple(kernel2)
    assert out.shape == (y.shape[0], 1, *(m // kd for m, kd in zip(y.shape[1:4], k)))
    return out, grad_y


@pytest.mark.parametrize("shape,P,kernel2", CONFIGS, ids=CONFIG_IDS)
def test_mean_matches_pytorch(shape, P, kernel2, device, dtype):
    check_mean(make_input(shape, dtype, device, seed=sum(shape)), P, dtype)


@pytest.mark.parametrize("shape,P,kernel2", CONFIGS, ids=CONFIG_IDS)
def test_cascade_matches_pytorch(shape, P, kernel2, device, dtype):
    _, grad_y = check_cascade(make_input(shape, dtype, device, seed=sum(shape)), P, kernel2, dtype)
    # the elements of y in no stage-2 window have no gradient
    k = triple(kernel2)
    outside = grad_y.clone()
    outside[:, :shape[1] // k[0] * k[0], :shape[2] // k[1] * k[1], :shape[3] // k[2] * k[2]] = 0
    assert not outside.any()


@pytest.mark.parametrize("layout", ["every-other-q", "transposed", "sliced-mw", "sliced-c"])
def test_non_contiguous(layout, device, dtype):
    """A strided y gives what y.contiguous() gives (values and gradients)."""
    shape = (2, 5, 4, 3, 3, 8)
    n, md, mh, mw, c, q = shape
    if layout == "every-other-q":
        y = make_input((n, md, mh, mw, c, 2 * q), dtype, device)[..., ::2]
    elif layout == "transposed":
        y = make_input((n, md, mh, mw, q, c), dtype, device).transpose(4, 5)
    elif layout == "sliced-mw":
        y = make_input((n, md, mh, mw + 2, c, q), dtype, device)[:, :, :, 1:-1]
    else:
        y = make_input((n, md, mh, mw, c + 3, q), dtype, device)[:, :, :, :, 2:-1]
    assert y.shape == shape and not y.is_contiguous()
    for op in (parity_max_pool3d_mean, lambda t: parity_max_pool3d_cascade_sum(t, (2, 3, 2))):
        a = y.detach().requires_grad_()
        b = y.detach().contiguous().requires_grad_()
        out_a, out_b = op(a), op(b)
        assert torch.equal(out_a, out_b)
        grad = torch.rand(out_b.shape, generator=torch.Generator().manual_seed(1)).to(dtype=dtype, device=device)
        out_a.backward(grad)
        out_b.backward(grad)
        assert torch.equal(a.grad, b.grad)
    # and both against the reference
    check_mean(y, (2, 2, 2), dtype)
    check_cascade(y, (1, 4, 2), (2, 3, 2), dtype)


# --------------------------------------------------------------------------
# Ties, NaN and inf: the same picks as PyTorch's, element for element
# --------------------------------------------------------------------------


# Md * Mh * Mw a power of two, so that the mean's gradient (grad / count) is exact in any dtype
MEAN_TIE_CASES = [
    ((2, 2, 4, 1, 3, 8), (2, 2, 2)),
    ((1, 4, 2, 2, 5, 12), (3, 1, 4)),
    ((2, 1, 1, 1, 16, 4), (1, 2, 2)),
    ((2, 2, 2, 2, 3, 1), (1, 1, 1)),
]
CASCADE_TIE_CASES = [
    ((2, 4, 5, 6, 3, 8), (2, 2, 2), (2, 2, 3)),
    ((1, 6, 7, 5, 5, 12), (3, 2, 2), (3, 3, 2)),
    ((2, 3, 4, 7, 16, 4), (4, 1, 1), 2),
    ((2, 5, 3, 3, 3, 1), (1, 1, 1), (2, 1, 3)),
]


def with_ties(shape, dtype, device):
    """torch.randint(0, 3) values, a constant channel, a constant region over whole windows of both
    stages, and a constant batch element."""
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, 3, shape, generator=g).to(dtype=dtype, device=device)
    y[:, :, :, :, :1] = 1.0
    y[0, :2, :2, :2] = 2.0
    y[-1, -1] = 0.0
    return y


@pytest.mark.parametrize("shape,P", MEAN_TIE_CASES, ids=[str(s) for s, _ in MEAN_TIE_CASES])
def test_mean_ties_match_pytorch_exactly(shape, P, device, dtype):
    y = with_ties(shape, dtype, device)
    out, ref, grad_y, grad_ref = exact_pair(y, parity_max_pool3d_mean, lambda t: eager_mean(t, P))
    torch.testing.assert_close(out, ref)
    assert torch.equal(grad_y, grad_ref), "picks differ from PyTorch's"


@pytest.mark.parametrize("shape,P,kernel2", CASCADE_TIE_CASES, ids=[str(s) for s, _, _ in CASCADE_TIE_CASES])
def test_cascade_ties_match_pytorch_exactly(shape, P, kernel2, device, dtype):
    y = with_ties(shape, dtype, device)
    out, ref, grad_y, grad_ref = exact_pair(y, lambda t: parity_max_pool3d_cascade_sum(t, kernel2),
                                            lambda t: eager_cascade(t, P, kernel2))
    torch.testing.assert_close(out, ref)
    assert torch.equal(grad_y, grad_ref), "picks differ from PyTorch's"


def scatter_special(y, seed, count=6):
    """NaN, +inf and -inf at `count` random positions each."""
    g = torch.Generator().manual_seed(seed)
    flat = y.view(-1)
    for value in (float("nan"), float("inf"), float("-inf")):
        flat[torch.randint(0, flat.numel(), (count,), generator=g)] = value
    return y


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_mean_nan_and_inf_match_pytorch(seed, device, dtype):
    """NaN propagates and the last NaN of a window is its pick; +-inf pick like any value (the first of
    equal ones); a window of -inf picks its first element; +inf and -inf maxima in one channel give NaN.
    seed None: those cases placed by hand; else NaN and +-inf at random positions."""
    nan, inf = float("nan"), float("inf")
    g = torch.Generator().manual_seed(2)
    y = torch.randint(-2, 3, (2, 4, 2, 1, 3, 8), generator=g).to(dtype=dtype, device=device)
    if seed is None:
        y[0, 0, 0, 0, 0, [1, 4, 6]] = nan  # three NaNs in one window: the last (q = 6) is the pick
        y[0, 3, 1, 0, 0, 0] = nan  # another window of the same channel
        y[0, 1, 1, 0, 1, [2, 5]] = inf  # two +inf in one window
        y[1, 0, 0, 0, 0] = -inf  # a window of -inf
        y[1, :, :, :, 1] = -inf
        y[1, 2, 1, 0, 1, 3] = inf  # maxima +inf and -inf: the mean is NaN
    else:
        scatter_special(y, seed)
    out, ref, grad_y, grad_ref = exact_pair(y, parity_max_pool3d_mean, lambda t: eager_mean(t, (2, 1, 4)))
    torch.testing.assert_close(out, ref, equal_nan=True)
    assert out.isnan().any()
    if seed is None:
        assert out[0, 0].isnan() and out[1, 1].isnan() and out[0, 1] == inf and not out[1, 0].isnan()
        assert grad_y[0, 0, 0, 0, 0].nonzero().flatten().tolist() == [6]
    assert torch.equal(grad_y, grad_ref), "picks differ from PyTorch's"


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_cascade_nan_and_inf_match_pytorch(seed, device, dtype):
    """NaN propagates and the last NaN wins at each stage (several NaNs in one stage-1 window, and in
    several stage-1 windows of one stage-2 window); +-inf pick like any value; a box of -inf picks its
    first element; +inf and -inf in one output's channel sum give NaN; a NaN in no stage-2 window changes
    nothing. seed None: those cases placed by hand; else NaN and +-inf at random positions."""
    nan, inf = float("nan"), float("inf")
    g = torch.Generator().manual_seed(2)
    y = torch.randint(-2, 3, (2, 4, 4, 4, 3, 8), generator=g).to(dtype=dtype, device=device)
    kernel2 = (2, 2, 3)  # the column mw = 3 is in no stage-2 window
    if seed is None:
        y[0, 0, 0, 0, 0, [1, 5]] = nan
        y[0, 1, 0, 0, 0, 7] = nan
        y[0, 1, 1, 2, 0, 3] = nan  # the last NaN of the stage-2 window (0, 0, 0) in scan order
        y[0, 0, 0, 1, 1, [2, 4]] = inf  # two +inf in one stage-1 window
        y[0, 1, 1, 0, 1, 0] = inf  # and a later one in the same stage-2 window
        y[1, 0:2, 0:2, :, 0] = inf
        y[1, 0:2, 0:2, :, 1] = -inf  # +inf + -inf: NaN
        y[1, 2:4, 0:2, :, 2] = -inf  # a box of -inf
        y[1, 0, 0, 3, 2, 0] = nan  # in no stage-2 window
    else:
        scatter_special(y, seed)
    out, ref, grad_y, grad_ref = exact_pair(y, lambda t: parity_max_pool3d_cascade_sum(t, kernel2),
                                            lambda t: eager_cascade(t, (2, 2, 2), kernel2))
    torch.testing.assert_close(out, ref, equal_nan=True)
    if seed is None:
        assert out[0, 0, 0, 0, 0].isnan() and out[1, 0, 0, 0, 0].isnan() and not out[1, 0, 1, 0, 0].isnan()
        assert grad_y[0, 0:2, 0:2, 0:3, 0].nonzero().tolist() == [[1, 1, 2, 3]]
        assert not grad_y[:, :, :, 3].any()
    assert torch.equal(grad_y, grad_ref), "picks differ from PyTorch's"


# --------------------------------------------------------------------------
# The raw ops
# --------------------------------------------------------------------------


def test_picks(device):
    """The saved picks: q of each window (the mean op), off2 * Q + q (the cascade), uint8; none without
    save_indices."""
    y = distinct_input((2, 5, 4, 7, 3, 12), torch.float32, device)
    mean, picks = MEAN(y, True)
    assert picks.dtype == torch.uint8 and picks.shape == (2, 5, 4, 7, 3) and picks.device == y.device
    assert torch.equal(picks.long(), y.argmax(-1))
    assert mean.shape == (2, 3) and mean.dtype == y.dtype
    _, none = MEAN(y, False)
    assert none.dtype == torch.uint8 and none.shape == (0,)

    kernel2 = [2, 3, 2]
    out, picks = CASCADE(y, kernel2, True)
    assert out.shape == (2, 1, 2, 1, 3) and out.dtype == y.dtype
    assert picks.dtype == torch.uint8 and picks.shape == (2, 2, 1, 3, 3) and picks.device == y.device
    off2 = block_stage2(y.amax(-1), kernel2).argmax(-1)
    q = block_stage2(y.argmax(-1), kernel2).gather(-1, off2[..., None])[..., 0]
    assert torch.equal(picks.long(), off2 * 12 + q)
    _, none = CASCADE(y, kernel2, False)
    assert none.dtype == torch.uint8 and none.shape == (0,)


def test_backward_ops(device):
    """The raw backward ops route each gradient to its pick (the saved picks of a random y)."""
    y = distinct_input((2, 5, 4, 7, 3, 12), torch.float64, device, seed=4)
    v = y.detach().cpu().requires_grad_()
    _, picks = MEAN(y, True)
    grad = torch.rand(2, 3, dtype=torch.float64)
    grad_y = MEAN_BACKWARD(grad.to(device), picks, 12)
    assert grad_y.shape == y.shape and grad_y.dtype == grad.dtype and grad_y.is_contiguous()
    torch.testing.assert_close(grad_y.cpu(), torch.autograd.grad(eager_mean(v, (3, 2, 2)), v, grad)[0])

    _, picks = CASCADE(y, [2, 3, 2], True)
    grad = torch.rand(2, 1, 2, 1, 3, dtype=torch.float64)
    grad_y = CASCADE_BACKWARD(grad.to(device), picks, [5, 4, 7], [2, 3, 2], 12)
    assert grad_y.shape == y.shape and grad_y.dtype == grad.dtype and grad_y.is_contiguous()
    torch.testing.assert_close(grad_y.cpu(), torch.autograd.grad(eager_cascade(v, (2, 3, 2), (2, 3, 2)), v, grad)[0])


def test_backward_ops_refuse_picks_past_their_window():
    """On the CPU a saved pick past its window is refused: the mean's past the 12 parity classes, the cascade's
    past 12 classes x kernel2's 12 elements (144)."""
    y = distinct_input((2, 5, 4, 7, 3, 12), torch.float64, "cpu", seed=4)
    _, picks = MEAN(y, True)
    picks[1, 2, 3, 6, 0] = 12
    with pytest.raises(ValueError, match="must each name an element of its window of 12, as the forward's do, got 12"):
        MEAN_BACKWARD(torch.rand(2, 3, dtype=torch.float64), picks, 12)
    _, picks = CASCADE(y, [2, 3, 2], True)
    picks.view(-1)[-1] = 144
    with pytest.raises(ValueError, match="must each name an element of its window of 144"
                       ", as the forward's do, got 144"):
        CASCADE_BACKWARD(torch.rand(2, 1, 2, 1, 3, dtype=torch.float64), picks, [5, 4, 7], [2, 3, 2], 12)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cuda_mean_backward_drops_picks_past_their_window(dtype):
    """On a GPU a saved pick past its window of 12 parity classes (12, or 255: at the first, a middle and the last
    window) adds nothing, without an error (refusing it would wait for the device): grad_y is every other
    window's grad_mean / M at its pick, exactly (grad_mean a multiple of M; vectors of 2 and 4 elements)."""
    y = distinct_input((2, 5, 4, 7, 3, 12), dtype, "cuda", seed=4)
    _, picks = MEAN(y, True)
    n = picks.numel()
    picks.view(-1)[[0, n // 2, n - 1]] = torch.tensor([12, 255, 12], dtype=torch.uint8, device="cuda")
    grad = (torch.randint(1, 5, (2, 3)) * 5 * 4 * 7).to(dtype)
    grad_y = MEAN_BACKWARD(grad.cuda(), picks, 12)
    expected = (picks.long().cpu()[..., None] == torch.arange(12)) * (grad / (5 * 4 * 7))[:, None, None, None, :, None]
    assert torch.equal(grad_y.cpu(), expected)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cuda_cascade_backward_drops_picks_past_their_window(dtype):
    """On a GPU a saved pick past its 12 classes x kernel2's 12 elements (144, or 255) adds nothing, without an
    error: with every channel's pick of the first, a middle and the last stage-2 cell (n, cell) replaced, grad_y
    is the forward's picks' with those cells' grad_out zeroed, bit for bit."""
    y = distinct_input((2, 5, 4, 7, 3, 12), dtype, "cuda", seed=4)
    _, picks = CASCADE(y, [2, 3, 2], True)
    grad = torch.rand(2, 1, 2, 1, 3, dtype=dtype, device="cuda")
    bad, zeroed = picks.clone(), grad.clone()
    for n, cell in [(0, 0), (1, 0), (1, 5)]:  # (of 2 x 6 cells)
        bad.view(2, 6, 3)[n, cell] = torch.tensor([144, 255, 144], dtype=torch.uint8, device="cuda")
        zeroed.view(2, 6)[n, cell] = 0
    grad_y = CASCADE_BACKWARD(grad, bad, [5, 4, 7], [2, 3, 2], 12)
    assert torch.equal(grad_y, CASCADE_BACKWARD(zeroed, picks, [5, 4, 7], [2, 3, 2], 12))


def test_opcheck(device):
    shape, kernel2 = (2, 3, 2, 5, 3, 8), [2, 1, 3]
    y = distinct_input(shape, torch.float32, device, requires_grad=True)
    torch.library.opcheck(MEAN, (y, True))
    # without saved picks the op is not differentiable: inference only
    torch.library.opcheck(MEAN, (y.detach(), False))
    torch.library.opcheck(CASCADE, (y, kernel2, True))
    torch.library.opcheck(CASCADE, (y.detach(), kernel2, False))
    mean, picks = MEAN(y.detach(), True)
    torch.library.opcheck(MEAN_BACKWARD, (torch.rand(mean.shape, device=device), picks, 8))
    out, picks = CASCADE(y.detach(), kernel2, True)
    torch.library.opcheck(CASCADE_BACKWARD, (torch.rand(out.shape, device=device), picks, [3, 2, 5], kernel2, 8))


def test_output_requires_grad(device):
    """The results require grad exactly when y does and grad mode is on."""
    y = distinct_input((2, 3, 4, 5, 3, 4), torch.float32, device, requires_grad=True)
    for op in (parity_max_pool3d_mean, lambda t: parity_max_pool3d_cascade_sum(t, 2)):
        assert op(y).requires_grad
        assert not op(y.detach()).requires_grad
        with torch.no_grad():
            out = op(y)
        assert not out.requires_grad
        assert torch.equal(out, op(y.detach()))


def test_gradcheck(device):
    """float64, distinct values (no ties)."""
    for shape in [(2, 3, 2, 1, 3, 4), (1, 1, 1, 1, 2, 12), (2, 2, 3, 2, 1, 1)]:
        y = distinct_input(shape, torch.float64, device, requires_grad=True)
        assert torch.autograd.gradcheck(parity_max_pool3d_mean, (y,))
    for shape, kernel2 in [((1, 4, 3, 5, 2, 4), (2, 1, 2)), ((2, 2, 2, 2, 3, 2), 2), ((1, 3, 3, 1, 1, 12), (3, 2, 1))]:
        y = distinct_input(shape, torch.float64, device, requires_grad=True)
        assert torch.autograd.gradcheck(lambda t: parity_max_pool3d_cascade_sum(t, kernel2), (y,))
    # strided
    y = distinct_input((2, 3, 2, 3, 4, 2), torch.float64, device).transpose(4, 5).requires_grad_()
    assert torch.autograd.gradcheck(parity_max_pool3d_mean, (y,))
    assert torch.autograd.gradcheck(lambda t: parity_max_pool3d_cascade_sum(t, (1, 2, 3)), (y,))


def test_torch_compile(device):
    """torch.compile(fullgraph=True) of a function calling both wrappers: forward and backward equal to eager."""
    def f(t):
        return parity_max_pool3d_mean(t), parity_max_pool3d_cascade_sum(t, (2, 3, 2))

    compiled = torch.compile(f, fullgraph=True)
    y = make_input((2, 5, 4, 7, 3, 8), torch.float32, device)
    a = y.clone().requires_grad_()
    b = y.clone().requires_grad_()
    mean_a, cascade_a = compiled(a)
    mean_b, cascade_b = f(b)
    assert torch.equal(mean_a, mean_b) and torch.equal(cascade_a, cascade_b)
    g = torch.Generator().manual_seed(5)
    grad_mean = torch.rand(mean_b.shape, generator=g).to(device)
    grad_cascade = torch.rand(cascade_b.shape, generator=g).to(device)
    for out_a, out_b, grad in [(mean_a, mean_b, grad_mean), (cascade_a, cascade_b, grad_cascade)]:
        (grad_a,) = torch.autograd.grad(out_a, a, grad, retain_graph=True)
        (grad_b,) = torch.autograd.grad(out_b, b, grad, retain_graph=True)
        assert grad_a.abs().sum() > 0
        assert torch.equal(grad_a, grad_b)


# --------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("shape,kernel2", [((2, 5, 4, 7, 3, 12), (2, 3, 2)), ((2, 15, 16, 17, 64, 8), (3, 3, 3)),
                                           ((1, 3, 5, 300, 5, 2), (1, 1, 3))])
def test_cuda_matches_cpu(shape, kernel2):
    for dtype in DTYPES:
        y = make_input(shape, dtype, "cuda", requires_grad=True)
        x = y.detach().cpu().requires_grad_()
        for op in (parity_max_pool3d_mean, lambda t: parity_max_pool3d_cascade_sum(t, kernel2)):
            out_cuda, out_cpu = op(y), op(x)
            torch.testing.assert_close(out_cuda.cpu(), out_cpu, rtol=RTOL[dtype], atol=0,
                                       msg=lambda m: f"{dtype}\n{m}")
            grad = torch.rand(out_cpu.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
            (grad_cuda,) = torch.autograd.grad(out_cuda, y, grad.cuda())
            (grad_cpu,) = torch.autograd.grad(out_cpu, x, grad)
            torch.testing.assert_close(grad_cuda.cpu(), grad_cpu, rtol=RTOL[dtype], atol=0,
                                       msg=lambda m: f"{dtype}\n{m}")
    y = make_input(shape, torch.float32, "cuda")
    assert torch.equal(MEAN(y, True)[1].cpu(), MEAN(y.cpu(), True)[1])
    assert torch.equal(CASCADE(y, list(kernel2), True)[1].cpu(), CASCADE(y.cpu(), list(kernel2), True)[1])


@requires_cuda
def test_mixed_devices():
    y = make_input((2, 4, 4, 3, 3, 8), torch.float32, "cpu")
    mean, picks = MEAN(y, True)
    with pytest.raises(BAD):
        MEAN_BACKWARD(torch.ones(mean.shape, device="cuda"), picks, 8)
    out, picks = CASCADE(y, [2, 2, 3], True)
    with pytest.raises(BAD):
        CASCADE_BACKWARD(torch.ones(out.shape, device="cuda"), picks, [4, 4, 3], [2, 2, 3], 8)


# --------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------


def call_mean(y, kernel2, raw):
    return MEAN(y, False) if raw else parity_max_pool3d_mean(y)


def call_cascade(y, kernel2, raw):
    return CASCADE(y, list(triple(kernel2)), False) if raw else parity_max_pool3d_cascade_sum(y, kernel2)


@pytest.mark.parametrize("raw", [False, True], ids=["wrapper", "raw"])
@pytest.mark.parametrize(
    "call,shape,dtype,kernel2,match",
    [
        (call_mean, (2, 2, 2, 3, 8), torch.float32, 1, "6-D"),
        (call_mean, (1, 2, 2, 2, 3, 8, 1), torch.float32, 1, "6-D"),
        (call_mean, (1, 2, 2, 2, 3, 8), torch.int64, 1, "floating-point"),
        (call_mean, (1, 2, 2, 2, 0, 8), torch.float32, 1, None),
        (call_mean, (1, 0, 2, 2, 3, 8), torch.float32, 1, None),
        (call_mean, (1, 2, 2, 2, 3, 0), torch.float32, 1, None),
        (call_mean, (0, 2, 2, 2, 3, 8), torch.float32, 1, None),
        (call_mean, (1, 2, 1, 1, 2, 257), torch.float32, 1, "256"),
        (call_cascade, (2, 2, 2, 3, 8), torch.float32, 1, "6-D"),
        (call_cascade, (1, 2, 2, 2, 3, 8), torch.int32, 1, "floating-point"),
        (call_cascade, (1, 2, 2, 2, 0, 8), torch.float32, 1, None),
        (call_cascade, (1, 2, 0, 2, 3, 8), torch.float32, 1, None),
        (call_cascade, (1, 2, 2, 2, 3, 0), torch.float32, 1, None),
        (call_cascade, (0, 2, 2, 2, 3, 8), torch.float32, 1, None),
        (call_cascade, (1, 3, 3, 3, 1, 12), torch.float32, 3, "256"),  # 27 * 12 = 324
        (call_cascade, (1, 1, 1, 1, 1, 257), torch.float32, 1, "256"),
        (call_cascade, (1, 2, 4, 4, 3, 8), torch.float32, (3, 2, 2), "smaller than"),
        (call_cascade, (1, 4, 4, 2, 3, 8), torch.float32, 3, "smaller than"),
    ],
    ids=lambda v: v.__name__ if callable(v) else None,
)
def test_bad_input(call, shape, dtype, kernel2, match, raw, device):
    y = torch.ones(shape, dtype=dtype, device=device)
    with pytest.raises(BAD, match=match):
        call(y, kernel2, raw)
