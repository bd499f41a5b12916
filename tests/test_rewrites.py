"""fused_ops.rewrites (the exact rewrites of the architectures' convolutions)
against the plain formulations in float64, their fallbacks, and the drop-in
modules with TF32 convolutions on a GPU."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import build_pair, check_matches_original, exact_pair, matmul_precision, requires_cuda
from fused_ops import rewrites
from fused_ops.architectures import ARCHITECTURES


def interleave(y, classes):
    """(N, Md, Mh, Mw, C, Q) windows side by side -> the pooled tensor (N, C, Md Pd, Mh Ph, Mw Pw)."""
    n, md, mh, mw, c, _ = y.shape
    pd, ph, pw = classes
    return y.reshape(n, md, mh, mw, c, pd, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(n, c, md * pd, mh * ph,
                                                                                          mw * pw)


def with_channel_bias(y, channel_bias):
    """y (N, C, ...) plus the per-channel constant a windows rewrite leaves out (if any)."""
    return y if channel_bias is None else y + channel_bias.view(-1, *[1] * (y.dim() - 2))


def assert_same_function(rewritten, plain, inputs):
    """Values and the gradients of every input (tensors requiring grad) equal to float64 rounding,
    for a gradient laid out as the rewritten output (as a fused tail gives it: channels-last where
    the rewrite's output is, so its backward's channels-last paths run)."""
    torch.testing.assert_close(rewritten, plain, rtol=1e-10, atol=1e-12)
    grad = torch.rand_like(rewritten)
    for a, b in zip(torch.autograd.grad(rewritten, inputs, grad), torch.autograd.grad(plain, inputs, grad)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def double_input(shape, device):
    return torch.rand(shape, dtype=torch.float64, device=device, requires_grad=True)


# (Conv3d args, MaxPool3d args, input shape, divisor)
CONV_POOL = [
    (dict(in_channels=3, out_channels=4, kernel_size=3), dict(kernel_size=2), (2, 3, 7, 9, 8), 2.0),
    (dict(in_channels=2, out_channels=3, kernel_size=(3, 2, 1), padding=(1, 0, 2)), dict(kernel_size=(2, 3, 1)),
     (1, 2, 6, 7, 5), -0.5),
    (dict(in_channels=1, out_channels=2, kernel_size=1, bias=False), dict(kernel_size=3, ceil_mode=True),
     (2, 1, 6, 9, 3), 1.0),
]


@pytest.mark.parametrize("conv_args,pool_args,shape,divisor", CONV_POOL)
def test_conv3d_max_pool_windows(conv_args, pool_args, shape, divisor, device):
    conv = nn.Conv3d(**conv_args).double().to(device)
    pool = nn.MaxPool3d(**pool_args)
    x = double_input(shape, device)
    windows, channel_bias = rewrites.conv3d_max_pool_windows(x, conv, pool, divisor)
    assert (channel_bias is None) == (conv.bias is None)  # the divisors here fold exactly
    classes = pool.kernel_size if isinstance(pool.kernel_size, tuple) else (pool.kernel_size,) * 3
    y = conv(x) / divisor
    plain = y[:, :, :windows.shape[1] * classes[0], :windows.shape[2] * classes[1], :windows.shape[3] * classes[2]]
    assert_same_function(with_channel_bias(interleave(windows, classes), channel_bias), plain, [x, *conv.parameters()])


# (ConvTranspose3d args, first pool kernel, second pool kernel, input shape)
TRANSPOSED_POOL = [
    (dict(in_channels=3, out_channels=4, kernel_size=5, stride=2, padding=2), 2, 3, (2, 3, 6, 7, 8)),
    (dict(in_channels=2, out_channels=3, kernel_size=3, stride=2, padding=1, output_padding=1), 2, 2, (1, 2, 4, 5, 6)),
    (dict(in_channels=2, out_channels=2, kernel_size=(4, 3, 2), stride=(2, 3, 1), padding=(0, 1, 0)), (2, 3, 1),
     (1, 2, 3), (2, 2, 5, 4, 6)),
    (dict(in_channels=1, out_channels=2, kernel_size=2, stride=3, bias=False), 3, 2, (1, 1, 3, 4, 4)),
]


@pytest.mark.parametrize("conv_args,kernel1,kernel2,shape", TRANSPOSED_POOL)
def test_conv_transpose3d_max_pool_windows(conv_args, kernel1, kernel2, shape, device):
    conv = nn.ConvTranspose3d(**conv_args).double().to(device)
    x = double_input(shape, device)
    windows, channel_bias = rewrites.conv_transpose3d_max_pool_windows(x, conv, nn.MaxPool3d(kernel1),
                                                                      nn.MaxPool3d(kernel2))
    assert channel_bias is conv.bias
    classes = kernel1 if isinstance(kernel1, tuple) else (kernel1,) * 3
    plain = conv(x)[:, :, :windows.shape[1] * classes[0], :windows.shape[2] * classes[1],
                    :windows.shape[3] * classes[2]]
    assert_same_function(with_channel_bias(interleave(windows, classes), channel_bias), plain,
                         [x, *conv.parameters()])


@pytest.mark.parametrize("conv_args,shape", [
    (dict(in_channels=3, out_channels=4, kernel_size=5), (2, 3, 3, 4, 2)),
    (dict(in_channels=2, out_channels=3, kernel_size=(3, 2, 4), padding=(1, 0, 2)), (1, 2, 4, 5, 6)),
    (dict(in_channels=2, out_channels=2, kernel_size=2, bias=False), (2, 2, 3, 3, 3)),
])
def test_conv_transpose3d_stride1(conv_args, shape, device):
    conv = nn.ConvTranspose3d(**conv_args).double().to(device)
    x = double_input(shape, device)
    y = rewrites.conv_transpose3d_stride1(x, conv)
    # (channels-last on a GPU, where batch_norm_gap and the weight gradient read it so)
    assert y is not None and y.is_contiguous(
        memory_format=torch.channels_last_3d if device == "cuda" else torch.contiguous_format)
    assert_same_function(y, conv(x), [x, *conv.parameters()])


@pytest.mark.parametrize("conv_args,shape", [
    (dict(in_channels=3, out_channels=4, kernel_size=5), (2, 3, 3, 4, 2)),
    (dict(in_channels=2, out_channels=3, kernel_size=(3, 2, 4), stride=(1, 2, 3), output_padding=(0, 1, 2)),
     (1, 2, 4, 5, 6)),
    (dict(in_channels=2, out_channels=2, kernel_size=2, bias=False), (2, 2, 3, 3, 3)),
])
def test_conv_transpose3d_spatial_mean(conv_args, shape, device):
    conv = nn.ConvTranspose3d(**conv_args).double().to(device)
    x = double_input(shape, device)
    mean = rewrites.conv_transpose3d_spatial_mean(x, conv)
    assert_same_function(mean, conv(x).mean(dim=(2, 3, 4)), [x, *conv.parameters()])


@pytest.mark.parametrize("conv_args,pool_args,shape", [
    (dict(in_channels=3, out_channels=4, kernel_size=3), dict(kernel_size=4), (2, 3, 19, 23)),
    (dict(in_channels=2, out_channels=3, kernel_size=(3, 2), padding=(1, 0)), dict(kernel_size=(2, 3), stride=(1, 2)),
     (1, 2, 12, 17)),
    (dict(in_channels=2, out_channels=2, kernel_size=2), dict(kernel_size=3, divisor_override=5), (2, 2, 11, 10)),
    (dict(in_channels=1, out_channels=2, kernel_size=1, bias=False), dict(kernel_size=3, stride=2, ceil_mode=True),
     (1, 1, 9, 11)),
])
def test_conv2d_avg_pool(conv_args, pool_args, shape, device):
    conv = nn.Conv2d(**conv_args).double().to(device)
    pool = nn.AvgPool2d(**pool_args)
    x = double_input(shape, device)
    y = rewrites.conv2d_avg_pool(x, conv, pool)
    assert y is not None
    assert_same_function(y, pool(conv(x)), [x, *conv.parameters()])


# Configurations where a rewrite does not hold: the function returns None and the
# drop-in module runs the plain formulation (check_drop_in: it matches the original).
FALLBACKS = [
    ("Conv3dDivMaxPoolGAPBiasSum", (3, 4, 3, 2.0, 2, (4, 1, 1, 1), 1), (2, 3, 12, 13, 11),
     lambda m, x: rewrites.conv3d_max_pool_windows(x, m.conv, m.max_pool, m.divisor),
     lambda m: setattr(m.conv, "stride", (2, 2, 2))),
    ("Conv3dDivMaxPoolGAPBiasSum", (3, 4, 3, 2.0, 2, (4, 1, 1, 1), 1), (2, 3, 9, 9, 8),
     lambda m, x: rewrites.conv3d_max_pool_windows(x, m.conv, m.max_pool, m.divisor),
     lambda m: setattr(m, "max_pool", nn.MaxPool3d(2, stride=1))),
    ("Conv3dDivMaxPoolGAPBiasSum", (3, 4, 3, 2.0, 2, (4, 1, 1, 1), 1), (2, 3, 9, 9, 8),
     lambda m, x: rewrites.conv3d_max_pool_windows(x, m.conv, m.max_pool, m.divisor),
     lambda m: setattr(m, "max_pool", nn.MaxPool3d(2, ceil_mode=True))),  # 7 -> 4 windows, the last partial
    ("ConvTranspose3dMaxPoolMaxPoolSum", (3, 4, 3, 1, 1), (2, 3, 7, 7, 7),  # stride 1: no parity classes of 2
     lambda m, x: rewrites.conv_transpose3d_max_pool_windows(x, m.conv_transpose, m.max_pool1, m.max_pool2), None),
    ("ConvTranspose3dMaxPoolMaxPoolSum", (3, 4, 5, 2, 2), (2, 3, 7, 7, 7),
     lambda m, x: rewrites.conv_transpose3d_max_pool_windows(x, m.conv_transpose, m.max_pool1, m.max_pool2),
     lambda m: setattr(m, "max_pool2", nn.MaxPool3d(3, stride=2))),
    ("Conv2dAvgPoolSigmoidSum", (3, 5, 3, 4), (2, 3, 19, 23),
     lambda m, x: rewrites.conv2d_avg_pool(x, m.conv, m.avg_pool),
     lambda m: setattr(m, "avg_pool", nn.AvgPool2d(4, padding=1))),
    ("Conv2dAvgPoolSigmoidSum", (3, 5, 3, 4), (2, 3, 19, 23),
     lambda m, x: rewrites.conv2d_avg_pool(x, m.conv, m.avg_pool),
     lambda m: setattr(m.conv, "stride", (2, 2))),
    ("ConvTranspose3dScaleBatchNormGAP", (3, 4, 3, 2.0), (2, 3, 4, 5, 3),
     lambda m, x: rewrites.conv_transpose3d_stride1(x, m.conv_transpose),
     lambda m: setattr(m.conv_transpose, "stride", (2, 2, 2))),
    ("ConvTranspose3dScaleBatchNormGAP", (3, 4, 3, 2.0), (2, 3, 4, 5, 3),
     lambda m, x: rewrites.conv_transpose3d_spatial_mean(x, m.conv_transpose),
     lambda m: setattr(m.conv_transpose, "padding", (1, 1, 1))),
]


@pytest.mark.parametrize("name,args,shape,rewrite,change", FALLBACKS)
@pytest.mark.parametrize("train", [True, False])
def test_fallback(name, args, shape, rewrite, change, train, device):
    original, fused = build_pair(name, args)
    for module in (original, fused):
        if change is not None:
            change(module)
        module.to(device, torch.float64).train(train)
    x = torch.rand(shape, dtype=torch.float64, device=device)
    assert rewrite(fused, x) is None
    # normwise for D: a conv bias's gradient through a training batch norm cancels to ~0
    check_matches_original(original, fused, x, torch.float64, normwise=name == "ConvTranspose3dScaleBatchNormGAP")


@pytest.mark.parametrize("arch", ARCHITECTURES, ids=lambda a: a.letter)
def test_spec_configurations_are_rewritten(arch):
    """Each architecture's SPEC configuration takes its rewrite (not a fallback)."""
    model = arch.build_original().double()
    x = torch.rand(arch.input_shape("tiny"), dtype=torch.float64)
    rewritten = {
        "A": lambda: rewrites.conv3d_max_pool_windows(x, model.conv, model.max_pool, model.divisor),
        "B": lambda: rewrites.conv_transpose3d_max_pool_windows(x, model.conv_transpose, model.max_pool1,
                                                                model.max_pool2),
        "C": lambda: rewrites.conv2d_avg_pool(x, model.conv, model.avg_pool),
        "D": lambda: (rewrites.conv_transpose3d_stride1(x, model.conv_transpose),
                      rewrites.conv_transpose3d_spatial_mean(x, model.conv_transpose)),
    }[arch.letter]()
    assert all(r is not None for r in (rewritten if isinstance(rewritten, tuple) else (rewritten,)))


