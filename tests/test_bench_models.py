"""bench/models.py, the whole-model benchmark: at tiny sizes on the CPU, both
modes through the CLI's machinery, in float32 and under bfloat16 autocast, its
JSON and its table."""
import json
import os

import pytest

from conftest import repo_script
from fused_ops import cli
from fused_ops.architectures import ARCHITECTURES

TINY = ["--device", "cpu", "--size", "tiny", "--no-compile", "--reps", "1"]


@pytest.fixture
def models(monkeypatch):
    """bench/models.py as a module."""
    return repo_script("bench", "models", monkeypatch)


def check_rows(result: dict) -> None:
    """Both modes' rows: every architecture, every peer but the compiled ones timed, the best of them named."""
    for mode, train in (("eval", False), ("train", True)):
        assert result[mode]["train"] == train and result[mode]["autocast"] == result["autocast"]
        rows = result[mode]["rows"]
        assert [r["model"] for r in rows] == [a.letter for a in ARCHITECTURES]
        for r in rows:
            assert r["eager_ms"] > 0 and r["tuned_ms"] > 0 and r["fused_ms"] > 0 and r["compile_ms"] is None
            assert r["best_peer"] == min(("eager", "tuned"), key=lambda peer: r[f"{peer}_ms"])
            assert r["vs_best_peer"] == pytest.approx(r["best_peer_ms"] / r["fused_ms"])
            assert r["eager_peak_mib"] is r["tuned_peak_mib"] is r["compile_peak_mib"] is r["fused_peak_mib"] is None


def check_table(lines: list[str]) -> None:
    """The table last: its header, a row per model and step, then its notes."""
    notes = len(cli.TIMES_NOTES)
    assert lines[-9 - notes].split()[:3] == ["model", "step", "check"]
    assert "tuned ms" in lines[-9 - notes] and "vs best" in lines[-9 - notes]
    assert [" eval fwd " in line for line in lines[-8 - notes:-notes]] == [True, False] * 4
    assert [" train step " in line for line in lines[-8 - notes:-notes]] == [False, True] * 4
    assert lines[-1].startswith("peak MiB e/t/c/f:")


def test_tiny_on_the_cpu_writes_both_modes(tmp_path, capsys, models):
    status = models.main([*TINY, "--out", str(tmp_path)])
    assert status == 0
    assert os.listdir(tmp_path) == ["models-cpu.json"]
    result = json.loads((tmp_path / "models-cpu.json").read_text())
    assert result["device"] == "cpu" and result["torch"] and result["size"] == "tiny" and result["ok"]
    assert result["dtype"] == "float32" and result["autocast"] is None
    check_rows(result)
    assert all(r["ok"] for mode in ("eval", "train") for r in result[mode]["rows"])
    lines = capsys.readouterr().out.splitlines()
    assert "on a CPU: a test run, not the GPU result" in lines
    assert "autocast" not in "\n".join(lines)
    check_table(lines)


def test_autocast_bfloat16_on_the_cpu(tmp_path, capsys, models):
    """Under torch.autocast("cpu", bfloat16): its own file, every check run at bfloat16's tolerance; the
    values agree, and a check fails only where the fused module's dtype is not the original's (dtype_mismatch:
    fused_ops.nn, not the benchmark, is to fix that)."""
    status = models.main([*TINY, "--autocast", "bfloat16", "--out", str(tmp_path)])
    assert os.listdir(tmp_path) == ["models-cpu-autocast-bfloat16.json"]
    result = json.loads((tmp_path / "models-cpu-autocast-bfloat16.json").read_text())
    assert result["dtype"] == "float32" and result["autocast"] == "bfloat16"
    assert status == (0 if result["ok"] else 1)
    check_rows(result)
    for mode in ("eval", "train"):
        for r in result[mode]["rows"]:
            assert r["tolerance"] == cli.TOLERANCE[cli.AUTOCAST_DTYPES["bfloat16"]]
            assert all(e <= r["tolerance"] for e in r["errors"].values()) or "fused_vs_float64" in r, r["errors"]
            assert r["ok"] == ("dtype_mismatch" not in r), (mode, r["model"], r.get("dtype_mismatch"))
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("whole models on CPU") and "float32, autocast=bfloat16" in line for line in lines)
    check_table(lines)
