"""The autotuner's CUDA-graph candidate (fused_ops._graphed): an eval call without gradients,
or a training step (forward and backward), replayed from a graph of its kept formulation gives
the original's results, follows the parameters (updated in place or replaced), the settings,
the hooks and autocast, never hands out memory a later call overwrites, and is not taken where
it must not be (a second forward before the first one's backward, saved-tensor hooks)."""
import os
import subprocess
import sys

import pytest
import torch
import torch.utils.checkpoint

from conftest import requires_cuda
from fused_ops import _graphed, autotune
from fused_ops.nn import _Formulations
from test_formulations import CONFIGS, IDS, pair, shared

def settle_graphed(monkeypatch, formulation=None, module_budget=False):
    """Each key settles at its first call on `formulation` (the rule's first where None or not
    its module's), replayed from a graph from its first call on (no verdict timed: each call replayed); a
    graph kept whatever it holds up to MEMORY_LIMIT (the tests' convolution outputs, a module's own
    budget, take kilobytes), or within the module's budget where module_budget."""
    init = autotune._Tuning.__init__

    def settled(self, key, order):
        init(self, key, order)
        self.choice = (formulation if formulation in order else order[0], True)
    monkeypatch.setattr(autotune._Tuning, "__init__", settled)
    monkeypatch.setattr(autotune._Tuning, "replay_timing", lambda self, module, signature, x: None)  # (no verdict)
    monkeypatch.setattr(autotune, "HOT_CALLS", 1)
    if not module_budget:
        monkeypatch.setattr(_Formulations, "_graph_budget", lambda self, x: _graphed.MEMORY_LIMIT)


@pytest.fixture
def graphs_win(monkeypatch):
    """The tuner takes the graphed candidate wherever it may, from a key's first call."""
    settle_graphed(monkeypatch)
    autotune.clear()
    autotune.set_enabled(True)
    yield
    autotune.clear()


@requires_cuda
@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_replays_follow_inputs_and_parameters(name, args, shape, mode, graphs_win):
    """float64: new inputs, earlier results kept, parameters updated in place and replaced,
    a setting changed: each call the original's result."""
    original, fused = shared(name, args, "cuda", dtype=torch.float64)
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with context():
        x = torch.rand(shape, dtype=torch.float64, device="cuda")
        first = fused(x)
        assert fused.graphed(x)
        kept = first.clone()
        for _ in range(2):
            x = torch.rand(shape, dtype=torch.float64, device="cuda")
            torch.testing.assert_close(fused(x), original(x), rtol=1e-9, atol=1e-12)
        assert torch.equal(first, kept)  # (a result is the caller's: no replay writes it)
        for p in fused.parameters():
            p.mul_(-0.5)
        torch.testing.assert_close(fused(x), original(x), rtol=1e-9, atol=1e-12)
        conv = fused.conv if hasattr(fused, "conv") else fused.conv_transpose
        conv.weight = torch.nn.Parameter(torch.rand_like(conv.weight))  # (shared: the same conv)
        torch.testing.assert_close(fused(x), original(x), rtol=1e-9, atol=1e-12)
        assert fused.graphed(x)
        setting = {"A": "divisor", "D": "scale_factor"}.get(IDS[[c[0] for c in CONFIGS].index(name)])
        if setting is not None:
            setattr(original, setting, 3.0)
            setattr(fused, setting, 3.0)
            torch.testing.assert_close(fused(x), original(x), rtol=1e-9, atol=1e-12)
            # (captured again for the new setting)
            assert [g.stamp[0][0] for g, _ in _graphed._GRAPHS[fused].values()] == [fused._config()]


@requires_cuda
@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
def test_no_graph_where_it_must_not(name, args, shape, graphs_win, monkeypatch):
    """Training mode, recorded gradients, a convolution with hooks (run on each call), a side
    stream (a user's own capture): no replay of the module's graph, the original's results."""
    replays = []
    replay = _graphed.GraphedCall.__call__
    monkeypatch.setattr(_graphed.GraphedCall, "__call__", lambda graph, x: replays.append(1) or replay(graph, x))
    original, fused = shared(name, args, "cuda", dtype=torch.float64)
    x = torch.rand(shape, dtype=torch.float64, device="cuda")
    fused.train(), original.train()
    torch.testing.assert_close(fused(x), original(x), rtol=1e-9, atol=1e-12)
    fused.eval(), original.eval()
    with torch.enable_grad():
        torch.testing.assert_close(fused(x), original(x), rtol=1e-9, atol=1e-12)
    assert not replays
    with torch.no_grad():
        fused(x)
        assert fused.graphed(x) and replays
        conv = fused.conv if hasattr(fused, "conv") else fused.conv_transpose
        calls = []
        handle = conv.register_forward_hook(lambda module, args, out: calls.append(1))
        replays.clear()
        for _ in range(2):
            torch.testing.assert_close(fused(x), original(x), rtol=1e-9, atol=1e-12)
        handle.remove()
        assert len(calls) == 2 + 2 and not replays  # (the hook runs in the original's calls too)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        out = fused(x)
    torch.cuda.current_stream().wait_stream(side)
    assert not replays
    torch.testing.assert_close(out, original(x), rtol=1e-9, atol=1e-12)


