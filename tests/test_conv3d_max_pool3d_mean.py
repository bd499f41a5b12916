"""fused_ops.conv3d_max_pool3d_mean against PyTorch's conv3d -> / divisor -> max_pool3d -> mean over
(D', H', W'), its backward op, and architecture A's ``fused_conv`` formulation. On a GPU of compute
capability 9.0 or more, float32 with TF32 allowed (or a 16-bit weight) runs the tensor-core kernel
(cuda/conv3d_max_pool3d_mean.cu) for 3 x 3 x 3 kernels, 2 x 2 x 2 pools, at most 16 input and 16
output channels and rows of whole 16-byte chunks: its cases take every path (padding, windows
leaving a remainder, several 64-column tiles, fewer outputs, one and two channel blocks, no bias,
negative and inexact divisors); the others take PyTorch's convolution then max_pool3d_mean."""
import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import (build_pair, built_with_cutlass, check_matches_original, cuda_kernel_names,
                      make_convolution_case, poison_cuda_allocator, requires_cuda)
from fused_ops import autotune, conv3d_max_pool3d_mean, reference
from fused_ops import nn as fnn

OP = torch.ops.fused_ops.conv3d_max_pool3d_mean.default
BACKWARD = torch.ops.fused_ops.conv3d_max_pool3d_mean_backward.default

# (x shape, weight shape, padding, pool, bias, divisor)
CASES = [
    ((2, 8, 8, 16, 16), (16, 8, 3, 3, 3), 0, 2, True, 2.0),          # architecture A, small
    ((2, 8, 6, 10, 12), (16, 8, 3, 3, 3), 1, 2, True, -2.0),         # padding, a negative divisor
    ((1, 8, 7, 10, 20), (16, 8, 3, 3, 3), (1, 2, 0), 2, True, 0.7),  # padding per dimension, inexact divisor
    ((2, 8, 9, 13, 20), (16, 8, 3, 3, 3), 0, 2, True, 2.0),          # conv 7 x 11 x 18: remainders
    ((1, 8, 4, 6, 72), (16, 8, 3, 3, 3), 0, 2, True, 2.0),           # 70 output columns: two tiles
    ((1, 4, 4, 5, 136), (16, 4, 3, 3, 3), 0, 2, True, -2.0),         # 134 output columns: three tiles
    ((2, 8, 6, 10, 16), (5, 8, 3, 3, 3), 0, 2, False, -2.0),         # 5 outputs, no bias
    ((2, 3, 7, 9, 24), (16, 3, 3, 3, 3), 1, 2, True, 0.7),           # 3 channels (a part block), padding
    ((2, 11, 6, 10, 20), (16, 11, 3, 3, 3), 0, 2, True, -2.0),       # two channel blocks, the last part
    ((1, 16, 5, 8, 16), (16, 16, 3, 3, 3), 0, 2, True, 2.0),         # two whole channel blocks
    ((2, 8, 8, 16, 21), (16, 8, 3, 3, 3), 0, 2, True, 2.0),          # rows not 16-byte chunks: PyTorch's ops
    ((1, 8, 6, 8, 16), (17, 8, 3, 3, 3), 0, 2, True, 2.0),           # 17 outputs: PyTorch's ops
    ((2, 8, 8, 16, 16), (16, 8, 2, 3, 3), (0, 1, 1), 2, True, -2.0),  # kernel 2 x 3 x 3: PyTorch's ops
    ((2, 8, 8, 16, 16), (16, 8, 3, 3, 3), 0, (1, 2, 2), True, 2.0),  # pool 1 x 2 x 2: PyTorch's ops
    ((2, 8, 6, 7, 64), (16, 8, 3, 3, 3), 0, 2, True, 2.0),           # SPEC's rows (64): the wgmma kernel, H' odd
    ((1, 8, 5, 10, 64), (16, 8, 3, 3, 3), 0, 2, False, -0.7),        # the wgmma kernel: D' odd, no bias
    # the wgmma kernel's columns of tiles sharing x planes (tiles_of, 132 SMs): 3 tiles a column, one a CTA or
    # two; then segments of 2 plane pairs, the last one's second tile past D' (skipped)
    ((9, 8, 8, 64, 64), (16, 8, 3, 3, 3), 0, 2, True, 2.0),
    ((2, 8, 16, 64, 64), (16, 8, 3, 3, 3), 0, 2, False, -0.7),
]
IDS = ["A-small", "padding-1", "padding-120", "remainders", "two-tiles", "three-tiles", "5-outputs-no-bias",
       "3-channels", "11-channels", "16-channels", "unaligned-rows", "17-outputs", "kernel-233", "pool-122",
       "wgmma", "wgmma-no-bias", "wgmma-columns", "wgmma-segments"]



def _triple(v):
    return [v] * 3 if isinstance(v, int) else list(v)


def composite(x, w, b, padding, pool, divisor):
    """The op's math in PyTorch's ops, on x's device and dtype."""
    return F.max_pool3d(F.conv3d(x, w, b, padding=_triple(padding)) / divisor, _triple(pool)).mean(dim=(2, 3, 4))


