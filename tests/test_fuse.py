"""fused_ops.fuse: the four architectures' chains found in models written without fused_ops in
mind (their own names, functional spellings, inside nn.Sequential and a larger network) and run
by the drop-in modules, with the original's outputs, gradients, running statistics and
state_dict; what it must leave alone (an intermediate result used twice, other ops, an
untraceable model) left alone and reported."""
import copy
import io
import operator
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import fused_ops
from conftest import DEVICES
from fused_ops import fusion
from fusable_models import InPlace, Network, Tails, check_step, inputs, tails_inputs


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("device", DEVICES)
def test_fuses_the_four_chains_with_the_originals_results(train, device):
    torch.manual_seed(0)
    check_fuses_the_four_chains(Network().double().to(device).train(train), device, train)


def check_fuses_the_four_chains(original, device, train):
    """fuse(a copy of `original`) fuses its four chains, shares its parameters and keeps its
    state_dict's keys; two steps of it against the original (check_step)."""
    model = copy.deepcopy(original)
    fused, report = fused_ops.fuse(model, report=True)
    assert report.traced and [letter for letter, _ in report.fused] == ["A", "B", "C", "D"] and not report.skipped
    assert sorted(fused.state_dict()) == sorted(original.state_dict())
    assert all(fused.get_parameter(name) is p for name, p in model.named_parameters())  # (shared, not copied)
    for step in range(2):
        args = inputs(device)
        check_step(model, original, fused(*args), args, train)


class Functional(nn.Module):
    """The four chains with functional convolutions over the model's own parameters (A's and D's
    with a bias, B's and C's without)."""

    def __init__(self):
        super().__init__()
        self.a_weight = nn.Parameter(torch.randn(4, 3, 3, 3, 3) / 9)
        self.a_bias = nn.Parameter(torch.randn(4))
        self.a_offset = nn.Parameter(torch.randn(4, 1, 1, 1))
        self.b_weight = nn.Parameter(torch.randn(3, 2, 5, 5, 5) / 9)
        self.c_weight = nn.Parameter(torch.randn(5, 3, 3, 3) / 5)
        self.d_weight = nn.Parameter(torch.randn(3, 6, 3, 3, 3) / 9)
        self.d_bias = nn.Parameter(torch.randn(6))
        self.norm = nn.BatchNorm3d(6)

    def forward(self, x, image):
        a = F.adaptive_avg_pool3d(F.max_pool3d(F.conv3d(x, self.a_weight, self.a_bias) / 2.0, 2), 1)
        a = (a + self.a_offset).sum(1)
        b = F.conv_transpose3d(x, self.b_weight, stride=2, padding=2)
        b = F.max_pool3d(F.max_pool3d(b, 2), 3).sum(1, keepdim=True)
        c = torch.sigmoid(F.avg_pool2d(F.conv2d(image, self.c_weight), 2)).sum((1, 2, 3))
        d = F.adaptive_avg_pool3d(self.norm(F.conv_transpose3d(x, self.d_weight, self.d_bias) * 2.0), 1)
        return a, b, c, d


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("device", DEVICES)
def test_functional_convolutions_fuse_over_the_models_parameters(train, device):
    torch.manual_seed(9)
    check_fuses_the_four_chains(Functional().double().to(device).train(train), device, train)


@pytest.mark.parametrize("device", DEVICES)
def test_modes_follow_the_model(device):
    """The fused calls take the traced model's train / eval mode: after training steps, eval uses
    the running statistics the steps updated, as the original does."""
    torch.manual_seed(1)
    original = Network().double().to(device)
    fused = fused_ops.fuse(copy.deepcopy(original))
    for _ in range(2):
        fused(*inputs(device))
        original(*inputs(device))
    fused.eval()
    original.eval()
    with torch.no_grad():
        for out, ref in zip(fused(*inputs(device)), original(*inputs(device))):
            torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


def check_eval(fused, original, args):
    """Both in eval mode, without autograd: the fused model's outputs are the original's (float64)."""
    with torch.no_grad():
        for out, ref in zip(fused.eval()(*args), original.eval()(*args), strict=True):
            torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


