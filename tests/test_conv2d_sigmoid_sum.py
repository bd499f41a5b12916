"""fused_ops.conv2d_sigmoid_sum against PyTorch's conv2d -> sigmoid -> sum, and architecture C's
``fused_conv`` formulation. On a GPU, float32 with TF32 allowed runs the tensor-core kernel
(cuda/conv2d_sigmoid_sum.cu): its kernel shapes (6 x 6 stride 4, 4 x 4 stride 2) are tested at
sizes that take every path (several column tiles, a half-used row pair, padding, an odd channel
count, more than 8 channels, fewer than 64 output channels, unaligned rows, no bias), with either
loader: the bulk tensor copy engine (Hopper, rows of whole 16-byte chunks) or cp.async."""
import re

import copy

import pytest
import torch
import torch.nn.functional as F

from conftest import cuda_kernel_names, make_convolution_case, poison_cuda_allocator, requires_cuda
from fused_ops import autotune, box_fold2d, conv2d_sigmoid_sum, reference
from fused_ops import nn as fnn

OP = torch.ops.fused_ops.conv2d_sigmoid_sum.default
BACKWARD = torch.ops.fused_ops.conv2d_sigmoid_sum_backward.default

# (x shape, weight shape, stride, padding, bias)
CASES = [
    ((2, 8, 45, 41), (64, 8, 6, 6), 4, 0, True),     # architecture C's folded convolution, small
    ((2, 8, 45, 44), (64, 8, 6, 6), 4, 0, True),     # the same, rows of whole 16-byte chunks
    ((1, 8, 24, 402), (64, 8, 6, 6), 4, 0, True),    # two column tiles (99 outputs a row)
    ((1, 8, 24, 400), (64, 8, 6, 6), 4, 0, True),    # two column tiles, 16-byte rows
    ((3, 3, 31, 37), (5, 3, 6, 6), 4, 1, False),     # odd channels, padding, 5 outputs, no bias
    ((3, 3, 31, 36), (5, 3, 6, 6), 4, 1, False),     # the same, 16-byte rows
    ((2, 16, 22, 27), (64, 16, 6, 6), 4, 0, True),   # 8 channel blocks
    ((1, 37, 22, 28), (64, 37, 6, 6), 4, 0, True),   # 19 channel blocks, the last half empty
    ((2, 8, 30, 33), (64, 8, 4, 4), 2, 0, True),     # the 4 x 4 stride-2 kernel shape
    ((1, 5, 19, 213), (48, 5, 4, 4), 2, (1, 2), True),  # two tiles, rows of odd length, padding
    ((1, 5, 19, 212), (48, 5, 4, 4), 2, (1, 2), True),  # the same, 16-byte rows
    ((2, 4, 17, 18), (7, 4, 3, 5), (2, 3), 1, True),  # no kernel for it: PyTorch's ops
]
IDS = ["C-small", "C-small-aligned", "two-tiles", "two-tiles-aligned", "odd-channels", "odd-channels-aligned",
       "16-channels", "37-channels", "k4s2", "k4s2-odd-rows", "k4s2-aligned", "uncompiled-shape"]



def _pair(v):
    return [v, v] if isinstance(v, int) else list(v)


def composite(x, weight, bias, stride, padding):
    return torch.sigmoid(F.conv2d(x, weight, bias, stride, padding)).sum(dim=(1, 2, 3))


def tf32_bound(x, w, b, stride, padding):
    """A bound on a TF32 convolution's effect on the sums: each product's operands rounded to
    10-bit mantissas (relative error 2^-11 each), sigmoid' <= 1/4, plus float32 accumulation."""
    magnitude = F.conv2d(x.double().abs(), w.double().abs(), None if b is None else b.double().abs(), stride, padding)
    return 0.25 * (2.0 ** -10 + 2.0 ** -20) * magnitude.sum(dim=(1, 2, 3)) + 1e-5 * magnitude[0].numel()


@pytest.mark.parametrize("x_shape,w_shape,stride,padding,bias", CASES, ids=IDS)
def test_float64_is_pytorchs(x_shape, w_shape, stride, padding, bias, device):
    x, w, b = make_convolution_case(x_shape, w_shape, bias, torch.float64, device)
    torch.testing.assert_close(conv2d_sigmoid_sum(x, w, b, stride, padding), composite(x, w, b, stride, padding),
                               rtol=1e-12, atol=1e-12)


