"""The CUDA kernels of architecture A's fused_conv training step and eval forward at SPEC's sizes
(float32, TF32; and under bf16 autocast), by the profiler: where the time goes.

    python bench/profile_conv3d_max_pool3d_mean.py [--batch 128]
"""
import argparse
import contextlib

import torch

from fused_ops import autotune, reference
from fused_ops import nn as fnn


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    original = reference.Conv3dDivMaxPoolGAPBiasSum(8, 16, 3, 2.0, (2, 2, 2), (16, 1, 1, 1), 1).cuda()
    fused = fnn.Conv3dDivMaxPoolGAPBiasSum.from_module(original)
    x = torch.rand(args.batch, 8, 16, 64, 64, device="cuda")
    grad = torch.rand(args.batch, 1, 1, 1, device="cuda")

    def train():
        fused(x).float().backward(grad)

    def evaluate():
        with torch.no_grad():
            fused(x)

    for name, step in (("train", train), ("eval", evaluate)):
        for autocast in (False, True):
            settings = torch.autocast("cuda", torch.bfloat16) if autocast else contextlib.nullcontext()
            fused.train(name == "train")
            with autotune.force("fused_conv"), settings:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        step()
                    torch.cuda.synchronize()
            print(f"\nA fused_conv {name}{' bf16' if autocast else ''}: kernels per step (us)")
            events = prof.key_averages()
            for e in sorted(events, key=lambda e: -e.device_time_total)[:8]:
                print(f"{e.device_time_total / 10:9.1f}  {e.key[:100]}")


if __name__ == "__main__":
    main()