def round_trips(fused):
    """A deep copy, a pickle's and torch.save's round trips of `fused`."""
    buffer = io.BytesIO()
    torch.save(fused, buffer)
    buffer.seek(0)
    return {"deepcopy": copy.deepcopy(fused), "pickle": pickle.loads(pickle.dumps(fused)),
            "torch.save": torch.load(buffer, weights_only=False)}


@pytest.mark.parametrize("network", [Network, Tails, Functional])
def test_copies_and_pickles_compute_with_their_own_parameters_and_mode(network):
    """A deep copy (an EMA model, say) or an unpickled copy of a fuse result has its own parameters,
    buffers and mode, which its fused calls use: a copy trained, changed or put in eval mode computes
    as the original model so changed, and the model it came from as it was; the state_dict's keys
    are the model's (the fused calls hold no tensors of their own)."""
    torch.manual_seed(2)
    original = network().double()
    args = tails_inputs("cpu") if network is Tails else inputs("cpu")
    fused = fused_ops.fuse(copy.deepcopy(original))
    with torch.no_grad():
        before = fused.eval()(*args)
    fused.train()
    for how, twin in round_trips(fused).items():
        assert sorted(twin.state_dict()) == sorted(original.state_dict()), how
        changed = copy.deepcopy(original)
        for model in (twin, changed):
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5).add_(0.25)
            model(*args)  # (a training call: the running statistics)
            model.eval()
        for out, ref in zip(twin(*args), changed(*args), strict=True):
            torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12, msg=how)
    with torch.no_grad():
        for out, ref in zip(fused.eval()(*args), before, strict=True):
            torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12, msg="the model copied")


@pytest.mark.parametrize("network", [Network, Tails, Functional])
def test_functional_call_and_per_sample_gradients_see_the_tensors_given(network):
    """torch.func.functional_call of a fuse result computes with the tensors it is given (parameters the
    fused calls hold themselves, A's added one and a functional convolution's, included), and so do
    per-sample gradients (vmap of grad: the fused calls run ops functorch transforms); a parameter
    assigned anew is the one used."""
    torch.manual_seed(4)
    original = network().double().eval()
    args = tails_inputs("cpu") if network is Tails else inputs("cpu")
    fused = fused_ops.fuse(copy.deepcopy(original))
    buffers = dict(original.named_buffers())
    given = {name: p.detach() * 1.5 - 0.1 for name, p in original.named_parameters()}
    with torch.no_grad():
        outs, refs = functional_call(fused, given | buffers, args), functional_call(original, given | buffers, args)
        for out, ref in zip(outs, refs, strict=True):
            torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)

    def loss(model):
        def one_sample(parameters, *sample):
            outs = functional_call(model, parameters | buffers, tuple(t.unsqueeze(0) for t in sample))
            return sum(out.sum() for out in outs)
        return one_sample

    per_sample = vmap(grad(loss(fused)), in_dims=(None, *[0] * len(args)))(given, *args)
    expected = vmap(grad(loss(original)), in_dims=(None, *[0] * len(args)))(given, *args)
    for name in expected:
        torch.testing.assert_close(per_sample[name], expected[name], rtol=1e-9, atol=1e-11, msg=name)
    for model in (fused, original):  # (assigned anew: another Parameter object)
        for name, p in list(model.named_parameters()):
            owner, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(owner), attribute, nn.Parameter(given[name].clone()))
    with torch.no_grad():
        for out, ref in zip(fused(*args), original(*args), strict=True):
            torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("network", [Network, Tails])