@requires_cuda
@pytest.mark.parametrize("arch", ARCHITECTURES, ids=lambda a: a.letter)
@pytest.mark.parametrize("train", [True, False])
def test_float32_passes_the_main_jobs_check_with_default_settings(arch, train):
    """PyTorch's default settings (TF32 convolutions allowed, float32 matrix products in full float32),
    the modules built under one seed as KernelBench builds them: each drop-in's float32 output and (in
    training) every parameter's gradient pass the main job's check against the original in the same
    settings (fused_ops.cli.check: KernelBench's tolerance, 1e-4, a gradient relative to the largest; or
    no farther from a float64 run than twice the original's own), for fresh inputs."""
    from fused_ops import cli
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=True):
        assert torch.get_float32_matmul_precision() == "highest"
        for seed in range(2):
            original, fused = build_pair(arch.name, arch.args, seed=42)
            original.to("cuda").train(train)
            fused.to("cuda").train(train)
            x = torch.rand(arch.input_shape("reduced"), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(seed))
            grad = torch.rand_like(copy.deepcopy(original)(x)) if train else None
            checked = cli.check(original, fused, x, train, grad, cli.TOLERANCE[torch.float32])
            assert checked["ok"], f"{arch.letter}: {cli.verdict(checked, cli.TOLERANCE[torch.float32])}"


