"""tools/check_cuda_compile.py's warning rule: the known register spills counted, not failing; any other
warning about our code (our sources, our namespace's functions) failing; others' (CUTLASS's, torch's) not ours."""
import pytest

from conftest import repo_script


@pytest.fixture
def check(monkeypatch):
    """tools/check_cuda_compile.py as a module (it puts the repository's root on sys.path: restored after)."""
    return repo_script("tools", "check_cuda_compile", monkeypatch)


def spill(function: str) -> str:
    return (f"ptxas warning : Registers are spilled to local memory in function '{function}', 28 bytes spill stores, "
            "28 bytes spill loads")


def test_known_spills_count_and_new_warnings_fail(check):
    known = spill("_ZN9fused_ops69_GLOBAL__N__17901378_30_depth_stacked_channels_last_cu_2f48db0a_1257018"
                  "depth_stack_kernelIN3c108BFloat16ES3_Li8EEEvPKT_NS0_8XStrides")
    new_spill = spill("_ZN9fused_ops12_GLOBAL__N_113other_kernelIfEEvPKf")
    ours = f"{check.ROOT}/csrc/cuda/x.cu(3): warning #177-D: variable \"x\" was declared but never referenced"
    theirs = f"{check.ROOT}/third_party/cutlass/include/cute/a.hpp(9): warning #177-D: variable \"y\" was declared"
    fresh, count = check.new_warnings("\n".join([known, new_spill, ours, theirs, "ptxas info : Used 40 registers"]))
    assert count == 1
    assert fresh == [new_spill, ours]
    assert check.new_warnings(known) == ([], 1)
