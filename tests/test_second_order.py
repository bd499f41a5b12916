"""Second-order gradients (a backward with create_graph=True, differentiated again) through every
formulation of every module: the original's, or a clear refusal, never a wrong result.

The fused ops' backwards have no derivatives of their own. A max-pool tail's gradient, its picks
fixed, is linear in the result's gradient and constant in x, so a gradient penalty through it is
right wherever the result's gradient records no graph (a loss linear in the output); a smooth
tail's (C's sigmoid, D's batch norm) depends on x and the parameters, so every create_graph
backward through it is refused, and so is every one through an op that holds the convolution too
(``fused_conv``: its gradient is bilinear in the result's gradient and the weight). The error names ``autotune.force("original")``, under which the
module runs the original's ops (and on a GPU, a replayed training step makes its create_graph
backward with them: tests/test_graphed_calls.py)."""
import pytest
import torch

from fused_ops import autotune
from test_formulations import FORMULATION_CASES, IDS, CONFIGS, pair

# (module, training) -> its formulations that call a fused tail op, and whether that tail is smooth
FUSED_TAIL = {("A", True): {"fused_conv", "fused", "fused_channels_last", "rewrite"},
              ("A", False): {"fused_conv", "fused", "fused_channels_last", "rewrite"},
              ("B", True): {"fused", "fused_channels_last", "rewrite"},
              ("B", False): {"fused", "fused_channels_last", "rewrite"},
              ("C", True): {"fused_conv", "fused", "fused_channels_last"},  # (the rewrite's tail is PyTorch's)
              ("C", False): {"fused_conv", "fused", "fused_channels_last"},
              ("D", True): {"fused", "fused_channels_last", "rewrite"},
              ("D", False): {"fused", "fused_channels_last"}}  # (eval rewrite: the spatial mean map)
SMOOTH = {"C", "D"}
WITH_CONVOLUTION = {"fused_conv"}


def penalty_grads(module, x, formulation, nonlinear_loss):
    """The parameters' gradients of the input gradient's squared norm, the call made under
    `formulation` (and which formulation ran)."""
    with autotune.force(formulation):
        out = module(x)
        ran = autotune.last_formulation()
    loss = out.square().sum() if nonlinear_loss else (out * torch.linspace(-1, 2, out.numel()).view_as(out)).sum()
    (grad_x,) = torch.autograd.grad(loss, x, create_graph=True)
    return torch.autograd.grad(grad_x.square().sum(), list(module.parameters()), allow_unused=True,
                               materialize_grads=True), ran


@pytest.mark.parametrize("name,args,shape,formulation", FORMULATION_CASES)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("nonlinear_loss", [False, True], ids=["linear_loss", "square_loss"])
def test_gradient_penalty_right_or_refused(name, args, shape, train, formulation, nonlinear_loss):
    which = IDS[[c[0] for c in CONFIGS].index(name)]
    original, fused = pair(name, args, "cpu", train=train)
    x = torch.rand(shape, dtype=torch.float64, requires_grad=True)
    expected, _ = penalty_grads(original, x, "original", nonlinear_loss)
    refused = formulation in FUSED_TAIL[which, train] and (which in SMOOTH or nonlinear_loss
                                                           or formulation in WITH_CONVOLUTION)
    if refused:
        with pytest.raises(NotImplementedError, match=r"second-order gradients .*force\(\"original\"\)"):
            penalty_grads(fused, x, formulation, nonlinear_loss)
        return
    actual, ran = penalty_grads(fused, x, formulation, nonlinear_loss)
    assert ran == formulation
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-12)
