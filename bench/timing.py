"""Timing helpers shared by the benchmarks: CUDA-event medians on a GPU,
wall-clock medians on a CPU, and the device's measured copy bandwidth."""
import statistics
import time

import torch


def median_ms(fn, device, warmup: int = 3, reps: int = 25) -> float:
    """Median time of fn() in milliseconds: CUDA events around each call on a
    GPU, the wall clock on a CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbs(device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus written."""
    src = torch.rand(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device)
    return 2 * nbytes / ms / 1e6


def device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"
