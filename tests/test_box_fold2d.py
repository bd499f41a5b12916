"""box_fold2d (a 2-D convolution kernel followed by an average pool's box, as one kernel) and its
backward: against a float64 composite, the identity it exists for (conv then avg_pool equals the
folded convolution), every dtype, gradcheck to second order, opcheck, bad input."""
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from fused_ops import box_fold2d

BACKWARD = torch.ops.fused_ops.box_fold2d_backward

# (weight shape, box, divisor)
CASES = [((64, 8, 3, 3), (4, 4), 16.0), ((3, 5, 2, 3), (2, 3), 6.0), ((7, 1, 1), (3, 2), 9.0),
         ((2, 3, 4, 1), (1, 1), 1.0), ((5, 2, 3, 3), (2, 2), -0.5)]
IDS = ["C-spec", "odd", "3d-divisor-9", "identity-box", "negative-divisor"]


def folded_float64(w, box, divisor):
    """The fold in float64 by slices: each tap's w / divisor added over the box under it."""
    w = w.double()
    out = w.new_zeros((*w.shape[:-2], w.shape[-2] + box[0] - 1, w.shape[-1] + box[1] - 1))
    for p in range(box[0]):
        for q in range(box[1]):
            out[..., p:p + w.shape[-2], q:q + w.shape[-1]] += w / divisor
    return out


@pytest.mark.parametrize("shape,box,divisor", CASES, ids=IDS)
def test_forward_is_the_float64_fold(shape, box, divisor, device, dtype):
    """Each tap the float64 sum converted once, as .to() converts: equal to the composite's
    conversion where the float64 sums are exact (taps of at most 24 bits over a power-of-two
    divisor), else within the float64 sums' rounding (bh bw terms) and one rounding to the dtype."""
    w = torch.randn(shape, device=device).to(dtype)
    expected = folded_float64(w, box, divisor)
    exact = dtype != torch.float64 and abs(divisor) == 2.0 ** round(torch.log2(torch.tensor(abs(divisor))).item())
    sums_error = box[0] * box[1] * 2.0 ** -52 * folded_float64(w.abs(), box, abs(divisor))
    for out_dtype in (None, torch.float64, torch.float32, torch.bfloat16):
        out = box_fold2d(w, box, divisor, dtype=out_dtype)
        assert out.dtype == (out_dtype or dtype) and out.shape == expected.shape
        if exact:
            assert torch.equal(out, expected.to(out.dtype))
        else:
            bound = torch.finfo(out.dtype).eps * expected.abs() + sums_error * (1 + torch.finfo(out.dtype).eps)
            assert ((out.double() - expected).abs() <= bound).all()


def test_integer_valued_sums_are_exact(device):
    """Integer taps over a power-of-two divisor: every sum exact, whatever the order."""
    w = torch.randint(-1000, 1000, (16, 4, 3, 3), device=device, dtype=torch.float32)
    out = box_fold2d(w, (4, 4), 16)
    assert torch.equal(out.double(), folded_float64(w, (4, 4), 16))


