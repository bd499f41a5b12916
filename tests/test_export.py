"""torch.export of the drop-in modules (CPU and CUDA, eval and training mode): the
exported program gives the module's outputs, and in training the same updated running
statistics; on a GPU, AOTInductor runs each exported module with the same outputs."""
import copy
import os
import subprocess
import sys

import pytest
import torch

from conftest import build_pair, requires_cuda

CONFIGS = [
    ("Conv3dDivMaxPoolGAPBiasSum", (3, 4, 3, 2.0, 2, (4, 1, 1, 1), 1), (2, 3, 9, 10, 11)),
    ("ConvTranspose3dMaxPoolMaxPoolSum", (3, 4, 5, 2, 2), (2, 3, 6, 7, 6)),
    ("Conv2dAvgPoolSigmoidSum", (3, 8, 3, 4), (2, 3, 22, 19)),
    ("ConvTranspose3dScaleBatchNormGAP", (3, 4, 3, 2.0), (3, 3, 4, 5, 6)),
]
IDS = [name for name, _, _ in CONFIGS]


def fused_module(name, args, device, train):
    _, fused = build_pair(name, args)
    return fused.to(device).train(train)


@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_export_gives_module_outputs(name, args, shape, train, device):
    fused = fused_module(name, args, device, train)
    x = torch.rand(shape, device=device)
    program = torch.export.export(copy.deepcopy(fused), (x,))
    exported = program.module()
    for _ in range(2):  # in training the running statistics change between the calls
        torch.testing.assert_close(exported(x), fused(x), rtol=1e-6, atol=1e-7)
    for (key, value), exported_value in zip(fused.state_dict().items(), exported.state_dict().values()):
        torch.testing.assert_close(exported_value, value, rtol=1e-6, atol=1e-7, msg=lambda m: f"{key}\n{m}")


AOT_INDUCTOR_CHECK = """
import sys, torch
from conftest import build_pair
import test_export
name, args, shape = test_export.CONFIGS[int(sys.argv[1])]
fused = test_export.fused_module(name, args, "cuda", train=False)
x = torch.rand(shape, device="cuda")
program = torch.export.export(fused, (x,))
path = torch._inductor.aoti_compile_and_package(program, package_path=sys.argv[2])
compiled = torch._inductor.aoti_load_package(path)
torch.testing.assert_close(compiled(x), fused(x), rtol=1e-6, atol=1e-7)
print("same outputs")
"""


def compiler_runtime() -> dict:
    """LD_PRELOAD of the C++ runtime of the compiler AOTInductor builds with (c++). On the GPU
    test image a Python process has an older libstdc++ loaded first, and a compiled model, a
    plain PyTorch one too, faults as it loads without the runtime it was built against."""
    path = subprocess.run(["c++", "-print-file-name=libstdc++.so.6"], capture_output=True, text=True).stdout.strip()
    return {"LD_PRELOAD": path} if os.path.isabs(path) else {}


@requires_cuda
@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=IDS)
def test_aot_inductor_gives_module_outputs(index, tmp_path):
    """In a child process: AOTInductor compiles and loads in native code, where a fault
    would end the test session instead of failing one test."""
    result = subprocess.run([sys.executable, "-c", AOT_INDUCTOR_CHECK, str(index), str(tmp_path / "model.pt2")],
                            cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True, text=True,
                            timeout=600, env={**os.environ, **compiler_runtime(),
                                                         "FUSED_OPS_AUTOTUNE": "0"})  # (conftest's rule, as here)
    assert result.returncode == 0 and "same outputs" in result.stdout, result.stdout + result.stderr[-3000:]