def test_hooks_on_the_models_modules_run(network):
    """Hooks registered on the model's modules after fuse (a pool's, the batch norm's; one changes its
    module's output) run as they do in the original, in the fused chains and the fused tails alike."""
    torch.manual_seed(5)
    original = network().double()
    args = tails_inputs("cpu") if network is Tails else inputs("cpu")
    model = copy.deepcopy(original)
    fused = fused_ops.fuse(model)  # (model's members: check_step compares its gradients in its order)
    counts = {}
    for tag, hooked in (("original", original), ("fused", fused)):
        for name, module in hooked.named_modules():
            if isinstance(module, (nn.MaxPool3d, nn.AvgPool2d, nn.BatchNorm3d)):
                def hook(m, inputs, out, key=(tag, name)):
                    counts[key] = counts.get(key, 0) + 1
                    return out * 1.25 + 0.5
                module.register_forward_hook(hook)
    check_step(model, original, fused(*args), args, train=True)
    assert counts and all(counts[("fused", name)] == n for (tag, name), n in counts.items() if tag == "original")


@pytest.mark.parametrize("network", [Network, Tails])
@pytest.mark.parametrize("frozen", ["before fuse", "after fuse"])
def test_a_frozen_batch_norm_stays_frozen(network, frozen):
    """A batch norm put in eval mode inside a training model (fine-tuning with frozen statistics), before
    or after fuse: the fused calls leave its mode alone, and training steps give the original's outputs,
    gradients and running statistics."""
    torch.manual_seed(6)
    original = network().double().train()
    norm = "d_norm" if network is Network else "norm"
    args = tails_inputs("cpu") if network is Tails else inputs("cpu")
    model = copy.deepcopy(original)
    if frozen == "before fuse":
        model.get_submodule(norm).eval()
    fused = fused_ops.fuse(model)
    if frozen == "after fuse":  # (an eval call first: its fused call's mode set to eval, then back)
        with torch.no_grad():
            fused.eval()(*args)
        fused.train().get_submodule(norm).eval()
    original.get_submodule(norm).eval()
    for _ in range(2):
        check_step(model, original, fused(*args), args, train=True)
    assert not fused.get_submodule(norm).training and fused.training


def test_parameters_loaded_with_assign_are_used():
    """load_state_dict(assign=True) (new parameter objects, a checkpoint's) into a fuse result: its calls
    compute with them, as the original does after the same load."""
    torch.manual_seed(7)
    original = Functional().double()
    args = inputs("cpu")
    fused = fused_ops.fuse(copy.deepcopy(original))
    state = {name: value * 0.5 + 0.1 if value.is_floating_point() else value
             for name, value in original.state_dict().items()}
    original.load_state_dict(state, assign=True)
    fused.load_state_dict({name: value.clone() for name, value in state.items()}, assign=True)
    check_eval(fused, original, args)


def test_a_fuse_result_fused_again_keeps_its_calls():
    """fuse of a fuse result traces it, its fused calls kept as they are (nothing more to fuse), with the
    same results and state_dict keys."""
    torch.manual_seed(9)
    original = Network().double()
    twice, report = fused_ops.fuse(fused_ops.fuse(copy.deepcopy(original)), report=True)
    assert report.traced and not report.fused
    assert sorted(twice.state_dict()) == sorted(original.state_dict())
    check_eval(twice, original, inputs("cpu"))


