"""CPU timings of the fused max-pool and batch-norm tails against PyTorch eager, per layout.

python bench/cpu_tails.py [--reps 20] [--threads 2] [--json PATH]

Each tail at its CPU (reduced) size: A's max_pool3d(y / 2) -> mean, B's max_pool3d(2) ->
max_pool3d(3) -> channel sum, D's y * 2 -> BatchNorm3d (training) -> mean; y contiguous and
channels_last_3d, float32 (and A in bfloat16). Forward: without autograd. Backward: the
gradient of the output with respect to y alone (autograd.grad on a graph kept between
calls). Wall-clock medians (fused_ops._timing.median_ms).
"""
import argparse
import json

import torch
import torch.nn.functional as F

import fused_ops
from fused_ops._timing import median_ms


def tail_a(y):
    return F.adaptive_avg_pool3d(F.max_pool3d(y / 2.0, 2), 1).flatten(1)


def fused_a(y):
    return fused_ops.max_pool3d_mean(y, 2, divisor=2.0)


def tail_b(y):
    return F.max_pool3d(F.max_pool3d(y, 2), 3).sum(dim=1, keepdim=True)


def fused_b(y):
    return fused_ops.max_pool3d_cascade_sum(y, 2, 3)


def tail_d(y, weight, bias):
    return F.adaptive_avg_pool3d(F.batch_norm(y * 2.0, None, None, weight, bias, training=True), 1)


def fused_d(y, weight, bias):
    return fused_ops.batch_norm_gap(y, 2.0, weight, bias, training=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    w, b = torch.rand(128, generator=g) + 0.5, torch.rand(128, generator=g)
    cases = [("A", (2, 16, 14, 62, 62), tail_a, fused_a, torch.float32),
             ("A", (2, 16, 14, 62, 62), tail_a, fused_a, torch.bfloat16),
             ("B", (1, 64, 31, 31, 31), tail_b, fused_b, torch.float32),
             ("D", (2, 128, 12, 20, 20), lambda y: tail_d(y, w, b), lambda y: fused_d(y, w, b), torch.float32)]
    rows = []
    print(f"{'tail':4} {'dtype':9} {'layout':17} {'eager fwd':>10} {'fused fwd':>10} {'eager bwd':>10} {'fused bwd':>10}")
    for name, shape, eager, fused, dtype in cases:
        for fmt in (torch.contiguous_format, torch.channels_last_3d):
            y = torch.randn(shape, generator=g).to(dtype).contiguous(memory_format=fmt)
            row = {"tail": name, "shape": shape, "dtype": str(dtype).removeprefix("torch."),
                   "layout": "channels_last_3d" if fmt == torch.channels_last_3d else "contiguous"}
            for label, fn in (("eager", eager), ("fused", fused)):
                with torch.no_grad():
                    row[f"{label}_fwd_ms"] = median_ms(lambda: fn(y), "cpu", reps=args.reps)
                yg = y.detach().requires_grad_()
                out = fn(yg)
                grad = torch.rand_like(out)
                row[f"{label}_bwd_ms"] = median_ms(
                    lambda: torch.autograd.grad(out, yg, grad, retain_graph=True), "cpu", reps=args.reps)
            rows.append(row)
            print(f"{name:4} {row['dtype']:9} {row['layout']:17} {row['eager_fwd_ms']:10.3f} {row['fused_fwd_ms']:10.3f} "
                  f"{row['eager_bwd_ms']:10.3f} {row['fused_bwd_ms']:10.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
