"""A's convolution by a wgmma prototype (bench/extensions/conv3d_wgmma_prototype.cu, built here as a
torch extension of its own: about a minute of nvcc) against cuDNN's, float32 with TF32, SPEC's A
(x (128, 8, 16, 64, 64), 8 -> 16 channels, kernel 3): the prototype writing y = conv3d(x, w) + bias, and
with its pool epilogue (conv3d_max_pool3d_mean's result: y / 2, 2 x 2 x 2 max-pool picks, their mean per
(n, o)), each from a channels-last x and from a contiguous one (its channels-last copy timed with it).
Beside them the fused op conv3d_max_pool3d_mean (A's convolution and its whole tail in one kernel: 0.427
ms on an H200 in session 27), the time to beat. Each result's error against the float64 one (normwise:
max|got - ref| / max|ref|), the share of the prototype's picks equal to the fused op's, CUDA-event medians
of --reps calls queued back to back in --rounds interleaved rounds, TFLOP/s of the 47.6 GFLOP.

    cd bench && python3 bench_conv3d_wgmma_prototype.py [--batch N] [--rounds 5]
"""
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load

from fused_ops._timing import median_ms
from timing import convolution_arguments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import setup  # noqa: E402  (the extension's flags: sm_90a, CUTLASS's headers)


def build_prototype():
    """The prototype's extension, built for sm_90a with CUTLASS's headers (CuTe's wgmma) as setup.py
    finds them."""
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    arch, sm90a = setup.cuda_arch_flags()
    cutlass = setup.cutlass_root()
    if not sm90a or cutlass is None:
        sys.exit("bench_conv3d_wgmma_prototype: needs an sm_90a build with CUTLASS's headers")
    began = time.perf_counter()
    module = load("conv3d_wgmma_prototype", [os.path.join(ROOT, "bench", "extensions", "conv3d_wgmma_prototype.cu")],
                  extra_include_paths=[os.path.join(ROOT, "csrc", "cuda")],
                  extra_cuda_cflags=["-O3", *arch, *setup.cutlass_nvcc_flags(cutlass)])
    print(f"built the prototype in {time.perf_counter() - began:.0f} s")
    return module


def main():
    args, device, shape = convolution_arguments(__doc__.splitlines()[0], "A")
    if device.type != "cuda":
        sys.exit("bench_conv3d_wgmma_prototype: a wgmma kernel: --device cuda")
    prototype = build_prototype()
    torch.manual_seed(0)
    x = torch.rand(shape, device=device)
    x_last = x.contiguous(memory_format=torch.channels_last_3d)
    conv = torch.nn.Conv3d(shape[1], 16, 3).to(device)
    weight, bias = conv.weight.detach(), conv.bias.detach()
    with torch.no_grad():
        expected = F.conv3d(x.double(), weight.double(), bias.double())
        expected_mean = F.max_pool3d(expected / 2.0, 2).mean((2, 3, 4))
    fused_op = torch.ops.fused_ops.conv3d_max_pool3d_mean.default
    n, _, d, h, w = shape
    flop = 2 * n * 16 * (d - 2) * (h - 2) * (w - 2) * shape[1] * 27
    if prototype.conv3d_wgmma(x, weight, bias) is None:
        sys.exit(f"bench_conv3d_wgmma_prototype: the prototype does not take x {tuple(shape)}")
    rows = {"cuDNN conv3d (x contiguous)": lambda: F.conv3d(x, weight, bias),
            "cuDNN conv3d (x channels-last)": lambda: F.conv3d(x_last, weight, bias),
            "prototype y (x channels-last)": lambda: prototype.conv3d_wgmma(x_last, weight, bias),
            "prototype y (x contiguous: its copy)": lambda: prototype.conv3d_wgmma(x, weight, bias),
            "prototype + pool (x channels-last)": lambda: prototype.conv3d_wgmma_pool(x_last, weight, bias, 2.0),
            "prototype + pool (x contiguous)": lambda: prototype.conv3d_wgmma_pool(x, weight, bias, 2.0),
            "fused op: convolution and tail": lambda: fused_op(x, weight, bias, [0] * 3, [2] * 3, 2.0, True)}
    errors = {}
    for name, call in rows.items():
        got = call()
        got, want = (got[0], expected_mean) if isinstance(got, tuple) else (got, expected)
        errors[name] = ((got.double() - want).abs().max() / want.abs().max()).item()
        del got
    _, fused_picks = rows["fused op: convolution and tail"]()
    _, picks = rows["prototype + pool (x contiguous)"]()
    print(f"the prototype's picks equal to the fused op's: {(picks == fused_picks).double().mean().item():.6f}")
    times = {name: [] for name in rows}
    for _ in range(args.rounds):
        for name, call in rows.items():
            times[name].append(median_ms(call, device, reps=args.reps or 20))
    print(f"{torch.cuda.get_device_name(device)}, x {tuple(shape)}, y {tuple(expected.shape)}, kernel 3, TF32, "
          f"{args.rounds} rounds")
    print(f"{'kernel':<40}{'ms':>9}{'TFLOP/s':>9}{'error':>10}")
    for name in rows:
        ms = statistics.median(times[name])
        print(f"{name:<40}{ms:>9.3f}{flop / ms / 1e9:>9.0f}{errors[name]:>10.1e}")


if __name__ == "__main__":
    main()