class Pooled(nn.Module):
    """A- and D-tails whose global averages are modules (which a user may replace)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(3, 4, 3)
        self.pool, self.norm = nn.MaxPool3d(2), nn.BatchNorm3d(4)
        self.gap, self.gap2 = nn.AdaptiveAvgPool3d(1), nn.AdaptiveAvgPool3d(1)

    def forward(self, x, image):
        h = self.conv(x)
        return self.gap(self.pool(h / 2.0)), self.gap2(self.norm(h * 2.0)), h.sum()


REPLACEMENTS = [  # (model, path, the module put there after fuse)
    (Network, "pools.1", nn.MaxPool3d(2, stride=1)),  # (B's chain: the same type)
    (Network, "pools.1", nn.Identity()),  # (another type: the original's forward)
    (Network, "a_conv", nn.Sequential(nn.Conv3d(8, 16, 3))),  # (another type, in A's chain with its held parameter)
    (Network, "d_norm", "sync"),  # (convert_sync_batchnorm after fuse)
    (Tails, "pool", nn.MaxPool3d(3, stride=2)),
    (Pooled, "gap", nn.AdaptiveAvgPool3d(2)),  # (a tail's pool the fused op does not compute: its traced ops)
    (Pooled, "gap2", nn.AdaptiveAvgPool3d(2)),
]


@pytest.mark.parametrize("network,path,replacement", REPLACEMENTS,
                         ids=[f"{n.__name__}-{p}-{type(r).__name__}" for n, p, r in REPLACEMENTS])
def test_modules_replaced_after_fuse_are_used(network, path, replacement):
    """A module of a fused chain or tail replaced after fuse (by one of its type, another type, a
    convert_sync_batchnorm) is the one used: outputs and gradients as the original's so changed."""
    torch.manual_seed(8)
    original = network().double()
    args = tails_inputs("cpu") if network is Tails else inputs("cpu")
    model = copy.deepcopy(original)
    fused = fused_ops.fuse(model)
    owner, _, name = path.rpartition(".")
    for changed in (original, fused):
        if replacement == "sync":
            new = nn.SyncBatchNorm.convert_sync_batchnorm(changed.get_submodule(path))
        else:
            new = copy.deepcopy(replacement).double()
        for target in (changed, model) if changed is fused else (changed,):  # (model: check_step's parameters)
            setattr(target.get_submodule(owner), name, new)
    check_step(model, original, fused(*args), args, train=True)
    check_eval(fused, original, args)
    given = {name: p.detach() * 1.5 - 0.1 for name, p in original.named_parameters()}  # (functional_call's)
    with torch.no_grad():
        outs, refs = functional_call(fused, given, args), functional_call(original, given, args)
        for out, ref in zip(outs, refs, strict=True):
            torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


class SharedIntermediate(nn.Module):
    """A's chain whose quotient is returned too: fusing it would lose that use."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(2, 4, 3)
        self.bias = nn.Parameter(torch.randn(4, 1, 1, 1))
        self.pool = nn.MaxPool3d(2)
        self.average = nn.AdaptiveAvgPool3d(1)

    def forward(self, x):
        y = self.conv(x) / 2.0
        out = torch.sum(self.average(self.pool(y)) + self.bias, dim=1)
        return out, y.amax()


class OtherOps(nn.Module):
    """Convolutions followed by other ops than the chains' and tails' (a mean not kept, a mean for
    the sum): nothing to fuse."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(2, 4, 3)
        self.conv2d = nn.Conv2d(2, 4, 3)

    def forward(self, x, image):
        y = F.max_pool3d(torch.relu(self.conv(x)), 2).mean((2, 3, 4))
        z = torch.sigmoid(F.avg_pool2d(self.conv2d(image) * 3.0, 2)).mean(dim=(1, 2, 3))
        return y, z


def test_an_intermediate_used_elsewhere_is_not_fused():
    """The chain through the quotient used twice is not fused (the report says why); the tail
    after it, which reads the quotient, is."""
    torch.manual_seed(2)
    original = SharedIntermediate().double()
    fused, report = fused_ops.fuse(copy.deepcopy(original), report=True)
    assert report.fused == [("A-tail", ["pool", "average"])]
    [(letter, node, why)] = report.skipped
    assert letter == "A" and node == "conv" and "used by 2 nodes" in why
    x = torch.rand(2, 2, 6, 7, 8, dtype=torch.float64)
    for out, ref in zip(fused(x), original(x)):
        assert torch.equal(out, ref)


