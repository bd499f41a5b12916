"""NaN, +inf and -inf through every formulation of every drop-in module (fused_ops.autotune.force)
against the original, eval and training (NOTES.md, "Non-finite values", the policy these check).

In the input: the output and the running statistics are the original's (NaN where its are, the
same infinities, the finite elements within float64 rounding), the gradients the original's wherever
those are finite. The formulations that multiply x by taps the original does not have or by sums of
its taps (REARRANGED_TAPS) cannot give that: on a CPU the module does not take them for such an
input (the next formulation runs); on a GPU they assume finite input (checking would wait for the
device on every call), and are left out here.

In a parameter or buffer: the output is non-finite exactly where the original's is (NaN may stand
for an infinity), its finite elements the original's; gradients are not promised."""
import pytest
import torch

from conftest import build_pair
from fused_ops import autotune
from fused_ops import nn as fnn
from test_formulations import CONFIGS, FORMULATION_CASES, formulation_input

NAN, INF = float("nan"), float("inf")

# (module, formulation) whose arithmetic cannot keep the original's non-finite values
# (fused_ops.rewrites._common._rearranged_taps_exact): the parity classes' zero taps (A's and B's rewrites),
# the space-to-depth kernel's zero padding and the pool folded into the kernel (C's rewrite and
# fused_conv).
REARRANGED_TAPS = {("Conv3dDivMaxPoolGAPBiasSum", "rewrite"), ("ConvTranspose3dMaxPoolMaxPoolSum", "rewrite"),
                   ("Conv2dAvgPoolSigmoidSum", "rewrite"), ("Conv2dAvgPoolSigmoidSum", "fused_conv")}


