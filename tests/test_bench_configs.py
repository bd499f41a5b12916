"""bench/configs.py, the configuration-grid benchmark: its list of configurations
(enough of them, SPEC's four among them, each valid for the original at the tiny
size), and a run of the grid at tiny sizes on the CPU, in-process: its checks,
its JSON, its table and its markdown."""
import json
import os

import pytest
import torch

from conftest import repo_script
from fused_ops.architectures import ARCHITECTURES

ROW_KEYS = {"config", "model", "name", "args", "batch", "spec_batch", "step", "input_shape", "errors", "ok",
            "max_rel_err", "tolerance", "verdict", "eager_ms", "tuned_ms", "fused_ms", "eager_reps", "tuned_reps",
            "fused_reps", "speedup_vs_eager", "speedup_vs_tuned", "formulation", "eager_peak_mib", "fused_peak_mib",
            "memory_ok", "settled_errors", "settled_verdict", "tuner_timings_ms"}


@pytest.fixture(scope="module")
def configs():
    """bench/configs.py as a module."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield repo_script("bench", "configs", monkeypatch)


def test_the_list(configs):
    """At least 32 configurations, 8 per architecture, uniquely named; SPEC's own four at SPEC's sizes; every
    spec-size input at SPEC's batch."""
    assert len(configs.CONFIGS) >= 32
    assert len({c.name for c in configs.CONFIGS}) == len(configs.CONFIGS)
    for a in ARCHITECTURES:
        mine = [c for c in configs.CONFIGS if c.letter == a.letter]
        assert len(mine) >= 8 and all(c.arch.name == a.name for c in mine)
        assert any(c.arch.args == a.args and c.arch.input_shapes["spec"] == a.input_shapes["spec"] for c in mine)
        assert all(c.arch.input_shapes["spec"][0] == a.input_shapes["spec"][0] for c in mine)
    b_args = [c.arch.args for c in configs.CONFIGS if c.letter == "B"]
    assert {s for _, _, _, s, _ in b_args} == {1, 2, 3} and {p for *_, p in b_args} == {0, 1, 2}
    assert {k for _, _, k, _, _ in b_args} == {3, 4, 5}
    c_args = [c.arch.args for c in configs.CONFIGS if c.letter == "C"]
    assert {p for *_, p in c_args} == {2, 3, 4, 5} and {k for _, _, k, _ in c_args} == {1, 3, 5, 7}


@pytest.mark.parametrize("size", ["tiny", "spec"])
def test_every_config_is_valid_for_the_original(configs, size):
    """Every configuration builds, and its original takes its input: at the tiny size an eval forward on the
    CPU, finite; at the spec size (batch 1) the shapes alone, on the meta device (the pools' outputs at least
    1 wide)."""
    device = "cpu" if size == "tiny" else "meta"
    for c in configs.CONFIGS:
        original = c.arch.build_original().to(device).eval()
        with torch.no_grad():
            out = original(torch.rand(c.arch.input_shape(size, 1), device=device))
        assert out.numel() > 0, c.name
        if size == "tiny":
            assert out.isfinite().all(), c.name