def windows(y, pool):
    """y's windows (N, O, D', H', W', volume), each in scan order ((dd * ph + hh) * pw + ww)."""
    (n, o, d, h, w), (pd, ph, pw) = y.shape, pool
    y = y[:, :, :d // pd * pd, :h // ph * ph, :w // pw * pw].reshape(n, o, d // pd, pd, h // ph, ph, w // pw, pw)
    return y.permute(0, 1, 2, 4, 6, 3, 5, 7).reshape(n, o, d // pd, h // ph, w // pw, pd * ph * pw)


def reference_of(x, w, b, padding, pool, divisor):
    """float64 on the CPU from the operands the op convolves (x rounded to the weight's dtype):
    (mean, PyTorch's picks as in-window scan offsets, y's windows, the windows' magnitudes
    conv3d(|x|, |w|, |b|) / |divisor|, M = their largest per (n, o), P = windows per plane)."""
    x, w = x.to(w.dtype).double().cpu(), w.double().cpu()
    b = None if b is None else b.double().cpu()
    padding, pool = _triple(padding), _triple(pool)
    y = F.conv3d(x, w, b, padding=padding) / divisor
    pooled, flat = F.max_pool3d(y, pool, return_indices=True)
    (h, w_), (pd, ph, pw) = y.shape[3:], pool
    od, oh, ow = (torch.arange(s).view(*[-1 if i == j else 1 for j in range(3)]) * p
                  for i, (s, p) in enumerate(zip(pooled.shape[2:], pool)))
    picks = ((flat // (h * w_) - od) * ph + (flat // w_ % h - oh)) * pw + (flat % w_ - ow)
    mags = windows(F.conv3d(x.abs(), w.abs(), None if b is None else b.abs(), padding=padding) / abs(divisor), pool)
    return pooled.mean(dim=(2, 3, 4)), picks, windows(y, pool), mags, mags.amax(dim=(2, 3, 4, 5)), pooled[0, 0].numel()


def within(actual, expected, bound):
    err = (actual.double().cpu() - expected).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(err)
    worst = (err - bound).argmax()
    assert (err <= bound).all(), f"error {err.flatten()[worst]:.3g} against a bound of {bound.flatten()[worst]:.3g}"


def assert_picks_near_max(indices, y_windows, elem_bound):
    """Each saved pick (uint8, in its window) holds a value within twice the elements' error bound
    of its window's float64 maximum: near-ties may pick either, nothing else may."""
    assert indices.dtype == torch.uint8 and indices.shape == y_windows.shape[:-1]
    picked = y_windows.gather(-1, indices.long().cpu().unsqueeze(-1)).squeeze(-1)
    assert (picked >= y_windows.amax(-1) - 2 * elem_bound.amax(-1)).all()


def kernel_ran(call) -> bool:
    """One of the op's tensor-core kernels ran: the mma.sync one, or the wgmma one (wgmma_takes)."""
    return any(kernel in name for name in cuda_kernel_names(call)
               for kernel in ("conv3d_max_pool3d_mean_kernel", "conv3d_wgmma_kernel"))


def wgmma_ran(call) -> bool:
    return any("conv3d_wgmma_kernel" in name for name in cuda_kernel_names(call))


def wgmma_takes(x, w, padding, pool) -> bool:
    """The wgmma kernel's condition (conv3d_max_pool3d_mean.cu's with_wgmma_layout): a build with CUTLASS, an
    sm_90 GPU, SPEC's shape (8 input and 16 output channels, rows 64 wide, D and H at least 4, no padding, a
    2 x 2 x 2 pool), a float32 x, TF32 or bfloat16."""
    precision = w.dtype == torch.bfloat16 or (w.dtype == torch.float32 and torch.backends.cudnn.allow_tf32)
    return (built_with_cutlass() and torch.cuda.get_device_capability(x.device) == (9, 0)
            and x.dtype == torch.float32 and precision and x.shape[1] == 8 and x.shape[-1] == 64
            and min(x.shape[2:4]) >= 4 and tuple(w.shape) == (16, 8, 3, 3, 3) and _triple(padding) == [0, 0, 0]
            and _triple(pool) == [2, 2, 2])


def kernel_takes(x, w, pool) -> bool:
    """The tensor-core kernel's condition for a float32 x."""
    precision = w.dtype in (torch.bfloat16, torch.float16) or (w.dtype == torch.float32
                                                                and torch.backends.cudnn.allow_tf32)
    return (torch.cuda.get_device_capability(x.device) >= (9, 0) and x.dtype == torch.float32 and precision
            and tuple(w.shape[2:]) == (3, 3, 3) and _triple(pool) == [2, 2, 2] and w.shape[0] <= 16
            and w.shape[1] <= 16 and x.shape[-1] % 4 == 0)


def float32_sums(w, pooled_per_plane):
    """Relative (to M) error of float32 arithmetic: k products accumulated, the division, the
    mean's P additions and its division."""
    return (w[0].numel() + 1 + pooled_per_plane + 3) * 2.0 ** -24


def mean_sums(y_windows, pooled_per_plane):
    """The error of a float32 mean of exact values: P additions and a division, relative to the
    largest |y| of the (n, o)'s windows."""
    return (pooled_per_plane + 2) * 2.0 ** -24 * y_windows.abs().amax(dim=(2, 3, 4, 5))


@pytest.mark.parametrize("x_shape,w_shape,padding,pool,bias,divisor", CASES, ids=IDS)
def test_float64_is_pytorchs(x_shape, w_shape, padding, pool, bias, divisor, device):
    """float64: PyTorch's result and picks; the wrapper (int or triple arguments) as the raw op,
    which saves no picks unless asked."""
    x, w, b = make_convolution_case(x_shape, w_shape, bias, torch.float64, device)
    out = conv3d_max_pool3d_mean(x, w, b, padding, pool, divisor)
    assert out.dtype == torch.float64 and out.shape == (x.shape[0], w.shape[0]) and out.device == x.device
    torch.testing.assert_close(out, composite(x, w, b, padding, pool, divisor), rtol=1e-10, atol=1e-12)
    mean, indices = OP(x, w, b, _triple(padding), _triple(pool), divisor, True)
    assert torch.equal(mean, out)
    _, picks, *_ = reference_of(x, w, b, padding, pool, divisor)
    assert indices.dtype == torch.uint8 and torch.equal(indices.long().cpu(), picks)
    empty = OP(x, w, b, _triple(padding), _triple(pool), divisor, False)[1]
    assert empty.numel() == 0 and empty.dtype == torch.uint8


@pytest.mark.parametrize("x_shape,w_shape,padding,pool,bias,divisor", CASES, ids=IDS)
def test_float32_full_precision(x_shape, w_shape, padding, pool, bias, divisor, device):
    """float32 with TF32 off: PyTorch's ops (no tensor-core kernel), within 1e-5 of M."""
    x, w, b = make_convolution_case(x_shape, w_shape, bias, torch.float32, device)
    out, indices = OP(x, w, b, _triple(padding), _triple(pool), divisor, True)
    if device == "cuda":
        assert not kernel_ran(lambda: OP(x, w, b, _triple(padding), _triple(pool), divisor, False))
    expected, _, y_windows, mags, m, _ = reference_of(x, w, b, padding, pool, divisor)
    assert out.dtype == torch.float32
    within(out, expected, 1e-5 * m)
    assert_picks_near_max(indices, y_windows, 1e-5 * mags)


@requires_cuda
@pytest.mark.parametrize("x_shape,w_shape,padding,pool,bias,divisor", CASES, ids=IDS)
def test_float32_tf32_kernel(x_shape, w_shape, padding, pool, bias, divisor, tf32):
    """TF32 allowed: the kernel where it covers the call, within TF32's bound of the float64 result:
    each product's operands rounded to nearest (2^-11 each), float32 sums; the max and the mean
    are 1-Lipschitz, so each (n, o) is within the bound of its windows' largest magnitude."""
    x, w, b = make_convolution_case(x_shape, w_shape, bias, torch.float32, "cuda")
    poison_cuda_allocator()  # (a mean or pick the kernel does not write reads NaN or garbage)
    out, indices = OP(x, w, b, _triple(padding), _triple(pool), divisor, True)
    assert kernel_ran(lambda: OP(x, w, b, _triple(padding), _triple(pool), divisor, True)) == kernel_takes(x, w, pool)
    assert wgmma_ran(lambda: OP(x, w, b, _triple(padding), _triple(pool), divisor, True)) == wgmma_takes(
        x, w, padding, pool)
    expected, _, y_windows, mags, m, p = reference_of(x, w, b, padding, pool, divisor)
    rel = 2.0 ** -10 + float32_sums(w, p)
    within(out, expected, rel * m + 1e-7)
    assert_picks_near_max(indices, y_windows, rel * mags + 1e-7)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x_shape,w_shape,padding,pool,bias,divisor", CASES, ids=IDS)
def test_integer_valued_exact(x_shape, w_shape, padding, pool, bias, divisor, weight_dtype, device, tf32):
    """Integer-valued x, eighths as weights and bias, divisor +-2: y exact in TF32, 16 bits and
    float32, so every path convolves PyTorch's float64 y: the picks exactly PyTorch's (many ties:
    the first maximum in scan order), the mean to its float32 arithmetic."""
    divisor = 2.0 if divisor > 0 else -2.0
    x, w, b = make_convolution_case(x_shape, w_shape, bias, torch.float32, device, integers=True)
    w, b = w.to(weight_dtype), None if b is None else b.to(weight_dtype)
    poison_cuda_allocator()
    out, indices = OP(x, w, b, _triple(padding), _triple(pool), divisor, True, torch.float32)
    if device == "cuda":
        assert kernel_ran(lambda: OP(x, w, b, _triple(padding), _triple(pool), divisor, True)) == kernel_takes(x, w,
                                                                                                                pool)
        assert wgmma_ran(lambda: OP(x, w, b, _triple(padding), _triple(pool), divisor, True)) == wgmma_takes(
            x, w, padding, pool)
    expected, picks, y_windows, _, _, p = reference_of(x, w, b, padding, pool, divisor)
    assert y_windows.abs().max() < 16  # (|conv| < 32 in eighths: exact in bfloat16 too)
    within(out, expected, mean_sums(y_windows, p))
    assert torch.equal(indices.long().cpu(), picks)
    # without the picks (the wgmma kernel's other epilogue): the same exact sums (eighths, far below 2^24)
    assert torch.equal(OP(x, w, b, _triple(padding), _triple(pool), divisor, False, torch.float32)[0], out)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [16, 64])
@pytest.mark.parametrize("divisor", [2.0, -2.0])
def test_nan_and_inf_as_pytorch(divisor, width, weight_dtype, device, tf32):
    """Integer data, positive weights: a NaN in an item's input makes its means NaN, the windows
    holding NaNs pick their last NaN; +-inf give +-inf maxima (a window of -inf picks its first).
    (Rows 64 wide: the wgmma kernel, where it takes the call; in bf16 its steps' zero-weight chunk
    must meet zeros, not x's inf: 0 x inf would make a NaN.)"""
    x, w, b = make_convolution_case((4, 8, 6, 10, width), (16, 8, 3, 3, 3), True, torch.float32, device,
                                    integers=True)
    w = w.abs() + 0.125  # (one sign, no zeros: an infinite input gives infinite outputs, not inf - inf or 0 * inf)
    w, b = w.to(weight_dtype), b.to(weight_dtype)
    x[1, 3, 2, 4, 7] = x[1, 5, 3, 4, 8] = float("nan")
    x[2, 0, 3, 5, 5] = float("inf")
    x[3, 7, 2, 2, 9] = float("-inf")
    out, indices = OP(x, w, b, [0, 0, 0], [2, 2, 2], divisor, True, torch.float32)
    if device == "cuda":
        assert kernel_ran(lambda: OP(x, w, b, [0, 0, 0], [2, 2, 2], divisor, True))
        assert wgmma_ran(lambda: OP(x, w, b, [0, 0, 0], [2, 2, 2], divisor, True)) == wgmma_takes(x, w, 0, 2)
    # (without the picks: the same means, NaNs where they are)
    torch.testing.assert_close(OP(x, w, b, [0, 0, 0], [2, 2, 2], divisor, False, torch.float32)[0], out, rtol=0,
                               atol=0, equal_nan=True)
    expected, picks, y_windows, _, _, p = reference_of(x, w, b, 0, 2, divisor)
    assert out[1].isnan().all() and not out[[0, 2, 3]].isnan().any()
    assert expected[2:].isinf().all() and torch.equal(out[2:].cpu().double(), expected[2:])
    within(out[:1], expected[:1], mean_sums(y_windows[:1], p))
    assert torch.equal(indices.long().cpu(), picks)


@requires_cuda
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width,padding", [(16, [1, 0, 1]), (72, [1, 0, 1]), (64, [0, 0, 0])])
def test_deterministic_and_strided(width, padding, weight_dtype, tf32):
    """Repeated calls bit for bit; the mean the same with or without saved picks (the wgmma kernel's
    epilogue without them takes each window's maximum, not its pick); a channels-last or sliced x
    gives the contiguous x's result. (Rows 64 wide, no padding: the wgmma kernel, where it takes the
    call.)"""
    x, w, b = make_convolution_case((2, 8, 8, 12, width), (16, 8, 3, 3, 3), True, torch.float32, "cuda")
    w, b = w.to(weight_dtype), b.to(weight_dtype)
    out, indices = OP(x, w, b, padding, [2, 2, 2], -2.0, True)
    assert kernel_ran(lambda: OP(x, w, b, padding, [2, 2, 2], -2.0, True))
    assert wgmma_ran(lambda: OP(x, w, b, padding, [2, 2, 2], -2.0, False)) == wgmma_takes(x, w, padding, 2)
    for _ in range(3):
        again, again_indices = OP(x, w, b, padding, [2, 2, 2], -2.0, True)
        assert torch.equal(again, out) and torch.equal(again_indices, indices)
    assert torch.equal(OP(x, w, b, padding, [2, 2, 2], -2.0, False)[0], out)
    wide = torch.zeros(2, 8, 8, 12, width + 8, device="cuda")
    wide[..., 4:4 + width] = x
    for strided in (x.contiguous(memory_format=torch.channels_last_3d), wide[..., 4:4 + width]):
        assert kernel_ran(lambda: OP(strided, w, b, padding, [2, 2, 2], -2.0, True))
        mean, picks = OP(strided, w, b, padding, [2, 2, 2], -2.0, True)
        assert torch.equal(mean, out) and torch.equal(picks, indices)


# (a process of its own: the library reads FUSED_OPS_CONV3D_WGMMA once)
WITHOUT_WGMMA = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from conftest import cuda_kernel_names, make_convolution_case
OP = torch.ops.fused_ops.conv3d_max_pool3d_mean.default
x, w, b = make_convolution_case((2, 8, 6, 7, 64), (16, 8, 3, 3, 3), True, torch.float32, "cuda", integers=True)
names = cuda_kernel_names(lambda: OP(x, w, b, [0, 0, 0], [2, 2, 2], -2.0, True))
assert any("conv3d_max_pool3d_mean_kernel" in n for n in names) and not any("wgmma" in n for n in names), names
torch.save([t.cpu() for t in OP(x, w, b, [0, 0, 0], [2, 2, 2], -2.0, True)], sys.argv[2])
"""


@requires_cuda
def test_wgmma_switched_off(tmp_path, tf32):
    """FUSED_OPS_CONV3D_WGMMA=0 keeps SPEC's rows on the mma.sync kernel: integer-valued data, exact in
    both, gives the wgmma kernel's means and picks bit for bit."""
    if not wgmma_takes(torch.empty(2, 8, 6, 7, 64, device="cuda"), torch.empty(16, 8, 3, 3, 3), 0, 2):
        pytest.skip("the wgmma kernel does not run here (a build without CUTLASS, or not an sm_90 GPU)")
    saved = tmp_path / "without_wgmma.pt"
    done = subprocess.run([sys.executable, "-c", WITHOUT_WGMMA, os.path.dirname(__file__), str(saved)],
                          capture_output=True, text=True, env={**os.environ, "FUSED_OPS_CONV3D_WGMMA": "0"})
    assert done.returncode == 0, done.stderr[-2000:]
    x, w, b = make_convolution_case((2, 8, 6, 7, 64), (16, 8, 3, 3, 3), True, torch.float32, "cuda", integers=True)
    assert wgmma_ran(lambda: OP(x, w, b, [0, 0, 0], [2, 2, 2], -2.0, True))
    for got, want in zip(OP(x, w, b, [0, 0, 0], [2, 2, 2], -2.0, True), torch.load(saved)):
        assert torch.equal(got.cpu(), want)


def test_gradcheck(device):
    """(cuDNN's deterministic algorithms: gradcheck checks that repeated backwards agree bit for bit)"""
    cudnn = torch.backends.cudnn
    for padding, pool, divisor in [(0, 2, 2.0), ((1, 0, 1), (2, 1, 2), -0.7)]:
        x, w, b = make_convolution_case((2, 3, 5, 6, 7), (2, 3, 3, 3, 3), True, torch.float64, device)
        inputs = [t.requires_grad_() for t in (x, w, b)]
        with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=True, allow_tf32=False):
            assert torch.autograd.gradcheck(lambda x, w, b: conv3d_max_pool3d_mean(x, w, b, padding, pool, divisor),
                                            inputs)


@pytest.mark.parametrize("w_shape,padding,pool,divisor", [((4, 3, 3, 3, 3), (1, 2, 0), 2, -2.0),
                                                          ((3, 3, 2, 3, 3), 0, (1, 2, 3), 0.7)],
                         ids=["padding", "uncompiled-shape"])
def test_backward_is_autograds(w_shape, padding, pool, divisor, device):
    """float64: the backward op from the saved picks gives autograd's gradients of the composite for
    x, the weight and the bias (windows leaving a remainder); masked gradients empty."""
    x, w, b = make_convolution_case((2, 3, 7, 9, 11), w_shape, True, torch.float64, device)
    _, indices = OP(x, w, b, _triple(padding), _triple(pool), divisor, True)
    grad_mean = torch.rand(2, w_shape[0], dtype=torch.float64, device=device) - 0.5
    actual = BACKWARD(grad_mean, indices, x, w, _triple(padding), _triple(pool), divisor, [True, True, True, False])
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    composite(*leaves, padding, pool, divisor).backward(grad_mean)
    for a, leaf in zip(actual, leaves):
        torch.testing.assert_close(a, leaf.grad, rtol=1e-10, atol=1e-12)
    assert actual[3].numel() == 0
    only_weight = BACKWARD(grad_mean, indices, x, w, _triple(padding), _triple(pool), divisor,
                           [False, True, False, False])
    assert only_weight[0].numel() == only_weight[2].numel() == 0 and torch.equal(only_weight[1], actual[1])


def test_opcheck(device):
    x, w, b = make_convolution_case((2, 3, 6, 7, 8), (4, 3, 3, 3, 3), True, torch.float32, device)
    grad = [t.clone().requires_grad_() for t in (x, w, b)]
    torch.library.opcheck(OP, (x, w, b, [0, 0, 0], [2, 2, 2], 2.0, False))
    torch.library.opcheck(OP, (*grad, [0, 0, 0], [2, 2, 2], 2.0, True))
    torch.library.opcheck(OP, (*[t.double().detach().requires_grad_() for t in (x, w, b)], [1, 0, 1], [2, 1, 2],
                               -0.7, True))
    torch.library.opcheck(OP, (x, w, None, [1, 1, 1], [2, 2, 2], 2.0, True, torch.float32))
    torch.library.opcheck(OP, (grad[0], w.bfloat16().requires_grad_(), b.bfloat16(), [0, 0, 0], [2, 2, 2], -2.0, True))
    torch.library.opcheck(OP, (x, w.half(), b.half(), [0, 0, 0], [2, 2, 2], 2.0, False, torch.float32))
    torch.library.opcheck(OP, (*grad, [0, 0, 0], [2, 2, 2], -2.0, True), dict(operand_dtype=torch.bfloat16))


@pytest.mark.parametrize("mask", [(True, True, True, False), (False, True, False, False), (True, False, False, True),
                                  (False, False, True, True), (False, False, False, True)])
def test_backward_opcheck(mask, device):
    x, w, b = make_convolution_case((2, 3, 6, 7, 8), (4, 3, 3, 3, 3), True, torch.float32, device)
    grad_mean = torch.rand(2, 4, device=device)
    for padding, pool, dtype in [([0, 0, 0], [2, 2, 2], torch.float32), ([1, 0, 1], [2, 1, 2], torch.float64)]:
        xt, wt, bt = (t.to(dtype) for t in (x, w, b))
        _, indices = OP(xt, wt, bt, padding, pool, -2.0, True)
        torch.library.opcheck(BACKWARD, (grad_mean.to(dtype), indices, xt, wt, padding, pool, -2.0, list(mask)))
        torch.library.opcheck(BACKWARD, (grad_mean.to(dtype)[:, :1].expand(2, 4), indices, xt, wt, padding, pool,
                                         -2.0, list(mask), torch.bfloat16))
    _, indices = OP(x, w, b, [0, 0, 0], [2, 2, 2], -2.0, True, None, None, False, torch.float16)
    torch.library.opcheck(BACKWARD, (grad_mean, indices, x, w, [0, 0, 0], [2, 2, 2], -2.0, list(mask), None,
                                     torch.float16))


# (x shape, weight shape, padding, divisor): A's kernel case (on a GPU), and PyTorch's ops (17 outputs)
CHANNEL_BIAS_CASES = [((3, 8, 6, 10, 16), (16, 8, 3, 3, 3), (1, 0, 1), -2.0),
                      ((2, 3, 5, 6, 7), (17, 3, 3, 3, 3), 0, 0.7)]


@pytest.mark.parametrize("x_shape,w_shape,padding,divisor", CHANNEL_BIAS_CASES, ids=["kernel", "composite"])
@pytest.mark.parametrize("weight_dtype,bias_dtype,out_dtype", [
    (torch.float32, torch.float32, torch.float32), (torch.float64, torch.float64, torch.float64),
    (torch.bfloat16, torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.bfloat16, torch.float32), (torch.float32, torch.float64, torch.float64)])
def test_channel_bias_and_sum(x_shape, w_shape, padding, divisor, weight_dtype, bias_dtype, out_dtype, device,
                              tf32):
    """With a channel bias and sum_channels, the op's result is its mean plus the bias (the same
    addition, in the promoted dtype: equal) summed over the channels (float32 sums: within their
    rounding), without sum_channels (B, O); the mean's kernel runs with them where it runs without."""
    x, w, b = make_convolution_case(x_shape, w_shape, True, torch.float32, device)
    x = x.double() if weight_dtype == torch.float64 else x
    w, b = w.to(weight_dtype), b.to(weight_dtype)
    cb = (torch.rand(w.shape[0], generator=torch.Generator().manual_seed(1), dtype=torch.float64) - 0.5).to(
        device, bias_dtype)
    args = (x, w, b, _triple(padding), [2, 2, 2], divisor, False)
    mean, _ = OP(*args)
    biased, _ = OP(*args, None, cb, False)
    summed, _ = OP(*args, None, cb, True)
    plain_sum, _ = OP(*args, None, None, True)
    assert biased.dtype == summed.dtype == out_dtype and plain_sum.dtype == mean.dtype
    assert biased.shape == mean.shape and summed.shape == plain_sum.shape == (x.shape[0],)
    assert torch.equal(biased, mean + cb)
    for total, terms in [(summed, biased), (plain_sum, mean)]:
        u = 2.0 ** -53 if total.dtype == torch.float64 else 2.0 ** -24
        last = 0.0 if total.dtype in (torch.float32, torch.float64) else 2.0 ** -8  # (a 16-bit sum's rounding)
        expected = terms.double().sum(1).cpu()
        within(total, expected, w.shape[0] * u * terms.double().abs().sum(1).cpu() + last * expected.abs())
    if device == "cuda":
        assert kernel_ran(lambda: OP(*args, None, cb, True)) == kernel_takes(x, w, 2)


@pytest.mark.parametrize("x_shape,w_shape,padding,divisor", CHANNEL_BIAS_CASES, ids=["kernel", "composite"])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_channel_bias_and_sum_backward(x_shape, w_shape, padding, divisor, weight_dtype, bias, device, tf32):
    """The gradients through the channel bias and the sum: those of x, the weight and the bias equal the
    op's own (no channel bias) given grad_mean[n, o] = grad_out[n] rounded to the mean's dtype, as
    autograd gives them through `(mean + b).sum(1)` (the weight-gradient kernel reads it expanded: the
    same values); the channel bias's is the sum over n of grad_out (within its float32 rounding). Also
    with the channel bias alone requiring grad (the forward then saves no picks), and without the
    convolution's bias (autograd then counts the channel bias third among the tensors)."""
    x, w, b = make_convolution_case(x_shape, w_shape, True, torch.float32, device)
    w, b = w.to(weight_dtype), b.to(weight_dtype) if bias else None
    cb = torch.rand(w.shape[0], device=device) - 0.5
    grad_out = torch.rand(x.shape[0], device=device) - 0.5
    leaves = [None if t is None else t.clone().requires_grad_() for t in (x, w, b, cb)]
    out = conv3d_max_pool3d_mean(*leaves[:3], _triple(padding), 2, divisor, channel_bias=leaves[3], sum_channels=True)
    out.backward(grad_out)
    ref = [None if t is None else t.clone().requires_grad_() for t in (x, w, b, cb)]
    (conv3d_max_pool3d_mean(*ref[:3], _triple(padding), 2, divisor) + ref[3]).sum(1).backward(grad_out)
    for leaf, expected in zip(leaves[:3], ref[:3]):
        assert leaf is None or torch.equal(leaf.grad, expected.grad)
    only = cb.clone().requires_grad_()
    conv3d_max_pool3d_mean(x, w, b, _triple(padding), 2, divisor, channel_bias=only, sum_channels=True).backward(
        grad_out)
    for grad in (leaves[3].grad, only.grad):
        within(grad, grad_out.double().sum().cpu(), x.shape[0] * 2.0 ** -24 * grad_out.abs().sum().item())


def test_channel_bias_gradcheck(device):
    """gradcheck and gradgradcheck (a backward that records a graph recomputes the forward with the
    bias and the sum) in float64, with and without the sum, the mean in its accumulation type."""
    cudnn = torch.backends.cudnn
    x, w, b = make_convolution_case((2, 3, 5, 6, 7), (2, 3, 3, 3, 3), True, torch.float64, device)
    cb = torch.rand(2, dtype=torch.float64, device=device)
    inputs = [t.requires_grad_() for t in (x, w, b, cb)]
    with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=True, allow_tf32=False):
        for sum_channels in (True, False):
            def f(x, w, b, cb):
                return conv3d_max_pool3d_mean(x, w, b, (1, 0, 1), (2, 1, 2), -0.7, channel_bias=cb,
                                              sum_channels=sum_channels)
            assert torch.autograd.gradcheck(f, inputs)
            assert torch.autograd.gradgradcheck(f, inputs)


def test_channel_bias_opcheck(device):
    x, w, b = make_convolution_case((2, 3, 6, 7, 8), (4, 3, 3, 3, 3), True, torch.float32, device)
    cb = torch.rand(4, device=device)
    grad = [t.clone().requires_grad_() for t in (x, w, b, cb)]
    torch.library.opcheck(OP, (x, w, b, [0, 0, 0], [2, 2, 2], 2.0, False, None, cb, True))
    torch.library.opcheck(OP, (*grad[:3], [0, 0, 0], [2, 2, 2], 2.0, True, None, grad[3], True))
    torch.library.opcheck(OP, (x, w, b, [1, 0, 1], [2, 1, 2], -0.7, False, None, grad[3], False))
    torch.library.opcheck(OP, (x, *[t.bfloat16().requires_grad_() for t in (w, b)], [0, 0, 0], [2, 2, 2], 2.0, True,
                               None, grad[3], True))


@pytest.mark.parametrize("channel_bias,match", [
    (lambda cb: cb[:3], "channel_bias must have shape"),
    (lambda cb: cb.view(4, 1), "channel_bias must have shape"),
    (lambda cb: cb.int(), "channel_bias must be a floating-point tensor"),
])
def test_bad_channel_bias_named(channel_bias, match, device):
    x, w, b = make_convolution_case((2, 3, 6, 7, 8), (4, 3, 3, 3, 3), True, torch.float32, device)
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        conv3d_max_pool3d_mean(x, w, b, channel_bias=channel_bias(torch.rand(4, device=device)), sum_channels=True)


def test_backward_needs_the_saved_indices(device):
    """The op called without save_indices (its wrapper sets it where a gradient is needed) cannot be
    differentiated: the backward says so; the backward op refuses other picks."""
    x, w, b = make_convolution_case((2, 3, 6, 7, 8), (4, 3, 3, 3, 3), True, torch.float32, device)
    out, indices = OP(x, w.clone().requires_grad_(), b, [0, 0, 0], [2, 2, 2], 2.0, False)
    with pytest.raises(RuntimeError, match="save_indices=True"):
        out.sum().backward()
    grad_mean = torch.ones(2, 4, device=device)
    for bad, match in [((grad_mean, indices), "save_indices=True"),
                       ((grad_mean[:1], OP(x, w, b, [0, 0, 0], [2, 2, 2], 2.0, True)[1]), "grad_mean must have shape")]:
        with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
            BACKWARD(*bad, x, w, [0, 0, 0], [2, 2, 2], 2.0, [True, True, True, True])


def test_backward_refuses_picks_past_their_window():
    """On the CPU a saved pick past its 2 x 2 x 2 window (8 elements) is refused, not followed."""
    x, w, b = make_convolution_case((2, 3, 6, 7, 8), (4, 3, 3, 3, 3), True, torch.float32, "cpu")
    _, indices = OP(x, w, b, [0, 0, 0], [2, 2, 2], 2.0, True)
    indices.view(-1)[3] = 8
    with pytest.raises(ValueError, match="must each name an element of its window of 8, as the forward's do, got 8"):
        BACKWARD(torch.ones(2, 4), indices, x, w, [0, 0, 0], [2, 2, 2], 2.0, [True, True, True, False])


def routed_gradients(x, w, indices, grad_mean, padding, pool, divisor):
    """float64 on the CPU: the gradients of x and the weight through PyTorch's convolution from grad_y =
    grad_mean[n, o] / P / divisor at each window's saved pick (its scan offset), none from a pick past its
    window (a byte of the pool's volume or more)."""
    x64, w64 = (t.double().cpu().requires_grad_() for t in (x, w))
    y = F.conv3d(x64, w64, padding=padding)
    picks = indices.long().cpu()
    (n, o, pd, ph, pw), (kd, kh, kw) = picks.shape, pool
    g = grad_mean.double().cpu() / picks[0, 0].numel() / divisor
    at_pick = (picks[..., None] == torch.arange(kd * kh * kw)) * g[:, :, None, None, None, None]
    grad_y = torch.zeros_like(y)
    grad_y[:, :, :pd * kd, :ph * kh, :pw * kw] = (at_pick.view(n, o, pd, ph, pw, kd, kh, kw)
                                                  .permute(0, 1, 2, 5, 3, 6, 4, 7).reshape(n, o, pd * kd, ph * kh,
                                                                                           pw * kw))
    return torch.autograd.grad(y, (x64, w64), grad_y)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_backward_drops_picks_past_their_window(dtype, tf32):
    """On a GPU a saved pick past its 2 x 2 x 2 window (8, or 255: at the first, a middle and the last window)
    adds nothing, without an error (refusing it would wait for the device): the weight's gradient (float32: the
    weight-gradient kernel, where it takes the call) and x's (float64: max_pool3d_mean's backward, then
    PyTorch's) are those of grad_y routed from the other windows' picks; exactly in float32 (integer-valued data,
    dyadic grad_mean / P / divisor), to float64's rounding of the convolution's sums. (The bias's gradient on
    Hopper, P times the sum of the windows' gradients, reads no picks: not compared.)"""
    x, w, b = make_convolution_case((2, 11, 7, 11, 20), (16, 11, 3, 3, 3), True, dtype, "cuda", integers=True)
    padding, pool, divisor = [1, 0, 1], [2, 2, 2], -2.0
    _, indices = OP(x, w, b, padding, pool, divisor, True)
    grad_mean = (torch.randint(-8, 9, (2, 16), device="cuda") / 4).to(dtype) * indices[0, 0].numel()
    n = indices.numel()
    indices.view(-1)[[0, n // 2, n - 1]] = torch.tensor([8, 255, 8], dtype=torch.uint8, device="cuda")
    args = (padding, pool, divisor, [dtype == torch.float64, True, False, False])
    grad_x, grad_w, _, _ = BACKWARD(grad_mean, indices, x, w, *args)
    expected_x, expected_w = routed_gradients(x, w, indices, grad_mean, padding, pool, divisor)
    if dtype == torch.float32:
        assert weight_grad_kernel_ran(lambda: BACKWARD(grad_mean, indices, x, w, *args)) == kernel_takes(x, w, pool)
        assert torch.equal(grad_w.double().cpu(), expected_w)
    else:
        torch.testing.assert_close(grad_x.cpu(), expected_x, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(grad_w.cpu(), expected_w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_weights(dtype, device):
    """A 16-bit weight and bias with a float32 or 16-bit x: the convolution of x rounded to the
    weight's dtype, the result in that dtype (or float32 asked for), within a few 16-bit roundings
    (y, y / divisor, the result: unit roundoff u each) and float32 sums of the float64 result on the
    rounded operands; x's gradient float32, the weight's and bias's 16-bit."""
    x, w, b = make_convolution_case((2, 8, 8, 16, 16), (16, 8, 3, 3, 3), True, torch.float32, device)
    w, b = w.to(dtype), b.to(dtype)
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    for xin in (x, x.to(dtype)):
        out = conv3d_max_pool3d_mean(xin, w, b, 1, 2, -2.0)
        out32 = conv3d_max_pool3d_mean(xin, w, b, 1, 2, -2.0, dtype=torch.float32)
        assert out.dtype == dtype and out32.dtype == torch.float32
        expected, _, _, _, m, p = reference_of(xin, w, b, 1, 2, -2.0)
        within(out32, expected, (2 * u + float32_sums(w, p)) * m)
        within(out, expected, (3 * u + float32_sums(w, p)) * m)
    if device == "cuda":
        assert kernel_ran(lambda: conv3d_max_pool3d_mean(x, w, b, 1, 2, -2.0))
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    conv3d_max_pool3d_mean(*leaves, 1, 2, -2.0, dtype=torch.float32).sum().backward()
    assert [t.grad.dtype for t in leaves] == [torch.float32, dtype, dtype]


OPERAND_CASES = [CASES[IDS.index(name)] for name in ("A-small", "5-outputs-no-bias", "3-channels", "unaligned-rows")]


@pytest.mark.parametrize("operand_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x_shape,w_shape,padding,pool,bias,divisor", OPERAND_CASES,
                         ids=["A-small", "no-bias", "3-channels", "unaligned-rows"])
def test_operand_dtype_is_the_casts(x_shape, w_shape, padding, pool, bias, divisor, operand_dtype, device):
    """operand_dtype T with a float32 weight and bias (what the op's autocast rule passes) computes what the
    weight and bias cast to T compute, bit for bit: the result, and the gradients of x, the weight, the bias and
    a channel bias (the weight's and bias's rounded to T, in float32, as autograd casts them back through the
    casts); the result's dtype T where dtype is None; on a GPU by the tensor-core kernel."""
    x, w, b = make_convolution_case(x_shape, w_shape, bias, torch.float32, device)
    cb = torch.rand(w_shape[0], device=device)
    leaves = [t.clone().requires_grad_() for t in (x, w, b, cb) if t is not None]
    cast = [t.clone().requires_grad_() for t in (x, w, b, cb) if t is not None]
    bias_of = (lambda ts: ts[2]) if bias else (lambda ts: None)
    kwargs = dict(dtype=torch.float32, channel_bias=cast[-1], sum_channels=True)
    expected = conv3d_max_pool3d_mean(cast[0], cast[1].to(operand_dtype), None if not bias else
                                      bias_of(cast).to(operand_dtype), padding, pool, divisor, **kwargs)
    kwargs["channel_bias"] = leaves[-1]
    out = conv3d_max_pool3d_mean(leaves[0], leaves[1], bias_of(leaves), padding, pool, divisor,
                                 operand_dtype=operand_dtype, **kwargs)
    assert out.dtype == torch.float32 and torch.equal(out, expected)
    grad = torch.rand_like(out)
    for g, e in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(expected, cast, grad), strict=True):
        assert g.dtype == e.dtype == torch.float32 and torch.equal(g, e)
    assert conv3d_max_pool3d_mean(x, w, b, padding, pool, divisor, operand_dtype=operand_dtype).dtype == operand_dtype
    if device == "cuda" and kernel_takes(x, w.to(operand_dtype), pool):
        assert kernel_ran(lambda: conv3d_max_pool3d_mean(x, w, b, padding, pool, divisor,
                                                         operand_dtype=operand_dtype))
        assert weight_grad_kernel_ran(lambda: torch.autograd.grad(
            conv3d_max_pool3d_mean(x, leaves[1], b, padding, pool, divisor, operand_dtype=operand_dtype).sum(),
            leaves[1]))


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_autocast_keeps_an_explicit_operand_dtype(autocast_dtype, device):
    """Under autocast a call without operand_dtype computes what operand_dtype = autocast's dtype computes (the
    float32 weight and bias uncast); an explicit operand_dtype is the caller's, as an explicit dtype is: the
    operands as given (a 16-bit weight of the other 16-bit dtype with it; float32 ones with float32), the result
    that of the same call without autocast (its dtype autocast's rule's: float32, as PyTorch's max_pool3d gives
    under either autocast: CUDA's sum, CPU's max-pool in float32)."""
    x_shape, w_shape, padding, pool, bias, divisor = CASES[IDS.index("A-small")]
    x, w, b = make_convolution_case(x_shape, w_shape, bias, torch.float32, device)
    other = torch.float16 if autocast_dtype == torch.bfloat16 else torch.bfloat16
    calls = {autocast_dtype: (w, b), other: (w.to(other), b.to(other)), torch.float32: (w, b)}
    for operand_dtype, (weight, weight_bias) in calls.items():
        explicit = operand_dtype != autocast_dtype
        with torch.autocast(device, dtype=autocast_dtype):
            out = conv3d_max_pool3d_mean(x, weight, weight_bias, padding, pool, divisor,
                                         operand_dtype=operand_dtype if explicit else None)
        assert out.dtype == torch.float32
        expected = conv3d_max_pool3d_mean(x, weight, weight_bias, padding, pool, divisor, dtype=out.dtype,
                                          operand_dtype=operand_dtype)
        assert torch.equal(out, expected), operand_dtype


@pytest.mark.parametrize("args,match", [
    (lambda x, w, b: ((x, w, b), dict(operand_dtype=torch.float64)), "operand_dtype must be"),
    (lambda x, w, b: ((x, w.bfloat16(), b.bfloat16()), dict(operand_dtype=torch.float16)), "operand_dtype must be"),
    (lambda x, w, b: ((x[0], w, b), {}), "5-D input"),
    (lambda x, w, b: ((x, w[0], b), {}), "5-D weight"),
    (lambda x, w, b: ((x.int(), w, b), {}), "floating-point"),
    (lambda x, w, b: ((x, w.double(), b), {}), "must have the input's dtype"),
    (lambda x, w, b: ((x.half(), w.bfloat16(), b.bfloat16()), {}), "must have the input's dtype"),
    (lambda x, w, b: ((x, w.bfloat16(), b), {}), "bias .* must have the weight's dtype"),
    (lambda x, w, b: ((x, w[:, :2], b), {}), "3 channels, the weight expects 2"),
    (lambda x, w, b: ((x, w, b[:2]), {}), "bias must have shape"),
    (lambda x, w, b: ((x, w, b), dict(divisor=0.0)), "divisor must be non-zero"),
    # (every dimension's output size in the message, the first's failing: x 6 x 7 x 8, kernel 3)
    (lambda x, w, b: ((x, w, b), dict(pool=(5, 2, 2))), r"pool \[5, 2, 2\] is larger than the convolution's "
     r"output \(4 x 5 x 6\)"),
    (lambda x, w, b: ((x, w, b), dict(pool=(2, 0, 2))), "pool must be positive"),
    (lambda x, w, b: ((x, w, b), dict(padding=(0, -1, 0))), "padding must be non-negative"),
    (lambda x, w, b: ((x[..., :2], w, b), {}), "smaller than the kernel"),
    (lambda x, w, b: ((x, w, b), dict(dtype=torch.float64)), "dtype must be"),
])
def test_bad_input_named(args, match, device):
    x, w, b = make_convolution_case((2, 3, 6, 7, 8), (4, 3, 3, 3, 3), True, torch.float32, device)
    positional, keywords = args(x, w, b)
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        conv3d_max_pool3d_mean(*positional, **keywords)


A_ARGS = [(8, 16, 3, 2.0, 2, (16, 1, 1, 1), 1), (3, 5, 3, -0.7, (2, 1, 2), (5, 1, 1, 1), 1)]


@pytest.mark.parametrize("args", A_ARGS, ids=["A", "3-to-5-pool212"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_module_fused_conv_float64(args, train, device):
    """Architecture A forced to ``fused_conv`` in float64: the original's output and the gradients
    of its input and parameters."""
    original, fused = build_pair("Conv3dDivMaxPoolGAPBiasSum", args)
    original.to(device, torch.float64).train(train)
    fused.to(device, torch.float64).train(train)
    x = torch.rand(2, args[0], 7, 10, 11, dtype=torch.float64, device=device)
    with autotune.force("fused_conv"):
        check_matches_original(original, fused, x, torch.float64)
    assert autotune.last_formulation() == "fused_conv"


@pytest.mark.parametrize("mode", ["eval", "no_grad", "train"])
def test_module_fused_conv_float32_exact(mode, device, tf32):
    """Architecture A forced to ``fused_conv`` in float32 (TF32 on: the kernel on a GPU) with
    integer-valued input and parameters in eighths, 32 windows (rows of whole 16-byte chunks: the
    kernel takes them): every value and sum dyadic and exact, so the output and (in training)
    every gradient equal the float64 original's."""
    original = reference.Conv3dDivMaxPoolGAPBiasSum(8, 16, 3, 2.0, 2, (16, 1, 1, 1), 1).to(device)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p, high in zip((original.conv.weight, original.conv.bias, original.bias), (2, 5, 5)):
            p.copy_(torch.randint(-high + 1, high, p.shape, generator=g) / 8)
    original.train(mode == "train")
    fused = fnn.Conv3dDivMaxPoolGAPBiasSum.from_module(original)
    x = torch.randint(-2, 3, (2, 8, 10, 18, 4), generator=g).float().to(device).requires_grad_(mode == "train")
    with torch.set_grad_enabled(mode != "no_grad"), autotune.force("fused_conv"):
        out = fused(x)
        if device == "cuda":
            assert kernel_ran(lambda: fused(x))
    assert autotune.last_formulation() == "fused_conv"
    exact = copy.deepcopy(original).double()
    x64 = x.detach().double().requires_grad_()
    expected = exact(x64)
    assert out.dtype == torch.float32 and torch.equal(out.double(), expected)
    if mode == "train":
        grad = torch.tensor([1.0, -3.0], device=device).view(2, 1, 1, 1)
        out.backward(grad)
        expected.backward(grad.double())
        assert torch.equal(x.grad.double(), x64.grad)
        for (name, p), q in zip(fused.named_parameters(), exact.parameters()):
            assert torch.equal(p.grad.double(), q.grad), name


@requires_cuda
@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["float32", "autocast-bf16"])
def test_module_training_step_launches_only_the_librarys_kernels(autocast, tf32):
    """A's training step on ``fused_conv`` (the bias (O, 1, 1, 1) and the sum over channels, as SPEC's):
    its bias and sum in the op (the forward's epilogue kernel adds them, the backward's mean-gradient
    kernel forms their gradients), so the step launches the library's kernels only: no PyTorch add,
    sum or copy (host time every step, and a module load each at a process's first step), under
    autocast no cast of the weight or bias nor of their gradients (operand_dtype); the output and
    the gradients those of the module's ops without them (the bias of shape (1, O, 1, 1, 1))."""
    original = reference.Conv3dDivMaxPoolGAPBiasSum(8, 16, 3, 2.0, 2, (16, 1, 1, 1), 1)
    fused = fnn.Conv3dDivMaxPoolGAPBiasSum.from_module(original).cuda()
    x = torch.rand(4, 8, 8, 16, 16, device="cuda")
    params = list(fused.parameters())
    grad = torch.rand(4, 1, 1, 1, device="cuda")

    def step():
        with autotune.force("fused_conv"), torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
            out = fused(x)
        return out, torch.autograd.grad(out, params, grad)

    names = cuda_kernel_names(step)
    assert any("mean_epilogue_kernel" in name for name in names) and weight_grad_kernel_ran(step)
    assert all("fused_ops" in name for name in names), names
    out, grads = step()
    unfused = copy.deepcopy(fused)  # (a bias the op does not take: the module's add and sum)
    unfused.bias = torch.nn.Parameter(fused.bias.detach().view(1, 16, 1, 1, 1).clone())
    with autotune.force("fused_conv"), torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
        expected = unfused(x)
    expected_grads = torch.autograd.grad(expected, list(unfused.parameters()), grad)
    assert autotune.last_formulation() == "fused_conv"
    torch.testing.assert_close(out, expected)  # (float32 sums in another order)
    for (name, _), g, e in zip(fused.named_parameters(), grads, expected_grads):
        if name == "bias":
            torch.testing.assert_close(g, e.view_as(g))
        else:  # (the convolution's: equal)
            assert torch.equal(g, e), name


def weight_grad_kernel_ran(call) -> bool:
    return any("conv3d_max_pool3d_mean_weight_grad_kernel" in name for name in cuda_kernel_names(call))


# (the weight-gradient kernel's blocks each take several tasks of two channel blocks: 360 tasks on up to 180 SMs,
# a channel block's sums between its items)
WEIGHT_GRAD_CASES = CASES + [((4, 11, 12, 72, 20), (16, 11, 3, 3, 3), 0, 2, True, -0.7)]
WEIGHT_GRAD_IDS = IDS + ["two-channel-blocks-many-tasks"]


@requires_cuda
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x_shape,w_shape,padding,pool,bias,divisor", WEIGHT_GRAD_CASES, ids=WEIGHT_GRAD_IDS)
def test_weight_grad_kernel(x_shape, w_shape, padding, pool, bias, divisor, weight_dtype, tf32):
    """The backward's weight and bias gradients from the forward's picks, where the weight-gradient
    kernel runs (exactly where the forward's does: TF32, or m16n8k16 for a 16-bit weight) and elsewhere,
    against float64 on the same picks (the CPU op's: routing and PyTorch's convolution backward): within
    TF32's rounding of x and of g (and, for a 16-bit weight, 16-bit rounding of g and of the result;
    float16's g also within half its smallest subnormal, 2^-25, where it underflows) times the float64
    sums of the terms' magnitudes (the same op on |grad_mean| and |x|); bit-identical on a second call."""
    x, w, b = make_convolution_case(x_shape, w_shape, True, torch.float32, "cuda")
    w, b = w.to(weight_dtype), b.to(weight_dtype)
    _, indices = OP(x, w, b, _triple(padding), _triple(pool), divisor, True)
    grad_mean = torch.rand(x.shape[0], w.shape[0], device="cuda") - 0.5
    mask = [False, True, True, False]

    def backward():
        return BACKWARD(grad_mean, indices, x, w, _triple(padding), _triple(pool), divisor, mask)

    _, grad_w, grad_b, _ = backward()
    assert weight_grad_kernel_ran(backward) == kernel_takes(x, w, pool)
    assert grad_w.dtype == grad_b.dtype == weight_dtype
    args = (_triple(padding), _triple(pool), divisor, mask)
    x64 = x.to(weight_dtype).double().cpu()
    _, ref_w, ref_b, _ = BACKWARD(grad_mean.double().cpu(), indices.cpu(), x64, w.double().cpu(), *args)
    magnitude_args = (_triple(padding), _triple(pool), abs(divisor), mask)
    _, mag_w, mag_b, _ = BACKWARD(grad_mean.double().abs().cpu(), indices.cpu(), x64.abs(), w.double().cpu(),
                               *magnitude_args)
    terms = x.shape[0] * indices[0, 0].numel()
    # (g to TF32, bf16 or f16, x to TF32; the 16-bit result's rounding)
    rounding = {torch.float32: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[weight_dtype]
    result = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[weight_dtype]
    underflow_w = underflow_b = 0.0
    if weight_dtype == torch.float16:  # (the same sums with g = 2^-25 everywhere: grad_mean = 2^-25 P |divisor|)
        tiny_mean = torch.full_like(grad_mean, 2.0 ** -25 * indices[0, 0].numel() * abs(divisor)).double().cpu()
        _, underflow_w, underflow_b, _ = BACKWARD(tiny_mean, indices.cpu(), x64.abs(), w.double().cpu(),
                                                  *magnitude_args)
    within(grad_w, ref_w, (rounding + (terms + 4) * 2.0 ** -24) * mag_w + result * ref_w.abs() + underflow_w)
    within(grad_b, ref_b, (rounding + (x.shape[0] + 4) * 2.0 ** -24) * mag_b + result * ref_b.abs() + underflow_b)
    again = backward()
    assert torch.equal(again[1], grad_w) and torch.equal(again[2], grad_b)


@requires_cuda
def test_weight_grad_kernel_exact_on_integer_data(tf32):
    """Integer-valued x and picks from it, dyadic grad_mean: every product and sum exact in TF32
    and float32, so the kernel's weight gradient is the float64 one bit for bit (two channel
    blocks, padding, a negative divisor, windows past the output's edge)."""
    x, w, b = make_convolution_case((2, 11, 7, 11, 20), (16, 11, 3, 3, 3), True, torch.float32, "cuda", integers=True)
    padding, divisor = [1, 0, 1], -2.0
    _, indices = OP(x, w, b, padding, [2, 2, 2], divisor, True)
    grad_mean = (torch.randint(-8, 9, (2, 16), device="cuda") / 4).float()
    # P = 4 * 4 * 10 windows: grad_mean / P is not dyadic; make it so by scaling by P
    grad_mean = grad_mean * indices[0, 0].numel()
    args = (padding, [2, 2, 2], divisor, [False, True, True, False])
    _, grad_w, grad_b, _ = BACKWARD(grad_mean, indices, x, w, *args)
    assert weight_grad_kernel_ran(lambda: BACKWARD(grad_mean, indices, x, w, *args))
    _, ref_w, ref_b, _ = BACKWARD(grad_mean.double().cpu(), indices.cpu(), x.double().cpu(), w.double().cpu(), *args)
    assert torch.equal(grad_w.double().cpu(), ref_w) and torch.equal(grad_b.double().cpu(), ref_b)


@requires_cuda
@pytest.mark.parametrize("mask", [[False, True, True, False], [False, False, True, True], [False, True, False, False]],
                         ids=["weight-bias", "bias-channel-bias", "weight"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_weight_grad_kernel_launches_only_the_librarys_kernels(mask, grad_dtype, tf32):
    """Where the weight-gradient kernel runs (one channel block), the backward launches the library's
    kernels only: g = grad_mean / P / divisor and the bias's gradient by its own kernel, grad_mean read
    through its strides, not PyTorch's copy, division and product (whose modules, loaded at their first
    launch, cost a process's first training step 8-14 ms apiece on an H200). 37 batch elements (past the
    kernel's 16 strided lanes), 5 of the 16 output channels, a transposed grad_mean, the masks (the
    channel bias's gradient too): the gradients the float64 ones on the same picks, within g's and the
    sums' roundings."""
    x, w, b = make_convolution_case((37, 8, 4, 6, 16), (5, 8, 3, 3, 3), True, torch.float32, "cuda")
    padding, pool, divisor = [1, 0, 1], [2, 2, 2], -0.7
    _, indices = OP(x, w, b, padding, pool, divisor, True)
    grad_mean = (torch.rand(5, 37, device="cuda") - 0.5).to(grad_dtype).t()
    args = (padding, pool, divisor, mask)

    def backward():
        return BACKWARD(grad_mean, indices, x, w, *args)

    names = cuda_kernel_names(backward)
    assert any("mean_gradient_kernel" in name for name in names)
    assert weight_grad_kernel_ran(backward) == mask[1]
    assert all("fused_ops" in name for name in names), names
    _, grad_w, grad_b, grad_cb = backward()
    _, ref_w, ref_b, ref_cb = BACKWARD(grad_mean.double().cpu(), indices.cpu(), x.double().cpu(), w.double().cpu(),
                                       *args)
    _, mag_w, mag_b, mag_cb = BACKWARD(grad_mean.double().abs().cpu(), indices.cpu(), x.double().abs().cpu(),
                               w.double().cpu(), padding, pool, abs(divisor), mask)
    terms = x.shape[0] * indices[0, 0].numel()
    if mask[1]:
        within(grad_w, ref_w, (2.0 ** -10 + (terms + 4) * 2.0 ** -24) * mag_w)  # (g and x to TF32)
    else:
        assert grad_w.numel() == 0
    if mask[2]:
        within(grad_b, ref_b, (x.shape[0] + 4) * 2.0 ** -24 * mag_b)
    else:
        assert grad_b.numel() == 0
    if mask[3]:  # (sums of grad_mean's values in its dtype's float: the additions' rounding alone)
        assert grad_cb.dtype == grad_dtype
        rounding = 0.0 if grad_dtype == torch.float32 else 2.0 ** -8
        within(grad_cb, ref_cb, x.shape[0] * 2.0 ** -24 * mag_cb + rounding * ref_cb.abs())
    else:
        assert grad_cb.numel() == 0


@requires_cuda
def test_weight_grad_kernel_scratch_under_x(tf32):
    """The weight-gradient kernel's scratch at a batch of one (SPEC's A): the backward allocates less than
    x's bytes beyond what it returns (one block's sums each: a sum per warp took 12 MB, x being 2 MB, and
    took A's training step over the original's peak at a batch of one)."""
    x, w, b = make_convolution_case((1, 8, 16, 64, 64), (16, 8, 3, 3, 3), True, torch.float32, "cuda")
    _, indices = OP(x, w, b, [0, 0, 0], [2, 2, 2], 2.0, True)
    grad_mean = torch.rand(1, 16, device="cuda")
    args = (grad_mean, indices, x, w, [0, 0, 0], [2, 2, 2], 2.0, [False, True, True, False])
    assert weight_grad_kernel_ran(lambda: BACKWARD(*args))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    BACKWARD(*args)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < x.numel() * x.element_size()


@requires_cuda
def test_kernels_bound_their_tasks(tf32):
    """The mma.sync kernels index partial sums by task x kWarps x kChannels in int: they take at most
    INT_MAX / 128 tasks (conv3d_max_pool3d_mean.cuh's kernel_takes). x (2^24, 1, 4, 4, 4), one task a
    sample, is past the bound (PyTorch's ops), x[:-1] at it (the kernels, their largest indices): both exact
    on integer-valued x that is zero but for a few samples at both ends and the middle (so every other
    sample's mean is max(b) / 2 with the first element picked, and adds nothing to the weight gradient)."""
    n = 2 ** 24
    if torch.cuda.mem_get_info()[0] < 24 * 2 ** 30:
        pytest.skip("needs 24 GiB of free GPU memory (x alone is 4 GiB)")
    some = torch.tensor([0, 1, n // 2 + 3, n - 3, n - 2, n - 1])  # (samples with data; n - 3 stays zero)
    x_some, w, b = make_convolution_case((len(some), 1, 4, 4, 4), (2, 1, 3, 3, 3), True, torch.float32, "cuda",
                                         integers=True)
    x_some[3] = 0
    x = torch.zeros(n, 1, 4, 4, 4, device="cuda")
    x[some.cuda()] = x_some
    args = ([0, 0, 0], [2, 2, 2], 2.0)
    grad_mean = torch.zeros(n, 2, device="cuda")
    grad_mean[some.cuda()] = (torch.randint(-8, 9, (len(some), 2), device="cuda") / 4).float()
    mask = [False, True, True, False]
    expected, picks, _, _, _, _ = reference_of(x_some, w, b, *args)
    for rows, runs in ((n, False), (n - 1, True)):  # (x[:-1]: contiguous, one task fewer)
        xs, kept = x[:rows], some < rows
        assert kernel_ran(lambda: OP(xs, w, b, *args, True)) == runs
        out, indices = OP(xs, w, b, *args, True)
        assert torch.equal(out[some[kept].cuda()].double().cpu(), expected[kept])
        assert torch.equal(indices[some[kept].cuda()].long().cpu(), picks[kept])
        zero = torch.ones(rows, dtype=torch.bool, device="cuda")
        zero[some[kept].cuda()] = False
        assert torch.equal(out[zero], (b / 2).expand(int(zero.sum()), 2)) and not indices[zero].any()
        backward = lambda: BACKWARD(grad_mean[:rows], indices, xs, w, *args, mask)  # noqa: E731
        assert weight_grad_kernel_ran(backward) == runs
        _, grad_w, grad_b, _ = backward()
        _, ref_w, ref_b, _ = BACKWARD(grad_mean[some[kept].cuda()].double().cpu(), indices[some[kept].cuda()].cpu(),
                                      x_some[kept].double().cpu(), w.double().cpu(), *args, mask)
        assert torch.equal(grad_w.double().cpu(), ref_w) and torch.equal(grad_b.double().cpu(), ref_b)
