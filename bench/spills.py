"""What the register spills that ptxas reports for kernels of ours cost (tools/check_cuda_compile.py's
KNOWN_SPILLS): each spilling instantiation of a speed path (16-bit and float32) timed beside a sibling that
does not spill, at the same sizes: the same kernel in another dtype, its time and its bandwidth; and
parity_max_pool3d_mean's three dtypes, whose 16-bit instantiations spilled until session 26 (bfloat16 then
0.115 ms against float16's 0.094 on the same bytes). Run under Nsight Compute (--reps 1) for each kernel's
local-memory instructions against all it executes (docs/contributing.md). float64's spills (depth_stack_kernel,
avg_pool2d_sigmoid_sum's backward, max_pool3d_cascade_sum's tiled kernels) are not timed: a reference dtype.

    python bench/spills.py [--reps 50] [--out bench/results]
"""
import argparse
import json
import os

import torch

import fused_ops
from timing import device_name, device_slug, median_ms, provenance

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def depth_stack(dtype_in, dtype_out):
    """A's depth-stacked copy (bench_depth_stacked_channels_last's case A): x in dtype_in, the result in dtype_out."""
    x = torch.rand(128, 8, 16, 64, 64, device="cuda").to(dtype_in)
    out = fused_ops.depth_stacked_channels_last(x, 4, 2, (0, 0, 0), (7, 64, 64), dtype=dtype_out)
    moved = x.numel() * x.element_size() + out.numel() * out.element_size()
    return (lambda: fused_ops.depth_stacked_channels_last(x, 4, 2, (0, 0, 0), (7, 64, 64), dtype=dtype_out)), moved


def batch_norm_gap_channels_last(dtype, channels):
    """D's tail in training on a channels_last_3d y (16 x channels x 20 x 36 x 36): forward and backward
    (plane_moments_channels_last_kernel, grad_x_channels_last_kernel; their vectors over channels as wide as
    the channel count allows: 8 for 128, 4 for 124, 2 for 126)."""
    y = torch.rand(16, channels, 20, 36, 36, device="cuda", dtype=dtype).to(memory_format=torch.channels_last_3d)
    y.requires_grad_()
    state = [torch.ones(channels, device="cuda"), torch.zeros(channels, device="cuda"),
             torch.zeros(channels, device="cuda"), torch.ones(channels, device="cuda"), torch.tensor(0, device="cuda")]

    def step():
        out = fused_ops.batch_norm_gap(y, 2.0, *state, training=True, dtype=torch.float32)
        return torch.autograd.grad(out.sum(), y)
    return step, 3 * y.numel() * y.element_size()  # read y twice (statistics, then grad_x), write grad_x


def avg_pool2d_sigmoid_sum_backward(dtype):
    """C's tail's backward at SPEC's size (128 x 64 x 382 x 382, pool 4): backward_aligned_runs_kernel."""
    x = torch.rand(128, 64, 382, 382, device="cuda", dtype=dtype, requires_grad=True)
    out = fused_ops.avg_pool2d_sigmoid_sum(x, 4)
    grad = torch.rand_like(out)
    return (lambda: torch.autograd.grad(out, x, grad, retain_graph=True)), x.numel() * x.element_size()


def parity_mean(dtype):
    """A's max-pool windows side by side (N 128, 7 x 31 x 31 positions, 16 channels, 8 window elements)."""
    y = torch.rand(128, 7, 31, 31, 16, 8, device="cuda", dtype=dtype)
    return (lambda: fused_ops.parity_max_pool3d_mean(y, dtype=torch.float32)), y.numel() * y.element_size()


# (kernel, variant, what spills: the instantiation ptxas names, or "" for a sibling that does not, build)
CASES = (
    ("depth_stack_kernel", "float32 -> float32", "", lambda: depth_stack(F32, F32)),
    ("depth_stack_kernel", "float32 -> bfloat16", "<float, BFloat16, 8>", lambda: depth_stack(F32, BF16)),
    ("depth_stack_kernel", "bfloat16 -> bfloat16", "<BFloat16, BFloat16, 8>", lambda: depth_stack(BF16, BF16)),
    ("depth_stack_kernel", "float16 -> float16", "<Half, Half, 8>", lambda: depth_stack(F16, F16)),
    ("batch_norm_gap channels-last", "bfloat16, 124 channels", "", lambda: batch_norm_gap_channels_last(BF16, 124)),
    ("batch_norm_gap channels-last", "float16, 124 channels", "grad_x<Half, 4>",
     lambda: batch_norm_gap_channels_last(F16, 124)),
    ("batch_norm_gap channels-last", "bfloat16, 126 channels", "", lambda: batch_norm_gap_channels_last(BF16, 126)),
    ("batch_norm_gap channels-last", "float16, 126 channels", "plane_moments<Half, 2>",
     lambda: batch_norm_gap_channels_last(F16, 126)),
    ("avg_pool2d_sigmoid_sum backward", "bfloat16", "", lambda: avg_pool2d_sigmoid_sum_backward(BF16)),
    ("avg_pool2d_sigmoid_sum backward", "float32", "backward_aligned_runs<float>",
     lambda: avg_pool2d_sigmoid_sum_backward(F32)),
    ("parity_max_pool3d_mean", "float32", "", lambda: parity_mean(F32)),
    ("parity_max_pool3d_mean", "bfloat16", "", lambda: parity_mean(BF16)),
    ("parity_max_pool3d_mean", "float16", "", lambda: parity_mean(F16)),
)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50, help="timed calls a case (1: once each, for a profiler)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    print(f"{device_name(device)}")
    for kernel, variant, spills, build in CASES:
        call, moved = build()
        if args.reps == 1:
            call()
            torch.cuda.synchronize()
        else:
            ms = median_ms(call, device, reps=args.reps)
            rows.append(dict(kernel=kernel, variant=variant, spills=spills, ms=ms, bytes=moved, gbs=moved / ms / 1e6))
        del call  # (its tensors: C's take 4.5 GiB)
        torch.cuda.empty_cache()
    if args.reps == 1:
        return
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"spills-{device_slug(device_name(device))}.json")
    with open(path, "w") as f:
        json.dump(dict(device=device_name(device), torch=torch.__version__, **provenance(), rows=rows), f, indent=1)
    print(f"{'kernel':<33}{'variant':<25}{'spills':<42}{'ms':>8}{'GB/s':>7}")
    for r in rows:
        print(f"{r['kernel']:<33}{r['variant']:<25}{r['spills'] or '-':<42}{r['ms']:>8.3f}{r['gbs']:>7.0f}")
    print(f"(written to {path})")


if __name__ == "__main__":
    main()