def training_step(module, x, grad):
    """Output and the gradients of x (where it requires them) and of every parameter."""
    out = module(x)
    inputs = [t for t in (x, *module.parameters()) if t.requires_grad]
    return [out, *torch.autograd.grad(out, inputs, grad)]


def sgd(module):
    with torch.no_grad():
        for p in module.parameters():
            p.sub_(0.1 * torch.rand_like(p))


@pytest.fixture
def count_step_replays(monkeypatch):
    """The replays of training-step graphs, counted as made."""
    replays = []
    replay = _graphed.GraphedStep.__call__

    def counted(graph, x):
        out = replay(graph, x)
        replays.append(out is not None)
        return out
    monkeypatch.setattr(_graphed.GraphedStep, "__call__", counted)
    return replays


@requires_cuda
@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
@pytest.mark.parametrize("x_grad", [True, False], ids=["x_grad", "params_only"])
def test_training_steps_replayed(name, args, shape, x_grad, graphs_win, count_step_replays):
    """float64 training steps, parameters updated in place between them: each step's output,
    gradients and running statistics are the original's; results handed out stay."""
    original, fused = pair(name, args, "cuda")
    results = []
    for _ in range(3):
        x = torch.rand(shape, dtype=torch.float64, device="cuda", requires_grad=x_grad)
        grad = torch.rand_like(original(x.detach()))
        original.load_state_dict(fused.state_dict())  # (the running statistics as the fused module's)
        expected = training_step(original, x, grad)
        actual = training_step(fused, x, grad)
        assert fused.graphed(x)
        for a, e in zip(actual + list(fused.buffers()), expected + list(original.buffers()), strict=True):
            torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-12)
        results.append(([a.clone() for a in actual], actual))
        sgd(original), fused.load_state_dict(original.state_dict())
    assert len(count_step_replays) >= 3 and all(count_step_replays)
    for kept, handed_out in results:
        for k, h in zip(kept, handed_out):
            assert torch.equal(k, h)


@requires_cuda
@pytest.mark.parametrize("name,args,shape", CONFIGS[:3], ids=IDS[:3])
def test_second_forward_before_backward(name, args, shape, graphs_win, count_step_replays):
    """Two forwards before their backwards (in either order), and a backward that keeps its
    graph followed by another forward: the later forward runs without the graph (whose
    activations are the earlier call's), every gradient the original's."""
    original, fused = pair(name, args, "cuda")
    x = [torch.rand(shape, dtype=torch.float64, device="cuda") for _ in range(3)]
    grad = torch.rand_like(original(x[0]))
    training_step(fused, x[0], grad)  # (tuned, captured)
    count_step_replays.clear()
    params = list(fused.parameters())
    first, second = fused(x[1]), fused(x[2])
    assert count_step_replays == [True, False]
    second_grads, first_grads = torch.autograd.grad(second, params, grad), torch.autograd.grad(first, params, grad)
    for actual, x_ in ((first_grads, x[1]), (second_grads, x[2])):
        expected = torch.autograd.grad(original(x_), list(original.parameters()), grad)
        for a, e in zip(actual, expected, strict=True):
            torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-12)
    count_step_replays.clear()
    out = fused(x[1])
    kept = torch.autograd.grad(out, params, grad, retain_graph=True)
    fused(x[2])
    again = torch.autograd.grad(out, params, grad)
    assert count_step_replays == [True, False]
    for a, e in zip(again, kept, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-12)


