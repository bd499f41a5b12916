"""torch.compile(fullgraph=True) of every drop-in module across changing batch and spatial sizes,
as a user compiles the original: with Dynamo's automatic dynamic shapes (the first size compiled
static, the second recompiled with dynamic sizes, the third run by that graph) and with
dynamic=True, in training (output, every gradient, running statistics)
and in eval mode without autograd; the original's results at every size, the same formulation's
ops in every graph. On a CPU also with the formulation a GPU's rule takes (its code under symbolic
sizes: the rewrites' rearranged convolutions, the fused convolutions' fakes). Inductor's caches
off (a cached graph's guards can specialize a size the compile left dynamic)."""
import contextlib

import pytest
import torch
from torch._inductor.compile_fx import compile_fx

from conftest import build_pair, check_matches_original
from fused_ops import autotune

# (name, constructor arguments, three input shapes: batch and every spatial size change)
CASES = [
    ("Conv3dDivMaxPoolGAPBiasSum", (3, 4, 3, 2.0, 2, (4, 1, 1, 1), 1), [(2, 3, 8, 9, 10), (3, 3, 10, 11, 9),
                                                                         (4, 3, 9, 10, 12)]),
    ("ConvTranspose3dMaxPoolMaxPoolSum", (3, 4, 5, 2, 2), [(2, 3, 7, 6, 7), (3, 3, 8, 7, 6), (4, 3, 6, 9, 8)]),
    ("Conv2dAvgPoolSigmoidSum", (3, 4, 3, 4), [(2, 3, 20, 20), (3, 3, 23, 26), (4, 3, 30, 18)]),
    ("ConvTranspose3dScaleBatchNormGAP", (3, 4, 3, 2.0), [(3, 3, 4, 5, 6), (2, 3, 5, 6, 4), (4, 3, 3, 4, 5)]),
]
IDS = ["A", "B", "C", "D"]
# The formulation each module's rule takes on a GPU (fused_ops.nn), forced on a CPU
GPU_RULES = {"Conv3dDivMaxPoolGAPBiasSum": "fused_conv", "ConvTranspose3dMaxPoolMaxPoolSum": "rewrite",
             "Conv2dAvgPoolSigmoidSum": "fused_conv", "ConvTranspose3dScaleBatchNormGAP": "rewrite"}


@pytest.fixture
def no_inductor_caches():
    # (the config's own patch: a monkeypatch's undo deletes a torch 2.11 Inductor option; no duck sizing,
    # which guards two sizes equal at the first compile, a square image's height and width, and recompiles
    # the next shape for it)
    with torch._inductor.config.patch(force_disable_caches=True), \
            torch.fx.experimental._config.patch(use_duck_shape=False):
        yield


def fused_ops_in(graph_module) -> list[str]:
    """The fused_ops ops a Dynamo graph calls, sorted."""
    return sorted({str(node.target) for node in graph_module.graph.nodes
                   if node.op == "call_function" and str(node.target).startswith("fused_ops.")})


def compiled_with_graphs(module, dynamic):
    """torch.compile(module, fullgraph=True) by Inductor, and the fused ops (fused_ops_in) of each Dynamo graph
    that Inductor compiled (not of one whose compile failed, as Dynamo's first graph with a float attribute
    made symbolic does before Dynamo specializes it)."""
    graphs = []

    def inductor(graph_module, example_inputs):
        fused_ops = fused_ops_in(graph_module)  # (before Inductor rewrites the graph)
        compiled = compile_fx(graph_module, example_inputs)
        graphs.append(fused_ops)
        return compiled

    return torch.compile(module, backend=inductor, dynamic=dynamic, fullgraph=True), graphs


def original_compiles(compiled_original, x) -> bool:
    """Whether the compiled original takes x, a training step (PyTorch's own compile fails in places:
    torch 2.13's Inductor lowers a convolution's backward under dynamic sizes on a CPU with a
    ValueRangeError, A's and B's originals at their second size)."""
    try:
        compiled_original(x.clone().requires_grad_()).sum().backward()
    except Exception:  # (Inductor's, whatever its kind)
        return False
    return True


def check_across_shapes(name, args, shapes, dynamic, train, device, formulation=None):
    """Each shape in turn through the compiled drop-in against the original eager: in eval mode at
    every size, in training wherever the compiled original takes the step (where it does not, the
    drop-in may fail too, or must give the original's results); every graph with the same fused ops
    (one formulation for every size), in eval at most one a size (a rewrite's padding guards the sizes'
    residues modulo its stride: a size of another residue compiles again), in training at most two (Inductor's
    lowering of a convolution's backward specializes spatial sizes on a CPU, the compiled original's too, and
    a size's first graph may be compiled again by its own guards)."""
    original, fused = (m.to(device).train(train) for m in build_pair(name, args))
    compiled, graphs = compiled_with_graphs(fused, dynamic)
    compiled_original = torch.compile(build_pair(name, args)[0].to(device).train(train), dynamic=dynamic)
    normwise = name == "ConvTranspose3dScaleBatchNormGAP"  # (its conv bias's gradient is rounding noise)
    for step, shape in enumerate(shapes):
        x = torch.rand(shape, generator=torch.Generator().manual_seed(step)).to(device)
        with autotune.force(formulation) if formulation else contextlib.nullcontext():
            if not train:
                with torch.no_grad():
                    out, expected = compiled(x), original(x)
                assert out.shape == expected.shape and out.dtype == expected.dtype
                torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
            elif original_compiles(compiled_original, x):
                check_matches_original(original, compiled, x, torch.float32, normwise=normwise)
            else:
                try:
                    check_matches_original(original, compiled, x, torch.float32, normwise=normwise)
                except AssertionError:
                    raise
                except Exception:  # (a compile failing where the original's fails)
                    pass
        for a, e in zip(fused.buffers(), original.buffers(), strict=True):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5, msg=lambda m: f"buffer at {shape}\n{m}")
    assert 1 <= len(graphs) <= (len(shapes) if not train else 2 * len(shapes)), graphs
    assert all([g == graphs[0] for g in graphs]), graphs


@pytest.mark.parametrize("name,args,shapes", CASES, ids=IDS)
@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_compiled_across_shapes(name, args, shapes, dynamic, train, device, no_inductor_caches):
    check_across_shapes(name, args, shapes, dynamic, train, device)


@pytest.mark.parametrize("name,args,shapes", CASES, ids=IDS)
def test_compiled_across_shapes_gpu_rule_on_cpu(name, args, shapes, no_inductor_caches):
    """Training with dynamic=True, forced to the formulation a GPU's rule takes."""
    check_across_shapes(name, args, shapes, True, True, "cpu", GPU_RULES[name])
