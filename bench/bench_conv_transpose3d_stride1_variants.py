"""conv_transpose3d_stride1_channels_last's CUTLASS fprop (D's forward convolution) against variants of
its kernel: the op's tiles with clusters of 2 and 4 CTAs along M, which load the filter's tile once a
cluster by TMA multicast (bench/extensions/conv_transpose3d_stride1_variants.cu, built here as a torch
extension of its own: about a minute of nvcc on the GPU machine). SPEC's D ran at 196 TFLOP/s in TF32 and
387 in bf16 (H200, session 27's profile), reading 26 GB of operand tiles from L2 in TF32 (8 MB a 128 x 128
tile, half of it the filter's) and 13 GB in bf16: about 9.5 TB/s in both. (Not L2 alone: CUTLASS's bf16 wgrad
of the same convolution reads more bytes per MAC and runs at 733 TFLOP/s; clusters of 2 slowed session 12's
wgrad and fprop2d variants, bench/results/d_weight_grad_cutlass-nvidia-h200.log. Measured here.) Beside
them, in both dtypes, the row-shifted prototype of the same extension: our own wgmma kernel over plain 2-D boxes
of a zero-padded NDHWC x, skipping each tile's taps that read only zeros (timed with its padding and rounding
copies, and its kernel alone on operands made once). Each row
checked against the float64 transposed convolution (normwise: max|got - ref| / max|ref|), timed by CUDA
events (median of --reps calls queued back to back, in --rounds interleaved rounds, the rounds' median),
float32 (TF32) and bfloat16; TFLOP/s and the time over the op's of the same dtype.

    cd bench && python3 bench_conv_transpose3d_stride1_variants.py [--size spec] [--batch N] [--rounds 5]
        [--prototype-only]
"""
import statistics
import sys

import torch
import torch.nn.functional as F

from fused_ops import conv_transpose3d_stride1_channels_last
from fused_ops._timing import median_ms
from fused_ops.ops import conv_transpose3d_stride1_channels_last_path
from timing import build_extension, convolution_arguments


def main():
    args, device, shape = convolution_arguments(
        __doc__.splitlines()[0], "D", {"--prototype-only": "the op and the prototype alone (a shorter build)"})
    if device.type != "cuda":
        sys.exit("bench_conv_transpose3d_stride1_variants: a CUTLASS kernel: --device cuda")
    # (--prototype-only: without CUTLASS's variants, a shorter build)
    variants = build_extension("conv_transpose3d_stride1_variants", "conv_transpose3d_stride1_variants.cu",
                               ["-DFUSED_OPS_PROTOTYPE_ONLY"] if args.prototype_only else [])
    n, c_in, *size = shape
    torch.manual_seed(0)
    x = torch.rand(shape, device=device)
    conv = torch.nn.ConvTranspose3d(c_in, 128, 5).to(device)
    weight, bias = conv.weight.detach(), conv.bias.detach()
    with torch.no_grad():
        expected = F.conv_transpose3d(x.double(), weight.double(), bias.double())
    flop = 2 * n * c_in * weight.shape[1] * size[0] * size[1] * size[2] * 125
    rows = {}  # name -> (call, dtype's name)
    for dtype, tag in ((torch.float32, "tf32"), (torch.bfloat16, "bf16")):
        xs, ws, bs = x.to(dtype), weight.to(dtype), bias.to(dtype)
        path = conv_transpose3d_stride1_channels_last_path(xs, ws, bs)
        rows[f"op ({path})"] = (lambda xs=xs, ws=ws, bs=bs: conv_transpose3d_stride1_channels_last(xs, ws, bs), tag)
        for v, name in enumerate(variants.names()):
            if variants.run(v, xs, ws, bs, [0, 0, 0]) is not None:
                rows[name] = (lambda v=v, xs=xs, ws=ws, bs=bs: variants.run(v, xs, ws, bs, [0, 0, 0]), tag)
        if variants.run_row_shifted(xs, ws, bs, [0, 0, 0]) is not None:
            rows[f"row-shifted prototype {tag}"] = (
                lambda xs=xs, ws=ws, bs=bs: variants.run_row_shifted(xs, ws, bs, [0, 0, 0]), tag)
            rows[f"row-shifted kernel alone {tag} (operands once)"] = (
                variants.row_shifted_kernel(xs, ws, bs, [0, 0, 0]), tag)
    errors = {}
    for name, (call, _) in rows.items():
        got = call()
        errors[name] = ((got.double() - expected).abs().max() / expected.abs().max()).item()
        del got
    times = {name: [] for name in rows}
    for _ in range(args.rounds):
        for name, (call, _) in rows.items():
            times[name].append(median_ms(call, device, reps=args.reps or 20))
    print(f"{torch.cuda.get_device_name(device)}, x {tuple(x.shape)}, y {tuple(expected.shape)}, kernel 5, "
          f"{args.rounds} rounds")
    print(f"{'kernel':<48}{'ms':>9}{'TFLOP/s':>9}{'/ op':>7}{'error':>10}")
    op_ms = {}
    for name, (_, tag) in rows.items():
        ms = statistics.median(times[name])
        op_ms.setdefault(tag, ms)  # (the op's row comes first in its dtype)
        print(f"{name:<48}{ms:>9.3f}{flop / ms / 1e9:>9.0f}{ms / op_ms[tag]:>7.2f}{errors[name]:>10.1e}")


if __name__ == "__main__":
    main()