def cascade_sum_of(conv, x, kernel2=3):
    """B's tail, pool2(pool1(conv(x))).sum(1, keepdim=True), by its rewrite (None where it does not hold)."""
    found = rewrites.conv_transpose3d_max_pool_cascade_sum(x, conv, nn.MaxPool3d(conv.stride), nn.MaxPool3d(kernel2))
    return None if found is None else found[0] + found[1].sum()


@pytest.fixture
def full_float32(monkeypatch):
    """rewrites._common._full_float32 true for any x (as on a GPU in float32 by default), in each module
    that uses it."""
    from fused_ops.rewrites import _common, conv_transpose3d_max_pool
    for module in (_common, conv_transpose3d_max_pool):
        monkeypatch.setattr(module, "_full_float32", lambda x: True)


def test_conv3d_rewrite_in_full_float32(full_float32, device):
    """Where full float32 is asked, A's rewrite does not hold where autograd records its windows'
    convolution with TF32 convolutions allowed (its gradients in TF32 strayed beyond the original's:
    rewrites._common._rounds_to_tf32), and holds where autograd records nothing or TF32 is off."""
    conv, pool = nn.Conv3d(3, 4, 3).to(device), nn.MaxPool3d(2)
    x = torch.rand(2, 3, 7, 8, 9, device=device)
    assert rewrites.conv3d_max_pool_windows(x, conv, pool) is not None  # (the tests' TF32 off: conftest)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=True):
        assert rewrites.conv3d_max_pool_windows(x, conv, pool) is None
        assert rewrites.conv3d_max_pool_windows(x.clone().requires_grad_(), conv.requires_grad_(False), pool) is None
        with torch.no_grad():
            assert rewrites.conv3d_max_pool_windows(x, conv.requires_grad_(True), pool) is not None


