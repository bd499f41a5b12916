"""Deploying the drop-in modules where their originals deploy: ONNX by both exporters (the default,
torch.export-based one and the TorchScript one), run by onnxruntime (float32) or ONNX's reference
evaluator (float64, which onnxruntime's CPU convolutions do not take); torch.jit.trace and
torch.jit.script, saved and loaded, in Python and (tests/cpp/load_scripted.cpp) in C++. Each runs the
original's forward (``fused_ops.nn._deploying``), so each gives the original's results, its batch
dimension as free as the original's.

Run as a script (``python tests/test_onnx_torchscript.py DIR``) it writes the scripted modules and
their reference outputs that the C++ test reads (ctest runs it first: CMakeLists.txt)."""
import copy
import io
import os
import pickle
import subprocess
import sys

import onnx
import onnxruntime
import pytest
import torch
from onnx.reference import ReferenceEvaluator

import fused_ops
from conftest import build_pair, make_input
from fused_ops import fusion
from fused_ops.fusion import CHAINS
from test_export import CONFIGS, IDS

# (torch 2.13 deprecates TorchScript, which deploys on: its warnings are not this test's)
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")

EXPORTERS = ["dynamo", "torchscript"]
LETTERS = {chain.module.__name__: chain.letter for chain in CHAINS}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPP_TEST = os.path.join(ROOT, "cmake-build", "fused_ops_load_scripted")
CPP_LIBRARY = os.path.join(ROOT, "cmake-build", "libfused_ops.so")


def pair(name, args, dtype=torch.float32, device="cpu", train=False):
    original, fused = build_pair(name, args)
    return original.to(device, dtype).train(train), fused.to(device, dtype).train(train)


def larger_batch(x):
    """An input like x with one more sample: what a trace or an export fixed at x must take too."""
    return make_input((x.shape[0] + 1, *x.shape[1:]), x.dtype, x.device, seed=1)


def export_onnx(module, x, exporter, train=False):
    """module exported by torch.onnx.export at x, its batch dimension dynamic: the ONNX bytes."""
    f = io.BytesIO()
    if exporter == "dynamo":
        torch.onnx.export(module, (x,), f, dynamo=True, dynamic_shapes=({0: torch.export.Dim("batch")},))
    else:
        # (output_names: the TorchScript exporter takes a GraphModule's fx graph for a TorchScript one without)
        training = torch.onnx.TrainingMode.TRAINING if train else torch.onnx.TrainingMode.EVAL
        torch.onnx.export(module, (x,), f, dynamo=False, input_names=["x"], output_names=["out"],
                          dynamic_axes={"x": {0: "batch"}, "out": {0: "batch"}}, training=training,
                          do_constant_folding=not train)
    return f.getvalue()


def run_onnx(model: bytes, x):
    """The ONNX model's output for x: by onnxruntime on the CPU, or in float64 by ONNX's reference evaluator."""
    if x.dtype == torch.float64:
        evaluator = ReferenceEvaluator(onnx.load_from_string(model))
        return torch.from_numpy(evaluator.run(None, {evaluator.input_names[0]: x.numpy()})[0])
    session = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])


def operators(model: bytes) -> list[str]:
    return [node.op_type for node in onnx.load_from_string(model).graph.node]


TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-12)}


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
def test_onnx_export_runs_the_originals_graph(name, args, shape, dtype, exporter):
    original, fused = pair(name, args, dtype)
    x = make_input(shape, dtype, "cpu")
    model = export_onnx(fused, x, exporter)
    assert operators(model) == operators(export_onnx(original, x, exporter))
    with torch.no_grad():
        for batch in (x, larger_batch(x)):
            torch.testing.assert_close(run_onnx(model, batch), original(batch), **TOLERANCE[dtype])


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
def test_onnx_export_in_training_mode_as_the_original(name, args, shape, exporter):
    """In training mode each exporter exports the drop-in as it exports the original (the dynamo
    exporter's batch norm normalizes with its running statistics, the original's too)."""
    original, fused = pair(name, args, train=True)
    x = make_input(shape, torch.float32, "cpu")
    model, expected = export_onnx(fused, x, exporter, train=True), export_onnx(original, x, exporter, train=True)
    assert operators(model) == operators(expected)
    torch.testing.assert_close(run_onnx(model, x), run_onnx(expected, x), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
def test_onnx_export_of_a_fused_model(name, args, shape, exporter):
    original, _ = pair(name, args)
    model = torch.nn.Sequential(torch.nn.Identity(), original).eval()
    fused, report = fused_ops.fuse(model, report=True)
    assert [letter for letter, _ in report.fused] == [LETTERS[name]]
    x = make_input(shape, torch.float32, "cpu")
    exported = export_onnx(fused, x, exporter)
    with torch.no_grad():
        torch.testing.assert_close(run_onnx(exported, larger_batch(x)), model(larger_batch(x)),
                                   **TOLERANCE[torch.float32])


def saved_and_loaded(module, device):
    f = io.BytesIO()
    torch.jit.save(module, f)
    f.seek(0)
    return torch.jit.load(f, map_location=device)


def assert_no_fused_ops(module):
    """The TorchScript module runs standard ops only (any libtorch runs it)."""
    assert "fused_ops::" not in str(module.inlined_graph)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
def test_trace_saves_loads_and_takes_another_batch(name, args, shape, train, device):
    original, fused = pair(name, args, torch.float64, device, train)
    x = make_input(shape, torch.float64, device)
    traced = saved_and_loaded(torch.jit.trace(fused, (x,), check_trace=False), device)
    assert_no_fused_ops(traced)
    original(x)  # (the trace's call: in training it updated the running statistics the traced module holds)
    for batch in (x, larger_batch(x)):
        torch.testing.assert_close(traced(batch), original(batch), **TOLERANCE[torch.float64])
    for key, value in original.state_dict().items():  # (in training the running statistics, updated alike)
        torch.testing.assert_close(traced.state_dict()[key], value, msg=key)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
def test_script_saves_and_loads(name, args, shape, train, device):
    original, fused = pair(name, args, torch.float64, device, train)
    scripted = saved_and_loaded(torch.jit.script(fused), device)
    assert_no_fused_ops(scripted)
    x = make_input(shape, torch.float64, device)
    for batch in (x, larger_batch(x)):
        torch.testing.assert_close(scripted(batch), original(batch), **TOLERANCE[torch.float64])


@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
def test_nested_drop_in_scripts_and_stays_a_drop_in(name, args, shape):
    """A drop-in inside a user's model scripts with it, and the model keeps the drop-in (no
    __prepare_scriptable__ swapping it for another module)."""
    original, fused = pair(name, args, torch.float64)
    model = torch.nn.Sequential(torch.nn.Identity(), fused)
    scripted = torch.jit.script(model)
    assert model[1] is fused
    x = make_input(shape, torch.float64, "cpu")
    torch.testing.assert_close(scripted(x), original(x), **TOLERANCE[torch.float64])


@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
def test_trace_and_script_of_a_fused_model(name, args, shape):
    original, _ = pair(name, args, torch.float64)
    model = torch.nn.Sequential(torch.nn.Identity(), original).eval()
    fused = fused_ops.fuse(model)
    x = make_input(shape, torch.float64, "cpu")
    copies = (pickle.loads(pickle.dumps(fused)), copy.deepcopy(fused))  # (their scripting hook kept)
    for deployed in (torch.jit.trace(fused, (x,)), torch.jit.script(fused), *map(torch.jit.script, copies)):
        deployed = saved_and_loaded(deployed, "cpu")
        assert_no_fused_ops(deployed)
        torch.testing.assert_close(deployed(larger_batch(x)), model(larger_batch(x)), **TOLERANCE[torch.float64])
    for module in (fused, *copies):  # (scripting left their fused calls as they were)
        assert [type(m) for m in module.children() if isinstance(m, fusion._FusedCall)] == [fusion._FusedCall]


def test_script_of_a_fused_model_after_its_parameters_were_assigned():
    """torch.jit.script of a fuse result whose parameters were assigned anew (load_state_dict with
    assign=True), A's added parameter among them, before any call: the new ones."""
    name, args, shape = CONFIGS[0]
    original, _ = pair(name, args, torch.float64)
    model = torch.nn.Sequential(torch.nn.Identity(), original).eval()
    fused = fused_ops.fuse(copy.deepcopy(model))
    state = {key: value * 0.5 + 0.1 for key, value in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    fused.load_state_dict({key: value.clone() for key, value in state.items()}, assign=True)
    x = make_input(shape, torch.float64, "cpu")
    torch.testing.assert_close(torch.jit.script(fused)(x), model(x), **TOLERANCE[torch.float64])


def test_eager_calls_still_run_the_fused_ops():
    """Outside a trace, script or ONNX export the drop-in keeps its formulations (torch.export too)."""
    name, args, shape = CONFIGS[0]
    _, fused = pair(name, args)
    x = make_input(shape, torch.float32, "cpu")
    with torch.no_grad():
        fused(x)
    assert fused_ops.autotune.last_formulation() != "original"
    assert "fused_ops" in str(torch.export.export(fused, (x,)).graph)


class _Tensors(torch.nn.Module):
    """Tensors as a scripted module's buffers: what a libtorch program reads with torch::jit::load."""

    def __init__(self, **tensors):
        super().__init__()
        for key, value in tensors.items():
            self.register_buffer(key, value)


def write_scripted_modules(directory: str) -> None:
    """For each drop-in (eval mode, float64), in `directory`: <name>.pt, the module scripted;
    <name>.tensors.pt, an input x (another batch than the trace's) and the original's output
    `expected`; and modules.txt listing the names: what tests/cpp/load_scripted.cpp checks."""
    os.makedirs(directory, exist_ok=True)
    for name, args, shape in CONFIGS:
        original, fused = pair(name, args, torch.float64)
        torch.jit.script(fused).save(os.path.join(directory, f"{name}.pt"))
        x = make_input((shape[0] + 1, *shape[1:]), torch.float64, "cpu", seed=2)
        with torch.no_grad():
            tensors = _Tensors(x=x, expected=original(x))
        torch.jit.script(tensors).save(os.path.join(directory, f"{name}.tensors.pt"))
    with open(os.path.join(directory, "modules.txt"), "w") as f:
        f.write("\n".join(name for name, _, _ in CONFIGS) + "\n")


@pytest.mark.skipif(not (os.path.exists(CPP_TEST) and os.path.exists(CPP_LIBRARY)),
                    reason="the C++ test is built by cmake (make test builds it, and ctest runs it too)")
def test_scripted_modules_run_in_cpp(tmp_path):
    write_scripted_modules(str(tmp_path))
    result = subprocess.run([CPP_TEST, CPP_LIBRARY, str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(" ok") == len(CONFIGS), result.stdout


if __name__ == "__main__":
    write_scripted_modules(sys.argv[1])
