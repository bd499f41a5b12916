"""fused_ops.conv_transpose3d_cascade_weight_grad (B's weight gradient from the cascade's picks)
against PyTorch's dense transposed-convolution weight gradient of y's gradient that is zero off the
picks, in float64; and B's rewrite, which takes it in a training step on data, against the original.

The picks (N, *cells, O) name, per stage-2 cell and channel, the element of y the cascade routes
the cell's gradient to: byte off * Q + q, y's position P (k2 * cell + off) + q per dim (off over
kernel2 and q over the stride's classes, each in scan order: csrc/parity_max_pool3d.h)."""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICES, DTYPES, assert_close_to_reference, matmul_precision, misaligned, requires_cuda
from fused_ops import autotune, conv_transpose3d_cascade_weight_grad, reference, rewrites
from fused_ops import nn as fnn

OP = torch.ops.fused_ops.conv_transpose3d_cascade_weight_grad.default


def unravel(flat, sizes):
    """Per-dim indices of scan-order indices `flat` over `sizes` (last fastest)."""
    out = []
    for size in reversed(sizes):
        out.append(flat % size)
        flat = flat // size
    return list(reversed(out))


def dense_grad_y(grad_out, picks, stride, kernel2, out_size):
    """y's gradient (N, O, *out_size): grad_out[n, 0, cell] at each (n, cell, o)'s pick, zero elsewhere."""
    n, *cells, channels = picks.shape
    classes = math.prod(stride)
    pick = picks.long()
    off, q = unravel(pick // classes, kernel2), unravel(pick % classes, stride)
    grid = torch.meshgrid(*[torch.arange(c, device=picks.device) for c in cells], indexing="ij")
    at = [stride[d] * (kernel2[d] * grid[d][None, ..., None] + off[d]) + q[d] for d in range(3)]
    grad_y = grad_out.new_zeros((n, channels, *out_size))
    index = torch.meshgrid(torch.arange(n, device=picks.device), *[torch.arange(c, device=picks.device) for c in cells],
                           torch.arange(channels, device=picks.device), indexing="ij")
    grad_y[index[0], index[4], at[0], at[1], at[2]] = grad_out[:, 0, :, :, :, None].expand(picks.shape)
    return grad_y


def dense_weight_grad(grad_out, picks, x, kernel, stride, padding, kernel2, out_size):
    """PyTorch's weight gradient of conv_transpose3d(x, w) for dense_grad_y, in float64."""
    x64 = x.double()
    extra = [out_size[d] - ((x.shape[2 + d] - 1) * stride[d] - 2 * padding[d] + kernel[d]) for d in range(3)]
    w = torch.zeros(x.shape[1], picks.shape[4], *kernel, dtype=torch.float64, device=x.device, requires_grad=True)
    y = F.conv_transpose3d(x64, w, stride=stride, padding=padding, output_padding=extra)
    assert list(y.shape[2:]) == list(out_size)
    return torch.autograd.grad(y, w, dense_grad_y(grad_out.double(), picks, stride, kernel2, out_size))[0]


def case(batch, channels, out_channels, size, kernel, stride, padding, kernel2, extra=(0, 0, 0), seed=0,
         integers=False, device="cpu", dtype=torch.float64):
    """Random x, grad_out and valid picks for a geometry; y's size."""
    g = torch.Generator().manual_seed(seed)
    out_size = [(size[d] - 1) * stride[d] - 2 * padding[d] + kernel[d] + extra[d] for d in range(3)]
    cells = [out_size[d] // stride[d] // kernel2[d] for d in range(3)]
    if integers:
        x = torch.randint(-3, 4, (batch, channels, *size), generator=g).to(dtype)
        grad_out = torch.randint(-2, 3, (batch, 1, *cells), generator=g).to(dtype)
    else:
        x = torch.rand((batch, channels, *size), generator=g, dtype=torch.float64).to(dtype)
        grad_out = torch.rand((batch, 1, *cells), generator=g, dtype=torch.float64) - 0.5
    picks = torch.randint(0, math.prod(stride) * math.prod(kernel2), (batch, *cells, out_channels), generator=g,
                          dtype=torch.uint8)
    return x.to(device), grad_out.to(device), picks.to(device), out_size


# (batch, I, O, input size, kernel, stride, padding, kernel2, output_padding)
GEOMETRIES = [
    (2, 3, 4, (5, 4, 6), (5, 5, 5), (2, 2, 2), (2, 2, 2), (3, 3, 3), (0, 0, 0)),  # B's, small
    (1, 2, 3, (4, 5, 3), (3, 4, 2), (2, 1, 3), (1, 0, 1), (2, 2, 1), (1, 0, 2)),  # mixed per dim
    (3, 33, 2, (3, 3, 4), (2, 3, 3), (1, 2, 2), (0, 1, 0), (1, 2, 3), (0, 0, 1)),  # 33 channels: two lane blocks
    (1, 1, 1, (2, 2, 2), (1, 1, 1), (1, 1, 1), (0, 0, 0), (1, 1, 1), (0, 0, 0)),  # 1x1x1
    (2, 4, 5, (3, 4, 3), (7, 6, 5), (3, 3, 2), (3, 2, 0), (1, 1, 2), (2, 0, 1)),  # kernels beyond the stride
]


# The GPU's window kernel takes these in float32 and 16 bits (stride 2 everywhere, cubic kernels of
# 3 to 5, input channels a multiple of 4): its class switch, windows clipped by x, part-filled blocks
WINDOW_GEOMETRIES = [
    (2, 4, 9, (5, 4, 6), (5, 5, 5), (2, 2, 2), (2, 2, 2), (3, 3, 3), (0, 0, 0)),  # B's; 9 output channels
    (3, 36, 5, (4, 5, 3), (3, 3, 3), (2, 2, 2), (0, 1, 2), (1, 2, 1), (1, 0, 1)),  # mixed; 36 channels: two lane blocks
    (1, 8, 16, (6, 6, 6), (4, 4, 4), (2, 2, 2), (1, 1, 1), (2, 2, 2), (0, 0, 0)),  # even kernel
    # 5000 items: dozens a block on a GPU (its ring of stages and batches of picks wrap around)
    (5, 4, 8, (31, 31, 31), (5, 5, 5), (2, 2, 2), (2, 2, 2), (3, 3, 3), (0, 0, 0)),
]


def window_ids(g):
    return f"K{g[4]}-pad{g[6]}-k2{g[7]}-I{g[1]}-O{g[2]}"


def window_kernel_call(device, *args):
    """conv_transpose3d_cascade_weight_grad(*args), asserting that on a GPU of compute capability 9
    the window kernel computed it."""
    if device != "cuda" or torch.cuda.get_device_capability()[0] < 9:
        return conv_transpose3d_cascade_weight_grad(*args)
    with torch.profiler.profile() as profile:
        grad_w = conv_transpose3d_cascade_weight_grad(*args)
        torch.cuda.synchronize()
    assert any("cascade_weight_grad_window_kernel" in e.name for e in profile.events())
    return grad_w


@pytest.mark.parametrize("geometry", WINDOW_GEOMETRIES, ids=window_ids)
@pytest.mark.parametrize("device", DEVICES)
def test_window_geometries_in_float32(geometry, device):
    """float32 x and gradients against the float64 dense gradient of the same values, and integer
    values exactly (every product and sum exact: PyTorch's picks, bit for bit)."""
    for integers in (False, True):
        x, grad_out, picks, out_size = case(*geometry[:8], extra=geometry[8], seed=4, integers=integers,
                                            device=device, dtype=torch.float32)
        grad_out = grad_out.float()
        grad_w = window_kernel_call(device, grad_out, picks, x, *geometry[4:8], out_size)
        expected = dense_weight_grad(grad_out, picks, x, *geometry[4:8], out_size)
        assert grad_w.dtype == torch.float32
        if integers:
            assert torch.equal(grad_w, expected.float()), geometry
        else:
            assert_close_to_reference(grad_w, expected, torch.float32, str(geometry), normwise=True)


@pytest.mark.parametrize("layout", ["channels_last", "misaligned"])
@pytest.mark.parametrize("device", DEVICES)
def test_window_reads_x_as_given(layout, device):
    """A float32 x already channels last (read in place) and one at a storage offset off 16 bytes
    (copied to an aligned one first): the float64 dense gradient's values."""
    geometry = WINDOW_GEOMETRIES[1]
    x, grad_out, picks, out_size = case(*geometry[:8], extra=geometry[8], seed=5, device=device, dtype=torch.float32)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last_3d)
    else:
        x = misaligned(x, tuple(range(5)))
    grad_w = window_kernel_call(device, grad_out.float(), picks, x, *geometry[4:8], out_size)
    expected = dense_weight_grad(grad_out.float(), picks, x, *geometry[4:8], out_size)
    assert_close_to_reference(grad_w, expected, torch.float32, layout, normwise=True)


@pytest.mark.parametrize("geometry", WINDOW_GEOMETRIES[:2], ids=window_ids)
@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_grad_out(geometry, device):
    """A non-finite gradient of a cell multiplies the x its pick reaches, and nothing outside x
    (no 0 * inf from beyond x's edges): PyTorch's dense gradient of the same values."""
    for seed, value in itertools.product(range(2), (float("inf"), float("-inf"), float("nan"))):
        x, grad_out, picks, out_size = case(*geometry[:8], extra=geometry[8], seed=seed, dtype=torch.float32)
        grad_out = grad_out.float()
        flat = grad_out.view(-1)
        flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(seed))[:2]] = value
        grad_w = window_kernel_call(device, grad_out.to(device), picks.to(device), x.to(device), *geometry[4:8],
                                    out_size)
        expected = dense_weight_grad(grad_out, picks, x, *geometry[4:8], out_size)  # (the CPU's direct sum)
        assert not torch.isfinite(expected).all()  # (the case this test is for)
        assert_close_to_reference(grad_w, expected, torch.float32, f"{seed} {value}", normwise=True)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"K{g[4]}-P{g[5]}-I{g[1]}")
