"""python -m fused_ops (fused_ops.cli): end to end at tiny sizes, its check
failing on a wrong fused result (or dtype), its errors, its JSON and chart, both
modes in one call, its peers (tuned, compiled, max-autotune), autocast."""
import copy
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from fused_ops import autotune, cli
from fused_ops import nn as fnn
from fused_ops import reference
from fused_ops.architectures import ARCHITECTURES

TINY = ["--size", "tiny", "--no-compile", "--reps", "1", "--device", "cpu"]
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
# the keys of a row that the README and the JSON under docs/ use
ROW_KEYS = {"model", "name", "args", "input_shape", "errors", "ok", "max_rel_err", "tolerance", "eager_ms",
            "tuned_ms", "compile_ms", "compile_s", "fused_ms", "speedup_vs_eager", "speedup_vs_tuned",
            "speedup_vs_compile", "best_peer", "best_peer_ms", "vs_best_peer", "fused_formulation", "fused_graphed",
            "settled_errors", "settled_verdict"}
PEAK_KEYS = {"eager_peak_mib", "tuned_peak_mib", "compile_peak_mib", "fused_peak_mib", "memory_ok"}
AUTOTUNE_KEYS = {"autotune_ms", "autotune_s", "speedup_vs_autotune", "autotune_peak_mib"}


def assert_best_peer(r):
    """best_peer is the fastest of the peers timed, and vs_best_peer the speed-up over it."""
    timed = {peer: r[f"{peer}_ms"] for peer in cli.PEERS if r.get(f"{peer}_ms") is not None}
    assert r["best_peer"] == min(timed, key=timed.get) and r["best_peer_ms"] == min(timed.values())
    assert r["vs_best_peer"] == pytest.approx(r["best_peer_ms"] / r["fused_ms"])
    for peer, ms in timed.items():
        assert ms > 0 and r[f"speedup_vs_{peer}"] == pytest.approx(ms / r["fused_ms"])


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
        assert r["eager_ms"] > 0 and r["tuned_ms"] > 0 and r["fused_ms"] > 0 and r["compile_ms"] is None
        assert_best_peer(r)
        assert r["best_peer"] in ("eager", "tuned") and r["speedup_vs_compile"] is None
        assert r["compile_peak_mib"] is None
        if device == "cpu":  # no allocator statistics
            assert r["eager_peak_mib"] is None and r["tuned_peak_mib"] is None and r["fused_peak_mib"] is None
        else:  # at least the output
            assert r["eager_peak_mib"] > 0 and r["tuned_peak_mib"] > 0 and r["fused_peak_mib"] > 0
        assert r["memory_ok"] == (r["fused_peak_mib"] is None or r["fused_peak_mib"] <= r["eager_peak_mib"])
        assert r["fused_formulation"] is None and not r["fused_graphed"]  # (the tests' tuner is off: conftest)
    assert result["autocast"] is None
    table = capsys.readouterr().out
    assert "C Conv2dAvgPoolSigmoidSum" in table and "tiny sizes" in table and "autocast" not in table
    header = next(line for line in table.splitlines() if line.startswith("model "))
    assert header.split()[-17:] == ["eager", "ms", "tuned", "ms", "compile", "ms", "fused", "ms", "vs", "eager",
                                    "vs", "compile", "vs", "best", "peak", "MiB", "e/t/c/f"]
    row = next(line for line in table.splitlines() if line.startswith("A "))
    assert f"{result['rows'][0]['vs_best_peer']:.2f}x {result['rows'][0]['best_peer']}" in row
    assert any(p.suffix == ".png" for p in tmp_path.iterdir()) == HAS_MATPLOTLIB


def test_rows_name_the_settled_formulation(tmp_path):
    """With the tuner on (as users run it), each row names the formulation the fused module's timed calls
    settled on, one of its own."""
    autotune.set_enabled(True)
    status, result = run_cli(tmp_path, "--models", "C", "D", "--mode", "train")
    for r in result["rows"]:
        module = getattr(fnn, r["name"])
        assert r["fused_formulation"] in module.FORMULATIONS and r["fused_graphed"] is False  # (no graphs on a CPU)


def test_training_step_checks_every_gradient_and_buffer(tmp_path):
    status, result = run_cli(tmp_path, "--train", "--models", "B", "d", "--batch", "2")
    assert status == 0
    b, d = result["rows"]
    assert b["input_shape"][0] == d["input_shape"][0] == 2
    assert list(b["errors"]) == ["output", "grad conv_transpose.weight", "grad conv_transpose.bias"]
    # each module starts from the same running statistics, and updates them alike
    assert d["errors"]["buffer batch_norm.running_mean"] < 1e-6
    assert d["errors"]["buffer batch_norm.num_batches_tracked"] == 0