def kernel_loaders(call) -> set:
    """The loaders of the tensor-core forward kernels call() ran, by their names (the kernel's
    next-to-last template argument; the last says whether it saves sigmoid'): "copy engine" or
    "cp.async"; empty if none ran."""
    loaders = set()
    for name in cuda_kernel_names(call):
        found = re.search(r"conv2d_sigmoid_sum_kernel<.*, (true|false), (?:true|false)>", name)
        if found:
            loaders.add("copy engine" if found.group(1) == "true" else "cp.async")
    return loaders


def expected_loader(x) -> str:
    """The loader the kernel takes for x: the copy engine on Hopper for rows of whole 16-byte
    chunks (a contiguous x at a 16-byte aligned address), else cp.async."""
    copy_engine = (torch.cuda.get_device_capability(x.device) >= (9, 0) and x.shape[-1] % 4 == 0
                   and x.data_ptr() % 16 == 0)
    return "copy engine" if copy_engine else "cp.async"


@requires_cuda
@pytest.mark.parametrize("x_shape,w_shape,stride,padding,bias", CASES, ids=IDS)
@pytest.mark.parametrize("allow_tf32", [True, False], ids=["tf32", "full-float32"])
def test_float32_within_tf32_or_float32(x_shape, w_shape, stride, padding, bias, allow_tf32):
    """float32: with TF32 allowed, the kernel (where its shapes cover the call) within the TF32
    bound of the float64 result; with it off, PyTorch's full-float32 ops, within float32's."""
    x, w, b = make_convolution_case(x_shape, w_shape, bias, torch.float32, "cuda")
    cudnn = torch.backends.cudnn
    with cudnn.flags(enabled=True, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic, allow_tf32=allow_tf32):
        out = conv2d_sigmoid_sum(x, w, b, stride, padding)
        loaders = kernel_loaders(lambda: conv2d_sigmoid_sum(x, w, b, stride, padding))
    assert loaders == ({expected_loader(x)} if allow_tf32 and w_shape[2:] in ((6, 6), (4, 4)) else set())
    expected = composite(x.double(), w.double(), None if b is None else b.double(), stride, padding)
    assert out.dtype == torch.float32 and out.shape == expected.shape
    bound = tf32_bound(x, w, b, stride, padding) if allow_tf32 else 1e-5 * expected.abs() + 1e-6
    assert ((out.double() - expected).abs() <= bound).all(), ((out.double() - expected).abs(), bound)


@requires_cuda
@pytest.mark.parametrize("x_shape,w_shape,stride,padding,bias", CASES, ids=IDS)
def test_integer_valued_exact(x_shape, w_shape, stride, padding, bias, tf32):
    """Integer-valued input and eighths as weights: every product and sum exact in TF32 and
    float32, so the kernel's result is the float64 one to float32's sigmoid and sums."""
    x, w, b = make_convolution_case(x_shape, w_shape, bias, torch.float32, "cuda", integers=True)
    expected = composite(x.double(), w.double(), None if b is None else b.double(), stride, padding)
    torch.testing.assert_close(conv2d_sigmoid_sum(x, w, b, stride, padding).double(), expected, rtol=1e-5, atol=1e-5)


@requires_cuda
@pytest.mark.parametrize("width", [41, 44])
def test_nan_and_inf_as_pytorch(width, tf32):
    """A NaN in an item's input makes its sum NaN; +-inf saturate the sigmoids as PyTorch's do."""
    x, w, b = make_convolution_case((4, 8, 45, width), (64, 8, 6, 6), True, torch.float32, "cuda")
    w = w.abs()  # (one sign: an infinite input gives infinite outputs, not inf - inf)
    x[1, 3, 10, 7] = float("nan")
    x[2, 0, 20, 20] = float("inf")
    x[3, 5, 0, 0] = float("-inf")
    out = conv2d_sigmoid_sum(x, w, b, 4, 0)
    expected = composite(x.double(), w.double(), b.double(), 4, 0)
    assert out[1].isnan() and not out[[0, 2, 3]].isnan().any()
    torch.testing.assert_close(out[[0, 2, 3]].double(), expected[[0, 2, 3]], rtol=2e-3, atol=0)


