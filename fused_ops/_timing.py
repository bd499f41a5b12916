"""Timing helpers: CUDA-event medians on a GPU, wall-clock medians on a CPU,
and the device's name for results and their file names (used by
``python -m fused_ops`` and by the benchmarks under bench/)."""
import re
import statistics
import time

import torch


def median_ms(fn, device, warmup: int = 3, reps: int = 50) -> float:
    """Median time of fn() in milliseconds: CUDA events around each call on a
    GPU, the wall clock on a CPU. The calls are queued back to back (one
    synchronization at the end), so that the GPU times the work and not the
    host's launch latency, as long as the host keeps ahead of the GPU."""
    for _ in range(warmup):
        fn()
    times = []
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
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


def device_name(device) -> str:
    """The GPU's name ("NVIDIA H200"), or "cpu"."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def device_slug(name: str) -> str:
    """A device_name as a file-name part: "NVIDIA H200" -> "nvidia-h200"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
