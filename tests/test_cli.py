"""python -m fused_ops (fused_ops.cli): end to end at tiny sizes, its check
failing on a wrong fused result, its errors, its JSON and chart, both modes in
one call."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from fused_ops import cli
from fused_ops import nn as fnn

TINY = ["--size", "tiny", "--no-compile", "--reps", "1", "--device", "cpu"]
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
# the keys of a row that the README and the JSON under docs/ use
ROW_KEYS = {"model", "name", "args", "input_shape", "errors", "ok", "max_rel_err", "tolerance", "eager_ms",
            "compile_ms", "compile_s", "fused_ms", "speedup_vs_eager", "speedup_vs_compile"}
PEAK_KEYS = {"eager_peak_mib", "compile_peak_mib", "fused_peak_mib"}


def run_cli(out_dir, *argv):
    """main(argv) writing to out_dir (on the CPU unless argv says otherwise): (exit status, the JSON result)."""
    status = cli.main([*TINY, "--out", str(out_dir), *argv])
    (path,) = [p for p in os.listdir(out_dir) if p.endswith(".json")]
    with open(os.path.join(out_dir, path)) as f:
        return status, json.load(f)


def test_eval_forward_of_all_four(tmp_path, capsys, device):
    status, result = run_cli(tmp_path, "--device", device)
    assert status == 0 and result["ok"]
    assert [r["model"] for r in result["rows"]] == ["A", "B", "C", "D"]
    assert result["device_type"] == device and result["dtype"] == "float32" and not result["train"]
    for r in result["rows"]:
        assert set(r) == ROW_KEYS | PEAK_KEYS
        assert r["ok"] and list(r["errors"]) == ["output"] and r["max_rel_err"] <= r["tolerance"] == 1e-4
        assert r["eager_ms"] > 0 and r["fused_ms"] > 0 and r["compile_ms"] is None
        assert r["speedup_vs_eager"] == pytest.approx(r["eager_ms"] / r["fused_ms"])
        assert r["compile_peak_mib"] is None
        if device == "cpu":  # no allocator statistics
            assert r["eager_peak_mib"] is None and r["fused_peak_mib"] is None
        else:  # at least the output
            assert r["eager_peak_mib"] > 0 and r["fused_peak_mib"] > 0
    table = capsys.readouterr().out
    assert "C Conv2dAvgPoolSigmoidSum" in table and "tiny sizes" in table and "peak MiB e/c/f" in table
    assert any(p.suffix == ".png" for p in tmp_path.iterdir()) == HAS_MATPLOTLIB


def test_training_step_checks_every_gradient_and_buffer(tmp_path):
    status, result = run_cli(tmp_path, "--train", "--models", "B", "d", "--batch", "2")
    assert status == 0
    b, d = result["rows"]
    assert b["input_shape"][0] == d["input_shape"][0] == 2
    assert list(b["errors"]) == ["output", "grad conv_transpose.weight", "grad conv_transpose.bias"]
    # each module starts from the same running statistics, and updates them alike
    assert d["errors"]["buffer batch_norm.running_mean"] < 1e-6
    assert d["errors"]["buffer batch_norm.num_batches_tracked"] == 0


def test_compile_timed_too(tmp_path):
    status = cli.main(["--size", "tiny", "--reps", "1", "--models", "D", "--dtype", "float64", "--device", "cpu",
                       "--out", str(tmp_path)])
    assert status == 0
    (row,) = json.loads((tmp_path / "cpu-float64-eval.json").read_text())["rows"]
    assert row["compile_ms"] > 0 and row["compile_s"] > 0
    assert row["speedup_vs_compile"] == pytest.approx(row["compile_ms"] / row["fused_ms"])
    assert row["compile_peak_mib"] is None  # on the CPU


def test_both_modes_in_one_call(tmp_path, capsys):
    status = cli.main([*TINY, "--mode", "both", "--models", "C", "--out", str(tmp_path)])
    assert status == 0
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["cpu-float32-eval.json", "cpu-float32-train.json"]
    results = [json.loads((tmp_path / f"cpu-float32-{mode}.json").read_text()) for mode in ("eval", "train")]
    assert [r["train"] for r in results] == [False, True]
    for result in results:
        (row,) = result["rows"]
        assert set(row) >= ROW_KEYS | PEAK_KEYS and row["ok"]
    table = capsys.readouterr().out
    assert "float32, eval forward" in table and "float32, training step (forward + backward)" in table


def test_wrong_output_fails(tmp_path, capsys, monkeypatch):
    forward = fnn.Conv2dAvgPoolSigmoidSum.forward
    monkeypatch.setattr(fnn.Conv2dAvgPoolSigmoidSum, "forward", lambda self, x: forward(self, x) * 1.001)
    status, result = run_cli(tmp_path, "--models", "A,C")
    assert status == 1 and not result["ok"]
    a, c = result["rows"]
    assert a["ok"] and not c["ok"] and c["max_rel_err"] == pytest.approx(1e-3, rel=1e-2)
    assert "FAILED" in capsys.readouterr().out


def test_wrong_gradient_fails(tmp_path, monkeypatch):
    """The output right to the last bit, the gradients 0.1% off."""
    forward = fnn.Conv2dAvgPoolSigmoidSum.forward

    def off_gradient(self, x):
        out = forward(self, x)
        return out.detach() + 1.001 * (out - out.detach())

    monkeypatch.setattr(fnn.Conv2dAvgPoolSigmoidSum, "forward", off_gradient)
    status, result = run_cli(tmp_path, "--models", "C", "--train")
    (row,) = result["rows"]
    assert status == 1 and not row["ok"]
    assert row["errors"]["output"] < 1e-6
    # relative to the largest gradient element, which is 0.1% off
    assert max(row["errors"]["grad conv.weight"], row["errors"]["grad conv.bias"]) == pytest.approx(1e-3, rel=1e-2)


def test_chart_skipped_without_matplotlib(tmp_path, capsys, monkeypatch):
    for name in ("matplotlib", "matplotlib.figure"):  # importing them raises ImportError
        monkeypatch.setitem(sys.modules, name, None)
    status, _ = run_cli(tmp_path, "--models", "C")
    assert status == 0
    assert not list(tmp_path.glob("*.png"))
    assert "matplotlib is not installed: no chart" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--models", "A,E"], "unknown model E; choose from A (Conv3dDivMaxPoolGAPBiasSum)"),
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--batch", "0"], "argument --batch: expected a positive integer, got '0'"),
    (["--device", "tpu"], "--device: not a device: 'tpu'"),
    (["--device", "meta"], "--device: meta is not supported"),
    pytest.param(["--device", "cuda"], "--device cuda: no CUDA device is available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="there is a CUDA device")),
])
def test_bad_arguments_one_line_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in err


def test_models_by_letter_or_name():
    args = cli.parse_args(["--models", "d,a", "conv2davgpoolsigmoidsum"])
    assert [a.letter for a in args.models] == ["A", "C", "D"]


@pytest.mark.parametrize("argv, mode", [([], "eval"), (["--train"], "train"), (["--mode", "both"], "both")])
def test_mode_options(argv, mode):
    assert cli.parse_args(argv).mode == mode


def test_python_m_fused_ops(tmp_path):
    """The entry point, in a fresh interpreter."""
    result = subprocess.run([sys.executable, "-m", "fused_ops", *TINY, "--models", "C", "--out", str(tmp_path)],
                            cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "C Conv2dAvgPoolSigmoidSum" in result.stdout
    assert "[fused_ops] [C] check: max relative error" in result.stderr