@requires_cuda
@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
def test_double_backward_through_a_replay(name, args, shape, graphs_win, count_step_replays, monkeypatch):
    """A gradient penalty (the input's gradient with create_graph, then differentiated) through a
    replayed step of a fused formulation (a replay records no graph: the create_graph backward runs
    the original's ops): the original's second-order gradients, its running statistics updated
    once."""
    settle_graphed(monkeypatch, "fused")
    original, fused = pair(name, args, "cuda")
    x = torch.rand(shape, dtype=torch.float64, device="cuda", requires_grad=True)
    grad = torch.rand_like(original(x.detach()))
    training_step(fused, x, grad)
    original.load_state_dict(fused.state_dict())
    count_step_replays.clear()
    results = []
    for module in (original, fused):
        out = module(x)
        (grad_x,) = torch.autograd.grad(out, x, grad, create_graph=True)
        penalty = grad_x.square().sum()  # (A's bias does not reach x's gradient: a zero one)
        results.append(torch.autograd.grad(penalty, list(module.parameters()), allow_unused=True, materialize_grads=True)
                       + tuple(module.buffers()))
    assert count_step_replays == [True] and fused.formulation(x) == "fused"
    for e, a in zip(*results, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-12)


@requires_cuda
@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
def test_checkpointed_steps_not_replayed(name, args, shape, graphs_win, count_step_replays):
    """A non-reentrant checkpoint (saved-tensor hooks that match the recomputation's saved
    tensors with the call's): no replay, the original's gradients."""
    original, fused = pair(name, args, "cuda")
    x = torch.rand(shape, dtype=torch.float64, device="cuda", requires_grad=True)
    grad = torch.rand_like(original(x.detach()))
    training_step(fused, x, grad)
    count_step_replays.clear()
    original.load_state_dict(fused.state_dict())
    grads = []
    for module in (original, fused):
        x_ = x.detach().clone().requires_grad_()
        out = torch.utils.checkpoint.checkpoint(module, x_, use_reentrant=False)
        out.backward(grad)
        grads.append([x_.grad, *[p.grad for p in module.parameters()]])
    assert not any(count_step_replays)
    for e, a in zip(*grads, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-12)


@requires_cuda
@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_replays_under_autocast_follow_parameters(name, args, shape, train, graphs_win):
    """bfloat16 autocast, the parameters updated in place between calls: each replay is the
    kept formulation's own call (autocast's cast cache, on in the caller's region, must not
    leave a cast weight of an earlier call in the graph)."""
    _, fused = pair(name, args, "cuda", dtype=torch.float32, train=train)
    for _ in range(3):
        x = torch.rand(shape, device="cuda", requires_grad=train)
        with torch.autocast("cuda", dtype=torch.bfloat16), torch.set_grad_enabled(train):
            out = fused(x)
            assert fused.graphed(x)
            with autotune.force(fused.formulation(x)):
                expected = fused(x)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        if train:
            inputs = [x, *fused.parameters()]
            grad = torch.rand_like(out)
            for a, e in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(expected, inputs, grad)):
                torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)  # (atomic sums in either order)
        with torch.no_grad():
            for p in fused.parameters():
                p.mul_(-0.5)


@requires_cuda
def test_batch_norm_momentum_none_not_replayed(graphs_win, count_step_replays):
    """With momentum None nn.BatchNorm3d's training call reads its count on the host: no graph."""
    name, args, shape = CONFIGS[3]
    original, fused = pair(name, args, "cuda")
    original.batch_norm.momentum = fused.batch_norm.momentum = None
    for _ in range(2):
        x = torch.rand(shape, dtype=torch.float64, device="cuda")
        grad = torch.rand_like(original(x))
        original.load_state_dict(fused.state_dict())
        expected = training_step(original, x, grad) + list(original.buffers())
        actual = training_step(fused, x, grad) + list(fused.buffers())
        for a, e in zip(actual, expected, strict=True):
            torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-12)
    assert not count_step_replays


@requires_cuda
def test_graph_memory_limit(graphs_win, monkeypatch):
    """A capture holding more than the limit is dropped: the call runs without a graph."""
    monkeypatch.setattr(_graphed, "MEMORY_LIMIT", -1)
    name, args, shape = CONFIGS[0]
    original, fused = shared(name, args, "cuda", dtype=torch.float64)
    x = torch.rand(shape, dtype=torch.float64, device="cuda")
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(fused(x), original(x), rtol=1e-9, atol=1e-12)
        assert autotune.kept_graphed(autotune.call_key(fused, fused._config(), x)) and not fused.graphed(x)


