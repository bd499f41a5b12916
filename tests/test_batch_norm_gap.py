"""fused_ops.batch_norm_gap against nn.BatchNorm3d(x * scale) -> AdaptiveAvgPool3d(1),
running statistics included."""
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import (DTYPES, LAYOUTS_5D, RTOL, assert_close_to_reference, grad_memory_format, in_layout_5d,
                      make_input, misaligned, poison_cuda_allocator, requires_cuda)
from fused_ops import batch_norm_gap

OP = torch.ops.fused_ops.batch_norm_gap.default
BACKWARD = torch.ops.fused_ops.batch_norm_gap_backward.default
UPDATE = torch.ops.fused_ops.batch_norm_update_running_stats.default


def make_params(channels, dtype, device, affine=True, track=True, seed=0):
    """weight, bias (affine), running_mean, running_var, num_batches_tracked (track), or Nones."""
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(channels, generator=g, dtype=torch.float64) if affine else None)
    bias = (torch.randn(channels, generator=g, dtype=torch.float64) if affine else None)
    running_mean = torch.rand(channels, generator=g, dtype=torch.float64) if track else None
    running_var = torch.rand(channels, generator=g, dtype=torch.float64) + 0.5 if track else None
    params = [t if t is None else t.to(dtype=dtype, device=device) for t in (weight, bias, running_mean, running_var)]
    nbt = torch.tensor(3, device=device) if track else None
    return (*params, nbt)


def reference_module(x, weight, bias, running_mean, running_var, nbt, training, momentum, eps):
    """nn.BatchNorm3d in float64 on the CPU with the given parameters and buffers (copied)."""
    bn = nn.BatchNorm3d(x.shape[1], eps=eps, momentum=momentum, affine=weight is not None,
                        track_running_stats=running_mean is not None).double()
    with torch.no_grad():
        if weight is not None:
            bn.weight.copy_(weight.double().cpu())
            bn.bias.copy_(bias.double().cpu())
        if running_mean is not None:
            bn.running_mean.copy_(running_mean.double().cpu())
            bn.running_var.copy_(running_var.double().cpu())
            bn.num_batches_tracked.copy_(nbt.cpu())
    return bn.train(training)


def reference(x, scale, bn):
    """float64 on the CPU, from the values the batch norm sees: x * scale as
    PyTorch rounds it in x's dtype on x's device. Returns (those values, out)."""
    y = (x.detach() * scale).cpu().double().requires_grad_()
    return y, F.adaptive_avg_pool3d(bn(y), 1)


def check_forward_backward(x, scale, params, training, momentum, dtype, eps=1e-5):
    """Output, running statistics and the gradients of x, weight and bias
    against float64 PyTorch on the same values."""
    poison_cuda_allocator()
    weight, bias, running_mean, running_var, nbt = params
    bn = reference_module(x, weight, bias, running_mean, running_var, nbt, training, momentum, eps)
    x = x.detach().requires_grad_()
    leaves = [t.requires_grad_() for t in (weight, bias) if t is not None]
    out = batch_norm_gap(x, scale, weight, bias, running_mean, running_var, nbt, training=training,
                         momentum=momentum, eps=eps)
    assert out.shape == (*x.shape[:2], 1, 1, 1) and out.dtype == x.dtype and out.device == x.device
    y, ref = reference(x, scale, bn)
    what = f"{tuple(x.shape)} scale {scale} training {training} momentum {momentum}"
    # The sizes of the terms that cancel (normwise errors are relative to
    # them): a plane's normalized mean, w rstd g / S in grad_x, and the sum
    # over the batch of g times a normalized plane mean in grad_weight.
    batch, size = x.shape[0], x[0, 0].numel()
    rstd = (bn.running_var if not bn.training and bn.track_running_stats else y.detach().var((0, 2, 3, 4), False))
    rstd = (rstd + eps).rsqrt().max().item()
    w_max = 1.0 if weight is None else weight.detach().abs().max().item()
    term = w_max / size ** 0.5
    assert_close_to_reference(out, ref, dtype, f"forward {what}", normwise=True, magnitude=term)
    if running_mean is not None:
        assert_close_to_reference(running_mean, bn.running_mean, dtype, f"running_mean {what}", normwise=True)
        assert_close_to_reference(running_var, bn.running_var, dtype, f"running_var {what}", normwise=True)
        assert nbt.item() == bn.num_batches_tracked.item()
    grad = (torch.rand(out.shape, dtype=torch.float64) + 0.5).to(dtype)
    grads = torch.autograd.grad(out, [x, *leaves], grad.to(x.device))
    ref_leaves = [bn.weight, bn.bias] if weight is not None else []
    ref_grads = torch.autograd.grad(ref, [y, *ref_leaves], grad.double())
    assert grads[0].dtype == x.dtype and grads[0].shape == x.shape
    g_max = grad.abs().max().item()
    assert_close_to_reference(grads[0], ref_grads[0] * scale, dtype, f"grad_x {what}", normwise=True,
                              magnitude=g_max * abs(scale) * w_max * rstd / size)
    for name, g, r, p in zip(["weight", "bias"], grads[1:], ref_grads[1:], leaves):
        assert g.dtype == p.dtype
        assert_close_to_reference(g, r, dtype, f"grad_{name} {what}", normwise=True,
                                  magnitude=g_max * batch / size ** 0.5)
    return grads[0]


