"""Each formulation of each drop-in module (fused_ops.autotune) against the original, the
autotuner's choice, parameters changed between calls, and CUDA graph capture."""
import copy
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.utils.prune as prune

from conftest import build_pair, requires_cuda
from fused_ops import autotune, reference
from fused_ops import nn as fnn

# (architecture, constructor arguments, input shape): every formulation holds for each (the
# rewrites too: A's and B's pools tile the convolution's output, C's pool does not pad and its output is wide
# enough for fused_conv's saved tiles in training (rewrites.conv2d_avg_pool_sigmoid_sum), D's
# transposed convolution has stride 1 and no padding).
CONFIGS = [
    ("Conv3dDivMaxPoolGAPBiasSum", (3, 4, 3, -1.5, 2, (4, 1, 1, 1), 1), (2, 3, 9, 10, 11)),
    ("ConvTranspose3dMaxPoolMaxPoolSum", (3, 4, 5, 2, 2), (2, 3, 7, 6, 7)),
    ("Conv2dAvgPoolSigmoidSum", (3, 5, 3, 4), (2, 3, 22, 194)),
    ("ConvTranspose3dScaleBatchNormGAP", (3, 4, 3, 2.0), (3, 3, 4, 5, 6)),
]
IDS = ["A", "B", "C", "D"]
# (name, args, shape, formulation) for each configuration and each formulation of its module
FORMULATION_CASES = [pytest.param(*config, formulation, id=f"{letter}-{formulation}")
                     for config, letter in zip(CONFIGS, IDS) for formulation in getattr(fnn, config[0]).FORMULATIONS]


def formulation_input(x, formulation):
    """x as `formulation` takes it: channels last for the *_channels_last ones, which on a GPU hold only
    where they copy x no more than the original does (fused_ops.nn._conv_channels_last)."""
    if formulation.endswith("channels_last"):
        return x.contiguous(memory_format=torch.channels_last_3d if x.dim() == 5 else torch.channels_last)
    return x


def pair(name, args, device, dtype=torch.float64, train=True):
    original, fused = build_pair(name, args)
    return original.to(device, dtype).train(train), fused.to(device, dtype).train(train)


def shared(name, args, device, dtype=torch.float32, train=False):
    """The original and the drop-in around it (from_module: the same parameters and buffers)."""
    original = getattr(reference, name)(*args).to(device, dtype).train(train)
    return original, getattr(fnn, name).from_module(original)


def step(module, x, grad):
    """Output, the input's and every parameter's gradient, and the buffers after one call."""
    module.zero_grad()
    x = x.clone().requires_grad_()
    out = module(x)
    out.backward(grad)
    return [out, x.grad, *[p.grad for p in module.parameters()], *module.buffers()]


@pytest.mark.parametrize("name,args,shape,formulation", FORMULATION_CASES)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_each_formulation_is_the_original(name, args, shape, train, formulation, device):
    """float64: the output, every gradient and the running statistics, forced to each formulation."""
    original, fused = pair(name, args, device, train=train)
    x = formulation_input(torch.rand(shape, dtype=torch.float64, device=device), formulation)
    grad = torch.rand_like(original(x.clone()))
    original, fused = pair(name, args, device, train=train)  # (fresh running statistics)
    expected = step(original, x, grad)
    with autotune.force(formulation):
        actual = step(fused, x, grad)
    assert autotune.last_formulation() == formulation
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name,args,shape,formulation", FORMULATION_CASES)
@pytest.mark.parametrize("autotuned", [True, False], ids=["autotuned", "rule"])
def test_an_empty_batch_gives_the_originals_result(name, args, shape, formulation, autotuned, device):
    """A batch of none, forced to each formulation, the tuner on or off, in training and eval: the
    original's empty result (its shape and dtype, an empty gradient), not a rewrite's reshape error;
    the next call of one batch is the original's too."""
    autotune.set_enabled(autotuned)
    for train in (True, False):
        original, fused = pair(name, args, device, train=train)
        for batch in (0, 1):
            x = torch.rand((batch, *shape[1:]), dtype=torch.float64, device=device)
            expected = original(x)
            with autotune.force(formulation):
                out = fused(x)
            assert out.shape == expected.shape and out.dtype == expected.dtype
            torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-12)
            if train:
                out.sum().backward()


