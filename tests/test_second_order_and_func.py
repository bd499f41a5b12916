"""Second-order gradients and torch.func transforms, through every op, module and formulation.

Second order: a backward with create_graph=True (a gradient penalty) gives the original's
second-order gradients. Where such a backward runs, each op computes its gradients by PyTorch's
differentiable ops (csrc/autograd/autograd_util.h, records_graph): the fused convolutions' and the
batch-statistics batch norm's forward recomputed from what they saved and differentiated; the
max-pool tails' gradients routed by differentiable products and scatters (the picks fixed: linear
in the result's gradient, constant in x); avg_pool2d_sigmoid_sum's and the running-statistics batch
norm's through their saved sigmoid and plane deviations, differentiable outputs. gradgradcheck
checks each op and each module in float64.

torch.func (grad, vjp, jacrev, vmap): under a transform every module runs the original's own ops
(fused_ops.autotune.choose), with the original's results, or its error (architecture D in training
mode: nn.BatchNorm3d's update of its running statistics, which functorch refuses)."""
import pytest
import torch
import torch._dynamo.testing
from torch.func import functional_call, grad, jacrev, vjp, vmap

import fused_ops
from conftest import make_input
from fused_ops import autotune
from test_formulations import CONFIGS, FORMULATION_CASES, IDS, formulation_input, pair

# Smaller configurations (every formulation holds for each: test_formulations.CONFIGS's conditions; C's
# output channels times its pool's area, 64, and its 48 output columns fill fused_conv's saved tiles, which
# in training may take no more than the convolution's output) for gradgradcheck, whose numerical Jacobians
# take a call per input and parameter element.
SMALL_CONFIGS = [
    ("Conv3dDivMaxPoolGAPBiasSum", (2, 2, 3, -1.5, 2, (2, 1, 1, 1), 1), (2, 2, 5, 6, 7)),
    ("ConvTranspose3dMaxPoolMaxPoolSum", (2, 2, 3, 2, 1), (1, 2, 4, 4, 4)),
    ("Conv2dAvgPoolSigmoidSum", (2, 16, 3, 2), (1, 2, 9, 99)),
    ("ConvTranspose3dScaleBatchNormGAP", (2, 3, 2, 2.0), (3, 2, 2, 3, 2)),
]
SMALL_CASES = [pytest.param(*config, formulation, id=f"{letter}-{formulation}")
               for config, letter in zip(SMALL_CONFIGS, IDS)
               for formulation in getattr(fused_ops.nn, config[0]).FORMULATIONS]
TOLERANCE = dict(rtol=1e-9, atol=1e-12)


def module_call(module, formulation):
    """module's function of (x, *parameters) (functional_call) under formulation (gradcheck
    perturbs its inputs in place through .data: the modules keep nothing derived from them)."""
    names = [name for name, _ in module.named_parameters()]

    def call(x, *params):
        with autotune.force(formulation):
            return functional_call(module, dict(zip(names, params)), (x,))
    return call


def penalty_grads(module, x, wrt_all):
    """The first-order gradients of a loss nonlinear in module(x) (so that its gradient records a
    graph too) to x (wrt_all False: a gradient penalty's) or to x and every parameter, taken with
    create_graph, and the gradients to x and every parameter of a penalty on them."""
    params = list(module.parameters())
    out = module(x)
    weight = torch.linspace(-1, 2, out.numel(), dtype=out.dtype, device=out.device).view_as(out)
    loss = (out * weight + out.square()).sum()
    first = torch.autograd.grad(loss, [x, *params] if wrt_all else [x], create_graph=True)
    penalty = sum([(g.square() * (1 + torch.arange(g.numel(), device=g.device).view_as(g) % 3)).sum()
                   for g in first])
    second = torch.autograd.grad(penalty, [x, *params], allow_unused=True, materialize_grads=True)
    return [g.detach() for g in first], second


