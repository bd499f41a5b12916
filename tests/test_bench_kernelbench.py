"""bench/kernelbench.py, KernelBench's correctness and timing protocol, on the CPU with tiny problem-like files
written here (KernelBench's own are not in the repository: `make kernelbench` fetches them): a right candidate
(the drop-in, built under the protocol's seeding) passes every trial, and wrong ones fail it (off by more than
the tolerance, right on one input only, a wrong shape, an exception, parameters drawn otherwise); the batch
override; the timing's calls; main end to end on four files under KernelBench's names; bench/run.py's step."""
import json
import os

import pytest
import torch

import fused_ops.nn
from conftest import repo_script

CPU = torch.device("cpu")

# A problem file as KernelBench writes them (its Model inline, module-level sizes, get_inputs and
# get_init_inputs): architecture C at a tiny size.
PROBLEM_C = '''
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, pool_kernel_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.avg_pool = nn.AvgPool2d(pool_kernel_size)

    def forward(self, x):
        return torch.sum(torch.sigmoid(self.avg_pool(self.conv(x))), dim=[1, 2, 3])

batch_size = 3
in_channels, out_channels, height, width = 2, 5, 11, 10
kernel_size, pool_kernel_size = 3, 2

def get_inputs():
    return [torch.rand(batch_size, in_channels, height, width)]

def get_init_inputs():
    return [in_channels, out_channels, kernel_size, pool_kernel_size]
'''

# The four architectures at tiny sizes under KernelBench's file names, their Models fused_ops.reference's.
TINY_PROBLEMS = {
    "A": ("Conv3dDivMaxPoolGAPBiasSum", "batch_size = 2\n"
          "def get_inputs(): return [torch.rand(batch_size, 3, 6, 9, 8)]\n"
          "def get_init_inputs(): return [3, 4, (3, 3, 3), 2.0, (2, 2, 2), (4, 1, 1, 1), 1]\n"),
    "B": ("ConvTranspose3dMaxPoolMaxPoolSum", "batch_size = 2\n"
          "def get_inputs(): return [torch.rand(batch_size, 3, 4, 5, 4)]\n"
          "def get_init_inputs(): return [3, 4, 3, 2, 1]\n"),
    "C": ("Conv2dAvgPoolSigmoidSum", "batch_size = 2\n"
          "def get_inputs(): return [torch.rand(batch_size, 2, 11, 10)]\n"
          "def get_init_inputs(): return [2, 5, 3, 2]\n"),
    "D": ("ConvTranspose3dScaleBatchNormGAP", "batch_size = 2\n"
          "def get_inputs(): return [torch.rand(batch_size, 3, 3, 4, 3)]\n"
          "def get_init_inputs(): return [3, 4, 3, 2.0]\n"),
}


@pytest.fixture
def kernelbench(monkeypatch):
    """bench/kernelbench.py as a module."""
    return repo_script("bench", "kernelbench", monkeypatch)


@pytest.fixture
def problem_c(tmp_path, kernelbench):
    path = tmp_path / "problem_c.py"
    path.write_text(PROBLEM_C)
    return kernelbench.load_problem(str(path))


def write_tiny_problems(kernelbench, directory) -> None:
    directory.mkdir(exist_ok=True)
    for problem in kernelbench.PROBLEMS:
        module, body = TINY_PROBLEMS[problem.letter]
        assert module == problem.module
        (directory / problem.file).write_text(f"import torch\nfrom fused_ops.reference import {module} as Model\n"
                                              f"{body}")


class Scaled(fused_ops.nn.Conv2dAvgPoolSigmoidSum):
    """The drop-in's result times FACTOR."""
    FACTOR = 1 + 1e-3

    def forward(self, x):
        return super().forward(x) * self.FACTOR


class ScaledWithinTolerance(Scaled):
    FACTOR = 1 + 5e-5  # (results ~10: off by 5e-4, within 1e-4 + 1e-4 * |result|)


class FirstResultCached(fused_ops.nn.Conv2dAvgPoolSigmoidSum):
    """Right on the first input, then returns that result again."""

    def forward(self, x):
        if not hasattr(self, "cached"):
            self.cached = super().forward(x)
        return self.cached


class WrongShape(fused_ops.nn.Conv2dAvgPoolSigmoidSum):
    def forward(self, x):
        return super().forward(x)[:, None]


class Raises(fused_ops.nn.Conv2dAvgPoolSigmoidSum):
    def forward(self, x):
        raise RuntimeError("launch failed")


class DrawsFirst(fused_ops.nn.Conv2dAvgPoolSigmoidSum):
    """The drop-in with one random number drawn before its parameters: different initial parameters."""

    def __init__(self, *args):
        torch.rand(1)
        super().__init__(*args)


