"""fused_ops.nn.ConvTranspose3dScaleBatchNormGAP against the original (fused_ops.reference),
running statistics included."""
import re

import pytest
import torch
from torch import nn

from conftest import (assert_close_to_reference, build_pair, check_from_module, check_matches_original,
                      check_same_init, check_state_dict_both_ways, requires_cuda)
from fused_ops import nn as fnn
from fused_ops import reference

NAME = "ConvTranspose3dScaleBatchNormGAP"

ARGS = [
    # (in_channels, out_channels, kernel_size, scale_factor[, eps, momentum]), input (B, D, H, W)
    # architecture D's configuration at small size
    ((3, 4, 5, 2.0), (2, 4, 6, 6)),
    # a tuple kernel, a negative scale, momentum None
    ((2, 5, (3, 2, 3), -1.5, 1e-3, None), (2, 3, 5, 4)),
    ((2, 3, 2, 0.5, 1e-5, 0.3), (3, 2, 3, 4)),
]

BUFFERS = ["batch_norm.running_mean", "batch_norm.running_var", "batch_norm.num_batches_tracked"]


def check_same_state(original, fused, dtype):
    """Running statistics within tolerance, the batch counter exactly."""
    a, b = original.batch_norm, fused.batch_norm
    if a.running_mean is None:
        assert b.running_mean is None and b.running_var is None
        return
    assert_close_to_reference(b.running_mean, a.running_mean, dtype, "running_mean", normwise=True)
    assert_close_to_reference(b.running_var, a.running_var, dtype, "running_var", normwise=True)
    assert b.num_batches_tracked.item() == a.num_batches_tracked.item()


def output_terms(module, x):
    """The size of the terms whose difference the output is: the largest
    |x * scale| normalized, (rounding errors of the conv output, in the original
    too, scale with it)."""
    with torch.no_grad():
        y = module.conv_transpose(x) * module.scale_factor
        bn = module.batch_norm
        running = not bn.training and bn.running_var is not None
        var = bn.running_var if running else y.var((0, 2, 3, 4), unbiased=False)
        w = bn.weight.abs() if bn.weight is not None else 1.0
        return (y.abs().amax((0, 2, 3, 4)) * w * (var + bn.eps).rsqrt()).max().item()


def check_steps(original, fused, input_shape, dtype, device, modes=(True, True, False, True, False)):
    """A sequence of training and eval steps: outputs, gradients and running
    statistics as the original's after each (the modules share nothing)."""
    for step, train in enumerate(modes):
        original.train(train)
        fused.train(train)
        g = torch.Generator().manual_seed(step)
        x = torch.rand(input_shape, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)
        check_matches_original(original, fused, x, dtype, normwise=True, magnitude=output_terms(original, x))
        check_same_state(original, fused, dtype)
        original.zero_grad()
        fused.zero_grad()


def test_same_parameters_under_same_seed():
    check_same_init(NAME, ARGS[0][0], ["conv_transpose.weight", "conv_transpose.bias", "batch_norm.weight",
                                       "batch_norm.bias", *BUFFERS])
    original, fused = build_pair(NAME, ARGS[1][0])
    assert fused.scale_factor == original.scale_factor
    assert fused.batch_norm.momentum is None and fused.batch_norm.eps == 1e-3


def test_state_dict_both_ways():
    check_state_dict_both_ways(NAME, ARGS[0][0])


def test_from_module_shares_parameters():
    check_from_module(NAME, ARGS[1][0], ["conv_transpose", "scale_factor", "batch_norm", "global_avg_pool"])
    original = reference.ConvTranspose3dScaleBatchNormGAP(*ARGS[0][0])
    fused = fnn.ConvTranspose3dScaleBatchNormGAP.from_module(original)
    fused(torch.rand(2, 3, 4, 6, 6))  # a training step updates the original's buffers
    assert original.batch_norm.num_batches_tracked.item() == 1


@pytest.mark.parametrize("args,size", ARGS)
def test_train_and_eval_steps(args, size, device):
    original, fused = build_pair(NAME, args)
    original.to(device, torch.float64)
    fused.to(device, torch.float64)
    check_steps(original, fused, (size[0], args[0], *size[1:]), torch.float64, device)


@pytest.fixture
def full_float32():
    """Convolutions in full float32, as with TF32 off: the float32 comparisons
    below hold the fused module's gradients to 1e-5 of the original's, and a
    TF32 conv backward rounds inputs that differ in their last bits apart by 1e-3."""
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        yield