@requires_cuda
@pytest.mark.parametrize("width", [47, 48])
def test_strided_input_and_deterministic(width, tf32):
    """A channels-last or sliced input gives the contiguous input's result; calls repeat bit for
    bit; both loaders stage the same values (rows of whole 16-byte chunks at an address that is
    not 16-byte aligned take cp.async)."""
    x, w, b = make_convolution_case((3, 8, 50, width), (64, 8, 6, 6), True, torch.float32, "cuda")
    out = conv2d_sigmoid_sum(x, w, b, 4, 0)
    assert torch.equal(conv2d_sigmoid_sum(x.contiguous(memory_format=torch.channels_last), w, b, 4, 0), out)
    wide = torch.zeros(3, 8, 50, 60, device="cuda")
    wide[..., 5:5 + width] = x
    assert torch.equal(conv2d_sigmoid_sum(wide[..., 5:5 + width], w, b, 4, 0), out)
    assert all(torch.equal(conv2d_sigmoid_sum(x, w, b, 4, 0), out) for _ in range(3))
    shifted = torch.empty(x.numel() + 1, device="cuda")[1:].view_as(x).copy_(x)
    assert expected_loader(shifted) == "cp.async"
    assert kernel_loaders(lambda: conv2d_sigmoid_sum(shifted, w, b, 4, 0)) == {"cp.async"}
    assert torch.equal(conv2d_sigmoid_sum(shifted, w, b, 4, 0), out)


def test_gradcheck(device):
    """(cuDNN's deterministic algorithms: gradcheck checks that repeated backwards agree bit for bit,
    which PyTorch's own convolution backward need not otherwise)"""
    x, w, b = make_convolution_case((2, 3, 9, 10), (4, 3, 3, 4), True, torch.float64, device)
    inputs = [t.requires_grad_() for t in (x, w, b)]
    cudnn = torch.backends.cudnn
    with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=True, allow_tf32=False):
        assert torch.autograd.gradcheck(lambda x, w, b: conv2d_sigmoid_sum(x, w, b, (2, 3), 1), inputs)


@requires_cuda
def test_input_gradient_float32_kernel(tf32):
    """x's gradient of a call the fused kernel computed: PyTorch's TF32 convolution backward of
    grad_y = grad_out * the saved factor, within TF32's bound of the float64 gradient. Per term
    grad_out * factor * w: the factor's error (y's TF32 error 2^-10 of its magnitude times
    |sigmoid''| <= 0.1; its rounding to TF32, 2^-11 of sigmoid' <= 1/4), the backward's own
    rounding of grad_y and w to TF32 (2^-10), plus float32 accumulation."""
    x, w, b = make_convolution_case((2, 8, 45, 41), (64, 8, 6, 6), True, torch.float32, "cuda")
    grad_out = torch.tensor([0.5, -2.0], device="cuda")
    leaf = x.clone().requires_grad_()
    conv2d_sigmoid_sum(leaf, w, b, 4, 0).backward(grad_out)
    exact = x.double().requires_grad_()
    composite(exact, w.double(), b.double(), 4, 0).backward(grad_out.double())
    magnitude = F.conv2d(x.double().abs(), w.double().abs(), b.double().abs(), 4)
    per_output = grad_out.double().abs().view(-1, 1, 1, 1) * (
        0.1 * 2.0 ** -10 * magnitude + 0.25 * (2.0 ** -11 + 2.0 ** -10 + w.shape[0] * w[0, 0].numel() * 2.0 ** -24))
    bound = torch.ops.aten.convolution_backward(per_output, x.double(), w.double().abs(), None, [4, 4], [0, 0],
                                                [1, 1], False, [0, 0], 1, [True, False, False])[0] + 1e-7
    assert ((leaf.grad.double() - exact.grad).abs() <= bound).all(), (leaf.grad.double() - exact.grad).abs().max()


def test_opcheck(device):
    x, w, b = make_convolution_case((2, 3, 13, 14), (4, 3, 6, 6), True, torch.float32, device)
    torch.library.opcheck(OP, (x, w, b, [4, 4], [0, 0], False))
    torch.library.opcheck(OP, (x.double().requires_grad_(), w.double().requires_grad_(), b.double(), [2, 3], [1, 0],
                               True))
    torch.library.opcheck(OP, (x, w, None, [4, 4], [1, 1], True, torch.float32))
    torch.library.opcheck(OP, (x.requires_grad_(), w.bfloat16(), b.bfloat16(), [4, 4], [0, 0], True))


@pytest.mark.parametrize("mask", [(True, True, True), (False, True, False), (True, False, False)])
def test_backward_opcheck(mask, device):
    x, w, b = make_convolution_case((2, 3, 13, 14), (4, 3, 6, 6), True, torch.float32, device)
    _, factor = OP(x, w, b, [4, 4], [1, 0], True)
    grad_out = torch.tensor([0.5, -2.0], device=device)
    torch.library.opcheck(BACKWARD, (grad_out, factor, x, w, [4, 4], [1, 0], list(mask)))
    torch.library.opcheck(BACKWARD, (grad_out.double(), factor.double(), x.double(), w.double(), [4, 4], [1, 0],
                                     list(mask)))


@pytest.mark.parametrize("w_shape,stride,padding", [((70, 3, 3, 5), (2, 3), (1, 0)), ((5, 3, 6, 6), 4, 1)],
                         ids=["two-channel-groups", "one-channel-group"])