def table_rows(kernelbench, output: str) -> list[list[str]]:
    """The table's rows (split into words) after its header, which comes after any other output; below a row
    may come a note (a flagged speedup: tiny problems timed on a shared CPU vary)."""
    lines = output.splitlines()
    header = max(i for i, line in enumerate(lines) if line.split()[:3] == ["problem", "our", "module"])
    rows = [line.split() for line in lines[header + 1:] if not line.startswith(" ")]
    assert [row[:3] for row in rows] == [[p.name, p.letter, p.module] for p in kernelbench.PROBLEMS]
    return rows


def check(kernelbench, problem, candidate_cls, trials=3):
    reference, candidate = kernelbench.build_models(problem, candidate_cls, CPU, torch.float32)
    return kernelbench.check_correctness(reference, candidate, problem["get_inputs"], CPU, torch.float32, trials)


@pytest.mark.parametrize("candidate_cls", [fused_ops.nn.Conv2dAvgPoolSigmoidSum, ScaledWithinTolerance])
def test_a_right_candidate_passes_every_trial(kernelbench, problem_c, candidate_cls):
    result = check(kernelbench, problem_c, candidate_cls)
    assert result["error"] is None and result["passed"] == result["trials"] == 3
    assert result["tolerance"] == 1e-4
    assert len(set(result["seeds"])) == 3
    assert all(d <= 1e-4 + 1e-4 * m for d, m in zip(result["max_difference"], result["reference_max_abs"]))
    if candidate_cls is ScaledWithinTolerance:
        assert min(result["max_difference"]) > 1e-4  # (outside atol alone: rtol counts)


@pytest.mark.parametrize("candidate_cls, passed", [(Scaled, 0), (FirstResultCached, 1), (DrawsFirst, 0)])
def test_a_wrong_candidate_fails(kernelbench, problem_c, candidate_cls, passed):
    result = check(kernelbench, problem_c, candidate_cls)
    assert result["error"] is None and result["passed"] == passed and result["trials"] == 3
    assert len(result["max_difference"]) == 3 and max(result["max_difference"]) > 1e-3


@pytest.mark.parametrize("candidate_cls, error", [(WrongShape, "output shape mismatch: expected (3,), got (3, 1)"),
                                                  (Raises, "RuntimeError: launch failed")])
def test_a_shape_mismatch_or_an_exception_ends_the_check(kernelbench, problem_c, candidate_cls, error):
    result = check(kernelbench, problem_c, candidate_cls)
    assert result["error"] == error and result["passed"] == 0 and result["max_difference"] == []


def test_the_reference_and_candidate_start_from_the_same_parameters(kernelbench, problem_c):
    reference, candidate = kernelbench.build_models(problem_c, fused_ops.nn.Conv2dAvgPoolSigmoidSum, CPU,
                                                    torch.float64)
    for (name, p), (name_fused, p_fused) in zip(reference.named_parameters(), candidate.named_parameters()):
        assert name == name_fused and p.dtype == torch.float64 and torch.equal(p, p_fused)


def test_batch_override(kernelbench, tmp_path):
    path = tmp_path / "problem_c.py"
    path.write_text(PROBLEM_C)
    assert kernelbench.load_problem(str(path))["get_inputs"]()[0].shape == (3, 2, 11, 10)
    assert kernelbench.load_problem(str(path), batch=1)["get_inputs"]()[0].shape == (1, 2, 11, 10)
    with pytest.raises(ValueError, match="a positive batch size, got 0"):
        kernelbench.load_problem(str(path), batch=0)
    path.write_text(PROBLEM_C.replace("batch_size = 3", "batch = 3").replace("(batch_size,", "(batch,"))
    with pytest.raises(ValueError, match="sets the problem's module-level batch_size, which it does not define"):
        kernelbench.load_problem(str(path), batch=1)
    path.write_text(PROBLEM_C.replace("def get_inputs", "def inputs"))
    with pytest.raises(ValueError, match="missing get_inputs"):
        kernelbench.load_problem(str(path))


def test_timing_calls(kernelbench):
    calls = []
    times = kernelbench.time_calls(lambda x: calls.append(x), [1], CPU, trials=4)
    assert len(calls) == kernelbench.WARMUP_CALLS + kernelbench.DISCARD_FIRST + 4 == 8
    assert len(times) == 4 and all(t >= 0 for t in times)
    stats = kernelbench.timing_stats([1.0, 2.0, 4.0])
    assert stats == dict(mean=pytest.approx(7 / 3), std=pytest.approx((14 / 9) ** 0.5), min=1.0, max=4.0,
                         num_trials=3)