def random_config(rng: random.Random):
    """A random input shape (odd sizes, batch 1), scale, and batch-norm configuration."""
    while True:
        shape = (rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 6), rng.randint(1, 7), rng.randint(1, 9))
        if shape[0] * shape[2] * shape[3] * shape[4] > 1:
            break
    return (shape, rng.choice([2.0, -1.5, 0.3, 1.0, 3]), dict(affine=rng.random() < 0.7, track=rng.random() < 0.7),
            rng.random() < 0.6, rng.choice([0.1, 0.5, None]))


CONFIGS = [random_config(random.Random(seed)) for seed in range(16)] + [
    # architecture D's tail at small size, training and eval
    ((2, 4, 5, 9, 9), 2.0, dict(affine=True, track=True), True, 0.1),
    ((2, 4, 5, 9, 9), 2.0, dict(affine=True, track=True), False, 0.1),
    # one plane of several values, one value per plane in a batch of several
    ((1, 3, 2, 3, 5), -2.0, dict(affine=True, track=True), True, None),
    ((5, 3, 1, 1, 1), 1.5, dict(affine=True, track=True), True, 0.2),
    # no affine parameters, no running statistics (batch statistics in eval mode too)
    ((2, 3, 4, 5, 6), 2.0, dict(affine=False, track=True), True, 0.1),
    ((2, 3, 4, 5, 6), 2.0, dict(affine=True, track=False), False, 0.1),
    ((2, 3, 4, 5, 6), 2.0, dict(affine=False, track=False), True, None),
]


@pytest.mark.parametrize("shape,scale,kind,training,momentum", CONFIGS,
                         ids=[f"{s}-{sc}-{sorted(k.items())}-{t}-{m}" for s, sc, k, t, m in CONFIGS])
def test_matches_pytorch(shape, scale, kind, training, momentum, device):
    for dtype in DTYPES:
        x = make_input(shape, dtype, device, seed=len(shape))
        check_forward_backward(x, scale, make_params(shape[1], dtype, device, **kind), training, momentum, dtype)


def bn_grad_memory_format(x, batch_stats):
    """batch_norm_gap's layout of grad_x: grad_memory_format's, and channels_last_3d on a GPU too
    for such an x whose gradient goes through batch statistics (the channels-last kernels)."""
    if x.is_cuda and batch_stats and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return grad_memory_format(x)


@pytest.mark.parametrize("layout", LAYOUTS_5D)
@pytest.mark.parametrize("training", [True, False])
def test_layouts(layout, training, device, dtype):
    base = make_input((2, 5, 6, 8, 10), dtype, device)
    x = in_layout_5d(base, layout)
    grad_x = check_forward_backward(x, -2.0, make_params(x.shape[1], dtype, device), training, 0.1, dtype)
    assert grad_x.is_contiguous(memory_format=bn_grad_memory_format(x, training))


@pytest.mark.parametrize("shape", [(2, 3, 5, 6, 7), (1, 13, 6, 9, 11), (3, 37, 4, 5, 70)])
@pytest.mark.parametrize("training", [True, False])
def test_channels_last(shape, training, device, dtype):
    """channels_last_3d inputs, which the CPU kernels and the CUDA ones read in vectors over
    channels: channel counts the vector width does not divide, planes of more than one block
    (chunk) of moments (4 * 5 * 70 elements); grad_x channels_last_3d on the CPU, and on a GPU
    through batch statistics."""
    x = make_input(shape, dtype, device).to(memory_format=torch.channels_last_3d)
    grad_x = check_forward_backward(x, 1.5, make_params(shape[1], dtype, device), training, 0.1, dtype)
    assert grad_x.is_contiguous(memory_format=bn_grad_memory_format(x, training))


