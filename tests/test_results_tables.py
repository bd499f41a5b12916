"""The README's and docs/' result tables are their JSON's (tools/results_tables.py, issue 45): the
check passes on this tree, and fails where a table and its JSON part."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "results_tables.py")


def tool():
    spec = importlib.util.spec_from_file_location("results_tables", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_table_is_its_json():
    done = subprocess.run([sys.executable, TOOL, "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_table_that_differs_from_its_json_fails_the_check(tmp_path, monkeypatch):
    results = tool()
    os.makedirs(tmp_path / "bench" / "results")
    os.makedirs(tmp_path / "docs")
    path = "bench/results/first-calls-nvidia-h200.json"
    shutil.copy(os.path.join(ROOT, path), tmp_path / path)
    (tmp_path / "README.md").write_text(f"# x\n<!-- results: first_calls_ratios {path} -->\n<!-- end results -->\n")
    monkeypatch.setattr(results, "ROOT", str(tmp_path))

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["results_tables.py", *args])
        return results.main()
    assert run("--check") == 1  # (an empty table)
    assert run() == 0 and run("--check") == 0
    assert "| serving | float32 |" in (tmp_path / "README.md").read_text()
    data = json.loads((tmp_path / path).read_text())
    data["rows"][0]["seconds"]["serving"] *= 2
    (tmp_path / path).write_text(json.dumps(data))
    assert run("--check") == 1


def test_main_job_tables_from_both_formats():
    """A table from `python -m fused_ops`'s JSON (one mode) and from bench/models.py's (eval and train):
    a row per model and step, each with its stamp."""
    results = tool()
    one_path = "bench/results/cli-nvidia-h200-float32-eval-session18.json"
    both_path = "bench/results/models-nvidia-h200.json"
    one, both = results.main_job([one_path]), results.main_job([both_path])

    def stamped(result):
        return f"commit {result['commit']}" if result.get("commit") else "commit not recorded"
    assert one.count("| eval |") == 4 and "training step" not in one and stamped(results.load(one_path)) in one
    assert both.count("| eval |") == 4 and both.count("| training step |") == 4
    assert stamped(results.load(both_path)["eval"]) in both and stamped(results.load(both_path)["train"]) in both


def test_the_readmes_chart_is_drawn_from_its_table(tmp_path):
    """The README's main_job table's JSONs give its chart: a PNG named for the first JSON."""
    pytest.importorskip("matplotlib")
    results = tool()
    with open(os.path.join(ROOT, "README.md")) as f:
        (paths,) = [m.group(3).split() for m in results.TABLE.finditer(f.read()) if m.group(2) == "main_job"]
    out = results.main_job_chart(paths, str(tmp_path))
    assert out == str(tmp_path / (os.path.basename(paths[0]).removesuffix(".json") + ".png"))
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