def test_graphs_of_a_module_share_its_budget(monkeypatch):
    """_graphed.graphed_call gives a capture the module's budget less what its other graphs hold; a refused
    signature is not captured again (the capture classes stood in for: no device needed)."""
    rooms = []

    class Capture:
        def __init__(self, module, run, name, x, stamp, budget):
            rooms.append(budget)
            if budget < 10:
                raise _graphed.CaptureRefused("over its budget")
            self.stamp, self.held = stamp, 10
    monkeypatch.setattr(_graphed, "GraphedCall", Capture)
    module, x = torch.nn.Linear(1, 1), torch.zeros(1)
    try:
        with torch.no_grad():
            graphs = [_graphed.graphed_call(module, signature, 0, None, "fused", x, lambda: 25)
                      for signature in ("a", "b", "c", "c")]
        assert rooms == [25, 15, 5] and graphs[0] is not None and graphs[1] is not None and graphs[2:] == [None, None]
        assert _graphed.kept(module, "a") and _graphed.refused(module, "c") and not _graphed.refused(module, "a")
        assert _graphed.held(module) == {"graphs": 2, "bytes": 20}
    finally:
        _graphed.drop(module)


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
def test_graph_budget_is_the_convolution_output(name, args, shape, autocast):
    """A module's graph budget (nn._Formulations._graph_budget): the bytes of its convolution's output for
    x, in the dtype it computes in (odd sizes, a batch of one, an unbatched input, 'same' and 'valid'
    padding)."""
    _, fused = shared(name, args, "cpu")
    conv = getattr(fused, fused._CONV)
    cases = [(conv.padding, 3), (conv.padding, 1), (conv.padding, None)]
    if not conv.transposed:
        cases += [("same", 2), ("valid", 1)]
    for padding, batch in cases:
        conv.padding = padding
        x = torch.rand(*(() if batch is None else (batch,)), *shape[1:2], *[n + 1 for n in shape[2:]])
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            y = conv(x)
            assert fused._graph_budget(x) == y.numel() * y.element_size()


@requires_cuda
def test_graph_within_the_originals_memory(monkeypatch):
    """A graph is kept only where what it holds (its pool, in whole allocator segments, and its static
    input) is within the module's budget: not at the tests' small sizes, whose convolution outputs take
    kilobytes; with a budget that allows it, kept, its memory counting the static input."""
    settle_graphed(monkeypatch, module_budget=True)
    autotune.set_enabled(True)
    name, args, shape = CONFIGS[0]
    original, fused = shared(name, args, "cuda")
    x = torch.rand(shape, device="cuda")
    assert fused._graph_budget(x) < 2**21
    try:
        with torch.no_grad():
            for _ in range(2):
                torch.testing.assert_close(fused(x), original(x))
            key = autotune.call_key(fused, fused._config(), x)
            assert autotune.kept_graphed(key) and not fused.graphed(x)  # (settled on a graph; none kept)
            monkeypatch.setattr(_Formulations, "_graph_budget", lambda self, x: _graphed.MEMORY_LIMIT)
            autotune.clear()
            torch.testing.assert_close(fused(x), original(x))
            assert fused.graphed(x) and autotune.memory(fused)["bytes"] >= x.nbytes + 2**21
    finally:
        autotune.clear()