@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_autotuner_keeps_its_choice(name, args, shape, train, device):
    """The first call of a key runs the rule's formulation; the next ones time the others on the
    calls themselves until the key settles on one, which the later calls run; every call's output,
    gradients and running statistics are the original's (no call the user did not make); another
    key starts its own tuning."""
    autotune.clear()
    autotune.set_enabled(False)
    original, fused = pair(name, args, device, train=train)
    x = torch.rand(shape, dtype=torch.float64, device=device)
    grad = torch.rand_like(original(x.clone()))
    original, fused = pair(name, args, device, train=train)
    step(fused, x, grad)
    rule = autotune.last_formulation()
    autotune.set_enabled(True)
    original, fused = pair(name, args, device, train=train)
    ran = []
    with autotune.exploring():
        for _ in range(autotune.MAX_TUNING_CALLS + 2):
            expected, actual = step(original, x, grad), step(fused, x, grad)
            ran.append(autotune.last_formulation())
            for a, e in zip(actual, expected, strict=True):
                torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-12)
    assert ran[0] == rule
    with torch.enable_grad():
        chosen = fused.formulation(x.clone().requires_grad_())
    assert chosen in fused.FORMULATIONS and ran[-1] == chosen, (chosen, ran)
    assert len(autotune._TUNINGS) == 1
    with torch.no_grad():  # another key
        fused(x)
    assert len(autotune._TUNINGS) == 2


def test_autotuner_passes_over_a_formulation_that_raises(monkeypatch):
    """A formulation that raises is not taken; where every one raises, the rule's error is."""
    autotune.clear()
    autotune.set_enabled(True)
    name, args, shape = CONFIGS[0]
    original, fused = pair(name, args, "cpu", train=False)
    run = fused._run

    def failing(formulation, x):
        if formulation != "original":
            raise RuntimeError(f"{formulation} fails")
        return run(formulation, x)

    monkeypatch.setattr(fused, "_run", failing)
    x = torch.rand(shape, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), original(x))
    assert autotune.last_formulation() == "original"
    monkeypatch.setattr(fused, "_run", lambda formulation, x: failing("rule", x))
    with pytest.raises(RuntimeError, match="rule fails"), torch.no_grad():
        fused(torch.rand(1, *shape[1:], dtype=torch.float64))


