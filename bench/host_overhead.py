"""Where a drop-in module's call spends its time at a small batch (host-bound): the
original, the module (its autotuned formulation), and each formulation forced; an eval
forward without autograd, or with --train a training step (forward, and the gradients of
every parameter); CUDA-event medians of calls queued back to back.

    python bench/host_overhead.py [--device cuda] [--batch 1] [--train] [--configs A-spec,B-64to32-s2p1k4]
"""
import argparse

import torch

from configs import select
from fused_ops import autotune, cli
from timing import device_name, median_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--train", action="store_true", help="time a training step instead of an eval forward")
    parser.add_argument("--configs", default="A-spec,B-spec,C-spec,D-spec")
    args = parser.parse_args()
    device = torch.device(args.device)
    step = "training step" if args.train else "eval forward without autograd"
    print(f"{device_name(device)}, batch {args.batch}, {step}, ms per call")
    print(f"{'config':<20}{'original':>10}{'module':>10}  " + "".join(f"{n:>24}" for n in autotune.FORMULATIONS))
    for c in select(argparse.ArgumentParser(), args.configs.split(",")):
        torch.manual_seed(0)
        original = c.arch.build_original().to(device).train(args.train)
        fused = c.arch.fused_from(original)
        x = torch.rand(c.arch.input_shape("spec", args.batch), device=device)
        grad = torch.ones_like(original(x)) if args.train else None
        with torch.set_grad_enabled(args.train):
            original_call, fused_call = (cli.timed_call(m, x, args.train, grad) for m in (original, fused))
            times = [median_ms(original_call, device), median_ms(fused_call, device)]
            chosen = autotune.last_formulation() + (" from a CUDA graph" if fused.graphed(x) else "")
            for name in autotune.FORMULATIONS:
                with autotune.force(name):
                    fused_call()
                    times.append(median_ms(fused_call, device) if autotune.last_formulation() == name else None)
        cells = "".join(f"{'-' if t is None else f'{t:.3f}':>24}" for t in times[2:])
        print(f"{c.name:<20}{times[0]:>10.3f}{times[1]:>10.3f}  {cells}   (tuned: {chosen})")


if __name__ == "__main__":
    main()
