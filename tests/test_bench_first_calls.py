"""bench/first_calls.py on the CPU at tiny sizes: every variant of one model runs each sequence from a
fresh start (the tuner's choices cleared: the fused module's first call the rule's, as with the tuner
off), and main writes the JSON and the table."""
import json

import torch

from conftest import repo_script
from fused_ops import autotune
from fused_ops.architectures import ARCHITECTURES

TINY = dict(size="tiny", max_batch=3, serving_calls=4, epochs=1, steps=2, repeats=1)


def test_each_variant_runs_each_sequence_afresh(monkeypatch):
    first_calls = repo_script("bench", "first_calls", monkeypatch)
    arch = next(a for a in ARCHITECTURES if a.letter == "C")
    made = []
    build = first_calls.build
    def fresh(*args):
        module = build(*args)
        made.append(len(autotune._TUNINGS))
        return module
    monkeypatch.setattr(first_calls, "build", fresh)
    for variant in ("eager", "tuned", "fused", "fused, tuner off"):
        seconds = first_calls.sequences(arch, variant, torch.device("cpu"), TINY, None)
        assert list(seconds) == ["first eval call", "first training step", "serving", "ragged training"]
        assert all(s > 0 for s in seconds.values())
    assert made == [0] * 16  # (four modules per variant, each with nothing tuned)


def test_main_writes_the_json_and_the_table(monkeypatch, tmp_path, capsys):
    first_calls = repo_script("bench", "first_calls", monkeypatch)
    monkeypatch.setitem(first_calls.SETTINGS, "cpu", TINY)
    monkeypatch.setattr("sys.argv", ["first_calls.py", "--device", "cpu", "--no-compile", "--models", "D",
                                     "--out", str(tmp_path)])
    assert first_calls.main() == 0
    (path,) = tmp_path.glob("first-calls-*.json")
    result = json.loads(path.read_text())
    assert [row["variant"] for row in result["rows"]] == ["eager", "tuned", "fused", "fused, tuner off"]
    assert "fused / eager" in capsys.readouterr().out


def test_each_sequence_is_the_median_of_its_repeats(monkeypatch, tmp_path):
    """With settings' repeats R, each variant's process runs R times and each sequence keeps its median."""
    first_calls = repo_script("bench", "first_calls", monkeypatch)
    monkeypatch.setitem(first_calls.SETTINGS, "cpu", dict(TINY, repeats=3))
    runs = iter([{"serving": s, "ragged training": 10 - s} for s in (3.0, 1.0, 2.0)] * 4)
    monkeypatch.setattr(first_calls, "in_own_process", lambda *args: next(runs))
    monkeypatch.setattr("sys.argv", ["first_calls.py", "--device", "cpu", "--no-compile", "--models", "D",
                                     "--out", str(tmp_path)])
    assert first_calls.main() == 0
    (path,) = tmp_path.glob("first-calls-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [row["seconds"] for row in rows] == [{"serving": 2.0, "ragged training": 8.0}] * 4