@pytest.mark.parametrize("name,args,shape,formulation", FORMULATION_CASES)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("wrt_all", [False, True], ids=["penalty_on_x", "penalty_on_all"])
def test_second_order_is_the_original(name, args, shape, formulation, train, wrt_all, device):
    """float64, forced to each formulation: the first-order gradients taken with create_graph and
    the penalty's gradients to x and to every parameter are the original's."""
    original, fused = pair(name, args, device, train=train)
    x = formulation_input(make_input(shape, torch.float64, device), formulation).requires_grad_()
    expected = penalty_grads(original, x, wrt_all)
    with autotune.force(formulation):
        actual = penalty_grads(fused, x, wrt_all)
    assert autotune.last_formulation() == formulation
    for a, e in zip([*actual[0], *actual[1]], [*expected[0], *expected[1]], strict=True):
        torch.testing.assert_close(a, e, **TOLERANCE)


@pytest.mark.parametrize("name,args,shape,formulation", SMALL_CASES)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_module_gradgradcheck(name, args, shape, formulation, train, device):
    """gradgradcheck of each module's function of its input and parameters, forced to each
    formulation (fast mode: random projections of the Jacobians, a few calls each)."""
    _, fused = pair(name, args, device, train=train)
    x = formulation_input(make_input(shape, torch.float64, device), formulation).requires_grad_()
    params = [p.detach().clone().requires_grad_() for p in fused.parameters()]
    call = module_call(fused, formulation)
    call(x, *params)
    assert autotune.last_formulation() == formulation
    # (on a GPU the convolutions' float64 backwards accumulate with atomics, in an order that changes from
    # one run to the next: gradgradcheck's check that two backwards agree takes PyTorch's own tolerance
    # for such ops, GRADCHECK_NONDET_TOL, as its convolution tests do; 0 on a CPU)
    nondet_tol = 1e-12 if device == "cuda" else 0.0
    assert torch.autograd.gradgradcheck(call, (x, *params), fast_mode=True, nondet_tol=nondet_tol)


def _batch_norm_gap(x, weight, bias, running=False):
    """batch_norm_gap in eval mode with running statistics, or with the batch's."""
    channels = x.shape[1]
    stats = (torch.linspace(-0.3, 0.2, channels, dtype=x.dtype, device=x.device),
             torch.linspace(0.5, 1.5, channels, dtype=x.dtype, device=x.device)) if running else (None, None)
    return fused_ops.batch_norm_gap(x, 1.5, weight, bias, *stats, training=False)