def test_large_mean_float32(device):
    """Mean 1e4, standard deviation 1: the statistics lose nothing to the mean's
    size (no E[y^2] - E[y]^2 cancellation); float32 within 1e-5 of float64."""
    g = torch.Generator().manual_seed(3)
    for shape in [(2, 3, 5, 9, 11), (4, 2, 8, 30, 36)]:
        x = (1e4 + torch.randn(shape, generator=g, dtype=torch.float64)).float().to(device)
        for training in (True, False):
            params = make_params(shape[1], torch.float32, device)
            if not training:  # running statistics near the batch's (of 2 * x)
                params[2].fill_(2e4)
                params[3].fill_(4.0)
            check_forward_backward(x, 2.0, params, training, 0.1, torch.float32)


@pytest.mark.parametrize("shape", [(3, 6, 3, 5, 7), (2, 6, 33, 33, 33)], ids=["small", "chunked"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last_3d", "transposed"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_non_finite_values(shape, layout, training, device, dtype):
    """NaN and +-inf in x give PyTorch's results (batch_norm_gap.h: finite_shift, merge_moments): in
    eval mode the planes holding them alone non-finite, in training their channels; the gradients
    PyTorch's wherever those are finite. Channel 0: a NaN at y[0, 0, 0, 0, 0] (the sums' shift); 1:
    +inf there; 2: -inf in another plane; 3: +inf in one plane and -inf in another; 4: two +inf in
    one plane; 5: finite. "chunked": planes of several chunks, the last partial (the CUDA kernels'
    padding lanes and their merges of chunks' moments)."""
    nan, inf = float("nan"), float("inf")
    base = make_input(shape, dtype, device)
    last, mid = tuple([s - 1 for s in shape[2:]]), tuple([s // 2 for s in shape[2:]])
    base[0, 0, 0, 0, 0] = nan
    base[0, 1, 0, 0, 0] = inf
    base[-1, 2][last] = -inf
    base[0, 3][mid] = inf
    base[-1, 3][mid] = -inf
    base[-1, 4][mid] = inf
    base[-1, 4][last] = inf
    x = base if layout == "contiguous" else in_layout_5d(base, layout)
    weight, bias, running_mean, running_var, nbt = params = make_params(shape[1], dtype, device)
    bn = reference_module(x, *params, training, 0.1, 1e-5)
    x = x.detach().requires_grad_()
    leaves = [weight.requires_grad_(), bias.requires_grad_()]
    out = batch_norm_gap(x, -1.5, *params, training=training, momentum=0.1)
    y, ref = reference(x, -1.5, bn)
    assert_close_to_reference(out, ref, dtype, "output", normwise=True)
    assert out[:, :5].isfinite().sum() == (0 if training else shape[0] * 5 - 6)
    for actual, expected in ((running_mean, bn.running_mean), (running_var, bn.running_var)):
        assert_close_to_reference(actual, expected, dtype, "running statistics", normwise=True)
    grad = (torch.rand(out.shape, dtype=torch.float64) + 0.5).to(dtype)
    grads = torch.autograd.grad(out, [x, *leaves], grad.to(device))
    expected = torch.autograd.grad(ref, [y, bn.weight, bn.bias], grad.double())
    for name, actual, reference_grad in zip(["x", "weight", "bias"], grads, expected):
        reference_grad = reference_grad * -1.5 if name == "x" else reference_grad
        finite = reference_grad.isfinite()
        assert finite.any()
        assert_close_to_reference(actual.cpu()[finite], reference_grad[finite], dtype, f"grad_{name}", normwise=True)


def test_mixed_dtype_parameters(device):
    """float16 / bfloat16 x with float32 parameters and running statistics, as
    PyTorch's batch norm takes them (autocast); grads in the parameters' dtype."""
    for dtype in (torch.float16, torch.bfloat16):
        x = make_input((2, 3, 4, 5, 6), dtype, device)
        for training in (True, False):
            check_forward_backward(x, 2.0, make_params(3, torch.float32, device), training, 0.1, dtype)


def test_several_steps_then_eval(device):
    """Running statistics as nn.BatchNorm3d's after several training steps
    (momentum None: the cumulative average), then eval with them."""
    for momentum in (0.1, None):
        weight, bias, rm, rv, nbt = make_params(3, torch.float64, device)
        bn = reference_module(torch.empty(1, 3), weight, bias, rm, rv, nbt, True, momentum, 1e-5)
        for step in range(5):
            training = step < 4
            bn.train(training)
            x = make_input((2, 3, 4, 5, 6), torch.float64, device, seed=step)
            out = batch_norm_gap(x, 2.0, weight, bias, rm, rv, nbt, training=training, momentum=momentum)
            _, ref = reference(x, 2.0, bn)
            assert_close_to_reference(out, ref, torch.float64, f"step {step}", normwise=True)
            assert_close_to_reference(rm, bn.running_mean, torch.float64, normwise=True)
            assert_close_to_reference(rv, bn.running_var, torch.float64, normwise=True)
            assert nbt.item() == bn.num_batches_tracked.item()


def test_one_value_per_channel(device):
    """Batch 1 of 1x1x1 planes: training refuses it as nn.BatchNorm3d does
    (having counted the batch); eval with running statistics takes it."""
    bn = nn.BatchNorm3d(3).to(device)
    x = torch.rand(1, 3, 1, 1, 1, device=device)
    weight, bias, rm, rv, nbt = make_params(3, torch.float32, device)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        bn(x)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        batch_norm_gap(x, 2.0, weight, bias, rm, rv, nbt, training=True)
    assert nbt.item() == 4 and bn.num_batches_tracked.item() == 1
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        batch_norm_gap(x, 2.0, weight, bias)  # no running statistics: batch statistics in eval too
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        OP(x, 2.0, weight, bias, None, None, 1e-5)
    out = batch_norm_gap(x, 2.0, weight, bias, rm, rv, nbt, training=False)
    bn.eval()
    with torch.no_grad():
        bn.weight.copy_(weight)
        bn.bias.copy_(bias)
        bn.running_mean.copy_(rm)
        bn.running_var.copy_(rv)
    torch.testing.assert_close(out, bn(x * 2.0))


def test_empty_batch(device):
    """Batch 0: an empty result; nn.BatchNorm3d counts the batch and keeps its statistics."""
    x = torch.rand(0, 3, 4, 4, 4, device=device, requires_grad=True)
    weight, bias, rm, rv, nbt = make_params(3, torch.float32, device)
    weight.requires_grad_()
    before = rm.clone(), rv.clone()
    out = batch_norm_gap(x, 2.0, weight, bias, rm, rv, nbt, training=True)
    assert out.shape == (0, 3, 1, 1, 1)
    assert torch.equal(rm, before[0]) and torch.equal(rv, before[1]) and nbt.item() == 4
    out.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(weight.grad, torch.zeros_like(weight))


def test_gradcheck(device):
    for training, kind in [(True, dict(affine=True, track=True)), (False, dict(affine=True, track=True)),
                           (True, dict(affine=True, track=False)), (False, dict(affine=True, track=False))]:
        for fmt in [torch.contiguous_format, torch.channels_last_3d]:
            x = make_input((2, 3, 3, 4, 5), torch.float64, device).to(memory_format=fmt).requires_grad_()
            weight, bias, rm, rv, nbt = make_params(3, torch.float64, device, **kind)
            weight.requires_grad_()
            bias.requires_grad_()

            def fn(x, weight, bias):
                return batch_norm_gap(x, -1.5, weight, bias, rm, rv, nbt, training=training, momentum=0.1)

            assert torch.autograd.gradcheck(fn, (x, weight, bias))
    # no affine parameters
    x = make_input((3, 2, 2, 3, 3), torch.float64, device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: batch_norm_gap(t, 0.7, training=True), (x,))


def test_opcheck(device):
    x = make_input((2, 3, 5, 6, 7), torch.float32, device, requires_grad=True)
    xl = make_input((2, 3, 5, 6, 7), torch.float64, device).to(memory_format=torch.channels_last_3d).requires_grad_()
    for t in (x, xl):
        weight, bias, rm, rv, _ = make_params(3, t.dtype, device)
        weight.requires_grad_()
        torch.library.opcheck(OP, (t, 2.0, weight, bias, None, None, 1e-5))
        torch.library.opcheck(OP, (t, -0.5, weight, bias, rm, rv, 1e-3))
        torch.library.opcheck(OP, (t, 1.0, None, None, None, None, 1e-5))
    weight, bias, rm, rv, nbt = make_params(3, torch.float32, device)
    _, plane_dev, mean, rstd, var = OP(x, 2.0, weight, bias, None, None, 1e-5)
    grad = torch.rand(2, 3, 1, 1, 1, device=device)
    for batch_stats in (True, False):
        for grad_input in (True, False):
            # x contiguous and channels_last_3d (grad_x laid out as x on the CPU, and on a GPU through
            # batch statistics)
            for t in (x, x.to(memory_format=torch.channels_last_3d)):
                torch.library.opcheck(BACKWARD, (grad, t.detach(), [5, 6, 7], 2.0, weight, plane_dev, mean, rstd,
                                                 batch_stats, grad_input))
    torch.library.opcheck(BACKWARD, (grad, None, [5, 6, 7], 2.0, None, plane_dev, mean, rstd, False, True))
    for counter, momentum, count in [(nbt, 0.1, 420), (nbt, None, 420), (None, 0.3, 420), (nbt, None, 0)]:
        torch.library.opcheck(UPDATE, (rm, rv, counter, mean, var, count, momentum))


@requires_cuda
def test_cuda_large_and_tiled():
    """Shapes past the CUDA kernels' tiles: planes of many chunks (more than a
    warp's lanes), a last chunk partly outside the plane, vectors of 4, 2 and 1
    elements, many planes per channel; channels_last_3d (the channels-last
    kernels: a row of 16 lanes of 8 bf16 channels, 8 lanes of 8 halves for 40
    channels (5 vectors), 4 groups of 32 lanes of 2 float64 channels, chunks of
    256 positions the last partly outside the plane)."""
    for shape, dtype, fmt in [
        ((2, 4, 6, 20, 36), torch.float32, torch.contiguous_format),
        ((2, 4, 6, 20, 36), torch.float16, torch.contiguous_format),
        ((2, 3, 5, 17, 33), torch.float32, torch.contiguous_format),
        ((1, 3, 3, 7, 50), torch.float32, torch.contiguous_format),
        ((1, 2, 40, 40, 40), torch.float32, torch.contiguous_format),
        ((1, 2, 40, 40, 40), torch.float64, torch.contiguous_format),
        ((300, 3, 2, 2, 2), torch.float32, torch.contiguous_format),
        ((2, 16, 6, 9, 10), torch.float32, torch.channels_last_3d),
        ((2, 128, 5, 9, 13), torch.bfloat16, torch.channels_last_3d),
        ((3, 64, 20, 9, 7), torch.float32, torch.channels_last_3d),
        ((2, 40, 6, 7, 9), torch.float16, torch.channels_last_3d),
        ((1, 256, 3, 4, 5), torch.float64, torch.channels_last_3d),
    ]:
        x = make_input(shape, dtype, "cuda").to(memory_format=fmt)
        for training in (True, False):
            check_forward_backward(x, 2.0, make_params(shape[1], dtype, "cuda"), training, 0.1, dtype)


@requires_cuda
def test_cuda_channels_last_edges():
    """The channels-last kernels where a chunk ends with fewer positions than a warp has rows (a
    lane a row: 32 rows; 257 positions, so the last chunk holds one and 31 lanes none), and where
    x's data is not 16-byte aligned (vectors of one element)."""
    xs = [make_input((2, 4, 1, 1, 257), torch.float32, "cuda").to(memory_format=torch.channels_last_3d),
          make_input((3, 8, 1, 1, 257), torch.bfloat16, "cuda").to(memory_format=torch.channels_last_3d),
          misaligned(make_input((2, 16, 3, 5, 7), torch.float32, "cuda"), (0, 2, 3, 4, 1))]
    for x in xs:
        assert not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last_3d)
        for training in (True, False):
            grad_x = check_forward_backward(x, 2.0, make_params(x.shape[1], x.dtype, "cuda"), training, 0.1, x.dtype)
            assert grad_x.is_contiguous(memory_format=bn_grad_memory_format(x, training))


@requires_cuda
def test_cuda_matches_cpu_and_is_deterministic():
    x = make_input((4, 16, 10, 18, 18), torch.float32, "cuda")
    weight, bias, _, _, _ = make_params(16, torch.float32, "cuda")
    a = OP(x, 2.0, weight, bias, None, None, 1e-5)
    b = OP(x, 2.0, weight, bias, None, None, 1e-5)
    for t, u in zip(a, b):
        assert torch.equal(t, u)
    c = OP(x.cpu(), 2.0, weight.cpu(), bias.cpu(), None, None, 1e-5)
    for t, u in zip(a, c):
        torch.testing.assert_close(t.cpu(), u, rtol=1e-5, atol=1e-6)
    grad = torch.rand(4, 16, 1, 1, 1, device="cuda")
    args = (grad, x, [10, 18, 18], 2.0, weight, *a[1:4], True, True)
    for t, u in zip(BACKWARD(*args), BACKWARD(*args)):
        assert torch.equal(t, u)


@requires_cuda
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last_3d], ids=["contiguous", "channels_last"])
def test_cuda_forward_materializes_nothing_of_x_size(fmt):
    x = make_input((4, 16, 14, 30, 31), torch.float32, "cuda").to(memory_format=fmt).requires_grad_()
    weight, bias, rm, rv, nbt = make_params(16, torch.float32, "cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = batch_norm_gap(x, 2.0, weight, bias, rm, rv, nbt, training=True)
    torch.cuda.synchronize()
    # out, the saved statistics and the chunks' partial moments
    assert torch.cuda.max_memory_allocated() - before < x.numel() * x.element_size() // 64
    del out


def test_grad_of_weight_only(device):
    """x not requiring grad: the backward computes no grad_x (the op is asked for none)."""
    x = make_input((2, 3, 4, 5, 6), torch.float32, device)
    weight, bias, _, _, _ = make_params(3, torch.float32, device)
    weight.requires_grad_()
    out = batch_norm_gap(x, 2.0, weight, bias, training=True)
    grad = torch.rand(out.shape, device=device)
    (grad_weight,) = torch.autograd.grad(out, [weight], grad)
    y = (x * 2.0).double()
    ref_weight = weight.detach().double().requires_grad_()
    ref = F.adaptive_avg_pool3d(F.batch_norm(y, None, None, ref_weight, bias.double(), True), 1)
    (ref_grad,) = torch.autograd.grad(ref, [ref_weight], grad.double())
    assert_close_to_reference(grad_weight, ref_grad, torch.float32, normwise=True)
    _, plane_dev, mean, rstd, _ = OP(x, 2.0, weight, bias, None, None, 1e-5)
    grad_x, _, _ = BACKWARD(torch.ones(2, 3, 1, 1, 1, device=device), None, [4, 5, 6], 2.0, weight, plane_dev,
                            mean, rstd, True, False)
    assert grad_x.numel() == 0


@pytest.mark.parametrize(
    "shape,dtype,params,error,match",
    [
        ((3, 8, 8, 8), torch.float32, {}, ValueError, "5-D input"),
        ((1, 2, 3, 8, 8, 8), torch.float32, {}, ValueError, "5-D input"),
        ((2, 2, 8, 8, 8), torch.int64, {}, TypeError, "floating-point"),
        ((2, 0, 8, 8, 8), torch.float32, {}, ValueError, "non-zero"),
        ((2, 2, 0, 8, 8), torch.float32, {}, ValueError, "non-zero"),
        ((2, 2, 4, 4, 4), torch.float32, dict(weight=torch.ones(3)), ValueError, "weight must be 1-D with one element per channel"),
        ((2, 2, 4, 4, 4), torch.float32, dict(bias=torch.ones(2, 1)), ValueError, "bias must be 1-D"),
        ((2, 2, 4, 4, 4), torch.float32, dict(running_mean=torch.ones(3), running_var=torch.ones(3)), ValueError,
         "running_mean must be 1-D with one element per channel"),
        ((2, 2, 4, 4, 4), torch.float32, dict(running_mean=torch.ones(2), running_var=torch.ones(5)), ValueError,
         "running_var must be 1-D"),
        ((2, 2, 4, 4, 4), torch.float32, dict(running_mean=torch.ones(2)), ValueError, "both running_mean and running_var"),
        ((2, 2, 4, 4, 4), torch.float32, dict(weight=torch.ones(2, dtype=torch.int64)), TypeError, "weight must be a floating-point"),
        ((2, 2, 4, 4, 4), torch.float32, dict(weight=torch.ones(2, dtype=torch.float64)), TypeError, "weight must have x's dtype"),
        ((2, 2, 4, 4, 4), torch.float16, dict(weight=torch.ones(2), bias=torch.ones(2, dtype=torch.float16)), TypeError,
         "bias must have weight's dtype"),
        ((2, 2, 4, 4, 4), torch.float32, dict(scale="2"), TypeError, "scale must be a number"),
    ],
)
def test_bad_input(shape, dtype, params, error, match, device):
    x = torch.ones(shape, dtype=dtype, device=device)
    params = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in params.items()}
    scale = params.pop("scale", 2.0)
    with pytest.raises(error, match=match):
        batch_norm_gap(x, scale, **params)


@pytest.mark.parametrize("eps", [0.0, -1e-5, float("nan")])
def test_eps_as_batch_norm_takes_it(eps, device):
    """F.batch_norm's rule: with the batch's statistics eps must be positive, with running ones non-negative (a
    running variance is the caller's); both raise a ValueError naming eps (0 returned NaN or inf before)."""
    x = make_input((2, 3, 4, 4, 4), torch.float32, device)
    weight, bias, rm, rv, nbt = make_params(3, torch.float32, device)
    with pytest.raises(ValueError, match="eps must be positive with the batch's statistics"):
        OP(x, 2.0, None, None, None, None, eps)
    with pytest.raises(ValueError, match="eps must be positive with the batch's statistics"):
        batch_norm_gap(x, 2.0, weight, bias, rm, rv, nbt, training=True, eps=eps)
    if eps == 0.0:
        out = batch_norm_gap(x, 2.0, weight, bias, rm, rv, training=False, eps=eps)
        expected = F.adaptive_avg_pool3d(F.batch_norm(x.double() * 2, rm.double(), rv.double(), weight.double(),
                                                      bias.double(), False, 0.1, 1e-300), 1)
        torch.testing.assert_close(out.double(), expected, rtol=RTOL[torch.float32], atol=RTOL[torch.float32])
    else:
        with pytest.raises(ValueError, match="eps must be non-negative"):
            OP(x, 2.0, None, None, rm, rv, eps)


def test_bad_backward_and_update_input(device):
    x = make_input((2, 3, 4, 4, 4), torch.float32, device)
    _, plane_dev, mean, rstd, var = OP(x, 2.0, None, None, None, None, 1e-5)
    grad = torch.ones(2, 3, 1, 1, 1, device=device)
    with pytest.raises(ValueError, match="grad_out must have shape"):
        BACKWARD(torch.ones(2, 3, device=device), x, [4, 4, 4], 2.0, None, plane_dev, mean, rstd, True, True)
    with pytest.raises(ValueError, match="x is needed"):
        BACKWARD(grad, None, [4, 4, 4], 2.0, None, plane_dev, mean, rstd, True, True)
    with pytest.raises(ValueError, match="does not match"):
        BACKWARD(grad, x, [4, 4, 5], 2.0, None, plane_dev, mean, rstd, True, True)
    with pytest.raises(TypeError, match="mean must be"):
        BACKWARD(grad, x, [4, 4, 4], 2.0, None, plane_dev, mean.double(), rstd, True, True)
    rm, rv = torch.zeros(3, device=device), torch.ones(3, device=device)
    with pytest.raises(TypeError, match="int64"):
        UPDATE(rm, rv, torch.tensor(1.0, device=device), mean, var, 128, 0.1)
    with pytest.raises(ValueError, match="var must have shape"):
        UPDATE(rm, rv, None, mean, var[:2], 128, 0.1)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        UPDATE(rm, rv, None, mean, var, 1, 0.1)


@requires_cuda
def test_mixed_devices():
    x = make_input((2, 3, 4, 4, 4), torch.float32, "cuda")
    weight, bias, rm, rv, nbt = make_params(3, torch.float32, "cpu")
    with pytest.raises(ValueError, match="same device"):
        batch_norm_gap(x, 2.0, weight)
    with pytest.raises(ValueError, match="same device"):
        batch_norm_gap(x.cpu(), 2.0, weight.cuda())
    with pytest.raises(ValueError, match="same device"):
        batch_norm_gap(x, 2.0, None, None, rm, rv, training=False)
    _, plane_dev, mean, rstd, var = OP(x, 2.0, None, None, None, None, 1e-5)
    with pytest.raises(ValueError, match="same device"):
        UPDATE(rm, rv, nbt, mean, var, 128, 0.1)
    with pytest.raises(ValueError, match="same device"):
        BACKWARD(torch.ones(2, 3, 1, 1, 1), x, [4, 4, 4], 2.0, None, plane_dev, mean, rstd, True, True)