def test_settled_check_after_steps_of_their_own():
    """The check of the settled formulation (after the timed calls) compares D's training step once the
    original's running statistics are copied into the fused module's: the timed calls ran each a different
    number of steps (without the copy its buffers fail the check)."""
    arch = next(a for a in ARCHITECTURES if a.letter == "D")
    original, fused, x, grad = cli.prepare(arch, arch.input_shape("tiny"), torch.device("cpu"), torch.float32, True)
    for _ in range(3):
        cli.timed_call(original, x, True, grad)()
    tolerance = cli.TOLERANCE[torch.float32]
    assert not cli.check(copy.deepcopy(original), copy.deepcopy(fused), x, True, grad, tolerance)["ok"]
    assert cli.settled_check(original, fused, x, True, grad, tolerance)["ok"]


def test_compile_and_max_autotune_timed_too(tmp_path):
    status = cli.main(["--size", "tiny", "--reps", "1", "--models", "D", "--dtype", "float64", "--device", "cpu",
                       "--max-autotune", "--out", str(tmp_path)])
    assert status == 0
    (row,) = json.loads((tmp_path / "cpu-float64-eval.json").read_text())["rows"]
    assert set(row) == ROW_KEYS | PEAK_KEYS | AUTOTUNE_KEYS
    assert row["compile_ms"] > 0 and row["compile_s"] > 0 and row["autotune_ms"] > 0 and row["autotune_s"] > 0
    assert_best_peer(row)
    assert row["compile_peak_mib"] is row["autotune_peak_mib"] is None  # on the CPU


def test_tuned_peer_channels_last():
    """Tuned: a copy of the original, its weights in channels_last (channels_last_3d for 5-D; A's 4-D bias in
    channels_last), its input converted in the call; the original untouched."""
    torch.manual_seed(0)
    original = reference.Conv3dDivMaxPoolGAPBiasSum(*ARCHITECTURES[0].args)
    tuned = cli.Tuned(original)
    weight, bias = tuned.original.conv.weight, tuned.original.bias
    assert weight.is_contiguous(memory_format=torch.channels_last_3d) and not weight.is_contiguous()
    assert bias.dim() == 4 and bias.is_contiguous(memory_format=torch.channels_last)
    assert original.conv.weight.is_contiguous() and original.conv.weight.data_ptr() != weight.data_ptr()
    assert torch.equal(weight, original.conv.weight)
    seen = []
    tuned.original.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    x = torch.rand(ARCHITECTURES[0].input_shape("tiny"))
    torch.testing.assert_close(tuned(x), original(x))
    assert seen[0].is_contiguous(memory_format=torch.channels_last_3d) and not seen[0].is_contiguous()


def test_every_forward_under_autocast_tuned_with_cudnn_benchmark(tmp_path, monkeypatch):
    """With --autocast, each forward of the original (the check's and every timed peer's) runs under
    torch.autocast, and the tuned peer's with a channels_last input and cudnn.benchmark on, restored after;
    the backward outside autocast."""
    calls = []
    forward = reference.Conv2dAvgPoolSigmoidSum.forward

    def recording(self, x):
        out = forward(self, x)
        if out.requires_grad:
            out.register_hook(lambda g: calls.append(("backward", torch.is_autocast_enabled("cpu"))))
        calls.append((torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"),
                      x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous(),
                      torch.backends.cudnn.benchmark))
        return out

    monkeypatch.setattr(reference.Conv2dAvgPoolSigmoidSum, "forward", recording)
    benchmark = torch.backends.cudnn.benchmark
    run_cli(tmp_path, "--models", "C", "--train", "--autocast", "bfloat16")
    assert torch.backends.cudnn.benchmark == benchmark
    forwards = [c for c in calls if c[0] != "backward"]
    assert {c[0] for c in forwards} == {torch.bfloat16}
    tuned = [c for c in forwards if c[1]]
    # warm-up, then each round's warm-up call and timed call (--reps 1; no peak on a CPU)
    assert len(tuned) == 3 + cli.TIMING_ROUNDS * 2 and all(c[2] for c in tuned)
    assert not any(c[2] for c in forwards if not c[1])
    backwards = [c for c in calls if c[0] == "backward"]
    assert backwards and not any(enabled for _, enabled in backwards)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_autocast_bfloat16(tmp_path, capsys, mode):
    """--autocast bfloat16 on the CPU: fused against original both under torch.autocast("cpu", bfloat16), at
    bfloat16's tolerance. Every tensor's values agree; a fused module whose dtype is not the original's fails
    the check (dtype_mismatch; fused_ops.nn, not the CLI, is to fix that)."""
    status, result = run_cli(tmp_path, "--mode", mode, "--autocast", "bfloat16")
    stem = f"cpu-float32-autocast-bfloat16-{mode}"
    assert sorted(os.listdir(tmp_path)) == [f"{stem}.json"] + ([f"{stem}.png"] if HAS_MATPLOTLIB else [])
    assert result["dtype"] == "float32" and result["autocast"] == "bfloat16" and result["train"] == (mode == "train")
    assert [r["model"] for r in result["rows"]] == ["A", "B", "C", "D"]
    for r in result["rows"]:
        assert set(r) - {"fused_vs_float64", "original_vs_float64", "tuned_vs_float64", "dtype_mismatch"} == ROW_KEYS | PEAK_KEYS
        assert r["tolerance"] == cli.TOLERANCE[torch.bfloat16]
        assert list(r["errors"])[0] == "output" and (len(r["errors"]) > 1) == (mode == "train")
        assert r["eager_ms"] > 0 and r["tuned_ms"] > 0 and r["fused_ms"] > 0
        assert_best_peer(r)
        values_ok = all(e <= r["tolerance"] for e in r["errors"].values()) or "fused_vs_float64" in r
        assert values_ok, (r["model"], r["errors"])
        assert r["ok"] == ("dtype_mismatch" not in r), (r["model"], r.get("dtype_mismatch"))
    assert status == (0 if result["ok"] else 1) and result["ok"] == all(r["ok"] for r in result["rows"])
    out = capsys.readouterr().out
    assert "float32, autocast=bfloat16" in out
    for r in result["rows"]:
        if "dtype_mismatch" in r:
            assert f"{r['model']}: the fused module's dtype differs from the original's: output" in out


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