# op: (its function of float64 tensors, the shapes of its differentiable inputs, which of them
# are x and require grad (the others are parameters); cases that take each backward's paths:
# overlapping and padded windows, ceil_mode, a negative divisor, the picks recomputed from x
# where they exceed a byte (kernel volumes over 256), channels-last layouts, batch and running
# statistics, the weight and bias alone.
OP_CASES = {
    "avg_pool2d_sigmoid_sum": (lambda x: fused_ops.avg_pool2d_sigmoid_sum(x, 3, 2, 1), [(2, 2, 5, 6)]),
    "avg_pool2d_sigmoid_sum-divisors": (
        lambda x: fused_ops.avg_pool2d_sigmoid_sum(x, (3, 2), (2, 1), 1, ceil_mode=True, count_include_pad=False),
        [(1, 2, 5, 6)]),
    "avg_pool2d_sigmoid_sum-override-channels_last": (
        lambda x: fused_ops.avg_pool2d_sigmoid_sum(x.contiguous(memory_format=torch.channels_last), 2,
                                                   divisor_override=3), [(1, 3, 4, 5)]),
    "conv2d_sigmoid_sum": (lambda x, w, b: fused_ops.conv2d_sigmoid_sum(x, w, b, 2, 1),
                           [(1, 2, 5, 5), (3, 2, 3, 2), (3,)]),
    "conv3d_max_pool3d_mean": (lambda x, w, b: fused_ops.conv3d_max_pool3d_mean(x, w, b, 1, 2, -1.5),
                               [(1, 2, 4, 5, 3), (2, 2, 2, 3, 2), (2,)]),
    "max_pool3d_mean": (lambda x: fused_ops.max_pool3d_mean(x, (3, 2, 2), (2, 1, 2), 1, ceil_mode=True,
                                                            divisor=-2.0), [(1, 2, 4, 4, 5)]),
    "max_pool3d_mean-recomputed_picks": (lambda x: fused_ops.max_pool3d_mean(x, (7, 7, 6), 1, 3), [(1, 2, 3, 3, 2)]),
    "max_pool3d_mean-channels_last": (
        lambda x: fused_ops.max_pool3d_mean(x.contiguous(memory_format=torch.channels_last_3d), 2),
        [(1, 3, 4, 3, 4)]),
    "max_pool3d_cascade_sum": (lambda x: fused_ops.max_pool3d_cascade_sum(x, 2, (3, 2, 3), stride1=1, padding1=1,
                                                                          stride2=(2, 1, 2)), [(1, 2, 4, 4, 5)]),
    "max_pool3d_cascade_sum-recomputed_picks": (
        lambda x: fused_ops.max_pool3d_cascade_sum(x, 3, (2, 2, 3), stride1=1), [(1, 2, 4, 4, 5)]),
    "max_pool3d_cascade_sum-channels_last": (
        lambda x: fused_ops.max_pool3d_cascade_sum(x.contiguous(memory_format=torch.channels_last_3d), 2, 2),
        [(1, 2, 4, 5, 4)]),
    "parity_max_pool3d_mean": (fused_ops.parity_max_pool3d_mean, [(2, 2, 2, 2, 2, 4)]),
    "parity_max_pool3d_cascade_sum": (lambda y: fused_ops.parity_max_pool3d_cascade_sum(y, (2, 1, 2)),
                                      [(1, 3, 2, 3, 2, 4)]),
    "batch_norm_gap-batch_statistics": (_batch_norm_gap, [(3, 2, 2, 3, 2), (2,), (2,)]),
    "batch_norm_gap-batch_statistics-parameters_alone": (
        lambda w, b: _batch_norm_gap(make_input((3, 2, 2, 3, 2), torch.float64, w.device), w, b), [(2,), (2,)]),
    "batch_norm_gap-running_statistics": (lambda x, w, b: _batch_norm_gap(x, w, b, running=True),
                                          [(3, 2, 2, 3, 2), (2,), (2,)]),
    "batch_norm_gap-running_statistics-channels_last": (
        lambda x, w, b: _batch_norm_gap(x.contiguous(memory_format=torch.channels_last_3d), w, b, running=True),
        [(3, 2, 2, 3, 2), (2,), (2,)]),
    "batch_norm_gap-no_affine": (lambda x: _batch_norm_gap(x, None, None), [(2, 2, 3, 2, 2)]),
    "box_fold2d": (lambda w: fused_ops.box_fold2d(w, (2, 3), 6.0), [(2, 3, 3, 2)]),
}


@pytest.mark.parametrize("op", OP_CASES)
def test_op_gradgradcheck(op, device):
    """gradgradcheck (full Jacobians) of each differentiable op in float64, random inputs of odd
    sizes (distinct values: no max-pool ties)."""
    call, shapes = OP_CASES[op]
    inputs = [(make_input(shape, torch.float64, device, seed=i) - 0.25).requires_grad_()
              for i, shape in enumerate(shapes)]
    assert torch.autograd.gradgradcheck(call, inputs)


@pytest.mark.parametrize("op", ["max_pool3d_mean", "max_pool3d_cascade_sum", "parity_max_pool3d_cascade_sum",
                                "avg_pool2d_sigmoid_sum"])
def test_op_third_order(op, device):
    """A recorded backward records its own backward too: gradgradcheck of an op's first-order
    gradient (of a loss cubic in its output, taken with create_graph) checks its third order
    (fast mode: random projections of the Jacobians)."""
    call, shapes = OP_CASES[op]
    x = make_input(shapes[0], torch.float64, device, requires_grad=True)

    def first_order(t):
        return torch.autograd.grad(call(t).pow(3).sum(), t, create_graph=True)[0]
    assert torch.autograd.gradgradcheck(first_order, (x,), fast_mode=True)


# ---------------------------------------------------------------------------------------------
# torch.func


def per_sample_grads(module, xs):
    """DP-SGD's per-sample gradients: each parameter's gradient of each sample's summed output."""
    params = {name: p.detach() for name, p in module.named_parameters()}
    loss = lambda p, x: functional_call(module, p, (x.unsqueeze(0),)).sum()  # noqa: E731
    return vmap(grad(loss), in_dims=(None, 0))(params, xs)


def transforms(module, x):
    """Per-sample gradients, the Jacobian to x and the parameters, and a vjp, each by torch.func."""
    params = {name: p.detach() for name, p in module.named_parameters()}
    call = lambda p, t: functional_call(module, p, (t,))  # noqa: E731
    out, pullback = vjp(call, params, x)
    cotangent = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).view_as(out)
    return {"per_sample": per_sample_grads(module, x), "jacrev": jacrev(call, argnums=(0, 1))(params, x),
            "vjp": (out, pullback(cotangent))}