@pytest.mark.parametrize("args,size", ARGS)
def test_train_and_eval_steps_float32(args, size, device, full_float32):
    """float32: the output, the input's and the batch norm's gradients and the
    running statistics. (The conv's parameter gradients, PyTorch's conv
    backward in float32 of gradients that cancel to 0 for its bias, differ
    from the original's by the original's own rounding, 1e-5 of the largest:
    test_compile_fullgraph and the float64 steps compare them.)"""
    original, fused = build_pair(NAME, args)
    original.to(device)
    fused.to(device)
    for step, train in enumerate((True, True, False, True, False)):
        original.train(train)
        fused.train(train)
        x = torch.rand(size[0], args[0], *size[1:], device=device)
        planes = original.conv_transpose(x.detach())
        x_ref, x = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, ref = fused(x), original(x_ref)
        assert_close_to_reference(out, ref, torch.float32, normwise=True, magnitude=output_terms(original, x))
        grad = torch.rand_like(ref)
        out.backward(grad)
        ref.backward(grad)
        assert_close_to_reference(x.grad, x_ref.grad, torch.float32, "grad input", normwise=True)
        # grad weight: a sum over the batch of grad times a normalized plane mean (of size 1 / sqrt(S))
        batch, plane = planes.shape[0], planes[0, 0].numel()
        for name in ("weight", "bias"):
            assert_close_to_reference(getattr(fused.batch_norm, name).grad, getattr(original.batch_norm, name).grad,
                                      torch.float32, f"grad batch_norm.{name}", normwise=True,
                                      magnitude=batch / plane ** 0.5)
        check_same_state(original, fused, torch.float32)
        original.zero_grad()
        fused.zero_grad()


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("variant", ["affine=False", "track_running_stats=False", "both"])
def test_batch_norm_variants(variant, momentum, device):
    """affine=False and track_running_stats=False behave as nn.BatchNorm3d does
    (without running statistics, eval mode normalizes with the batch's)."""
    original = reference.ConvTranspose3dScaleBatchNormGAP(3, 4, 3, 2.0, momentum=momentum)
    original.batch_norm = nn.BatchNorm3d(4, momentum=momentum, affine=variant != "track_running_stats=False",
                                         track_running_stats=variant == "affine=False")
    original.to(device, torch.float64)
    fused = fnn.ConvTranspose3dScaleBatchNormGAP(3, 4, 3, 2.0)
    fused.batch_norm = nn.BatchNorm3d(4, momentum=momentum, affine=original.batch_norm.affine,
                                      track_running_stats=original.batch_norm.track_running_stats)
    fused.to(device, torch.float64)
    fused.load_state_dict(original.state_dict())
    check_steps(original, fused, (2, 3, 4, 5, 6), torch.float64, device)


def test_tracking_switched_off_after_construction(device):
    """track_running_stats set False on a module that has running statistics:
    training leaves them (and the counter) alone, eval mode uses them."""
    original, fused = build_pair(NAME, ARGS[0][0])
    original.to(device, torch.float64)
    fused.to(device, torch.float64)
    check_steps(original, fused, (2, 3, 4, 6, 6), torch.float64, device, modes=(True,))
    original.batch_norm.track_running_stats = fused.batch_norm.track_running_stats = False
    check_steps(original, fused, (2, 3, 4, 6, 6), torch.float64, device)


def test_batch_1(device):
    """Batch 1: in training each channel's output is its bias (the plane is the
    batch) and the running statistics take the plane's; eval as the original."""
    original, fused = build_pair(NAME, ARGS[1][0])
    original.to(device, torch.float64)
    fused.to(device, torch.float64)
    for step, train in enumerate((True, True, False)):
        original.train(train)
        fused.train(train)
        x = torch.rand(1, 2, 3, 5, 4, dtype=torch.float64, device=device)
        if train:
            with torch.no_grad():
                out, ref = fused(x), original(x)
            torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
            check_same_state(original, fused, torch.float64)
        else:
            check_matches_original(original, fused, x, torch.float64, normwise=True,
                                   magnitude=output_terms(original, x))


def test_one_value_per_channel(device):
    """A batch of one 1x1x1 conv output per channel: refused in training as the
    original refuses it, after counting it as the original does."""
    original, fused = build_pair(NAME, (3, 4, 1, 2.0))
    original.to(device)
    fused.to(device)
    x = torch.rand(1, 3, 1, 1, 1, device=device)
    for module in (original, fused):
        with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
            module(x)
    check_same_state(original, fused, torch.float32)
    original.eval()
    fused.eval()
    assert_close_to_reference(fused(x), original(x), torch.float32, normwise=True, magnitude=output_terms(original, x))