@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
def test_autotuner_times_no_fake_tensor(name, args, shape, device):
    """A call on fake tensors (the fake propagation of a compiler pass over a graph that calls the
    module: fused_ops.compile_patterns) takes the rule, as under torch.compile: a fake tensor has
    no data to time, keep or capture."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    autotune.clear()
    autotune.set_enabled(True)
    original, fused = pair(name, args, device, dtype=torch.float32)
    expected = original(torch.rand(shape, device=device))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(torch.rand(shape, device=device)).requires_grad_()
        out = fused(x)
        out.sum().backward()
    assert not autotune._TUNINGS
    assert out.shape == expected.shape and out.dtype == expected.dtype
    # eval without autograd, the rules: nothing fake kept for the next real call
    autotune.set_enabled(False)
    original, fused = pair(name, args, device, dtype=torch.float32, train=False)
    x = torch.rand(shape, device=device)
    with torch.no_grad():
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fused(mode.from_tensor(x))
        out = fused(x)
        assert type(out) is torch.Tensor
        torch.testing.assert_close(out, original(x), rtol=1e-4, atol=1e-5)


@requires_cuda
@pytest.mark.parametrize("letter, leader", [("B", "rewrite"), ("C", "fused_conv")])
def test_rule_leads_with_fused_where_launch_bound(letter, leader):
    """On a GPU, B's and C's rules take "fused" (the convolution and one tail kernel) for an input of
    fewer than nn._LAUNCH_BOUND_ELEMENTS elements (the main job's tiny sizes), their rearranged
    formulation from there on (its reduced sizes)."""
    from fused_ops.architectures import ARCHITECTURES
    arch = next(a for a in ARCHITECTURES if a.letter == letter)
    _, fused = pair(arch.name, arch.args, "cuda", dtype=torch.float32, train=False)
    small, large = (torch.rand(arch.input_shape(size), device="cuda") for size in ("tiny", "reduced"))
    assert small.numel() < fnn._LAUNCH_BOUND_ELEMENTS <= large.numel()
    with torch.no_grad():
        fused(small)
        assert autotune.last_formulation() == "fused"
        fused(large)
        assert autotune.last_formulation() == leader


@pytest.mark.parametrize("letter", ["A", "B"])
def test_cpu_rule_leads_with_channels_last_in_float32(letter):
    """On a CPU in float32 A's and B's rules take fused_channels_last (the input copied channels last:
    oneDNN's 3-D convolutions run faster so), with the original's results; in float64 fused."""
    from fused_ops.architectures import ARCHITECTURES
    arch = next(a for a in ARCHITECTURES if a.letter == letter)
    original, fused = pair(arch.name, arch.args, "cpu", dtype=torch.float32, train=False)
    x = torch.rand(arch.input_shape("tiny"))
    with torch.no_grad():
        out = fused(x)
        assert autotune.last_formulation() == "fused_channels_last"
        torch.testing.assert_close(out, original(x), rtol=1e-4, atol=1e-5)
        fused.double()(x.double())
        assert autotune.last_formulation() == "fused"


@pytest.mark.parametrize("letter", ["A", "B"])
def test_cpu_16_bit_module_takes_no_rearranged_or_channels_last_formulation(letter):
    """A bf16 module on a CPU (no autocast) takes the formulations that convolve as the original does, as
    under autocast: the rewrites' and channels-last bf16 convolutions round otherwise, and the max-pools then
    pick other elements (A's bf16 weight gradient was 60x the original's error from float64 by the rewrite)."""
    from fused_ops.architectures import ARCHITECTURES
    arch = next(a for a in ARCHITECTURES if a.letter == letter)
    original, fused = pair(arch.name, arch.args, "cpu", dtype=torch.bfloat16, train=True)
    x = torch.rand(arch.input_shape("tiny")).bfloat16()
    original(x).sum().backward()
    for forced in ("rewrite", "fused_channels_last"):
        fused.zero_grad()
        with autotune.force(forced):
            fused(x).sum().backward()
            assert autotune.last_formulation() in ("fused", "fused_conv", "original"), forced
        for (name, a), b in zip(fused.named_parameters(), original.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=2e-2, atol=1e-2, msg=f"{forced}: {name}")


@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_inputs_of_another_dtype_or_device_as_the_original(name, args, shape, train):
    """An input of another dtype than the parameters' (outside autocast), on another device (meta), or not a
    tensor: the original's error, or its result where it takes the input (B's and C's a meta one). D's eval
    map took a dtype mix, A's and D's fused ops a meta input, before."""
    original, fused = (m.train(train) for m in build_pair(name, args))
    x = torch.rand(shape)
    for bad in (x.double(), x.bfloat16(), x.to("meta"), x.numpy()):
        try:
            expected = original(bad)
        except (RuntimeError, TypeError) as error:
            with pytest.raises(type(error), match=re.escape(str(error))):
                fused(bad)
        else:
            out = fused(bad)
            assert (out.shape, out.dtype, out.device) == (expected.shape, expected.dtype, expected.device)


def test_autotuner_off():
    """Off (the tests' default, conftest), nothing is tuned: each module takes its rule."""
    name, args, shape = CONFIGS[0]
    _, fused = pair(name, args, "cpu", train=False)
    x = torch.rand(shape, dtype=torch.float64)
    with torch.no_grad():
        fused(x)
        assert fused.formulation(x) is None
    assert autotune.last_formulation() == "fused"  # the CPU's rule
    for value, enabled in (("0", False), ("off", False), ("1", True)):
        env = dict(os.environ, FUSED_OPS_AUTOTUNE=value)
        code = "import fused_ops.autotune as a; print(a.is_enabled())"
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert result.stdout.strip() == str(enabled)


# Ways users change a module's parameters and buffers between calls (optimizers and hand-written
# updates, EMA, weight clipping, re-initialisation, checkpoints): each a function of the module.
def _through_data_in_place(m):
    for p in m.parameters():
        p.data.mul_(-1.5).add_(0.25)


def _through_data_copy(m):
    for p in m.parameters():
        p.data.copy_(torch.rand_like(p) - 0.5)


def _data_replaced(m):
    for p in m.parameters():
        p.data = torch.rand_like(p) - 0.5


def _in_place_without_grad(m):
    with torch.no_grad():
        for p in m.parameters():
            p.clamp_(-0.1, 0.1)


def _optimizer_step(m):
    for p in m.parameters():
        p.grad = torch.rand_like(p)
    torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9).step()
    m.zero_grad()


def _state_dict_loaded(m):
    # (positive: a running variance among them)
    m.load_state_dict({k: torch.rand_like(v) + 0.25 if v.is_floating_point() else v
                       for k, v in m.state_dict().items()})


def _parameters_replaced(m):
    for module in m.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                setattr(module, name, torch.nn.Parameter(torch.rand_like(p) - 0.5))


def _buffers_through_data(m):
    for b in m.buffers():
        if b.is_floating_point():
            b.data.mul_(0.5).add_(0.75)


PARAMETER_CHANGES = [_through_data_in_place, _through_data_copy, _data_replaced, _in_place_without_grad,
                     _optimizer_step, _state_dict_loaded, _parameters_replaced, _buffers_through_data]


@pytest.mark.parametrize("name,args,shape,formulation", FORMULATION_CASES)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_parameters_changed_between_calls_are_seen(name, args, shape, formulation, train, device):
    """After calls without autograd (eval under no_grad, and training mode without autograd), the
    parameters and buffers changed in each way users change them (PARAMETER_CHANGES: through .data
    too, which no version counter sees) are seen by the next call of every formulation: the
    original's result (float64), twice, for the same state."""
    original, fused = pair(name, args, device, train=train)
    fused.load_state_dict(original.state_dict())
    x = formulation_input(torch.rand(shape, dtype=torch.float64, device=device), formulation)
    with autotune.force(formulation), torch.no_grad():
        for change in PARAMETER_CHANGES:
            for _ in range(2):
                torch.testing.assert_close(fused(x), original(x), rtol=1e-9, atol=1e-12,
                                           msg=lambda m: f"after {change.__name__}: {m}")
            assert autotune.last_formulation() == formulation
            change(fused)
            original.load_state_dict(fused.state_dict())


class _Doubled(torch.nn.Module):
    def forward(self, weight):
        return 2 * weight


def _weight_parametrized(m):
    # (the convolution's class becomes a subclass whose weight is a property: fused_ops._members reads it by getattr)
    torch.nn.utils.parametrize.register_parametrization(getattr(m, m._CONV), "weight", _Doubled())


def _weight_made_a_plain_tensor(m):
    # (the weight no longer registered: an instance attribute, as torch.nn.utils.weight_norm's old way leaves it)
    conv = getattr(m, m._CONV)
    weight = conv.weight.detach() - 0.25
    del conv.weight
    conv.weight = weight


def _bias_removed(m):
    getattr(m, m._CONV).bias = None


def _weight_a_subclass_property(m):
    # (a subclass whose property of the registered weight's name wins over the registry, as attribute lookup has it)
    conv = getattr(m, m._CONV)
    conv.__class__ = type(f"Halved{type(conv).__name__}", (type(conv),),
                          {"weight": property(lambda self: self._parameters["weight"] * 0.5)})


@pytest.mark.parametrize("name,args,shape,formulation", FORMULATION_CASES)
def test_members_read_as_attribute_lookup_reads_them(name, args, shape, formulation, device):
    """The drop-ins read their members' parameters from the registries where attribute lookup would reach
    them there (fused_ops._members): a parametrized weight (a property), a weight made a plain tensor
    attribute, a bias set to None, a subclass's property of the weight's name are each seen by the next call
    of every formulation, as by the original that shares the members."""
    x = formulation_input(torch.rand(shape, dtype=torch.float64, device=device), formulation)
    for change in (_weight_parametrized, _weight_made_a_plain_tensor, _bias_removed, _weight_a_subclass_property):
        original, fused = shared(name, args, device, dtype=torch.float64)
        with autotune.force(formulation), torch.no_grad():
            fused(x)
            change(fused)
            torch.testing.assert_close(fused(x), original(x), rtol=1e-9, atol=1e-12,
                                       msg=lambda m: f"after {change.__name__}: {m}")
            assert autotune.last_formulation() == formulation


@requires_cuda
@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
def test_parameters_changed_between_graphed_calls_are_seen(name, args, shape):
    """The autotuner's choice replayed from a CUDA graph, where it takes one, sees the parameters and
    buffers changed in each way between calls (eval without autograd, a batch of one: host-bound)."""
    autotune.set_enabled(True)
    original, fused = pair(name, args, "cuda", dtype=torch.float32, train=False)
    fused.load_state_dict(original.state_dict())
    x = torch.rand((1, *shape[1:]), device="cuda")
    with torch.no_grad():
        for change in PARAMETER_CHANGES:
            for _ in range(3):
                torch.testing.assert_close(fused(x), original(x), rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"after {change.__name__}: {m}")
            change(fused)
            original.load_state_dict(fused.state_dict())


@pytest.mark.parametrize("name,args,shape", [CONFIGS[1], CONFIGS[3]], ids=["B", "D"])
def test_parameters_made_under_inference_mode(name, args, shape, device):
    """A parameter made under inference_mode (an inference tensor: no version counter) is
    derived from on each call (nothing kept): the original's results, before and after it
    changes in place."""
    original, fused = shared(name, args, device, dtype=torch.float64)
    conv = fused.conv_transpose
    x = torch.rand(shape, dtype=torch.float64, device=device)
    with torch.inference_mode():
        conv.weight = torch.nn.Parameter(torch.rand_like(conv.weight))  # (shared: the same conv)
        for formulation in ("rewrite", *autotune.FORMULATIONS):
            with autotune.force(formulation):
                torch.testing.assert_close(fused(x), original(x), rtol=1e-9, atol=1e-12)
                conv.weight.mul_(-0.5)
                torch.testing.assert_close(fused(x), original(x), rtol=1e-9, atol=1e-12)


@requires_cuda
@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
@pytest.mark.parametrize("autotuned", [True, False], ids=["autotuned", "rule"])
def test_cuda_graph_eval(name, args, shape, autotuned):
    """Captured in a CUDA graph after warm-up calls on a side stream (the serving recipe), a
    module in eval mode replays the original's result for new inputs, and after an in-place
    update of its parameters too (nothing derived from them is frozen into the graph)."""
    autotune.clear()
    autotune.set_enabled(autotuned)
    original, fused = shared(name, args, "cuda")
    static_x = torch.rand(shape, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            fused(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        static_out = fused(static_x)
    for update in range(2):
        static_x.copy_(torch.rand(shape, device="cuda"))
        graph.replay()
        with torch.no_grad():
            torch.testing.assert_close(static_out, original(static_x), rtol=1e-4, atol=1e-5)
            for p in fused.parameters():
                p.mul_(0.5)


@requires_cuda
@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
def test_make_graphed_callables_training(name, args, shape):
    """torch.cuda.make_graphed_callables of a module in training mode: its forward and
    backward replay the original's output and gradients, step after step."""
    autotune.clear()
    autotune.set_enabled(True)
    original, fused = pair(name, args, "cuda", dtype=torch.float32, train=True)
    sample = torch.rand(shape, device="cuda", requires_grad=True)
    graphed = torch.cuda.make_graphed_callables(fused, (sample,))
    grad = torch.ones_like(copy.deepcopy(original)(sample))
    for _ in range(2):
        x = torch.rand(shape, device="cuda")
        original.load_state_dict(fused.state_dict())  # (the warm-up calls moved the running statistics)
        expected = step(original, x, grad)
        actual = step(graphed, x, grad)
        for a, e in zip(actual, expected, strict=True):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name,args,shape,formulation", FORMULATION_CASES)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_each_formulation_without_autograd(name, args, shape, train, mode, formulation, device):
    """float64, no gradient recorded (the one-pass stacking copy): the output and the running
    statistics, twice."""
    original, fused = pair(name, args, device, train=train)
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    for _ in range(2):
        x = formulation_input(torch.rand(shape, dtype=torch.float64, device=device), formulation)
        with context():
            expected = [original(x), *original.buffers()]
            with autotune.force(formulation):
                actual = [fused(x), *fused.buffers()]
        assert autotune.last_formulation() == formulation
        for a, e in zip(actual, expected, strict=True):
            torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("autotuned", [True, False], ids=["autotuned", "rule"])
def test_eval_after_training_reads_the_new_running_statistics(autotuned, device):
    """D's eval map folds the running statistics in; training steps move them in place (a
    frozen convolution keeps its version): each eval after training reads the new ones."""
    autotune.set_enabled(autotuned)
    name, args, shape = CONFIGS[3]
    original, fused = shared(name, args, device, dtype=torch.float64)
    fused.requires_grad_(False)
    for _ in range(3):
        fused.train()
        for _ in range(2):
            fused(torch.rand(shape, dtype=torch.float64, device=device) * 3 + 1)
        fused.eval()
        x = torch.rand(shape, dtype=torch.float64, device=device)
        with torch.no_grad():
            torch.testing.assert_close(fused(x), original(x), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name,args,shape", CONFIGS[:2], ids=IDS[:2])
def test_inference_mode_then_autograd(name, args, shape, device):
    """A rewrite first called under inference_mode, then recording gradients (what it keeps
    between calls must not be an inference tensor the backward needs)."""
    original, fused = pair(name, args, device)
    x = torch.rand(shape, dtype=torch.float64, device=device)
    with autotune.force("rewrite"):
        with torch.inference_mode():
            fused(x)
        actual = step(fused, x, torch.ones_like(original(x.clone())))
    original, _ = pair(name, args, device)
    expected = step(original, x, torch.ones_like(actual[0]))
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
def test_autotuned_under_a_non_reentrant_checkpoint(name, args, shape):
    """A call of a key still tuning, under torch.utils.checkpoint(use_reentrant=False): the
    checkpoint's recomputation saves what the call saved (no tuning call under saved-tensor hooks)."""
    autotune.set_enabled(True)
    original, fused = pair(name, args, "cpu")
    x = torch.rand(shape, dtype=torch.float64, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(fused, x, use_reentrant=False)
    out.backward(torch.ones_like(out))
    x_ref = x.detach().clone().requires_grad_()
    original(x_ref).backward(torch.ones_like(out))
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-9, atol=1e-12)


def test_from_module_keeps_a_frozen_batch_norm():
    """from_module of a training original whose batch norm is frozen (eval mode): the drop-in leaves the
    member's mode as it is, and its training steps are the original's (outputs, gradients, statistics)."""
    name, args, shape = CONFIGS[3]
    original, _ = pair(name, args, "cpu")
    original.batch_norm.eval()
    reference_model = copy.deepcopy(original)
    fused = getattr(fnn, name).from_module(original)
    assert fused.training and not fused.batch_norm.training
    x = torch.rand(shape, dtype=torch.float64)
    grad = torch.rand_like(copy.deepcopy(reference_model)(x))
    for _ in range(2):
        for got, ref in zip(step(fused, x, grad), step(reference_model, x, grad), strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12)


HOOKS = {
    "forward": lambda module, record: module.register_forward_hook(lambda m, args, out: record() or out * 1.25 + 0.5),
    "forward pre": lambda module, record: module.register_forward_pre_hook(lambda m, args: record()),
    "full backward": lambda module, record: module.register_full_backward_hook(lambda m, gi, go: record()),
}


@pytest.mark.parametrize("name,args,shape,formulation", FORMULATION_CASES)
@pytest.mark.parametrize("hook", list(HOOKS))
def test_every_members_hooks_run(name, args, shape, formulation, hook, device):
    """A hook on any member (the convolution, a pool, the batch norm, the global average; one that
    changes a pool's output too) runs as often as in the original, whatever the formulation forced, and
    the output and gradients are the original's: a member with hooks is called as the original calls it."""
    original, fused = pair(name, args, device)
    x = formulation_input(torch.rand(shape, dtype=torch.float64, device=device), formulation)
    grad = torch.rand_like(copy.deepcopy(original)(x))  # (a copy: the running statistics kept)
    for member, _ in original.named_children():
        counts = []
        for model in (copy.deepcopy(original), copy.deepcopy(fused)):
            calls = []
            HOOKS[hook](getattr(model, member), lambda: calls.append(1))
            with autotune.force(formulation):
                results = step(model, x, grad)
            counts.append((len(calls), results))
        (expected_calls, expected), (ran_calls, results) = counts
        assert ran_calls == expected_calls > 0, member
        for got, ref in zip(results, expected, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12, msg=member)


def test_global_hooks_see_every_member_called():
    """A global forward hook (nn.modules.module.register_module_forward_hook) sees the original's module
    calls, in order."""
    for name, args, shape in CONFIGS:
        original, fused = pair(name, args, "cpu", train=False)
        x = torch.rand(shape, dtype=torch.float64)
        seen = []
        handle = torch.nn.modules.module.register_module_forward_hook(lambda m, args, out: seen.append(type(m)))
        try:
            with torch.no_grad():
                expected = original(x)
                called, seen[:] = list(seen), []
                torch.testing.assert_close(fused(x), expected, rtol=1e-9, atol=1e-12)
        finally:
            handle.remove()
        assert [type(m) for m in original.children()] == called[:-1] and seen[:-1] == called[:-1], name


@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
@pytest.mark.parametrize("autotuned", [True, False], ids=["autotuned", "rule"])
def test_convolution_hooks_run(name, args, shape, autotuned, device):
    """A pruned convolution (its weight set by a forward pre-hook from weight_orig and the mask)
    gives the original's results across optimizer steps: the module is called, its hooks run."""
    autotune.set_enabled(autotuned)
    original, fused = pair(name, args, device)
    conv = "conv" if hasattr(original, "conv") else "conv_transpose"
    for model in (original, fused):
        prune.l1_unstructured(getattr(model, conv), "weight", amount=0.5)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (original, fused)]
    x = torch.rand(shape, dtype=torch.float64, device=device)
    for _ in range(2):
        for model, optimizer in zip((original, fused), optimizers):
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert autotune.last_formulation() in ("fused", "original")
    original.eval(), fused.eval()
    with torch.no_grad():
        torch.testing.assert_close(fused(x), original(x), rtol=1e-9, atol=1e-12)