def outcome(call):
    """call()'s result, or its error as (type, message)."""
    try:
        return call()
    except RuntimeError as error:
        return type(error), str(error)


@pytest.mark.parametrize("name,args,shape,formulation", SMALL_CASES)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_torch_func_is_the_original(name, args, shape, formulation, train, device):
    """grad, vjp, jacrev and vmap over the module, forced to each formulation: the original's
    results (D in training mode: the original's error, its running statistics' update in place)."""
    original, fused = pair(name, args, device, train=train)
    x = make_input(shape, torch.float64, device)
    expected = outcome(lambda: transforms(original, x))
    with autotune.force(formulation):
        actual = outcome(lambda: transforms(fused, x))
    assert autotune.last_formulation() == "original"
    if isinstance(expected, tuple):
        assert actual == expected
        return
    torch.testing.assert_close(actual, expected, **TOLERANCE)
    [torch.testing.assert_close(a, e) for a, e in zip(fused.buffers(), original.buffers(), strict=True)]


def test_torch_func_batch_norm_without_running_statistics(device):
    """D in training mode with a batch norm that tracks no running statistics (which functorch
    allows the original): per-sample gradients and the rest are the original's."""
    name, args, shape = CONFIGS[3]
    original, fused = pair(name, args, device, train=True)
    for module in (original, fused):
        bn = module.batch_norm
        module.batch_norm = torch.nn.BatchNorm3d(bn.num_features, track_running_stats=False).to(device,
                                                                                               torch.float64)
    fused.batch_norm.load_state_dict(original.batch_norm.state_dict())
    x = make_input(shape, torch.float64, device)
    torch.testing.assert_close(transforms(fused, x), transforms(original, x), **TOLERANCE)


@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
def test_torch_func_with_the_autotuner(name, args, shape, device):
    """With the autotuner on: a transform's first call times nothing (no saved-tensor hooks
    under functorch), and a call under a transform like a tuned plain call before it (the same
    signature, the module's remembered choice) runs the original's ops too."""
    autotune.clear()
    autotune.set_enabled(True)
    original, fused = pair(name, args, device, train=False)
    x = make_input(shape, torch.float64, device)
    torch.testing.assert_close(per_sample_grads(fused, x), per_sample_grads(original, x), **TOLERANCE)
    params = {name: p.detach().requires_grad_() for name, p in fused.named_parameters()}
    functional_call(fused, params, (x,)).sum().backward()  # tuned, remembered
    expected = grad(lambda p: functional_call(original, p, (x,)).sum())(params)
    actual = grad(lambda p: functional_call(fused, p, (x,)).sum())(params)
    assert autotune.last_formulation() == "original"
    torch.testing.assert_close(actual, expected, **TOLERANCE)


@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
def test_compiled_torch_func_is_the_original(name, args, shape, device):
    """torch.compile of per-sample gradients (vmap of grad) traces the original's ops too."""
    original, fused = pair(name, args, device, train=False)
    x = make_input(shape, torch.float64, device)
    params = {name: p.detach() for name, p in fused.named_parameters()}

    def per_sample(module):
        loss = lambda p, t: functional_call(module, p, (t.unsqueeze(0),)).sum()  # noqa: E731
        return torch.compile(vmap(grad(loss), in_dims=(None, 0)), fullgraph=True)(params, x)
    torch.testing.assert_close(per_sample(fused), per_sample_grads(original, x), **TOLERANCE)


def test_compiled_module_keeps_its_formulations():
    """The transform check leaves a plain torch.compile alone (dynamo reads the interpreter-stack
    query's None as true, its type as it is): a compiled call traces the rule's formulation, A's
    fused tail on a CPU."""
    name, args, shape = CONFIGS[0]
    original, fused = pair(name, args, "cpu", dtype=torch.float32, train=False)
    x = torch.rand(shape)
    backend = torch._dynamo.testing.EagerAndRecordGraphs()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(fused, backend=backend, fullgraph=True)(x), original(x),
                                   rtol=1e-4, atol=1e-5)
    assert "fused_ops.max_pool3d_mean" in backend.graphs[0].code
