"""Timing helpers: CUDA-event medians on a GPU, wall-clock medians on a CPU,
and the device's name for results and their file names (used by
``python -m fused_ops`` and by the benchmarks under bench/)."""
import contextlib
import os
import re
import statistics
import subprocess
import time
from collections.abc import Callable

import torch


def warm_up(fn, device, warmup_ms: float = 50.0, calls: int = 3) -> float:
    """Runs fn() `calls` times (at least autotune.steady_calls: a drop-in's calls tune themselves,
    trying their candidates at once: autotune.exploring) and, on a GPU, until warmup_ms have passed,
    each call synchronized: the fastest call's wall-clock time in milliseconds (the launch latency
    included: a guide to how many calls to time)."""
    from . import autotune
    calls = max(calls, autotune.steady_calls(device))
    cuda = torch.device(device).type == "cuda"
    began, fastest, done = time.perf_counter(), float("inf"), 0
    with autotune.exploring():
        while done < calls or (cuda and (time.perf_counter() - began) * 1e3 < warmup_ms):
            start = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            fastest = min(fastest, (time.perf_counter() - start) * 1e3)
            done += 1
    return fastest


def median_ms(fn, device, warmup_ms: float = 50.0, reps: int = 50, warmup_calls: int = 3) -> float:
    """Median time of fn() in milliseconds: CUDA events around each call on a
    GPU, the wall clock on a CPU. First fn() runs warmup_calls (3) times and,
    on a GPU, for at least warmup_ms (warm_up): right after a correctness check
    (a few milliseconds of other work and a synchronization), an H200 timed a
    0.24 ms kernel at 0.27 ms without it (clocks, most likely). The calls are
    then queued back to back (one synchronization at the end), so that the GPU
    times the work and not the host's launch latency, as long as the host keeps
    ahead of the GPU."""
    cuda = torch.device(device).type == "cuda"
    warm_up(fn, device, warmup_ms, warmup_calls)
    times = []
    if cuda:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) for start, end in events]
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def interleaved_medians(calls: dict[str, Callable], device, reps: dict[str, int], rounds: int,
                        settings: Callable[[str], contextlib.AbstractContextManager],
                        warmup_ms: float = 50.0) -> dict[str, list[float]]:
    """Each call's median time (median_ms, reps[name] calls) in each of `rounds` rounds, the
    calls taken in turn within a round, each under settings(name) and warmed up before the
    first: {name: [round medians]}. Variants compared from one round to the next see the
    same clocks and host load; their medians over the rounds are what a comparison takes (a
    host-bound call's time moves by tens of percent from second to second)."""
    for name, call in calls.items():
        with settings(name):
            warm_up(call, device, warmup_ms)
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            with settings(name):
                times[name].append(median_ms(call, device, warmup_ms=0.0, reps=reps[name], warmup_calls=1))
    return times


def device_name(device) -> str:
    """The GPU's name ("NVIDIA H200"), or "cpu"."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def device_slug(name: str) -> str:
    """A device_name as a file-name part: "NVIDIA H200" -> "nvidia-h200"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def provenance() -> dict:
    """{"date": today, "commit": the source tree's commit ("<short hash>", "+" where tracked files
    differ from it), or None where the package runs from no checkout of its own (an installed copy,
    a site-packages inside some other repository among them)}: the stamp of a result's JSON
    (tools/results_tables.py prints it with each table). FUSED_OPS_COMMIT, where set, is the commit:
    a copy of a tree whose git metadata is not the tree's (the lent GPU machines' copies)."""
    if os.environ.get("FUSED_OPS_COMMIT"):
        return {"date": time.strftime("%Y-%m-%d"), "commit": os.environ["FUSED_OPS_COMMIT"]}
    source = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))

    def git(*args) -> str | None:
        try:
            done = subprocess.run(["git", "-C", source, *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None
    top = git("rev-parse", "--show-toplevel")
    commit = git("rev-parse", "--short", "HEAD") if top and os.path.realpath(top) == source else None
    if commit is not None and git("status", "--porcelain", "--untracked-files=no"):
        commit += "+"
    return {"date": time.strftime("%Y-%m-%d"), "commit": commit}