def test_evaluate_times_a_correct_candidate_only(kernelbench, problem_c):
    right = kernelbench.evaluate(problem_c, fused_ops.nn.Conv2dAvgPoolSigmoidSum, CPU, torch.float32, 2, 3)
    assert right["correct"] and right["input_shapes"] == [[3, 2, 11, 10]]
    assert right["fused_ms"]["num_trials"] == right["reference_ms"]["num_trials"] == 3
    assert right["speedup"] == pytest.approx(right["reference_ms"]["mean"] / right["fused_ms"]["mean"])
    assert right["formulation"] in fused_ops.nn.Conv2dAvgPoolSigmoidSum.FORMULATIONS
    wrong = kernelbench.evaluate(problem_c, Scaled, CPU, torch.float32, 2, 3)
    assert not wrong["correct"] and wrong["correctness"]["passed"] == 0
    assert wrong["fused_ms"] is None and wrong["speedup"] is None and wrong["reference_ms"]["num_trials"] == 3


def test_main_on_four_tiny_problems(kernelbench, tmp_path, capsys):
    write_tiny_problems(kernelbench, tmp_path / "problems")
    (tmp_path / "problems" / "COMMIT").write_text(kernelbench.KERNELBENCH_COMMIT + "\n")
    argv = ["--device", "cpu", "--problems", str(tmp_path / "problems"), "--batch", "3", "--trials", "2",
            "--correct-trials", "2", "--out", str(tmp_path / "out"), "--out", str(tmp_path / "out2")]
    assert kernelbench.main(argv) == 0
    assert os.listdir(tmp_path / "out") == os.listdir(tmp_path / "out2") == ["kernelbench-cpu-batch3.json"]
    result = json.loads((tmp_path / "out" / "kernelbench-cpu-batch3.json").read_text())
    assert result["ok"] and result["kernelbench_commit"] == kernelbench.KERNELBENCH_COMMIT
    assert result["tolerance"] == 1e-4 and result["correct_trials"] == 2 and result["perf_trials"] == 2
    assert [row["letter"] for row in result["rows"]] == ["A", "B", "C", "D"]
    for row in result["rows"]:
        assert row["correct"] and row["batch_size"] == 3 and row["input_shapes"][0][0] == 3
        assert row["correctness"]["passed"] == 2 and row["fused_ms"]["num_trials"] == 2
    for row in table_rows(kernelbench, capsys.readouterr().out):
        assert row[3] == "2/2" and row[-1].endswith("x")


def test_main_reports_a_wrong_drop_in(kernelbench, tmp_path, capsys, monkeypatch):
    write_tiny_problems(kernelbench, tmp_path / "problems")
    monkeypatch.setattr(fused_ops.nn, "Conv2dAvgPoolSigmoidSum", Scaled)
    argv = ["--device", "cpu", "--problems", str(tmp_path / "problems"), "--trials", "1", "--correct-trials", "2",
            "--out", str(tmp_path)]
    assert kernelbench.main(argv) == 1
    result = json.loads((tmp_path / "kernelbench-cpu.json").read_text())
    assert not result["ok"] and result["kernelbench_commit"] is None
    assert [row["correct"] for row in result["rows"]] == [True, True, False, True]
    row = table_rows(kernelbench, capsys.readouterr().out)[2]
    assert row[3] == "0/2" and row[-2:] == ["-", "-"]


def test_main_without_the_problems(kernelbench, tmp_path, capsys):
    assert kernelbench.main(["--device", "cpu", "--problems", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "lacks KernelBench's 8_Conv3d_Divide_Max_GlobalAvgPool_BiasAdd_Sum.py" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_run_py_step(kernelbench, monkeypatch, tmp_path):
    """bench/run.py's kernelbench step: skipped without the problems; with them, the script in its own process
    (on a CPU at batch 2 as asked, 3 timed calls), its JSON in each directory, its table."""
    run = repo_script("bench", "run", monkeypatch)
    assert run.run_kernelbench("cpu", None, [str(tmp_path)], problems=str(tmp_path / "absent")) is None
    write_tiny_problems(kernelbench, tmp_path / "problems")
    ok, table = run.run_kernelbench("cpu", 2, [str(tmp_path / "out"), str(tmp_path / "out2")],
                                    problems=str(tmp_path / "problems"))
    assert ok and all(row[3] == "5/5" for row in table_rows(kernelbench, table))
    for out in ("out", "out2"):
        result = json.loads((tmp_path / out / "kernelbench-cpu-batch2.json").read_text())
        assert result["ok"] and result["perf_trials"] == 3 and result["correct_trials"] == 5