def test_a_write_before_a_chain_leaves_it_fused():
    """Eager, a chain reading an input written in place before it fuses (the compile patterns
    leave it: torch 2.11's Inductor miscompiled it), with the original's results; the chain the
    write falls inside stays, its tail fuses."""
    torch.manual_seed(6)
    original = InPlace().double().eval()
    fused, report = fused_ops.fuse(copy.deepcopy(original), report=True)
    assert sorted(letter for letter, _ in report.fused) == ["C", "C-tail"], report
    x = torch.rand(2, 3, 12, 13, dtype=torch.float64)
    with torch.no_grad():
        for out, ref in zip(fused(x.clone()), original(x.clone()), strict=True):
            torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_the_writes_a_match_watches_for():
    """fusion._written: the in-place spellings (x.add_, x += ..., x[i] = v, inplace=True) write
    their first argument; out-of-place calls write nothing."""
    graph = torch.fx.Graph()  # (symbolic tracing refuses x[i] = v)
    x, y = graph.placeholder("x"), graph.placeholder("y")
    nodes = {"add_": graph.call_method("add_", (x, 1)), "iadd": graph.call_function(operator.iadd, (y, 1)),
             "setitem": graph.call_function(operator.setitem, (x, 0, 2.0)),
             "__setitem__": graph.call_method("__setitem__", (y, 0, 2.0)),
             "relu": graph.call_function(F.relu, (y,), {"inplace": True}),
             "add": graph.call_function(torch.add, (x, y)), "relu_1": graph.call_function(F.relu, (x,))}
    writes = {name: fusion._written(node) for name, node in nodes.items()}
    assert writes == {"add_": [x], "iadd": [y], "setitem": [x], "__setitem__": [y], "relu": [y], "add": [],
                      "relu_1": []}, writes


def test_other_ops_are_left_as_they_were():
    torch.manual_seed(3)
    original = OtherOps().double()
    fused, report = fused_ops.fuse(copy.deepcopy(original), report=True)
    assert report.fused == []
    [(name, node, why)] = report.skipped  # (the pool and the sigmoid began C's tail)
    assert name == "C-tail" and node == "avg_pool2d" and "mean_1 is not the chain's next op" in why
    assert "relu" in fused.code and "avg_pool2d" in fused.code
    x, image = torch.rand(2, 2, 6, 7, 8, dtype=torch.float64), torch.rand(2, 2, 9, 9, dtype=torch.float64)
    for out, ref in zip(fused(x, image), original(x, image)):
        assert torch.equal(out, ref)


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)

    def forward(self, x):
        y = self.conv(x)
        return y if y.sum() > 0 else -y  # (data-dependent control flow)


def test_an_untraceable_model_is_returned_as_it_is():
    model = Untraceable()
    fused, report = fused_ops.fuse(model, report=True)
    assert fused is model and not report.traced and "nothing fused" in str(report)


def test_an_untraceable_model_with_example_inputs_that_export_cannot_take_either():
    """Data-dependent control flow: torch.export refuses it too; returned as it is, both reasons given."""
    model = Untraceable()
    fused, report = fused_ops.fuse(model, (torch.rand(1, 2, 5, 5, 5),), report=True)
    assert fused is model and not report.traced and "torch.export" in report.reason