@pytest.mark.parametrize("stride", [4, 2])
def test_conv_then_avg_pool_is_the_folded_convolution(stride, device):
    """What the fold is for: conv2d then avg_pool2d(box, stride) is one conv2d with the folded kernel."""
    x = torch.randn(2, 3, 23, 21, device=device, dtype=torch.float64)
    w = torch.randn(5, 3, 3, 3, device=device, dtype=torch.float64)
    pooled = F.avg_pool2d(F.conv2d(x, w), 4, stride)
    folded = F.conv2d(x, box_fold2d(w, (4, 4), 16), stride=stride)
    torch.testing.assert_close(folded, pooled, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape,box,divisor", CASES, ids=IDS)
def test_backward_is_the_adjoint(shape, box, divisor, device):
    """grad_w from the op's autograd equals the composite's, in the weight's dtype."""
    w = torch.randn(shape, device=device, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(folded_float64(w.detach(), box, divisor).shape, device=device, dtype=torch.float64)
    (mine,) = torch.autograd.grad(box_fold2d(w, box, divisor), w, grad)
    (expected,) = torch.autograd.grad(folded_float64(w, box, divisor), w, grad)
    torch.testing.assert_close(mine, expected, rtol=1e-13, atol=1e-13)
    # a float32 weight folded to bfloat16: the bfloat16 gradient summed in float64, converted once to float32
    w32 = w.detach().float().requires_grad_()
    (mine32,) = torch.autograd.grad(box_fold2d(w32, box, divisor, dtype=torch.bfloat16), w32, grad.bfloat16())
    assert mine32.dtype == torch.float32
    w64 = w32.detach().double().requires_grad_()
    (expected32,) = torch.autograd.grad(folded_float64(w64, box, divisor), w64, grad.bfloat16().double())
    sums_error = box[0] * box[1] * 2.0 ** -52 * unfolded_abs(grad.bfloat16().double(), shape, box, divisor)
    bound = torch.finfo(torch.float32).eps * expected32.abs() + 2 * sums_error
    assert ((mine32.double() - expected32).abs() <= bound).all()


def unfolded_abs(grad, shape, box, divisor):
    """The backward's sums of |terms|: sum over the box of |grad| / |divisor| under each tap."""
    w = torch.zeros(shape, dtype=torch.float64, device=grad.device, requires_grad=True)
    (out,) = torch.autograd.grad(folded_float64(w, box, abs(divisor)), w, grad.abs())
    return out


@pytest.mark.parametrize("shape,box,divisor", CASES[:3], ids=IDS[:3])
def test_gradcheck_to_second_order(shape, box, divisor, device):
    w = torch.randn(shape, device=device, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t: box_fold2d(t, box, divisor), (w,))
    torch.autograd.gradgradcheck(lambda t: box_fold2d(t, box, divisor), (w,))
    g = torch.randn(folded_float64(w.detach(), box, divisor).shape, device=device, dtype=torch.float64,
                    requires_grad=True)
    torch.autograd.gradcheck(lambda t: BACKWARD(t, list(shape[-2:]), list(box), divisor, torch.float64), (g,))


def test_opcheck(device):
    w = torch.randn(6, 4, 3, 3, device=device)
    torch.library.opcheck(torch.ops.fused_ops.box_fold2d, (w, [4, 4], 16.0))
    torch.library.opcheck(torch.ops.fused_ops.box_fold2d, (w.double().requires_grad_(), [2, 3], 6.0, torch.float64))
    torch.library.opcheck(torch.ops.fused_ops.box_fold2d, (w.requires_grad_(), [4, 4], 16.0, torch.bfloat16))
    g = torch.randn(6, 4, 6, 6, device=device, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(BACKWARD, (g, [3, 3], [4, 4], 16.0, torch.float32))


def test_compiles(device):
    w = torch.randn(6, 4, 3, 3, device=device, requires_grad=True)
    compiled = torch.compile(lambda t: box_fold2d(t, (4, 4), 16).square().sum(), fullgraph=True)
    (grad,) = torch.autograd.grad(compiled(w), w)
    (expected,) = torch.autograd.grad(folded_float64(w, (4, 4), 16).square().sum(), w)
    torch.testing.assert_close(grad, expected.float(), rtol=1e-6, atol=1e-6)


def test_empty_leading_dims(device):
    w = torch.randn(0, 3, 3, 3, device=device, requires_grad=True)
    out = box_fold2d(w, (4, 4), 16)
    assert out.shape == (0, 3, 6, 6)
    (grad,) = torch.autograd.grad(out, w, torch.ones_like(out))
    assert grad.shape == w.shape


def test_the_op_takes_two_box_sizes_traced_or_run(device):
    """The wrapper expands one size; the op itself takes two, traced (its fake) as run."""
    w = torch.randn(4, 2, 3, 3, device=device)
    torch.testing.assert_close(box_fold2d(w, 4, 16), box_fold2d(w, (4, 4), 16), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="box must be two positive sizes"):
        torch.ops.fused_ops.box_fold2d(w, [4], 16.0)
    with FakeTensorMode() as mode, pytest.raises(RuntimeError, match="box must be two positive sizes"):
        torch.ops.fused_ops.box_fold2d(mode.from_tensor(w), [4], 16.0)


def test_bad_input(device):
    w = torch.randn(4, 2, 3, 3, device=device)
    with pytest.raises(RuntimeError, match="divisor must be finite and non-zero"):
        box_fold2d(w, (4, 4), 0)
    with pytest.raises(RuntimeError, match="divisor must be finite and non-zero"):
        box_fold2d(w, (4, 4), float("nan"))
    with pytest.raises(RuntimeError, match="box must be two positive sizes"):
        box_fold2d(w, (0, 4), 16)
    with pytest.raises(RuntimeError, match="at least 2 dims"):
        box_fold2d(w[0, 0, 0], (4, 4), 16)
    with pytest.raises(RuntimeError, match="must not be empty"):
        box_fold2d(w[..., :0], (4, 4), 16)
    with pytest.raises(TypeError, match="must be floating point"):
        box_fold2d(w.int(), (4, 4), 16)
    with pytest.raises(TypeError, match="must be a Tensor"):
        box_fold2d([1.0], (4, 4), 16)
    with pytest.raises(RuntimeError, match=r"grad must be \(\.\.\., 6, 6\)"):
        BACKWARD(torch.randn(4, 2, 5, 6, device=device), [3, 3], [4, 4], 16.0, torch.float32)
