"""bench/models.py, the whole-model benchmark: at tiny sizes on the CPU, both
modes through the CLI's machinery, its JSON and its table."""
import importlib.util
import json
import os

from fused_ops.architectures import ARCHITECTURES

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def test_tiny_on_the_cpu_writes_both_modes(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(BENCH)  # its imports, as when run as a script
    spec = importlib.util.spec_from_file_location("bench_models", os.path.join(BENCH, "models.py"))
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    status = models.main(["--device", "cpu", "--size", "tiny", "--no-compile", "--reps", "1", "--out", str(tmp_path)])
    assert status == 0
    result = json.loads((tmp_path / "models-cpu.json").read_text())
    assert result["device"] == "cpu" and result["torch"] and result["size"] == "tiny" and result["ok"]
    for mode, train in (("eval", False), ("train", True)):
        assert result[mode]["train"] == train
        rows = result[mode]["rows"]
        assert [r["model"] for r in rows] == [a.letter for a in ARCHITECTURES]
        for r in rows:
            assert r["ok"] and r["eager_ms"] > 0 and r["fused_ms"] > 0 and r["compile_ms"] is None
            assert r["eager_peak_mib"] is r["compile_peak_mib"] is r["fused_peak_mib"] is None
    lines = capsys.readouterr().out.splitlines()
    assert "on a CPU: a test run, not the GPU result" in lines
    # the table last: a row per model and step, then its notes
    assert [" eval fwd " in line for line in lines[-10:-2]] == [True, False] * 4
    assert [" train step " in line for line in lines[-10:-2]] == [False, True] * 4
    assert lines[-1].startswith("peak MiB e/c/f:")
