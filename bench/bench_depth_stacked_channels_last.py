"""depth_stacked_channels_last (the input copy of the rewritten convolutions of A, B and C,
fused_ops.rewrites; C's space-to-depth stacks each block's rows of x (N, I, H, Bw, Sw)) at
SPEC's sizes: the op against the same copy in PyTorch (a copy tap
by tap into slices, as the differentiable path of fused_ops.rewrites writes it) and
torch.compile of that, with the bytes moved and the achieved bandwidth.

    python bench/bench_depth_stacked_channels_last.py [--device cuda] [--dtype float32|bfloat16]
"""
import argparse

import torch

import fused_ops
from timing import copy_bandwidth_gbs, device_name, median_ms

# (name, x's shape, taps, stride, start, size): A's, B's and C's calls at SPEC's sizes.
CASES = (("A", (128, 8, 16, 64, 64), 4, 2, (0, 0, 0), (7, 64, 64)),
         ("B", (16, 32, 32, 32, 32), 3, 1, (-1, -1, -1), (30, 32, 32)),
         ("C", (128, 8, 384, 96, 4), 4, 4, (0, 0, 0), (96, 96, 4)))


def eager_stack(x, taps, stride, start, size, dtype):
    """The same result by PyTorch's own copies: x zero-padded and cropped, channels last, then tap by tap."""
    n, i = x.shape[:2]
    pad = []
    for d in (2, 1, 0):  # F.pad's order: last dimension first
        first, last = start[d], start[d] + (size[d] - 1) * (stride if d == 0 else 1) + (taps - 1 if d == 0 else 0)
        pad += [-first, last - (x.shape[2 + d] - 1)]
    padded = torch.nn.functional.pad(x, pad).permute(0, 2, 3, 4, 1)
    out = x.new_empty(n, *size, taps, i, dtype=dtype)
    for a in range(taps):
        out[:, :, :, :, a] = padded[:, a:a + stride * (size[0] - 1) + 1:stride]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    copy = copy_bandwidth_gbs(device, 1 << 28)
    print(f"{device_name(device)}; output in {args.dtype}; a device-to-device copy moves {copy:.0f} GB/s")
    print(f"{'case':<5}{'variant':<10}{'ms':>8}{'MB moved':>10}{'GB/s':>8}")
    for name, shape, taps, stride, start, size in CASES:
        x = torch.rand(shape, device=device)
        fused = fused_ops.depth_stacked_channels_last(x, taps, stride, start, size, dtype=dtype)
        expected = eager_stack(x, taps, stride, start, size, dtype)
        assert torch.equal(fused, expected), f"{name}: the op differs from PyTorch's copy"
        # the least it must move: read x once, write the result
        moved = x.numel() * x.element_size() + fused.numel() * fused.element_size()
        variants = {"fused": lambda: fused_ops.depth_stacked_channels_last(x, taps, stride, start, size, dtype=dtype),
                    "eager": lambda: eager_stack(x, taps, stride, start, size, dtype)}
        if device.type == "cuda":
            compiled = torch.compile(eager_stack)
            variants["compile"] = lambda: compiled(x, taps, stride, start, size, dtype)
        for variant, call in variants.items():
            ms = median_ms(call, device, reps=20 if device.type == "cpu" else 50)
            print(f"{name:<5}{variant:<10}{ms:>8.3f}{moved / 1e6:>10.0f}{moved / ms / 1e6:>8.0f}")


if __name__ == "__main__":
    main()
