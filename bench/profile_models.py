"""Where a whole model's time goes on a GPU: each architecture's fused drop-in (and,
for comparison, the original eager and tuned by hand: channels_last, cudnn.benchmark),
eval forward and training step, under an optional autocast, profiled with
torch.profiler; prints each variant's CUDA-event median and its top CUDA kernels.

    python bench/profile_models.py [--models A,B] [--autocast bfloat16] [--top 8]
"""
import argparse
import copy

import torch

from fused_ops._timing import median_ms
from fused_ops.architectures import ARCHITECTURES


def variants(arch, device):
    original = arch.build_original().to(device)
    fused = arch.fused_from(copy.deepcopy(original))
    fmt = torch.channels_last_3d if len(arch.input_shapes["spec"]) == 5 else torch.channels_last
    tuned = copy.deepcopy(original)
    for m in tuned.modules():
        if isinstance(m, torch.nn.modules.conv._ConvNd):
            m.to(memory_format=fmt)
    return {"eager": (original, None), "tuned": (tuned, fmt), "fused": (fused, None)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="A,B,C,D")
    parser.add_argument("--autocast", choices=["bfloat16", "float16"])
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    device = torch.device("cuda")
    dtype = getattr(torch, args.autocast) if args.autocast else None
    for arch in ARCHITECTURES:
        if arch.letter not in args.models.split(","):
            continue
        x = torch.rand(arch.input_shape("spec"), device=device)
        for name, (module, fmt) in variants(arch, device).items():
            for train in (False, True):
                module.train(train)

                def call():
                    xin = x if fmt is None else x.contiguous(memory_format=fmt)
                    with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
                        with torch.set_grad_enabled(train):
                            out = module(xin)
                    if train:
                        out.float().sum().backward()

                torch.backends.cudnn.benchmark = name == "tuned"
                ms = median_ms(call, device, reps=20)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    call()
                    torch.cuda.synchronize()
                print(f"\n== {arch.letter} {name} {'train' if train else 'eval'} {args.autocast or 'float32'}: "
                      f"{ms:.3f} ms")
                events = sorted([e for e in prof.key_averages() if e.device_time_total > 0],
                                key=lambda e: -e.device_time_total)
                print(f"   GPU busy {sum([e.device_time_total for e in events]) / 1e3:.3f} ms")
                for e in events[:args.top]:
                    print(f"{e.device_time_total:10.1f} us {e.count:3d}x  {e.key[:110]}")
    torch.backends.cudnn.benchmark = False


if __name__ == "__main__":
    main()