def test_conv_transpose3d_rewrite_in_full_float32(full_float32, tf32, device):
    """Where full float32 is asked (rewrites._common._full_float32: on a GPU by default), B's rewrite
    computes its windows' convolution with TF32 off by the call's own argument where autograd records
    nothing (eval, and the forward of the picked weight gradient), takes the picked weight gradient
    (float32 sums) for a training step on data, and does not hold where autograd would record the
    windows' convolution (x's gradient: autograd's backward reads the global TF32 setting)."""
    torch.manual_seed(0)
    conv = nn.ConvTranspose3d(7, 13, 5, stride=2, padding=2).to(device)
    x = torch.rand(2, 7, 5, 6, 7, device=device)
    expected_conv = copy.deepcopy(conv).double()
    expected = F.max_pool3d(F.max_pool3d(expected_conv(x.double()), 2), 3).sum(1, keepdim=True)
    with torch.no_grad():
        torch.testing.assert_close(cascade_sum_of(conv, x), expected.float(), rtol=1e-5, atol=1e-5)
    out = cascade_sum_of(conv, x)
    grad = torch.rand_like(out)
    (weight_grad,) = torch.autograd.grad(out, conv.weight, grad)
    (expected_grad,) = torch.autograd.grad(expected, expected_conv.weight, grad.double())
    torch.testing.assert_close(weight_grad, expected_grad.float(), rtol=1e-5, atol=1e-5)
    assert cascade_sum_of(conv, x.requires_grad_()) is None
    assert rewrites.conv_transpose3d_max_pool_windows(x.detach(), conv, nn.MaxPool3d(2), nn.MaxPool3d(3)) is None
    with torch.no_grad():
        assert rewrites.conv_transpose3d_max_pool_windows(x, conv, nn.MaxPool3d(2), nn.MaxPool3d(3)) is not None