class ShapeBranching(nn.Module):
    """Control flow on a shape (symbolic tracing refuses it; torch.export specializes it), around
    C's chain and A's and B's tails."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.conv3d = nn.Conv3d(3, 6, 3)

    def forward(self, image, volume):
        if image.shape[0] > 1:
            image = image * 2.0
        c = torch.sigmoid(F.avg_pool2d(self.conv(image), 4)).sum(dim=(1, 2, 3))
        h = self.conv3d(volume)
        a = F.adaptive_avg_pool3d(F.max_pool3d(h / -1.5, 2), 1)
        b = F.max_pool3d(F.max_pool3d(torch.relu(h), 2), 2, stride=1).sum(1, keepdim=True)
        return c, a, b


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_the_export_fallback_fuses_with_the_originals_results(train):
    """symbolic tracing fails; with example inputs torch.export traces it: C's chain and A's and B's
    tails by the fused ops, the model's own parameters, the original's outputs and gradients."""
    torch.manual_seed(8)
    original = ShapeBranching().double().train(train)
    model = copy.deepcopy(original)
    g = torch.Generator().manual_seed(9)
    args = (torch.rand(2, 3, 23, 27, generator=g, dtype=torch.float64),
            torch.rand(2, 3, 9, 11, 12, generator=g, dtype=torch.float64))
    fused, report = fused_ops.fuse(model, args, report=True)
    assert report.traced and report.exported and "torch.export" in str(report)
    assert sorted(name for name, _ in report.fused) == ["A-tail", "B-tail", "C"], report
    assert fused.get_parameter("conv.weight") is model.conv.weight
    with torch.profiler.profile() as profile:
        outputs = fused(*args)
    ran = {event.name for event in profile.events()}
    assert {"fused_ops::conv2d_sigmoid_sum", "fused_ops::max_pool3d_mean", "fused_ops::max_pool3d_cascade_sum"} <= ran
    check_step(model, original, outputs, args, train)


def test_the_reference_architectures_fuse_to_their_drop_ins():
    """Each of the SPEC's architectures, traced whole, is one fused chain of its own letter."""
    from fused_ops import architectures

    for architecture in architectures.ARCHITECTURES:
        torch.manual_seed(4)
        original = architecture.build_original().double()
        fused, report = fused_ops.fuse(copy.deepcopy(original), report=True)
        assert [chain for chain, _ in report.fused] == [architecture.letter], report
        x = torch.rand(architecture.input_shape("tiny"), dtype=torch.float64)
        torch.testing.assert_close(fused(x), original(x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("device", DEVICES)
def test_tails_alone_are_fused_with_the_originals_results(train, device):
    torch.manual_seed(5)
    original = Tails().double().to(device).train(train)
    model = copy.deepcopy(original)
    fused, report = fused_ops.fuse(model, report=True)
    assert sorted(name for name, _ in report.fused) == ["A-tail", "A-tail", "B-tail", "C-tail", "D-tail"], report
    x, image = tails_inputs(device)
    with torch.profiler.profile() as profile:
        outputs = fused(x, image)
    ran = {event.name for event in profile.events()}
    assert {"fused_ops::max_pool3d_mean", "fused_ops::max_pool3d_cascade_sum",
            "fused_ops::avg_pool2d_sigmoid_sum", "fused_ops::batch_norm_gap"} <= ran
    check_step(model, original, outputs, (x, image), train)


def test_a_cascade_tail_on_unbatched_input_runs_the_traced_ops():
    """A 4-D (unbatched) input's channel sum is over its depth: the tail's call runs the traced ops."""

    class Cascade(nn.Module):
        def forward(self, y):
            return F.max_pool3d(F.max_pool3d(y, 2), 3).sum(1, keepdim=True)

    fused, report = fused_ops.fuse(Cascade(), report=True)
    assert [name for name, _ in report.fused] == ["B-tail"]
    y = torch.rand(4, 13, 14, 15, dtype=torch.float64)
    assert torch.equal(fused(y), Cascade()(y))


@pytest.mark.parametrize("network", [Network, Tails])
def test_autocast_returns_the_originals_dtypes(network):
    """Under CPU bfloat16 autocast the fused calls return the dtype each traced chain returns
    (autocast runs the CPU's pools in float32), within bfloat16's rounding of the original."""
    torch.manual_seed(7)
    original = network().eval()
    fused = fused_ops.fuse(copy.deepcopy(original))
    args = (inputs if network is Network else tails_inputs)("cpu", torch.float32)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        outputs, expected = fused(*args), original(*args)
    for out, ref in zip(outputs, expected):
        assert out.dtype == ref.dtype and out.shape == ref.shape
        torch.testing.assert_close(out.float(), ref.float(), rtol=3e-2, atol=3e-2 * ref.float().abs().max().item())


def test_a_zero_divisor_stays_a_traced_division():
    """The fused ops refuse a zero divisor where PyTorch's division gives infinities: the division
    stays as traced (only the pool and the average after it are fused), with the original's result."""

    class ByZero(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv3d(2, 3, 3)

        def forward(self, x):
            return F.adaptive_avg_pool3d(F.max_pool3d(self.conv(x) / 0.0, 2), 1)

    torch.manual_seed(8)
    original = ByZero().double()
    fused, report = fused_ops.fuse(copy.deepcopy(original), report=True)
    assert report.fused == [("A-tail", ["max_pool3d", "adaptive_avg_pool3d"])]
    x = torch.rand(2, 2, 6, 7, 8, dtype=torch.float64)
    torch.testing.assert_close(fused(x), original(x), equal_nan=True)