def test_backward_is_autograds(w_shape, stride, padding, device):
    """float64 (PyTorch's ops): the backward op from the saved factor gives autograd's gradients of
    the composite for x, the weight and the bias (two column blocks; two channel groups)."""
    x, w, b = make_convolution_case((2, 3, 30, 211), w_shape, True, torch.float64, device)
    out, factor = OP(x, w, b, _pair(stride), _pair(padding), True)
    grad_out = torch.tensor([0.5, -2.0], dtype=torch.float64, device=device)
    actual = BACKWARD(grad_out, factor, x, w, _pair(stride), _pair(padding), [True, True, True])
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    composite(*leaves, stride, padding).backward(grad_out)
    for a, leaf in zip(actual, leaves):
        torch.testing.assert_close(a, leaf.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("args,match", [
    (lambda g, f, x, w: (g[:1], f, x, w), "grad_out must have shape"),
    (lambda g, f, x, w: (g.int(), f, x, w), "grad_out must be a floating-point"),
    (lambda g, f, x, w: (g, f[:, :1], x, w), "grad_factor must have shape"),
    (lambda g, f, x, w: (g, f.double(), x, w), "grad_factor must be"),
    (lambda g, f, x, w: (g, f, x[:, :2], w), "conv2d_sigmoid_sum_backward: the input has 2 channels"),
])
def test_backward_bad_input_named(args, match, device):
    x, w, b = make_convolution_case((2, 3, 13, 14), (4, 3, 6, 6), True, torch.float32, device)
    _, factor = OP(x, w, b, [4, 4], [0, 0], True)
    grad_out = torch.tensor([0.5, -2.0], device=device)
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        BACKWARD(*args(grad_out, factor, x, w), [4, 4], [0, 0], [True, True, True])


def test_backward_needs_the_saved_factor(device):
    """The op called without save_grad_factor (its wrapper sets it where a gradient is needed)
    cannot be differentiated: the backward says so."""
    x, w, b = make_convolution_case((2, 3, 13, 14), (4, 3, 6, 6), True, torch.float32, device)
    out, factor = OP(x, w.requires_grad_(), b, [4, 4], [0, 0], False)
    assert factor.numel() == 0
    with pytest.raises(RuntimeError, match="save_grad_factor=True"):
        out.sum().backward()


def layout_index(n, o, oh, ow):
    """For the factor's layout (csrc/conv2d_sigmoid_sum.h) of an (n, o, oh, ow) output: per element
    of the layout, the flat index of its (n, o, oh, ow) element, or -1 for a zero past O or OW;
    built from the header's formula, word by word."""
    blocks, groups = -(-ow // 48), -(-o // 64)
    word = torch.arange(3072)
    q, lane, pair, kk = word % 4, word // 4 % 32, word // 128 % 4, word // 512
    g, t = lane // 4, lane % 4
    column = 16 * (kk // 2) + 4 * (kk % 2) + t + 8 * (q % 2)
    channel = 16 * pair + 8 * (q // 2) + g
    index = torch.full((n, oh, blocks, groups, 3072), -1, dtype=torch.long)
    for b in range(blocks):
        for group in range(groups):
            cols, chans = 48 * b + column, 64 * group + channel
            inside = (cols < ow) & (chans < o)
            for i in range(n):
                for r in range(oh):
                    flat = ((i * o + chans) * oh + r) * ow + cols
                    index[i, r, b, group] = torch.where(inside, flat, -1)
    return index


def in_layout(values, index):
    """values (N, O, OH, OW) placed in the factor's layout by layout_index's index (zeros at -1)."""
    flat = values.reshape(-1)
    return torch.where(index >= 0, flat[index.clamp(min=0)], torch.zeros((), dtype=values.dtype))


@pytest.mark.parametrize("w_shape,stride,padding", [((5, 3, 6, 6), 4, 1), ((70, 3, 3, 5), (2, 3), 0)],
                         ids=["one-channel-group", "two-channel-groups"])
def test_grad_factor_is_sigmoid_derivative_in_layout(w_shape, stride, padding, device):
    """The saved factor is s (1 - s) of every output, placed as the header's formula says (two
    column blocks; two channel groups past 64 outputs), zeros elsewhere; float64 exactly."""
    x, w, b = make_convolution_case((2, 3, 30, 211), w_shape, True, torch.float64, device)
    out, factor = OP(x, w, b, _pair(stride), _pair(padding), True)
    s = torch.sigmoid(F.conv2d(x, w, b, stride, padding))
    assert factor.dtype == torch.float64
    assert torch.equal(factor.cpu(), in_layout((s * (1 - s)).cpu(), layout_index(*s.shape)))
    assert OP(x, w, b, _pair(stride), _pair(padding), False)[1].numel() == 0


@requires_cuda
@pytest.mark.parametrize("x_shape,w_shape,stride,padding,bias", CASES[:-1], ids=IDS[:-1])
def test_kernel_grad_factor(x_shape, w_shape, stride, padding, bias, tf32):
    """The tensor-core forward's factor: sigmoid'(y) of its TF32 convolution rounded to TF32, in the
    layout, zeros past OW and O: within TF32's effect (y's error times |sigmoid''| <= 0.1, and the
    rounding's 2^-11 relative) of the float64 factor."""
    x, w, b = make_convolution_case(x_shape, w_shape, bias, torch.float32, "cuda")
    poison_cuda_allocator()  # (a word the kernel does not write reads NaN)
    out, factor = OP(x, w, b, _pair(stride), _pair(padding), True)
    assert kernel_loaders(lambda: OP(x, w, b, _pair(stride), _pair(padding), True)) == {expected_loader(x)}
    torch.testing.assert_close(out, OP(x, w, b, _pair(stride), _pair(padding), False)[0], rtol=0, atol=0)
    y = F.conv2d(x.double(), w.double(), None if b is None else b.double(), stride, padding)
    s = torch.sigmoid(y)
    expected = in_layout((s * (1 - s)).cpu(), layout_index(*s.shape))
    magnitude = F.conv2d(x.double().abs(), w.double().abs(), None if b is None else b.double().abs(), stride, padding)
    bound = in_layout((0.1 * 2.0 ** -10 * magnitude + 2.0 ** -11 * s * (1 - s) + 1e-7).cpu(), layout_index(*s.shape))
    assert ((factor.double().cpu() - expected).abs() <= bound).all()


def weight_grad_loaders(call) -> set:
    """Whether the weight-gradient kernel ran in call(): {"kernel"} or empty."""
    return {"kernel" for name in cuda_kernel_names(call) if "conv2d_sigmoid_sum_weight_grad_kernel" in name}


def weight_grad_kernel_takes(x, w) -> bool:
    return (torch.cuda.get_device_capability() >= (9, 0) and x.shape[-1] % 4 == 0 and w.shape[0] <= 64
            and w.shape[2:] in ((6, 6), (4, 4)))


@requires_cuda
@pytest.mark.parametrize("x_shape,w_shape,stride,padding,bias", CASES, ids=IDS)
def test_backward_kernel_exact_on_exact_factor(x_shape, w_shape, stride, padding, bias, tf32):
    """The weight-gradient kernel on integer-valued x, a factor of 64ths and integer grad_out (every
    product and sum exact in TF32 and float32): exactly the float64 convolution backward's
    weight and bias gradients of grad_y = grad_out * factor; x's gradient as PyTorch's."""
    x, w, b = make_convolution_case(x_shape, w_shape, bias, torch.float32, "cuda", integers=True)
    n = x.shape[0]
    _, factor = OP(x, w, b, _pair(stride), _pair(padding), True)
    g = torch.Generator().manual_seed(1)
    values = torch.randint(0, 17, factor.shape, generator=g).double() / 64
    oh, ow = F.conv2d(x, w, None, stride, padding).shape[2:]
    index = layout_index(n, w.shape[0], oh, ow)
    factor = torch.where(index >= 0, values, 0.0).float().cuda()
    grad_out = torch.arange(1, n + 1, dtype=torch.float32, device="cuda") * torch.tensor([1.0, -1.0] * n)[:n].cuda()
    mask = [True, True, True]
    poison_cuda_allocator()  # (a partial sum the kernel does not write reads NaN)
    actual = BACKWARD(grad_out, factor, x, w, _pair(stride), _pair(padding), mask)
    assert weight_grad_loaders(lambda: BACKWARD(grad_out, factor, x, w, _pair(stride), _pair(padding), mask)) == (
        {"kernel"} if weight_grad_kernel_takes(x, w) else set())
    # grad_y from the layout: each output's factor at its index
    f = torch.zeros(n * w.shape[0] * oh * ow, dtype=torch.float64)
    f[index[index >= 0]] = values[index >= 0]
    grad_y = f.view(n, w.shape[0], oh, ow).cuda() * grad_out.double().view(-1, 1, 1, 1)
    gx, gw, gb = torch.ops.aten.convolution_backward(grad_y, x.double(), w.double(), [w.shape[0]], _pair(stride),
                                                    _pair(padding), [1, 1], False, [0, 0], 1, mask)
    assert torch.equal(actual[1].double(), gw) and torch.equal(actual[2].double(), gb)
    torch.testing.assert_close(actual[0].double(), gx, rtol=1e-5, atol=1e-5)


@requires_cuda
@pytest.mark.parametrize("x_shape,w_shape,stride,padding,bias", CASES, ids=IDS)
def test_backward_kernel_within_tf32(x_shape, w_shape, stride, padding, bias, tf32):
    """Through autograd on random data: the weight's (and bias's) gradients within TF32's bound of
    the float64 gradients, and (the kernel's) bit for bit the same in repeated calls. Per term
    grad_out * factor
    * x: the factor's error from the forward's TF32 convolution (y's error 2^-10 of its
    magnitude, times |sigmoid''| <= 0.1) and its and x's rounding to TF32 (2^-11 each of
    sigmoid' <= 1/4), plus float32 accumulation over an image's pixels."""
    x, w, b = make_convolution_case(x_shape, w_shape, bias, torch.float32, "cuda")
    grad_out = torch.linspace(-2, 2, x.shape[0], device="cuda")
    params = [w] if b is None else [w, b]
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in params]
        conv2d_sigmoid_sum(x, *leaves, stride=stride, padding=padding).backward(grad_out)
        grads.append([t.grad for t in leaves])
    if weight_grad_kernel_takes(x, w):  # (deterministic; cuDNN's backward elsewhere need not be)
        assert all(torch.equal(a, e) for a, e in zip(*grads))
    exact = [t.double().requires_grad_() for t in params]
    composite(x.double(), *exact, *([None] if b is None else []), stride, padding).backward(grad_out.double())
    magnitude = F.conv2d(x.double().abs(), w.double().abs(), None if b is None else b.double().abs(), stride, padding)
    pixels = magnitude.shape[2] * magnitude.shape[3]
    per_output = grad_out.double().abs().view(-1, 1, 1, 1) * (
        0.1 * 2.0 ** -10 * magnitude + 0.25 * (2.0 ** -10 + pixels * 2.0 ** -24))
    bounds = [torch.ops.aten.convolution_backward(per_output, x.double().abs(), torch.ones_like(w.double()), None,
                                                  _pair(stride), _pair(padding), [1, 1], False, [0, 0], 1,
                                                  [False, True, False])[1] + 1e-6,
              per_output.sum(dim=(0, 2, 3)) + 1e-6]
    assert weight_grad_loaders(
        lambda: conv2d_sigmoid_sum(x, *[t.clone().requires_grad_() for t in params], stride=stride,
                                   padding=padding).backward(grad_out)) == (
        {"kernel"} if weight_grad_kernel_takes(x, w) else set())
    for actual, expected, bound in zip(grads[0], [t.grad for t in exact], bounds):
        assert ((actual.double() - expected).abs() <= bound).all(), (actual.double() - expected).abs().max()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_as_pytorch(dtype, device):
    """A 16-bit input: PyTorch's ops in that dtype (the result its dtype, or float32 asked for)."""
    x, w, b = make_convolution_case((2, 3, 13, 14), (4, 3, 6, 6), True, dtype, device)
    out = conv2d_sigmoid_sum(x, w, b, 4, 0)
    assert out.dtype == dtype
    torch.testing.assert_close(out, composite(x, w, b, 4, 0))
    assert conv2d_sigmoid_sum(x, w, b, 4, 0, dtype=torch.float32).dtype == torch.float32


def rounded_bound(x, w, b, stride, padding):
    """A bound on the kernel's error against the float64 sums of a 16-bit convolution (operands
    already rounded: every product exact in float32): float32 accumulation of k terms (relative
    k 2^-24), sigmoid' <= 1/4, plus float32 sigmoids and sums."""
    magnitude = F.conv2d(x.double().abs(), w.double().abs(), None if b is None else b.double().abs(), stride, padding)
    return 0.25 * (w[0].numel() + 1) * 2.0 ** -24 * magnitude.sum(dim=(1, 2, 3)) + 1e-5 * magnitude[0].numel()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [41, 44])
def test_rounded_input(dtype, width, device):
    """A float32 x with a 16-bit weight and bias: the convolution of x rounded to the weight's dtype
    (the result in that dtype by default). PyTorch's ops on the CPU, exactly; the kernel on a GPU
    (either loader), within float32 accumulation's bound of the float64 sums."""
    x, w, b = make_convolution_case((2, 8, 45, width), (64, 8, 6, 6), True, torch.float32, device)
    w, b = w.to(dtype), b.to(dtype)
    out = conv2d_sigmoid_sum(x, w, b, 4, 0, dtype=torch.float32)
    assert conv2d_sigmoid_sum(x, w, b, 4, 0).dtype == dtype
    if device == "cpu":
        expected = torch.sigmoid(F.conv2d(x.to(dtype), w, b, 4)).sum(dim=(1, 2, 3), dtype=torch.float32)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        return
    assert kernel_loaders(lambda: conv2d_sigmoid_sum(x, w, b, 4, 0)) == {expected_loader(x)}
    exact = composite(x.to(dtype).double(), w.double(), b.double(), 4, 0)
    assert ((out.double() - exact).abs() <= rounded_bound(x.to(dtype), w, b, 4, 0)).all()


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounded_input_kernel_shapes(dtype):
    """The kernel at the rounded input for every case it takes (both kernel shapes, padding, odd
    channels, fewer outputs, no bias), integer-valued (exact in 16 bits): the float64 result."""
    for x_shape, w_shape, stride, padding, bias in CASES[:-1]:
        x, w, b = make_convolution_case(x_shape, w_shape, bias, torch.float32, "cuda", integers=True)
        w, b = w.to(dtype), None if b is None else b.to(dtype)
        assert kernel_loaders(lambda: conv2d_sigmoid_sum(x, w, b, stride, padding)) == {expected_loader(x)}
        expected = composite(x.double(), w.double(), None if b is None else b.double(), stride, padding)
        torch.testing.assert_close(conv2d_sigmoid_sum(x, w, b, stride, padding, dtype=torch.float32).double(),
                                   expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("width", [14, 44], ids=["pytorch-backward", "kernel-backward"])
def test_rounded_input_gradients(width, device, tf32):
    """The backward of a rounded input: x's gradient in float32 (the rounding's is the identity),
    the weight's and bias's in their dtype; each, and the original ops' (the composite on
    x.to(dtype)), within 16-bit rounding's bound of the float64 gradients of the composite on
    the rounded operands: per term grad_out * sigmoid' * (x or w), sigmoid' <= 1/4, relative
    2^-7 (a few 16-bit roundings: y, sigmoid', grad_y, the result). On a GPU with rows of whole
    16-byte chunks the weight's and bias's come from the weight-gradient kernel."""
    x, w, b = make_convolution_case((2, 3, 13, width), (4, 3, 6, 6), True, torch.float32, device)
    w, b = w.bfloat16(), b.bfloat16()
    grad_out = torch.tensor([0.5, -2.0], device=device)
    grads = []
    for f in (conv2d_sigmoid_sum, lambda x, w, b, s, p: composite(x.bfloat16(), w, b, s, p).float()):
        inputs = [t.clone().requires_grad_() for t in (x, w, b)]
        f(*inputs, 4, 0).float().backward(grad_out)
        grads.append([t.grad for t in inputs])
    assert [g.dtype for g in grads[0]] == [torch.float32, torch.bfloat16, torch.bfloat16]
    if device == "cuda":
        backward = lambda: conv2d_sigmoid_sum(x, w.clone().requires_grad_(), b, 4, 0).float().backward(grad_out)
        assert weight_grad_loaders(backward) == ({"kernel"} if weight_grad_kernel_takes(x, w) else set())
    exact = [t.double().requires_grad_() for t in (x.bfloat16(), w, b)]
    composite(*exact, 4, 0).backward(grad_out.double())
    terms = (grad_out.double().abs() / 4).view(-1, 1, 1, 1).expand(-1, 4, 2, (width - 6) // 4 + 1).contiguous()
    bounds = torch.ops.aten.convolution_backward(terms, exact[0].detach().abs(), exact[1].detach().abs(), [4], [4, 4],
                                                 [0, 0], [1, 1], False, [0, 0], 1, [True, True, True])
    for actual in grads:
        for a, e, bound in zip(actual, exact, bounds):
            assert ((a.double() - e.grad).abs() <= 2.0 ** -7 * bound + 1e-6).all()


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("w_shape", [(4, 3, 6, 6), (4, 3, 3, 5)], ids=["kernel-shape", "other-shape"])
def test_autocast_casts_as_a_convolution(autocast_dtype, w_shape, device):
    """Under autocast the convolution's operands are rounded as autocast casts a convolution's and
    the result's dtype is the sum's (float32 on CUDA). Where PyTorch's ops compute it (the CPU, a
    shape the kernel does not take) it is the original's ops under autocast, exactly; the kernel
    adds float32 sigmoids of the rounded operands' convolution (the original also rounds y and the
    sigmoids to 16 bits): within float32 accumulation's bound of the float64 sums."""
    x, w, b = make_convolution_case((2, 3, 13, 16), w_shape, True, torch.float32, device)
    kernel = device == "cuda" and w_shape[2:] == (6, 6)
    with torch.autocast(device, dtype=autocast_dtype):
        out = conv2d_sigmoid_sum(x, w, b, 4, 0)
        expected = composite(x, w, b, 4, 0)
        if device == "cuda":
            assert bool(kernel_loaders(lambda: conv2d_sigmoid_sum(x, w, b, 4, 0))) == kernel
    assert out.dtype == expected.dtype == (torch.float32 if device == "cuda" else autocast_dtype)
    if kernel:
        rounded = [t.to(autocast_dtype) for t in (x, w, b)]
        exact = composite(*[t.double() for t in rounded], 4, 0)
        assert ((out.double() - exact).abs() <= rounded_bound(*rounded, 4, 0)).all()
    else:
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("args,match", [
    (lambda x, w, b: (x[0], w, b, 4, 0), "4-D input"),
    (lambda x, w, b: (x, w[0], b, 4, 0), "4-D weight"),
    (lambda x, w, b: (x.int(), w, b, 4, 0), "floating-point"),
    (lambda x, w, b: (x, w.double(), b, 4, 0), "weight .* must have the input's dtype"),
    (lambda x, w, b: (x.half(), w.bfloat16(), b.bfloat16(), 4, 0), "weight .* must have the input's dtype"),
    (lambda x, w, b: (x, w.bfloat16(), b, 4, 0), "bias .* must have the weight's dtype"),
    (lambda x, w, b: (x, w[:, :2], b, 4, 0), "3 channels, the weight expects 2"),
    (lambda x, w, b: (x, w, b[:2], 4, 0), "bias must have shape"),
    (lambda x, w, b: (x[..., :5], w, b, 4, 0), "smaller than the kernel"),
    (lambda x, w, b: (x, w, b, 0, 0), "stride must be positive"),
    (lambda x, w, b: (x, w, b, 4, -1), "padding must be non-negative"),
])
def test_bad_input_named(args, match, device):
    x, w, b = make_convolution_case((2, 3, 13, 14), (4, 3, 6, 6), True, torch.float32, device)
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        conv2d_sigmoid_sum(*args(x, w, b))


@requires_cuda
@pytest.mark.parametrize("shape", [(2, 8, 45, 41), (1, 8, 70, 402)], ids=["small", "two-tiles"])
@pytest.mark.parametrize("mode", ["eval", "no_grad", "train"])
def test_module_fused_conv_float32(shape, mode, tf32):
    """Architecture C forced to ``fused_conv`` in float32 (TF32 on, the kernel): the original's
    float64 result within the TF32 bound of its folded convolution; in training the original's
    gradients (rows of 41 and 402 columns, not whole 16-byte chunks: the backward is PyTorch's
    convolution backward on the saved factor; the weight-gradient kernel's own tests are the
    op's above)."""
    original = reference.Conv2dAvgPoolSigmoidSum(8, 64, 3, 4).cuda().train(mode == "train")
    fused = fnn.Conv2dAvgPoolSigmoidSum.from_module(original)
    x = torch.rand(shape, device="cuda")
    with torch.set_grad_enabled(mode != "no_grad"), autotune.force("fused_conv"):
        out = fused(x)
    assert autotune.last_formulation() == "fused_conv"
    expected = copy.deepcopy(original).double()(x.double())
    folded = box_fold2d(original.conv.weight.detach(), (4, 4), 16, dtype=torch.float64)
    bound = tf32_bound(x, folded, original.conv.bias.detach(), 4, 0)
    assert ((out.double() - expected).abs() <= bound).all()
    if mode == "train":
        out.sum().backward()
        grads = [p.grad.clone() for p in original.parameters()]
        original.zero_grad()
        original(x).sum().backward()
        for a, e in zip(grads, [p.grad for p in original.parameters()]):
            torch.testing.assert_close(a, e, rtol=2e-3, atol=1e-4)


def test_module_dtype_mismatch_raises_as_original(device):
    """A bfloat16 C given a float32 input outside autocast: ``fused_conv`` raises the original's
    error (the op itself would take the pair, rounding x, as autocast has it call)."""
    original = reference.Conv2dAvgPoolSigmoidSum(3, 8, 3, 4).to(device, torch.bfloat16)
    fused = fnn.Conv2dAvgPoolSigmoidSum.from_module(original)
    x = torch.rand(2, 3, 22, 19, device=device)
    with pytest.raises(RuntimeError) as expected:
        original(x)
    with autotune.force("fused_conv"), pytest.raises(RuntimeError) as raised:
        fused(x)
    assert str(raised.value) == str(expected.value)