def test_wrong_dtype_fails(tmp_path, capsys, monkeypatch):
    """The values right to the last bit, the dtype not the original's."""
    forward = fnn.Conv2dAvgPoolSigmoidSum.forward
    monkeypatch.setattr(fnn.Conv2dAvgPoolSigmoidSum, "forward", lambda self, x: forward(self, x).double())
    status, result = run_cli(tmp_path, "--models", "C")
    (row,) = result["rows"]
    assert status == 1 and not row["ok"] and row["errors"]["output"] == 0
    assert row["dtype_mismatch"] == {"output": "float64 (original: float32)"}
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
    (["--autocast", "float64"], "argument --autocast: invalid choice: 'float64'"),
    (["--autocast", "bfloat16", "--dtype", "float64"],
     "--autocast bfloat16: the input and parameters must be float32 (--dtype float32), not float64"),
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


@pytest.mark.parametrize("argv, autocast, max_autotune", [
    ([], None, False), (["--autocast", "bfloat16"], torch.bfloat16, False),
    (["--autocast", "float16", "--max-autotune"], torch.float16, True)])
def test_autocast_and_max_autotune_options(argv, autocast, max_autotune):
    args = cli.parse_args(argv)
    assert args.autocast == autocast and args.max_autotune == max_autotune and args.dtype == torch.float32


def test_python_m_fused_ops(tmp_path):
    """The entry point, in a fresh interpreter."""
    result = subprocess.run([sys.executable, "-m", "fused_ops", *TINY, "--models", "C", "--out", str(tmp_path)],
                            cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "C Conv2dAvgPoolSigmoidSum" in result.stdout
    assert "[fused_ops] [C] check: max relative error" in result.stderr


class _Offset(torch.nn.Module):
    """original(x) moved by `offset` times the largest output (a stand-in for a module that rounds)."""

    def __init__(self, original, offset):
        super().__init__()
        self.original, self.offset = original, offset

    def forward(self, x):
        out = self.original(x)
        return out + self.offset * out.abs().max()


class _Float32Rounding(torch.nn.Module):
    """original(x) times (1 + relative) in float32 alone (a stand-in for a module whose float32 run rounds:
    its float64 run is exact)."""

    def __init__(self, original, relative):
        super().__init__()
        self.original, self.relative = original, relative

    def forward(self, x):
        out = self.original(x)
        return out * (1 + self.relative) if out.dtype == torch.float32 else out


@pytest.mark.parametrize("fused_offset,ok", [(3e-3, True), (5e-3, False), (5e-5, True)])
def test_check_allows_twice_the_originals_own_rounding(monkeypatch, fused_offset, ok):
    """Beyond the tolerance of the eager original, a fused result passes where it is at most twice as far
    from float64 as the original's own float32 run is (here 2e-3), and fails where it is further, whatever
    the original tuned by hand makes of it (here 1.2e-2 from float64: reported, not counted)."""
    torch.manual_seed(0)
    module = reference.Conv2dAvgPoolSigmoidSum(3, 4, 3, 2)
    monkeypatch.setattr(cli, "Tuned", lambda original: _Float32Rounding(original, 1e-2))
    x = torch.rand(2, 3, 10, 10)
    checked = cli.check(_Float32Rounding(module, 2e-3), _Offset(module, fused_offset), x, False, None, 1e-4)
    assert checked["ok"] is ok  # (each 2e-3 from the original: beyond its tolerance, the float64 run decides)
    assert checked["original_vs_float64"]["output"] == pytest.approx(2e-3, rel=1e-3)
    assert checked["tuned_vs_float64"]["output"] > 1e-2
