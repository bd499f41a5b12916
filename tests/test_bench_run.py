"""bench/run.py's test shards: the shards of a collected suite partition it, each test in exactly
one, every N-th from the K-th (so that each file's cases spread over the shards)."""
import os
import subprocess

import pytest

from conftest import repo_script



@pytest.fixture
def run(monkeypatch):
    """bench/run.py as a module, its suite's collection replaced by 10 listed tests."""
    module = repo_script("bench", "run", monkeypatch)
    listing = "\n".join([f"tests/test_{i % 3}.py::test_case[{i}]" for i in range(10)] + ["", "10 tests collected"])
    monkeypatch.setattr(module.subprocess, "run",
                        lambda *args, **kwargs: subprocess.CompletedProcess(args, 0, stdout=listing, stderr=""))
    return module


def test_shards_partition_the_suite(run):
    shards = [run.shard_tests(f"{k}/3") for k in (1, 2, 3)]
    names = [os.path.relpath(test_id, run.ROOT) for shard in shards for test_id in shard]
    assert sorted(names) == sorted([f"tests/test_{i % 3}.py::test_case[{i}]" for i in range(10)])
    assert [len(shard) for shard in shards] == [4, 3, 3]
    assert os.path.relpath(shards[1][0], run.ROOT) == "tests/test_1.py::test_case[1]"


@pytest.mark.parametrize("shard", ["0/3", "4/3"])
def test_shard_out_of_range_named(run, shard):
    with pytest.raises(SystemExit, match="1 <= K <= N"):
        run.shard_tests(shard)