@requires_cuda
def test_memory_of_one_module(graphs_win):
    """autotune.memory(module) counts that module's graphs alone, and the benchmarks' peak memory of a
    call (cli.peak_extra_mib) adds them: a replay allocates inside its graph's pool, held between calls."""
    from fused_ops import cli
    name, args, shape = CONFIGS[0]
    (_, fused), (_, other) = (shared(name, args, "cuda") for _ in range(2))
    x = torch.rand(shape, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            fused(x)
        assert fused.graphed(x)
        held = autotune.memory(fused)
        assert held["graphs"] >= 1 and held["bytes"] > 0 and autotune.memory(other) == {"graphs": 0, "bytes": 0}
        assert autotune.memory()["bytes"] >= held["bytes"]
        outside = cli.peak_extra_mib(lambda: fused(x), torch.device("cuda"))
        with_graphs = cli.peak_extra_mib(lambda: fused(x), torch.device("cuda"), fused)
        assert with_graphs == pytest.approx(outside + held["bytes"] / 2**20, rel=1e-12)


class _FakeTiming:
    """A call's timing: read as `ms` a call, or not yet passed (ms None)."""

    def __init__(self, ms=None):
        self.ms = ms

    def mark(self):
        pass

    def read(self):
        return None if self.ms is None else (self.ms, self.ms, 0.0)

    def close(self):
        pass


@pytest.mark.parametrize("replay_ms,kept", [(0.5, True), (0.99, False), (1.5, False)])
def test_graph_kept_where_its_replays_are_faster(replay_ms, kept):
    """A graph's first SAMPLES replays decide it against SAMPLES calls without it timed beside them (1 ms
    here, not the choice's timings as a candidate): kept where the replays' median is below the calls' by
    PREFERRED_MARGIN, else released and its signature graphed no more (the verdict read at the next call).
    The bookkeeping alone: no device needed."""
    module, signature = torch.nn.Linear(1, 1), ("signature",)
    tuning = autotune._Tuning((object, (), ((1, 3), "contiguous", torch.float32), ()), ["fused", "original"])
    tuning.choice = ("fused", True)
    tuning.timings["fused"] = [(100.0, 100.0, 0.8)] * autotune.SAMPLES  # (first calls: set-up, not compared)
    _graphed._GRAPHS[module] = {signature: (object(), 1)}  # (a graph captured)
    try:
        tuning.replay_pending = ([(0, signature, _FakeTiming(replay_ms), True)] * autotune.SAMPLES +
                                 [(0, signature, _FakeTiming(1.0), False)] * autotune.SAMPLES)
        assert tuning.replay_timing(module, signature, torch.zeros(1)) is None  # (the verdict, no more timing)
        assert tuning.replays_won[signature] is kept and tuning.replays[signature] == [replay_ms] * 3
        assert tuning.unreplayed[signature] == [1.0] * 3
        assert _graphed.kept(module, signature) is kept and _graphed.refused(module, signature) is not kept
        assert tuning.replays_pay(module, signature) is kept
    finally:
        _graphed.drop(module)


def test_replays_and_calls_timed_in_turn(monkeypatch):
    """While its graph's verdict is open a signature's calls are timed in turn replayed and not (a replay
    first), SAMPLES of each, then no more; no verdict before both are read."""
    module, signature = torch.nn.Linear(1, 1), ("signature",)
    tuning = autotune._Tuning((object, (), ((1, 3), "contiguous", torch.float32), ()), ["fused", "original"])
    tuning.choice = ("fused", True)
    monkeypatch.setattr(autotune, "_Timing", lambda x: _FakeTiming())
    _graphed._GRAPHS[module] = {signature: (object(), 1)}
    try:
        replays = []
        for _ in range(2 * autotune.SAMPLES):
            timing, replay = tuning.replay_timing(module, signature, torch.zeros(1))
            replays.append(replay)
            tuning.replay_pending.append((0, signature, timing, replay))  # (as replayed() adds it, unread)
        assert replays == [True, False] * autotune.SAMPLES
        assert tuning.replay_timing(module, signature, torch.zeros(1)) is None  # (enough timed: none read yet)
        assert signature not in tuning.replays_won and tuning.replays_pay(module, signature)
    finally:
        _graphed.drop(module)


@requires_cuda
@pytest.mark.parametrize("margin,kept", [(1.0, False), (-1e9, True)], ids=["replays-slower", "replays-faster"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_replays_timed_decide_the_graph(margin, kept, train, monkeypatch):
    """On a GPU, a key settled graphed: its graph's first replays are timed in turn with calls without it (a
    training step's to its parameters' gradients) and the graph kept only where the replays were faster by
    PREFERRED_MARGIN (1: never; -1e9: always); the results the original's throughout."""
    init = autotune._Tuning.__init__

    def settled(self, key, order):
        init(self, key, order)
        self.choice = (order[0], True)
    monkeypatch.setattr(autotune._Tuning, "__init__", settled)
    monkeypatch.setattr(autotune, "PREFERRED_MARGIN", margin)
    monkeypatch.setattr(autotune, "HOT_CALLS", 1)
    monkeypatch.setattr(_Formulations, "_graph_budget", lambda self, x: _graphed.MEMORY_LIMIT)
    autotune.clear()
    autotune.set_enabled(True)  # (conftest's rule_formulations turns it off, and back after)
    name, args, shape = CONFIGS[0]
    original, fused = shared(name, args, "cuda", dtype=torch.float64, train=train)
    x = torch.rand(shape, dtype=torch.float64, device="cuda")
    try:
        with torch.set_grad_enabled(train):
            for _ in range(3 * autotune.SAMPLES):
                out, expected = fused(x), original(x)
                if train:
                    out.sum().backward()
                torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-12)
                torch.cuda.synchronize()
            signature = autotune._signature(fused, x)
            tuning = autotune._TUNINGS[autotune.call_key(fused, fused._config(), x)]
            assert len(tuning.replays[signature]) == len(tuning.unreplayed[signature]) == autotune.SAMPLES
            assert tuning.replays_won[signature] is kept
            assert fused.graphed(x) is kept
    finally:
        autotune.clear()


def test_graphs_off_by_environment():
    """FUSED_OPS_CUDA_GRAPHS=0 turns the graphed candidate off (the tuner stays on)."""
    for value, enabled in (("0", False), ("off", False), ("1", True)):
        env = dict(os.environ, FUSED_OPS_CUDA_GRAPHS=value)
        code = "import fused_ops.autotune as a; print(a._GRAPHS_ENABLED, a.is_enabled())"
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert result.stdout.split() == [str(enabled), "True"]


@requires_cuda
def test_failed_capture_leaves_random_ops_working():
    """A capture CUDA refuses (a host synchronization in it) raises, and PyTorch's CUDA
    generator is left usable (a failed capture otherwise leaves it in its capture state)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), pytest.raises(RuntimeError):
        _graphed._capture(lambda: torch.ones(1, device="cuda").item())
    torch.cuda.current_stream().wait_stream(side)
    torch.manual_seed(0)
    first = torch.rand(3, device="cuda")
    torch.manual_seed(0)
    assert torch.equal(torch.rand(3, device="cuda"), first)


def settled_choice(device, forward_ms, host_ms, shape=(1, 3)):
    """The choice of a tuning whose calls of x's `shape` (float32, contiguous, on `device`) timed fused at
    forward_ms on the device and host_ms on the host, and the original at twice fused's device time."""
    key = (object, (), (shape, "contiguous", torch.float32, torch.device(device)), ())
    tuning = autotune._Tuning(key, ["fused", "original"])
    tuning.timings = {"fused": [(forward_ms, forward_ms, host_ms)] * 3,
                      "original": [(2 * forward_ms, 2 * forward_ms, host_ms)] * 3}
    tuning._settle()
    return tuning.choice


def test_graphed_where_host_bound():
    """A key settles on a CUDA graph where queueing its fastest formulation's forward took the host
    at least HOST_BOUND_SHARE of the forward's time on the device (the device waited for the host),
    not where the device's time was the larger; never on a CPU."""
    assert settled_choice("cuda", 0.1, 0.09) == ("fused", autotune._GRAPHS_ENABLED)
    assert settled_choice("cuda", 5.0, 0.2) == ("fused", False)
    assert settled_choice("cpu", 0.1, 0.1) == ("fused", False)


def test_not_graphed_where_the_input_copy_costs():
    """Host-bound or not, no graph where the replay's copy of the input into the graph's (2 x.nbytes at
    GRAPH_COPY_BANDWIDTH) would take over GRAPH_COPY_SHARE of the call (the larger of the forward's device
    and host times): C's float32 eval at SPEC's size (x 604 MB, 0.28 ms a call) ran 0.56 ms replayed."""
    spec_c = (128, 8, 384, 384)
    copy_ms = 2 * 128 * 8 * 384 * 384 * 4 / autotune.GRAPH_COPY_BANDWIDTH * 1e3
    assert autotune._input_copy_ms((object, (), (spec_c, "contiguous", torch.float32), ())) == copy_ms
    assert settled_choice("cuda", 0.28, 0.2, spec_c) == ("fused", False)
    forward_ms = copy_ms / autotune.GRAPH_COPY_SHARE * 1.01  # (the copy's share just met, host-bound)
    assert settled_choice("cuda", forward_ms, forward_ms, spec_c) == ("fused", autotune._GRAPHS_ENABLED)
    assert settled_choice("cuda", 0.01, 0.05, (1, 8, 384, 384)) == ("fused", autotune._GRAPHS_ENABLED)  # (batch 1)


def test_calls_in_flight_counted_through_errors():
    """A drop-in call on a GPU counts itself in flight for its block (a capture waits for the others'),
    nested calls each, and uncounts itself where the call raises."""
    before = _graphed._ACTIVE[0]
    with _graphed.call_in_flight:
        assert _graphed._ACTIVE[0] == before + 1
        with _graphed.call_in_flight:
            assert _graphed._ACTIVE[0] == before + 2
    with pytest.raises(ValueError, match="the call's"):
        with _graphed.call_in_flight:
            raise ValueError("the call's")
    assert _graphed._ACTIVE[0] == before
