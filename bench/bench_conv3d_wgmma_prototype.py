"""A's convolution by a wgmma prototype (bench/extensions/conv3d_wgmma_prototype.cu, built here as a torch
extension of its own: about a minute of nvcc) against cuDNN's, float32 with TF32, SPEC's A (x (128, 8, 16, 64,
64), 8 -> 16 channels, kernel 3), in each of its operand layouts (TF32 swizzled rows, TF32 channel planes,
bf16 tap pairs, and the TF32 swizzled rows and bf16 pairs with A from registers: "rs", whose results must be
the same layout's bits from shared memory): the prototype writing y = conv3d(x, w) + bias, and with its pool
epilogue (conv3d_max_pool3d_mean's result: y / 2, 2 x 2 x 2 max-pool picks, their mean per (n, o)) from a
channels-last x and from a contiguous one (its channels-last copy timed with it). Beside them cuDNN's
convolution and the fused op conv3d_max_pool3d_mean (A's convolution and its whole tail: in a build with
CUTLASS, SPEC's shape takes this kernel from x NCDHW, then the op's mean kernel; elsewhere the mma.sync
kernel, 0.464 ms TF32 and 0.372 bf16 on an H200 in session 34). Each result's error against the float64 one
(normwise: max|got - ref| / max|ref|), the share of the prototype's picks equal to the fused op's, CUDA-event
medians of --reps calls queued back to back in --rounds interleaved rounds, TFLOP/s of the 47.6 GFLOP.
--nonfinite plants NaN, inf and -inf in x (the pool's exact path, the one a NaN in a warp's windows sends it
through): the error is then over the elements finite in both results, and each result's non-finite elements
must lie where the float64 one's do, with the same values; each window with a non-finite element must pick as
F.max_pool3d picks in the float64 result. A layout's rows from a contiguous x and from a channels-last one run
the same kernel on the same values: their results must be the same bits (printed, and again for a second
call); bf16's from x float32 NCDHW (A's input, the fused op's call: the producer warp group converts each box)
too.

    cd bench && python3 bench_conv3d_wgmma_prototype.py [--batch N] [--rounds 5] [--nonfinite] [--few-sms]
"""
import statistics
import sys

import torch
import torch.nn.functional as F

from fused_ops._timing import median_ms
from timing import build_extension, convolution_arguments

LAYOUTS = {"tf32 swizzled": 0, "tf32 planes": 1, "bf16 pairs": 2, "tf32 swizzled rs": 3, "bf16 pairs rs": 4}


