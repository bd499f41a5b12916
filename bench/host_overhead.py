"""Where a drop-in module's call spends its time at a small batch (host-bound): the
original, the module (its autotuned formulation), and each formulation forced, eval
forward without autograd, CUDA-event medians of calls queued back to back.

    python bench/host_overhead.py [--device cuda] [--batch 1] [--configs A-spec,B-64to32-s2p1k4]
"""
import argparse

import torch

from configs import select
from fused_ops import autotune
from timing import device_name, median_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--configs", default="A-spec,B-spec,C-spec,D-spec")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"{device_name(device)}, batch {args.batch}, eval forward without autograd, ms per call")
    print(f"{'config':<20}{'original':>10}{'module':>10}  " + "".join(f"{n:>24}" for n in autotune.FORMULATIONS))
    for c in select(argparse.ArgumentParser(), args.configs.split(",")):
        torch.manual_seed(0)
        original = c.arch.build_original().to(device).eval()
        fused = c.arch.fused_from(original)
        x = torch.rand(c.arch.input_shape("spec", args.batch), device=device)
        with torch.no_grad():
            times = [median_ms(lambda: original(x), device), median_ms(lambda: fused(x), device)]
            chosen = autotune.last_formulation() + (" from a CUDA graph" if fused.graphed(x) else "")
            for name in autotune.FORMULATIONS:
                with autotune.force(name):
                    fused(x)
                    times.append(median_ms(lambda: fused(x), device) if autotune.last_formulation() == name else None)
        cells = "".join(f"{'-' if t is None else f'{t:.3f}':>24}" for t in times[2:])
        print(f"{c.name:<20}{times[0]:>10.3f}{times[1]:>10.3f}  {cells}   (tuned: {chosen})")


if __name__ == "__main__":
    main()