@requires_cuda
@pytest.mark.parametrize("precision", ["highest", "high"])
def test_conv_transpose3d_rewrite_float32_by_the_matmul_precision(precision):
    """B's configuration 7 -> 13 channels, kernel 5, stride 2 (bench/configs.py's B-7to13-s2p2k5, whose rewrite
    with TF32 failed KernelBench's float32 check at batch 16 on an H200): with PyTorch's default float32 matmul
    precision ("highest"), TF32 convolutions allowed, the rewrite's output and (training step on data) weight
    gradient lie within float32's rounding of a float64 run (TF32's is ~100x larger); with "high" it runs
    the TF32 formulation, x's gradient included."""
    torch.manual_seed(0)
    conv = nn.ConvTranspose3d(7, 13, 5, stride=2, padding=2).cuda()
    x = torch.rand(4, 7, 11, 13, 9, device="cuda")
    expected_conv = copy.deepcopy(conv).double()
    expected = F.max_pool3d(F.max_pool3d(expected_conv(x.double()), 2), 3).sum(1, keepdim=True)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=True), matmul_precision(precision):
        out = cascade_sum_of(conv, x)
        if precision == "high":
            assert cascade_sum_of(conv, x.clone().requires_grad_()) is not None
            return
        grad = torch.rand_like(out)
        (weight_grad,) = torch.autograd.grad(out, conv.weight, grad)
    (expected_grad,) = torch.autograd.grad(expected, expected_conv.weight, grad.double())
    for actual, reference in ((out, expected), (weight_grad, expected_grad)):
        assert (actual.double() - reference).abs().max() <= 2e-6 * reference.abs().max()