def test_grid_at_tiny_sizes_on_the_cpu(configs, tmp_path, capsys, monkeypatch):
    """One configuration per architecture at batch 1, both steps: every check passes, the JSON has each row's
    fields and the worst cases, the table a row each; the fused module's formulation (the autotuner's choice;
    C's made to say "rewrite-test" here) is recorded; --markdown prints the README's table."""
    from fused_ops import autotune
    from fused_ops import nn as fnn

    autotune.set_enabled(True)  # (conftest turns it off; it turns it back after)
    monkeypatch.setattr(fnn.Conv2dAvgPoolSigmoidSum, "formulation", lambda self, x: "rewrite-test")
    names = ["A-pool3", "B-s1p0k3", "C-p2k3", "D-k3"]
    status = configs.main(["--device", "cpu", "--size", "tiny", "--configs", ",".join(names), "--batches", "1",
                           "--reps", "2", "--out", str(tmp_path)])
    assert status == 0
    assert os.listdir(tmp_path) == ["configs-cpu.json"]
    result = json.loads((tmp_path / "configs-cpu.json").read_text())
    assert result["device"] == "cpu" and result["size"] == "tiny" and result["autocast"] is None and result["ok"]
    rows = result["rows"]
    assert [(r["config"], r["batch"], r["step"]) for r in rows] == [(n, 1, s) for n in names for s in ("eval", "train")]
    for r in rows:
        assert ROW_KEYS <= set(r) and "error" not in r and r["ok"], r
        assert r["eager_ms"] > 0 and r["tuned_ms"] > 0 and r["fused_ms"] > 0 and r["fused_reps"] == 2
        assert r["speedup_vs_eager"] == pytest.approx(r["eager_ms"] / r["fused_ms"])
        assert (r["formulation"] == "rewrite-test" if r["model"] == "C"
                else r["formulation"] in getattr(fnn, r["name"]).FORMULATIONS)  # (A's has fused_conv too)
        assert (len(r["errors"]) > 1) == (r["step"] == "train")
        # (no CUDA allocator statistics on a CPU)
        assert r["eager_peak_mib"] is None and r["fused_peak_mib"] is None and r["memory_ok"]
    summary = result["summary"]
    rewrites = [r for r in rows if r["formulation"].startswith("rewrite")]
    assert summary["timed"] == 8 and summary["rewrites"] == len(rewrites) and summary["failed"] == []
    assert summary["worst_vs_eager"]["speedup"] == min(r["speedup_vs_eager"] for r in rows)
    assert set(summary["worst_vs_eager_by_model"]) == {"A", "B", "C", "D"}
    assert summary["worst_vs_tuned_rewrite"]["speedup"] == min(r["speedup_vs_tuned"] for r in rewrites)
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("config "))
    assert lines[header].split() == ["config", "batch", "step", "eager", "ms", "tuned", "ms", "fused", "ms", "vs",
                                     "eager", "vs", "tuned", "peak", "MiB", "e/f", "formulation", "check"]
    assert [line.split()[0] for line in lines[header + 1:header + 9]] == [n for n in names for _ in range(2)]
    assert lines[-2].startswith("worst fused/tuned where a rewrite is taken: ")
    assert lines[-1].startswith("peak MiB e/f: ")

    assert configs.main(["--markdown", str(tmp_path / "configs-cpu.json")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "| config | arguments | input at SPEC's batch | batch 1 eval | batch 1 train |"
    assert [line.split(" | ")[0] for line in table[2:6]] == [f"| {n}" for n in names]
    for line, name in zip(table[2:6], names):
        assert ("†" in line) == any(r["formulation"].startswith("rewrite") for r in rows if r["config"] == name)


def test_a_grid_cut_short_keeps_its_rows_and_resumes(configs, tmp_path, monkeypatch):
    """The JSON is written after each row (complete: false until the end); --resume keeps the rows measured
    under the same settings and measures only the others; other settings (here --reps) or another tree's
    commit start over."""
    measured = []
    measure = configs.measure

    def counting(c, batch, step, args):
        if len(measured) == 2:
            raise KeyboardInterrupt  # (the run cut short after two rows)
        measured.append((c.name, step))
        return measure(c, batch, step, args)

    monkeypatch.setattr(configs, "measure", counting)
    argv = ["--device", "cpu", "--size", "tiny", "--configs", "A-pool3,D-k3", "--batches", "1", "--reps", "2",
            "--out", str(tmp_path)]
    with pytest.raises(KeyboardInterrupt):
        configs.main(argv)
    path = tmp_path / "configs-cpu.json"
    cut = json.loads(path.read_text())
    assert cut["complete"] is False and [(r["config"], r["step"]) for r in cut["rows"]] == measured
    assert "Partial" in configs.markdown(cut)

    measured.clear()
    assert configs.main(argv + ["--resume"]) == 0
    assert measured == [("D-k3", "eval"), ("D-k3", "train")]
    resumed = json.loads(path.read_text())
    assert resumed["complete"] is True and len(resumed["rows"]) == 4
    assert resumed["rows"][:2] == cut["rows"] and "Partial" not in configs.markdown(resumed)

    measured.clear()
    monkeypatch.setattr(configs, "measure", lambda c, batch, step, args: measured.append(c.name) or measure(c, batch, step, args))
    argv[argv.index("--reps") + 1] = "3"
    assert configs.main(argv + ["--resume"]) == 0
    assert measured == ["A-pool3", "A-pool3", "D-k3", "D-k3"]

    measured.clear()  # (another tree's rows: none kept)
    path.write_text(json.dumps(dict(json.loads(path.read_text()), commit="another tree")))
    assert configs.main(argv + ["--resume"]) == 0
    assert measured == ["A-pool3", "A-pool3", "D-k3", "D-k3"]


def test_a_grid_split_over_processes_merges_in_the_grid_order(configs, tmp_path):
    """--gpus 2: two processes (on a GPU machine one a GPU), each over every other configuration, each writing
    its own file; the rows merged in the grid's order into one complete result, the processes' folders gone."""
    names = ["A-pool3", "B-s1p0k3", "D-k3"]
    argv = ["--device", "cpu", "--size", "tiny", "--configs", ",".join(names), "--batches", "1", "--steps", "eval",
            "--reps", "2", "--gpus", "2", "--out", str(tmp_path)]
    assert configs.main(argv) == 0
    assert os.listdir(tmp_path) == ["configs-cpu.json"]
    result = json.loads((tmp_path / "configs-cpu.json").read_text())
    assert result["complete"] and result["ok"]
    assert [(r["config"], r["step"]) for r in result["rows"]] == [(n, "eval") for n in names]
    assert all(r["fused_ms"] > 0 for r in result["rows"])
