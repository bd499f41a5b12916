"""Where a whole model's time goes on a GPU: each architecture's fused drop-in (and,
for comparison, the original eager and tuned by hand: fused_ops.cli's Tuned, under
cudnn.benchmark), eval forward and training step, under an optional autocast, timed
and profiled as fused_ops.cli times them (cli.timed_call); prints each variant's
CUDA-event median, the GPU's busy time and its top CUDA kernels.

    python bench/profile_models.py [--models A,B] [--autocast bfloat16] [--top 8] [--host] [--batch N]

--host also lists the host's side of the profiled call: its wall time, and the ops and CUDA runtime
calls by self CPU time (where a call whose GPU is idle part of the time spends its host's time).
"""
import argparse
import contextlib
import copy
import time

import torch

from fused_ops import cli
from fused_ops._timing import median_ms
from fused_ops.architectures import ARCHITECTURES


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="A,B,C,D")
    parser.add_argument("--autocast", choices=cli.AUTOCAST_DTYPES)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--host", action="store_true", help="the host's ops and runtime calls too")
    parser.add_argument("--batch", type=int, help="the input's batch (default: SPEC's)")
    args = parser.parse_args()
    device = torch.device("cuda")
    autocast_dtype = cli.AUTOCAST_DTYPES.get(args.autocast)
    for arch in ARCHITECTURES:
        if arch.letter not in args.models.split(","):
            continue
        x = torch.rand(arch.input_shape("spec", args.batch), device=device)
        original = arch.build_original().to(device)
        variants = {"eager": original, "tuned": cli.Tuned(original),
                    "fused": arch.fused_from(copy.deepcopy(original))}
        for name, module in variants.items():
            for train in (False, True):
                module.train(train)
                with torch.no_grad(), cli.autocast(device, autocast_dtype):
                    grad = torch.rand_like(module(x)) if train else None
                call = cli.timed_call(module, x, train, grad, autocast_dtype)
                setting = cli.cudnn_benchmark if name == "tuned" else contextlib.nullcontext
                with torch.set_grad_enabled(train), setting():
                    ms = median_ms(call, device, reps=20)
                    activities = [torch.profiler.ProfilerActivity.CUDA]
                    if args.host:
                        activities.append(torch.profiler.ProfilerActivity.CPU)
                    torch.cuda.synchronize()
                    with torch.profiler.profile(activities=activities) as prof:
                        began = time.perf_counter()
                        call()
                        queued = time.perf_counter() - began
                        torch.cuda.synchronize()
                print(f"\n== {arch.letter} {name} {'train' if train else 'eval'} {args.autocast or 'float32'}: "
                      f"{ms:.3f} ms")
                events = sorted([e for e in prof.key_averages() if e.device_time_total > 0],
                                key=lambda e: -e.device_time_total)
                print(f"   GPU busy {sum([e.device_time_total for e in events]) / 1e3:.3f} ms")
                for e in events[:args.top]:
                    print(f"{e.device_time_total:10.1f} us {e.count:3d}x  {e.key[:110]}")
                if args.host:
                    host = sorted([e for e in prof.key_averages() if e.self_cpu_time_total > 0],
                                  key=lambda e: -e.self_cpu_time_total)
                    print(f"   host: the call queued in {queued * 1e3:.3f} ms (profiled), "
                          f"{sum([e.self_cpu_time_total for e in host]) / 1e3:.3f} ms in ops and runtime calls")
                    for e in host[:args.top]:
                        print(f"{e.self_cpu_time_total:10.1f} us {e.count:3d}x  {e.key[:110]}")


if __name__ == "__main__":
    main()