def main():
    args, device, shape = convolution_arguments(
        __doc__.splitlines()[0], "A", {"--nonfinite": "NaN, inf and -inf planted in x",
                                       "--few-sms": "the prototype over 4 SMs: columns of several tiles at a small "
                                                    "batch (a sanitizer's run)"})
    if device.type != "cuda":
        sys.exit("bench_conv3d_wgmma_prototype: a wgmma kernel: --device cuda")
    prototype = build_extension("conv3d_wgmma_prototype", "conv3d_wgmma_prototype.cu")
    torch.manual_seed(0)
    x = torch.rand(shape, device=device)
    if args.nonfinite:
        # (a few a kind: each reaches a sample's means, and most samples must stay finite to compare)
        planted = torch.randint(0, x.numel(), (3, max(1, shape[0] // 8)), device=device)
        for where, value in zip(planted, (float("nan"), float("inf"), float("-inf"))):
            x.view(-1)[where] = value
    conv = torch.nn.Conv3d(shape[1], 16, 3).to(device)
    sms = 4 if args.few_sms else 0  # (0: the device's)
    fused_op = torch.ops.fused_ops.conv3d_max_pool3d_mean.default
    n, _, d, h, w = shape
    flop = 2 * n * 16 * (d - 2) * (h - 2) * (w - 2) * shape[1] * 27
    rows, expected, picks = {}, {}, {}  # name -> (call, what it computes: y or the pool's mean, in a precision)
    for dtype in (torch.float32, torch.bfloat16):
        tag = "tf32" if dtype == torch.float32 else "bf16"
        xs, ws, bs = x.to(dtype), conv.weight.detach().to(dtype), conv.bias.detach().to(dtype)
        xs_last = xs.contiguous(memory_format=torch.channels_last_3d)
        with torch.no_grad():
            y64 = F.conv3d(xs.double(), ws.double(), bs.double())
            expected[tag, "y"] = y64
            expected[tag, "mean"] = F.max_pool3d(y64 / 2.0, 2).mean((2, 3, 4))
        rows[f"cuDNN conv3d {tag} (x channels-last)"] = (lambda a=xs_last, b=ws, c=bs: F.conv3d(a, b, c), (tag, "y"))
        # (the fused op's bf16 path: a float32 x with bf16 weights, x rounded as read)
        rows[f"fused op {tag}: convolution and tail"] = (
            lambda b=ws, c=bs: fused_op(x, b, c, [0] * 3, [2] * 3, 2.0, True), (tag, "mean"))
        for layout, number in LAYOUTS.items():
            if not layout.startswith(tag) or prototype.conv3d_wgmma(xs, ws, bs, number, sms) is None:
                continue
            rows[f"{layout} y (x channels-last)"] = (
                lambda a=xs_last, b=ws, c=bs, k=number: prototype.conv3d_wgmma(a, b, c, k, sms), (tag, "y"))
            rows[f"{layout} + pool (x channels-last)"] = (
                lambda a=xs_last, b=ws, c=bs, k=number: prototype.conv3d_wgmma_pool(a, b, c, 2.0, k, False, sms),
                (tag, "mean"))
            rows[f"{layout} + pool (x contiguous)"] = (
                lambda a=xs, b=ws, c=bs, k=number: prototype.conv3d_wgmma_pool(a, b, c, 2.0, k, False, sms),
                (tag, "mean"))
            # (A's input as it comes, float32 NCDHW, converted by the producer warp group: the fused op's call)
            rows[f"{layout} + pool (x NCDHW f32)"] = (
                lambda b=ws, c=bs, k=number: prototype.conv3d_wgmma_pool(x, b, c, 2.0, k, True, sms), (tag, "mean"))
    errors, means = {}, {}
    for name, (call, what) in rows.items():
        got = call()
        if isinstance(got, tuple):
            got, picks[name] = got
            means[name] = got
        want = expected[what]
        finite = got.isfinite() & want.isfinite()
        misplaced = (~finite & ~alike(got.double(), want)).sum().item()
        if misplaced:
            print(f"{name}: {misplaced} non-finite elements unlike the float64 result's")
        errors[name] = ((got.double() - want)[finite].abs().max() / want[finite].abs().max()).item()
        del got
    for name in picks:
        tag = rows[name][1][0]
        if "+ pool" in name:
            same = (picks[name] == picks[f"fused op {tag}: convolution and tail"]).double().mean().item()
            print(f"{name}: picks equal to the fused op's {same:.6f}")
        if "(x contiguous)" in name or name.startswith("bf16") and "(x NCDHW f32)" in name:
            # (the same kernel, or bf16's NCDHW one, on the same values: the results must be the same bits; TF32's
            # NCDHW kernel rounds x to nearest, the others' wgmma truncates it)
            twin = name.replace("(x contiguous)", "(x channels-last)").replace("(x NCDHW f32)", "(x channels-last)")
            again = rows[name][0]()
            print(f"{name}: picks unlike the channels-last row's {unlike(picks[name], picks[twin])}, means unlike "
                  f"it {unlike(means[name], means[twin])}; called again: picks unlike {unlike(again[1], picks[twin])}, "
                  f"means {unlike(again[0], means[twin])}")
        if " rs " in name:
            # (A from registers: the same products and sums as from shared memory)
            twin = name.replace(" rs ", " ")
            print(f"{name}: picks unlike the A-from-shared-memory row's {unlike(picks[name], picks[twin])}, means "
                  f"{unlike(means[name], means[twin])}")
        if args.nonfinite:
            # (a window with a non-finite element picks by its NaNs and infs, which the roundings keep: PyTorch's
            # pick of the float64 result's window is then every kernel's)
            windows, want_picks = window_offsets(expected[tag, "y"])
            same = (picks[name][windows] == want_picks[windows]).double().mean().item()
            print(f"{name}: picks of the {windows.sum().item()} windows with a non-finite element equal to "
                  f"PyTorch's {same:.6f}")
    times = {name: [] for name in rows}
    for _ in range(args.rounds):
        for name, (call, _) in rows.items():
            times[name].append(median_ms(call, device, reps=args.reps or 20))
    print(f"{torch.cuda.get_device_name(device)}, x {tuple(shape)}, kernel 3, {args.rounds} rounds; errors against "
          "float64 on the same inputs (bf16: x and w rounded)")
    print(f"{'kernel':<42}{'ms':>9}{'TFLOP/s':>9}{'error':>10}")
    for name in rows:
        ms = statistics.median(times[name])
        print(f"{name:<42}{ms:>9.3f}{flop / ms / 1e9:>9.0f}{errors[name]:>10.1e}")


def alike(a, b):
    """Where a and b hold the same value (a NaN is like a NaN)."""
    return (a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else a == b


def unlike(a, b):
    """How many elements of a and b differ (a NaN is like a NaN)."""
    return (~alike(a, b)).sum().item()


def window_offsets(y):
    """The 2 x 2 x 2 windows of y with a non-finite element, and each window's pick by F.max_pool3d, as an
    offset in the window (dz 4 + dy 2 + dx, as the kernels store it)."""
    _, indices = F.max_pool3d(y, 2, return_indices=True)
    h, w = y.shape[3:]
    pd, ph, pw = (torch.arange(size, device=y.device).view(shape) for size, shape in
                  zip(indices.shape[2:], ((-1, 1, 1), (-1, 1), (-1,))))
    offsets = (indices // (h * w) - 2 * pd) * 4 + (indices // w % h - 2 * ph) * 2 + (indices % w - 2 * pw)
    return F.max_pool3d((~y.isfinite()).double(), 2) > 0, offsets.to(torch.uint8)


if __name__ == "__main__":
    main()
