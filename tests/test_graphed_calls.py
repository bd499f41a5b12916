"""The autotuner's CUDA-graph candidate (fused_ops._graphed): an eval call without gradients
replayed from a graph of its kept formulation gives the original's results, follows the
parameters (updated in place or replaced), the settings and the hooks, never hands out memory
a later call overwrites, and is not taken where it must not be."""
import os
import subprocess
import sys

import pytest
import torch

from conftest import requires_cuda
from fused_ops import _graphed, autotune
from test_formulations import CONFIGS, IDS, shared

_fastest = autotune._fastest


@pytest.fixture
def graphs_win(monkeypatch):
    """The tuner takes the graphed candidate wherever it may (its timing otherwise decides)."""
    def fastest(calls, device):
        return True if set(calls) == {False, True} else _fastest(calls, device)
    monkeypatch.setattr(autotune, "_fastest", fastest)
    autotune.clear()
    autotune.set_enabled(True)
    yield
    autotune.clear()


def graphed(fused, x) -> bool:
    """Whether the call fused(x) replays a graph: kept so by the tuner, and one captured."""
    return fused.graphed(x) and any(g is not None for g, _ in _graphed._GRAPHS.get(fused, {}).values())


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
        assert graphed(fused, x)
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
        assert graphed(fused, x)
        setting = {"A": "divisor", "D": "scale_factor"}.get(IDS[[c[0] for c in CONFIGS].index(name)])
        if setting is not None:
            setattr(original, setting, 3.0)
            setattr(fused, setting, 3.0)
            torch.testing.assert_close(fused(x), original(x), rtol=1e-9, atol=1e-12)
            # (captured again for the new setting)
            assert [g.stamp[0] for g, _ in _graphed._GRAPHS[fused].values()] == [fused._config()]


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
        assert graphed(fused, x) and replays
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
    assert not graphed(fused, x)


def test_graphs_off_by_environment():
    """FUSED_OPS_CUDA_GRAPHS=0 turns the graphed candidate off (the tuner stays on)."""
    for value, enabled in (("0", False), ("off", False), ("1", True)):
        env = dict(os.environ, FUSED_OPS_CUDA_GRAPHS=value)
        code = "import fused_ops.autotune as a; print(a._GRAPHS_ENABLED, a.is_enabled())"
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert result.stdout.split() == [str(enabled), "True"]