@pytest.mark.parametrize("device", DEVICES)
def test_against_pytorchs_dense_weight_gradient(geometry, device):
    batch, channels, out_channels, size, kernel, stride, padding, kernel2, extra = geometry
    x, grad_out, picks, out_size = case(batch, channels, out_channels, size, kernel, stride, padding, kernel2, extra,
                                        device=device)
    grad_w = conv_transpose3d_cascade_weight_grad(grad_out, picks, x, kernel, stride, padding, kernel2, out_size)
    expected = dense_weight_grad(grad_out, picks, x, kernel, stride, padding, kernel2, out_size)
    assert grad_w.shape == expected.shape and grad_w.dtype == x.dtype and grad_w.device == x.device
    torch.testing.assert_close(grad_w, expected, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("geometry", [GEOMETRIES[0], WINDOW_GEOMETRIES[0]], ids=["partials", "window"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("device", DEVICES)
def test_dtypes_against_float64(dtype, device, geometry):
    """x in each dtype, the result in x's and in float32: within the dtype's rounding of x
    (products and sums in float64 on the CPU, float32 on a GPU)."""
    x, grad_out, picks, out_size = case(*geometry[:8], extra=geometry[8], seed=1, device=device, dtype=dtype)
    expected = dense_weight_grad(grad_out, picks, x.double(), *geometry[4:8], out_size)
    for out_dtype in (dtype, torch.float32):
        grad_w = conv_transpose3d_cascade_weight_grad(grad_out.to(dtype), picks, x, *geometry[4:8], out_size,
                                                      dtype=out_dtype)
        assert grad_w.dtype == out_dtype
        assert_close_to_reference(grad_w, expected, out_dtype if dtype == torch.float64 else dtype,
                                  f"{dtype} -> {out_dtype}", normwise=True)


@pytest.mark.parametrize("device", DEVICES)
def test_integer_values_exactly(device):
    """Integer x and gradients: every product and sum exact, so PyTorch's result bit for bit."""
    for geometry in GEOMETRIES:
        for dtype in (torch.float32, torch.float64):
            x, grad_out, picks, out_size = case(*geometry[:8], extra=geometry[8], seed=2, integers=True, device=device,
                                                dtype=dtype)
            grad_w = conv_transpose3d_cascade_weight_grad(grad_out, picks, x, *geometry[4:8], out_size)
            expected = dense_weight_grad(grad_out, picks, x, *geometry[4:8], out_size)
            assert torch.equal(grad_w, expected.to(dtype)), geometry


@pytest.mark.parametrize("geometry,dtype", [(GEOMETRIES[1], torch.float64), (WINDOW_GEOMETRIES[1], torch.float32)],
                         ids=["partials", "window"])
@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_x_as_pytorchs_zero_products(device, geometry, dtype):
    """Where an unpicked element of y meets a non-finite x, PyTorch's dense gradient adds 0 * x:
    NaN; where only picked ones do, the picked products (+-inf, or NaN). (The dense gradient by
    the CPU's direct sum: cuDNN's algorithms may spread a NaN further.)"""
    for seed, value in itertools.product(range(3), (float("inf"), float("-inf"), float("nan"))):
        x, grad_out, picks, out_size = case(*geometry[:8], extra=geometry[8], seed=seed, dtype=dtype)
        grad_out = grad_out.to(dtype)
        flat = x.view(-1)
        flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(seed))[:2]] = value
        grad_w = conv_transpose3d_cascade_weight_grad(grad_out.to(device), picks.to(device), x.to(device),
                                                      *geometry[4:8], out_size)
        expected = dense_weight_grad(grad_out, picks, x, *geometry[4:8], out_size)
        assert torch.isnan(expected).any()  # (the case this test is for)
        if dtype == torch.float64:
            torch.testing.assert_close(grad_w.cpu(), expected, rtol=1e-12, atol=1e-13, equal_nan=True)
        else:
            assert_close_to_reference(grad_w, expected, dtype, f"{seed} {value}", normwise=True)


@pytest.mark.parametrize("device", DEVICES)
def test_mostly_non_finite_x(device):
    """More non-finite x in an item's channel than there are picks make that channel wholly NaN
    (the pass takes that shortcut: a diverged step stays quick); PyTorch's mask either way."""
    geometry = GEOMETRIES[0]
    x, grad_out, picks, out_size = case(*geometry[:8], extra=geometry[8], seed=3)
    x[0, 1] = float("nan")
    x[1, 2, 1:3] = float("inf")
    grad_w = conv_transpose3d_cascade_weight_grad(grad_out.to(device), picks.to(device), x.to(device),
                                                  *geometry[4:8], out_size)
    expected = dense_weight_grad(grad_out, picks, x, *geometry[4:8], out_size)  # (the CPU's direct sum)
    assert torch.isnan(expected[1]).all() and torch.isnan(expected[2]).all() and not torch.isnan(expected[0]).any()
    torch.testing.assert_close(grad_w.cpu(), expected, rtol=1e-12, atol=1e-13, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_no_cells_with_a_non_finite_x(device):
    """No cells (y's gradient all zero): zeros, NaN where a non-finite x meets the zeros."""
    x = torch.rand(2, 3, 2, 2, 2, dtype=torch.float64, device=device)
    x[1, 2, 0, 1, 1] = float("nan")
    args = ([3, 3, 3], [2, 2, 2], [1, 1, 1], [2, 2, 2], [3, 3, 3], torch.float64)
    grad_w = OP(torch.zeros(2, 1, 0, 0, 0, dtype=torch.float64, device=device),
                torch.zeros(2, 0, 0, 0, 4, dtype=torch.uint8, device=device), x, *args)
    expected = dense_weight_grad(torch.zeros(2, 1, 0, 0, 0, dtype=torch.float64), torch.zeros(2, 0, 0, 0, 4,
                                 dtype=torch.uint8), x.cpu(), *[tuple(a) for a in args[:5]])
    assert torch.isnan(expected[2]).all() and not expected[:2].any()
    torch.testing.assert_close(grad_w.cpu(), expected, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch_and_cells(device):
    x = torch.rand(0, 3, 4, 4, 4, dtype=torch.float64, device=device)
    grad_w = OP(torch.zeros(0, 1, 1, 1, 1, dtype=torch.float64, device=device),
                torch.zeros(0, 1, 1, 1, 2, dtype=torch.uint8, device=device), x, [3, 3, 3], [2, 2, 2], [1, 1, 1],
                [2, 2, 2], [7, 7, 7], torch.float64)
    assert grad_w.shape == (3, 2, 3, 3, 3) and not grad_w.any()


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    geometry = GEOMETRIES[1]
    x, grad_out, picks, out_size = case(*geometry[:8], extra=geometry[8], device=device, dtype=torch.float32)
    torch.library.opcheck(OP, (grad_out.float(), picks, x, *[list(v) for v in geometry[4:8]], out_size, torch.float32))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_raises_clearly(device):
    x, grad_out, picks, out_size = case(*GEOMETRIES[0][:8], device=device)
    args = dict(kernel_size=5, stride=2, padding=2, kernel_size2=3, output_size=out_size)
    with pytest.raises(ValueError, match="x must be 5-D"):
        conv_transpose3d_cascade_weight_grad(grad_out, picks, x[0], **args)
    with pytest.raises(TypeError, match="picks must be uint8"):
        conv_transpose3d_cascade_weight_grad(grad_out, picks.int(), x, **args)
    with pytest.raises(TypeError, match="floating point"):
        conv_transpose3d_cascade_weight_grad(grad_out, picks, x.long(), **args)
    with pytest.raises(ValueError, match="agree on the batch"):
        conv_transpose3d_cascade_weight_grad(grad_out[:1], picks, x, **args)
    with pytest.raises(ValueError, match="reach past output_size"):
        conv_transpose3d_cascade_weight_grad(grad_out, picks, x, **{**args, "output_size": [o - 3 for o in out_size]})
    with pytest.raises(ValueError, match="at most 256"):
        conv_transpose3d_cascade_weight_grad(grad_out, picks, x, **{**args, "kernel_size2": (3, 3, 4)})
    with pytest.raises(ValueError, match="positive"):
        conv_transpose3d_cascade_weight_grad(grad_out, picks, x, **{**args, "stride": 0})
    if device == "cuda":
        with pytest.raises(ValueError, match="one device"):
            conv_transpose3d_cascade_weight_grad(grad_out.cpu(), picks, x, **args)


def test_picks_past_their_window_refused():
    """On the CPU a pick past the stride's 8 classes x kernel2's 27 elements (216) is refused."""
    x, grad_out, picks, out_size = case(*GEOMETRIES[0][:8], device="cpu")
    args = dict(kernel_size=5, stride=2, padding=2, kernel_size2=3, output_size=out_size)
    picks.view(-1)[0] = 216
    with pytest.raises(ValueError, match="must each name an element of its window of 216"
                       ", as the forward's do, got 216"):
        conv_transpose3d_cascade_weight_grad(grad_out, picks, x, **args)


@requires_cuda
@pytest.mark.parametrize("geometry,dtype", [(GEOMETRIES[1], torch.float64), (GEOMETRIES[4], torch.float64),
                                            (WINDOW_GEOMETRIES[1], torch.float32),
                                            (WINDOW_GEOMETRIES[2], torch.float32)],
                         ids=["partials-mixed", "partials-beyond-stride", "window", "window-even-kernel"])
def test_cuda_picks_past_their_window_add_nothing(geometry, dtype):
    """On a GPU a pick past its window (a byte of the stride's classes x kernel2's elements, or 255) adds nothing,
    without an error (refusing it would wait for the device): with every output channel's pick of the first, a
    middle and the last (n, cell) replaced, the weight gradient is the valid picks' with those cells' grad_out
    zeroed, bit for bit (integer values; float32: the window kernel on a GPU of compute capability 9)."""
    x, grad_out, picks, out_size = case(*geometry[:8], extra=geometry[8], seed=6, integers=True, device="cuda",
                                        dtype=dtype)
    volume = math.prod(geometry[5]) * math.prod(geometry[7])
    batch, out_channels = picks.shape[0], picks.shape[4]
    cells = picks[0, ..., 0].numel()
    bad, zeroed = picks.clone(), grad_out.clone()
    replaced = torch.tensor([volume, 255], dtype=torch.uint8, device="cuda")[torch.arange(out_channels) % 2]
    for n, cell in [(0, 0), (batch // 2, cells // 2), (batch - 1, cells - 1)]:
        bad.view(batch, cells, out_channels)[n, cell] = replaced
        zeroed.view(batch, cells)[n, cell] = 0

    def weight_grad(grad, saved):
        args = (grad, saved, x, *geometry[4:8], out_size)
        if dtype == torch.float32:
            return window_kernel_call("cuda", *args)
        return conv_transpose3d_cascade_weight_grad(*args)

    assert torch.equal(weight_grad(grad_out, bad), weight_grad(zeroed, picks))


# --------------------------------------------------------------------------
# B's rewrite in a training step on data: the weight's gradient from the picks
# --------------------------------------------------------------------------

B_CASES = [((3, 4, 5, 2, 2), (2, 3, 7, 6, 7)), ((2, 3, (3, 4, 3), 2, (1, 0, 1)), (3, 2, 7, 6, 8))]


def b_pair(args, train=True):
    torch.manual_seed(0)
    original = reference.ConvTranspose3dMaxPoolMaxPoolSum(*args).double().train(train)
    return original, fnn.ConvTranspose3dMaxPoolMaxPoolSum.from_module(original)


@pytest.mark.parametrize("args,shape", B_CASES)
def test_b_rewrite_takes_the_picked_weight_gradient(args, shape):
    """x without a gradient, the weight with one: the rewrite's weight gradient comes from the
    picks (the op runs) and equals the original's, the bias's too."""
    original, fused = b_pair(args)
    x = torch.rand(shape, dtype=torch.float64)
    grad = torch.rand(original(x).shape, dtype=torch.float64)
    expected = torch.autograd.grad(original(x), list(original.parameters()), grad)
    with autotune.force("rewrite"), torch.profiler.profile() as profile:
        actual = torch.autograd.grad(fused(x), list(fused.parameters()), grad)
    assert "fused_ops::conv_transpose3d_cascade_weight_grad" in {e.name for e in profile.events()}
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


@requires_cuda
@pytest.mark.parametrize("in_channels,precision", [(8, "high"), (6, "high"), (6, "highest")])
def test_b_rewrite_on_a_gpu_takes_the_picked_weight_gradient_where_quick(in_channels, precision):
    """On a GPU the rule takes the op in full float32 (matmul precision "highest", PyTorch's default:
    the dense gradient would round to TF32), and where TF32 is asked for, where its window kernel
    takes the call (compute capability 9, input channels a multiple of 4 here), else the dense
    gradient; either way the original's gradients, bit for bit on integer values (float32, every sum
    exact, in TF32 too; ties picked as PyTorch picks them)."""
    torch.manual_seed(0)
    original = reference.ConvTranspose3dMaxPoolMaxPoolSum(in_channels, 12, 5, 2, 2).cuda()
    with torch.no_grad():
        for p in original.parameters():
            p.copy_(torch.randint(-2, 3, p.shape))
    fused = fnn.ConvTranspose3dMaxPoolMaxPoolSum.from_module(original)
    x = torch.randint(-2, 3, (2, in_channels, 8, 7, 9), device="cuda").float()
    grad = torch.randint(-2, 3, original(x).shape, device="cuda").float()
    picked = precision == "highest" or (in_channels % 4 == 0 and torch.cuda.get_device_capability()[0] >= 9)
    with matmul_precision(precision):
        expected = torch.autograd.grad(original(x), list(original.parameters()), grad)
        with autotune.force("rewrite"), torch.profiler.profile() as profile:
            actual = torch.autograd.grad(fused(x), list(fused.parameters()), grad)
    ran = "fused_ops::conv_transpose3d_cascade_weight_grad" in {e.name for e in profile.events()}
    assert ran == picked
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a, e)


def test_b_rewrite_create_graph_backward():
    """A backward that records a graph recomputes the windows and differentiates them: a penalty on
    the weight's gradient has the original's gradient (zero: the picks fixed, that gradient is
    constant in the weight); so does one where the output's gradient records a graph itself."""
    original, fused = b_pair(B_CASES[0][0])
    x = torch.rand(B_CASES[0][1], dtype=torch.float64)
    for module in (original, fused):
        weight = module.conv_transpose.weight
        with autotune.force("rewrite"):
            out = module(x)
        (grad_w,) = torch.autograd.grad((out * torch.linspace(-1, 2, out.numel()).view_as(out)).sum(), weight,
                                        create_graph=True)
        (second,) = torch.autograd.grad(grad_w.square().sum(), weight, allow_unused=True, materialize_grads=True)
        assert not second.any()
    results = []
    for module in (original, fused):
        weight = module.conv_transpose.weight
        with autotune.force("rewrite"):
            out = module(x)
        (grad_w,) = torch.autograd.grad(out.square().sum(), weight, create_graph=True)
        results.append([grad_w, *torch.autograd.grad(grad_w.square().sum(), [weight, module.conv_transpose.bias])])
    for a, e in zip(*results, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-12)


def test_b_rewrite_under_autocast_as_the_dense_path():
    """Under CPU bfloat16 autocast (the module's own rule there is another formulation; the
    rewrite called directly): the picked weight gradient from x and y's gradient in bfloat16,
    rounded to it, as the windows' convolution's, within a bfloat16 rounding of it."""
    original, _ = b_pair(B_CASES[0][0])
    original.float()
    conv, pools = original.conv_transpose, (original.max_pool1, original.max_pool2)
    x = torch.rand(B_CASES[0][1])
    grads = {}
    for picked in (True, False):
        with rewrites.forced_picked_weight_grad(picked):
            with torch.autocast("cpu", torch.bfloat16):
                out, _ = rewrites.conv_transpose3d_max_pool_cascade_sum(x, conv, *pools)
            with torch.profiler.profile() as profile:
                grads[picked] = torch.autograd.grad(out.float().sum(), conv.weight)[0]
        ran = "fused_ops::conv_transpose3d_cascade_weight_grad" in {e.name for e in profile.events()}
        assert ran == picked
    picked, dense = grads[True], grads[False]
    assert picked.dtype == dense.dtype == torch.float32
    torch.testing.assert_close(picked, dense, rtol=1.6e-2, atol=1.6e-2 * dense.abs().max().item())