def input_patterns(shape):
    """(name, [(index, value), ...]): NaN, +inf and -inf alone at the first element (the batch norm's
    shift), an interior one and the last (read by the rewrites' extra taps alone, where the original's
    windows drop it), and together: all three apart, +inf beside -inf and beside +inf (one window)."""
    first, last = (0,) * len(shape), tuple([s - 1 for s in shape])
    mid = (shape[0] - 1, *[s // 2 for s in shape[1:]])
    beside = (*mid[:-1], mid[-1] - 1)
    alone = [(f"{name} at {where}", [(index, value)])
             for where, index in (("first", first), ("mid", mid), ("last", last))
             for name, value in (("nan", NAN), ("+inf", INF), ("-inf", -INF))]
    return alone + [("nan, +inf, -inf apart", [(first, NAN), (mid, INF), (last, -INF)]),
                    ("+inf beside -inf", [(mid, INF), (beside, -INF)]),
                    ("+inf beside +inf", [(mid, INF), (beside, INF)])]


def with_values(x, pattern):
    x = x.clone()
    for index, value in pattern:
        x[index] = value
    return x


def step(module, x):
    """(output, [x's gradient, every parameter's], [buffers]) of one call and its backward (of the
    output's sum)."""
    module.zero_grad()
    x = x.clone().requires_grad_()
    out = module(x)
    out.backward(torch.ones_like(out))
    return out.detach(), [x.grad, *[p.grad for p in module.parameters()]], [b.clone() for b in module.buffers()]


def assert_same(actual, expected, what):
    """NaN where expected is NaN, its infinities, its finite elements within float64 rounding."""
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-12, equal_nan=True, msg=lambda m: f"{what}\n{m}")


def assert_same_where_finite(actual, expected, what):
    """actual is expected wherever expected is finite (a gradient the original makes NaN by 0 * inf is
    not compared)."""
    finite = expected.isfinite()
    torch.testing.assert_close(actual[finite], expected[finite], rtol=1e-9, atol=1e-12,
                               msg=lambda m: f"{what}\n{m}")


@pytest.mark.parametrize("name,args,shape,formulation", FORMULATION_CASES)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_non_finite_input(name, args, shape, formulation, train, device):
    if device != "cpu" and (name, formulation) in REARRANGED_TAPS:
        pytest.skip("assumes finite input on a GPU (NOTES.md, Non-finite values)")
    g = torch.Generator().manual_seed(1)
    base = torch.rand(shape, generator=g, dtype=torch.float64).to(device)
    for pattern, values in input_patterns(shape):
        what = f"{pattern}, {formulation}"
        x = formulation_input(with_values(base, values), formulation)
        original, fused = (m.to(device, torch.float64).train(train) for m in build_pair(name, args))
        expected_out, expected_grads, expected_buffers = step(original, x)
        with autotune.force(formulation):
            out, grads, buffers = step(fused, x)
        ran = autotune.last_formulation()
        if (name, formulation) in REARRANGED_TAPS:
            assert ran != formulation, f"{what}: taken for a non-finite input"
        else:
            assert ran == formulation, f"{what}: {ran} ran"
        assert_same(out, expected_out, f"output, {what}")
        for a, e in zip(buffers, expected_buffers, strict=True):
            assert_same(a, e, f"buffer, {what}")
        for a, e, of in zip(grads, expected_grads, ["x", *[n for n, _ in fused.named_parameters()]], strict=True):
            assert_same_where_finite(a, e, f"gradient of {of}, {what}")


def test_finite_input_takes_the_rearranged_taps_on_a_cpu():
    """The check passes a finite input on: the formulations of REARRANGED_TAPS run for it (and for
    one whose sum overflows, the check's only false alarm, the next formulation gives the original's
    result)."""
    for name, args, shape in CONFIGS:
        for formulation in [f for n, f in REARRANGED_TAPS if n == name]:
            original, fused = (m.double().eval() for m in build_pair(name, args))
            x = torch.rand(shape, dtype=torch.float64)
            with autotune.force(formulation), torch.no_grad():
                assert_same(fused(x), original(x), f"{name} {formulation}")
                assert autotune.last_formulation() == formulation
                huge = x * torch.finfo(torch.float64).max
                assert_same(fused(huge), original(huge), f"{name} {formulation}, overflowing sum")


def parameter_patterns(name):
    """(name, setter) of a NaN or an infinity in a parameter or buffer of module `name`."""
    def setting(path, index, value):
        def set_value(module):
            *owners, attribute = path.split(".")
            for owner in owners:
                module = getattr(module, owner)
            with torch.no_grad():
                getattr(module, attribute).view(-1)[index] = value
        return set_value

    conv = "conv_transpose" if "ConvTranspose" in name else "conv"
    paths = [(f"{conv}.weight", 0), (f"{conv}.bias", 0)]
    if name == "Conv3dDivMaxPoolGAPBiasSum":
        paths.append(("bias", 1))
    if name == "ConvTranspose3dScaleBatchNormGAP":
        paths += [("batch_norm.weight", 1), ("batch_norm.bias", 1), ("batch_norm.running_mean", 2),
                  ("batch_norm.running_var", 2)]
    return [(f"{path}[{index}] = {value}", setting(path, index, value))
            for path, index in paths for value in (NAN, INF, -INF)]


@pytest.mark.parametrize("name,args,shape,formulation", FORMULATION_CASES)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_non_finite_parameters(name, args, shape, formulation, train, device):
    """The output is non-finite exactly where the original's is, its finite elements the original's;
    on a GPU for the formulations that run the original's convolution (the others rearrange it,
    whose algorithms, cuDNN's Winograd and FFT kernels among them, may spread an infinite weight
    differently)."""
    if device != "cpu" and formulation not in autotune.OWN_CONVOLUTION:
        pytest.skip("a rearranged convolution on a GPU (NOTES.md, Non-finite values)")
    x = torch.rand(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(device)
    for pattern, set_value in parameter_patterns(name):
        original, fused = (m.to(device, torch.float64).train(train) for m in build_pair(name, args))
        set_value(original)
        set_value(fused)
        with torch.no_grad():
            expected = original(x)
            with autotune.force(formulation):
                out = fused(formulation_input(x, formulation))
        assert autotune.last_formulation() == formulation
        assert torch.equal(out.isfinite(), expected.isfinite()), f"{pattern}, {formulation}: {out} against {expected}"
        assert_same_where_finite(out, expected, f"{pattern}, {formulation}")


@pytest.mark.parametrize("name", ["Conv3dDivMaxPoolGAPBiasSum", "ConvTranspose3dScaleBatchNormGAP"], ids=["A", "D"])
def test_non_finite_divisor_and_scale(name, device):
    """A's divisor and D's scale_factor NaN, +inf or -inf (numbers, not tensors): every formulation
    gives the original's output, eval and training."""
    config = next(c for c in CONFIGS if c[0] == name)
    attribute = "divisor" if name == "Conv3dDivMaxPoolGAPBiasSum" else "scale_factor"
    x = torch.rand(config[2], generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(device)
    for value in (NAN, INF, -INF):
        for train in (True, False):
            for formulation in getattr(fnn, name).FORMULATIONS:
                if device != "cpu" and (name, formulation) in REARRANGED_TAPS:
                    continue
                original, fused = (m.to(device, torch.float64).train(train) for m in build_pair(name, config[1]))
                setattr(original, attribute, value)
                setattr(fused, attribute, value)
                with torch.no_grad():
                    expected = original(x)
                    with autotune.force(formulation):
                        assert_same(fused(formulation_input(x, formulation)), expected,
                                    f"{attribute} {value}, {formulation}, train {train}")