@pytest.mark.parametrize("eps", [0.0, -1e-3])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_eps_not_positive_as_the_original(eps, train, device):
    """An eps of 0 or less: the original's result or its error, whichever this torch's F.batch_norm gives (a
    ValueError in training since torch 2.10; 0 is taken in eval since 2.11), not the fused tail's NaN."""
    original, fused = build_pair(NAME, (3, 4, 3, 2.0, eps))
    original.to(device).train(train)
    fused.to(device).train(train)
    x = torch.rand(2, 3, 4, 5, 5, device=device)
    try:
        expected = original(x)
    except ValueError as error:
        with pytest.raises(ValueError, match=re.escape(str(error))):
            fused(x)
    else:
        torch.testing.assert_close(fused(x), expected, equal_nan=True)
    check_same_state(original, fused, torch.float32)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_cuda(dtype):
    _, fused = build_pair(NAME, ARGS[0][0])
    fused.to("cuda", dtype)
    x = torch.rand(2, 3, 4, 6, 6, device="cuda", dtype=dtype)
    bn = fused.batch_norm
    y = (fused.conv_transpose(x) * fused.scale_factor).double()
    ref = torch.nn.functional.batch_norm(y, None, None, bn.weight.double(), bn.bias.double(), True)
    out = fused(x)
    assert out.dtype == dtype
    # the fused tail against a float64 tail of the same (low-precision) conv output and scaling
    assert_close_to_reference(out, ref.mean(dim=(2, 3, 4), keepdim=True), dtype, normwise=True)


def test_compile_fullgraph(device, full_float32):
    """torch.compile(fullgraph=True) of the drop-in: the same outputs, gradients
    and running statistics over training and eval steps."""
    for args in (ARGS[0][0], ARGS[1][0]):
        original, fused = build_pair(NAME, args)
        original.to(device)
        fused.to(device)
        compiled = torch.compile(fused, fullgraph=True)
        for step, train in enumerate((True, True, False, True)):
            original.train(train)
            fused.train(train)
            x = torch.rand(2, args[0], 4, 6, 6, device=device)
            check_matches_original(original, compiled, x, torch.float32, normwise=True,
                                   magnitude=output_terms(original, x))
            check_same_state(original, fused, torch.float32)
            original.zero_grad()
            fused.zero_grad()


def test_bad_input(device):
    fused = fnn.ConvTranspose3dScaleBatchNormGAP(3, 4, 3, 2.0).to(device)
    with pytest.raises(ValueError, match="channels"):
        fused(torch.rand(2, 4, 5, 5, 5, device=device))
    with pytest.raises(ValueError, match="5-D input"):
        fused(torch.rand(3, 5, 5, 5, device=device))
    with pytest.raises(TypeError, match="floating-point"):
        fused(torch.ones(2, 3, 5, 5, 5, dtype=torch.int64, device=device))
    fused.batch_norm = nn.BatchNorm3d(5).to(device)  # a batch norm of the wrong width
    with pytest.raises(ValueError, match="one element per channel"):
        fused(torch.rand(2, 3, 5, 5, 5, device=device))
    fused = fnn.ConvTranspose3dScaleBatchNormGAP(3, 4, 3, 2.0).to(device)
    fused.global_avg_pool = nn.AdaptiveAvgPool3d(2)
    with pytest.raises(ValueError, match="pools to"):
        fused(torch.rand(2, 3, 5, 5, 5, device=device))


@requires_cuda
def test_mixed_devices():
    fused = fnn.ConvTranspose3dScaleBatchNormGAP(3, 4, 3, 2.0).cuda()
    with pytest.raises(RuntimeError, match="device|cuda|cpu"):
        fused(torch.rand(2, 3, 5, 5, 5))
    fused.batch_norm.cpu()  # conv on the GPU, batch norm on the CPU
    with pytest.raises(ValueError, match="same device"):
        fused(torch.rand(2, 3, 5, 5, 5, device="cuda"))


def test_eval_map_follows_parameter_changes(device):
    """The eval output's kept map (parameters and running statistics folded) is rebuilt
    when any of them changes in place (an optimizer step, a training step's update of the
    running statistics, load_state_dict) or x's size changes."""
    original, fused = build_pair(NAME, ARGS[0][0])
    original.to(device, torch.float64)
    fused.to(device, torch.float64)
    shape = (ARGS[0][1][0], ARGS[0][0][0], *ARGS[0][1][1:])

    def check_eval(size=shape):
        original.eval()
        fused.eval()
        x = torch.rand(size, dtype=torch.float64, device=device)
        with torch.no_grad():
            torch.testing.assert_close(fused(x), original(x), rtol=1e-10, atol=1e-12)

    check_eval()
    x = torch.rand(shape, dtype=torch.float64, device=device)
    for module in (original, fused):  # a training step: running statistics and an SGD update
        module.train()
        module(x).sum().backward()
        with torch.no_grad():
            for p in module.parameters():
                p -= 0.1 * p.grad
    check_eval()
    check_eval((shape[0] + 1, shape[1], shape[2] + 1, *shape[3:]))
    state = {k: torch.rand_like(v) if v.is_floating_point() else v for k, v in original.state_dict().items()}
    original.load_state_dict(state)
    fused.load_state_dict(state)
    check_eval()
