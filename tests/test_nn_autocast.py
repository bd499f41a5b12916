"""The drop-in modules under torch.autocast (bfloat16 and float16, CPU and CUDA, train
and eval): the original's output dtype and shape, within about twice the original's
own error against a float64 run, and every parameter's gradient in its own dtype,
within about twice the original's error too."""
import copy

import pytest
import torch

from conftest import build_pair
from fused_ops import autotune
from fused_ops import nn as fnn

# (architecture, constructor arguments, input shape): small, odd sizes, pools that do not
# divide them; on a GPU A and B take their rewrites, C its pool-folded convolution, D in
# training its stride-1 transposed convolution rewrite and in eval its spatial-mean one.
CONFIGS = [
    ("Conv3dDivMaxPoolGAPBiasSum", (3, 4, 3, 2.0, 2, (4, 1, 1, 1), 1), (2, 3, 9, 10, 11)),
    ("Conv3dDivMaxPoolGAPBiasSum", (2, 3, (3, 2, 3), -1.5, (2, 3, 2), (3, 1, 1, 1), -4), (1, 2, 8, 9, 7)),
    ("ConvTranspose3dMaxPoolMaxPoolSum", (3, 4, 5, 2, 2), (2, 3, 6, 7, 6)),
    ("Conv2dAvgPoolSigmoidSum", (3, 8, 3, 4), (2, 3, 22, 19)),
    ("Conv2dAvgPoolSigmoidSum", (3, 8, 3, 4), (2, 3, 21, 19)),  # the pool overhangs: the fused tail op
    ("ConvTranspose3dScaleBatchNormGAP", (3, 4, 3, 2.0), (3, 3, 4, 5, 6)),
]

LOW_PRECISION = [torch.bfloat16, torch.float16]


def relative_error(actual, reference, scale=None):
    """max |actual - reference| / scale, by default max |reference| (the difference itself
    where that is zero)."""
    scale = reference.abs().max().item() if scale is None else scale
    return (actual.double() - reference).abs().max().item() / (scale if scale > 0 else 1.0)


def step(module, x, grad, device, autocast_dtype=None):
    """Output and every parameter's gradient after a forward (under autocast when
    autocast_dtype is given) and a backward outside it, as AMP runs a training step."""
    module.zero_grad()
    with torch.autocast(device_type=device, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        out = module(x)
    if module.training:
        (out.double() * grad).sum().backward()
    return out, [p.grad for p in module.parameters()] if module.training else []


@pytest.mark.parametrize("name,args,shape,formulation",
                         [pytest.param(*config, formulation, id=f"{config[0]}-{formulation}")
                          for config in CONFIGS for formulation in getattr(fnn, config[0]).FORMULATIONS])
@pytest.mark.parametrize("autocast_dtype", LOW_PRECISION, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_autocast_like_original(name, args, shape, autocast_dtype, train, formulation, device):
    original, fused = build_pair(name, args)
    original.to(device).train(train)
    fused.to(device).train(train)
    reference = copy.deepcopy(original).double()
    x = torch.rand(shape, device=device, generator=torch.Generator(device).manual_seed(1))
    grad = torch.rand(original(x).shape, dtype=torch.float64, device=device)

    ref_out, ref_grads = step(reference, x.double(), grad, device)
    out, grads = step(original, x, grad, device, autocast_dtype)
    with autotune.force(formulation):
        fused_out, fused_grads = step(fused, x, grad, device, autocast_dtype)

    assert fused_out.dtype == out.dtype and fused_out.shape == out.shape and fused_out.device == out.device
    tolerance = 2 * relative_error(out, ref_out) + 1e-6
    assert relative_error(fused_out, ref_out) <= tolerance, "output"
    # A parameter's gradient relative to the largest of all, within twice the original's error
    # or half a unit of the autocast dtype's last place (D's conv bias gets a gradient that is
    # zero but for rounding, a training batch norm removing a per-channel constant: both
    # modules' are noise far below the 16-bit resolution, whose ratio means nothing).
    largest = max([g.abs().max().item() for g in ref_grads], default=0.0)
    resolution = torch.finfo(autocast_dtype).eps / 2
    for (p_name, p), g, fused_g, ref_g in zip(original.named_parameters(), grads, fused_grads, ref_grads):
        assert fused_g.dtype == p.dtype, p_name
        tolerance = max(2 * relative_error(g, ref_g, largest), resolution)
        assert relative_error(fused_g, ref_g, largest) <= tolerance, f"grad {p_name}"
    if name == "ConvTranspose3dScaleBatchNormGAP":  # the running statistics, updated in training
        for buffer, fused_buffer, ref_buffer in zip(original.buffers(), fused.buffers(), reference.buffers()):
            assert fused_buffer.dtype == buffer.dtype
            if buffer.is_floating_point():
                tolerance = 2 * relative_error(buffer, ref_buffer) + 1e-6
                assert relative_error(fused_buffer, ref_buffer) <= tolerance


@pytest.mark.parametrize("name,args,shape", CONFIGS[:1] + CONFIGS[2:4] + CONFIGS[5:],
                         ids=lambda v: v if isinstance(v, str) else None)
def test_autocast_float64_untouched(name, args, shape, device):
    """Autocast casts no float64 tensor: float64 modules compute and return float64."""
    original, fused = build_pair(name, args)
    original.to(device, torch.float64)
    fused.to(device, torch.float64)
    x = torch.rand(shape, dtype=torch.float64, device=device)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        out, expected = fused(x), original(x)
    assert out.dtype == expected.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name,args,shape", CONFIGS[:1] + CONFIGS[2:4] + CONFIGS[5:],
                         ids=lambda v: v if isinstance(v, str) else None)
def test_autocast_compiles_fullgraph(name, args, shape, device):
    """torch.compile(fullgraph=True) of the drop-in under autocast: no graph break (the
    autocast state and the result dtypes are read in traceable ways), its eager result."""
    _, fused = build_pair(name, args)
    fused.to(device).train()
    x = torch.rand(shape, device=device)
    compiled = torch.compile(fused, fullgraph=True)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        out, expected = compiled(x), fused(x)
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-3)