# --------------------------------------------------------------------------
# Integer-valued data: where PyTorch's own arithmetic is exact, the rewritten
# convolutions give the same values bit for bit, so the max-pools' picks and
# the routing of their gradients are PyTorch's.
# --------------------------------------------------------------------------


def integer_valued(module, dtype, device, seed=0):
    """module in dtype on device with integer weights and bias in [-2, 2]."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randint(-2, 3, p.shape, generator=g))
    return module.to(device, dtype)


def integer_input(shape, dtype, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 3, shape, generator=g).to(device, dtype)


EXACT_DTYPES = [torch.float64, torch.float32]


@pytest.mark.parametrize("divisor", [2.0, -1.5, 3.0, 0.5, -0.25, 7.0, 1.0])
@pytest.mark.parametrize("precision", ["highest", "high"])
@pytest.mark.parametrize("dtype", EXACT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_conv3d_max_pool_windows_exact_on_integers(divisor, dtype, precision, device):
    """conv(x) / divisor bit for bit, whatever the divisor (the weights are divided only by
    a power of two, which is exact; other divisors divide where PyTorch divides). (In full float32,
    "highest", the rewrite holds where autograd records nothing: under no_grad.)"""
    conv = integer_valued(nn.Conv3d(3, 4, (3, 2, 3), padding=(1, 0, 0)), dtype, device)
    pool = nn.MaxPool3d((2, 3, 2))
    x = integer_input((2, 3, 7, 10, 9), dtype, device)
    with matmul_precision(precision), torch.set_grad_enabled(precision == "high"):
        windows, channel_bias = rewrites.conv3d_max_pool_windows(x, conv, pool, divisor)
    plain = (conv(x) / divisor)[:, :, :windows.shape[1] * 2, :windows.shape[2] * 3, :windows.shape[3] * 2]
    assert torch.equal(with_channel_bias(interleave(windows, (2, 3, 2)), channel_bias), plain)


@pytest.mark.parametrize("precision", ["highest", "high"])
@pytest.mark.parametrize("dtype", EXACT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_conv_transpose3d_rewrites_exact_on_integers(dtype, precision, device):
    """(In full float32, "highest", B's rewrite holds where autograd records nothing: under no_grad;
    with "high" also where it records the windows' convolution.)"""
    conv = integer_valued(nn.ConvTranspose3d(3, 4, 5, stride=2, padding=2), dtype, device)
    x = integer_input((2, 3, 5, 6, 7), dtype, device)
    with matmul_precision(precision), torch.set_grad_enabled(precision == "high"):
        windows, channel_bias = rewrites.conv_transpose3d_max_pool_windows(x, conv, nn.MaxPool3d(2),
                                                                          nn.MaxPool3d(3))
    plain = conv(x)[:, :, :windows.shape[1] * 2, :windows.shape[2] * 2, :windows.shape[3] * 2]
    assert torch.equal(with_channel_bias(interleave(windows, (2, 2, 2)), channel_bias), plain)
    stride1 = integer_valued(nn.ConvTranspose3d(3, 4, (3, 2, 4), padding=(1, 0, 1)), dtype, device)
    assert torch.equal(rewrites.conv_transpose3d_stride1(x, stride1), stride1(x))


def test_conv2d_avg_pool_exact_on_integers(device):
    """(float64: for float32 3x3 convolutions cuDNN may choose Winograd transforms, whose
    arithmetic is not exact on integers; C has no picks whose routing it would change.)"""
    dtype = torch.float64
    conv = integer_valued(nn.Conv2d(3, 4, 3), dtype, device)
    pool = nn.AvgPool2d(4)
    x = integer_input((2, 3, 22, 19), dtype, device)
    assert torch.equal(rewrites.conv2d_avg_pool(x, conv, pool), pool(conv(x)))


@pytest.mark.parametrize("name,args,shape", [
    ("Conv3dDivMaxPoolGAPBiasSum", (3, 4, 3, -1.5, 2, (4, 1, 1, 1), 1), (2, 3, 9, 10, 11)),
    ("Conv3dDivMaxPoolGAPBiasSum", (3, 4, 3, 3.0, (2, 3, 2), (4, 1, 1, 1), 1), (2, 3, 9, 10, 11)),
    ("Conv3dDivMaxPoolGAPBiasSum", (3, 4, 3, 2.0, 2, (4, 1, 1, 1), 1), (2, 3, 9, 10, 11)),
    ("ConvTranspose3dMaxPoolMaxPoolSum", (3, 4, 5, 2, 2), (2, 3, 6, 7, 6)),
], ids=lambda v: v if isinstance(v, str) else None)
@pytest.mark.parametrize("dtype", EXACT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_drop_in_routes_ties_as_pytorch(name, args, shape, dtype, device):
    """Integer weights and input (exact ties everywhere): the drop-in's output and the
    gradients of its input and parameters are the original's, through the rewrites on a
    GPU (to the precision of sums taken in another order; a gradient routed to another
    element of a window would be off by a window's share)."""
    original, fused = build_pair(name, args)
    for module in (original, fused):
        integer_valued(module, dtype, device)
    x = integer_input(shape, dtype, device)
    out, expected, grad_x, expected_grad_x = exact_pair(x, fused, original)
    tolerance = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, expected, **tolerance)  # the averages add in another order
    torch.testing.assert_close(grad_x, expected_grad_x, **tolerance)
    for (p_name, p), q in zip(fused.named_parameters(), original.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **tolerance, msg=lambda m: f"grad {p_name}\n{m}")


@pytest.mark.parametrize("dtype", EXACT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_stacked_input_without_grad_same_as_with(dtype, device):
    """Where x needs no gradient the rewrites stack their input with the one-pass op
    (fused_ops.depth_stacked_channels_last), else with differentiable copies: the same values
    (cropped, zero-padded on every side)."""
    x = torch.rand(2, 3, 6, 7, 8, dtype=dtype, device=device)
    conv3d = nn.Conv3d(3, 4, 3, padding=(1, 2, 0)).to(device, dtype)
    transposed = nn.ConvTranspose3d(3, 4, 5, stride=2, padding=2).to(device, dtype)
    stride1 = nn.ConvTranspose3d(3, 4, (3, 2, 4), padding=(1, 0, 1)).to(device, dtype)
    rewritten = [
        lambda x: rewrites.conv3d_max_pool_windows(x, conv3d, nn.MaxPool3d(2), 2.0)[0],
        lambda x: rewrites.conv_transpose3d_max_pool_windows(x, transposed, nn.MaxPool3d(2), nn.MaxPool3d(3))[0],
        lambda x: rewrites.conv_transpose3d_stride1(x, stride1),
    ]
    for rewrite in rewritten:
        with matmul_precision("high"):  # (in full float32 A's and B's rewrites may not hold where autograd records)
            with torch.no_grad():
                one_pass = rewrite(x)
            assert torch.equal(one_pass, rewrite(x.clone().requires_grad_()).detach())


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d).removeprefix("torch."))
def test_conv_transpose3d_stride1_under_autocast(autocast_dtype, device):
    """16-bit: the rewritten convolution differentiated by autograd (its weight gradient);
    the transposed convolution's dtype, and values and parameter gradients within 16-bit
    rounding of the original's under the same autocast."""
    conv = nn.ConvTranspose3d(3, 4, (3, 2, 4), padding=(1, 0, 1)).to(device)
    x = torch.rand(2, 3, 4, 5, 6, device=device)
    with torch.autocast(device_type=device, dtype=autocast_dtype):
        y, expected = rewrites.conv_transpose3d_stride1(x, conv), conv(x)
    assert y.dtype == expected.dtype == autocast_dtype and y.is_contiguous()
    torch.testing.assert_close(y.float(), expected.float(), rtol=2e-2, atol=2e-2)
    grad = torch.rand_like(expected)
    for a, b in zip(torch.autograd.grad(y, list(conv.parameters()), grad),
                    torch.autograd.grad(expected, list(conv.parameters()), grad)):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())
