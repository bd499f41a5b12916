"""conv2d_sigmoid_sum (architecture C's pool-folded convolution and tail in one tensor-core kernel,
NCHW read in place) against the field's library: CUTLASS 3.x Hopper implicit-GEMM convolutions
(TMA im2col, wgmma, warp-specialized) whose epilogue visitor tree computes sigmoid(conv + bias)
and sums it over the output channels, writing one float per output pixel and no convolution
output (bench/cutlass/conv2d_sigmoid_sum_cutlass.cu: its "fused" variants); its "plain" variants
write conv + bias (NHWC float32) and leave the tail to PyTorch. At SPEC's size (x 128x8x384x384
float32, the folded weight 64x8x6x6, stride 4: output 128x64x95x95), in one run (interleaved
rounds, CUDA events, median over the rounds):

  TF32   ours on NCHW x; cuDNN (+ PyTorch's sigmoid and sum) on NCHW x and on channels_last x;
         the NCHW -> NHWC copy alone; each CUTLASS variant on a pre-made NHWC x, its tail (the
         per-item sum) included; the copy + the fastest fused CUTLASS variant (what a caller
         holding NCHW x pays).
  bf16   ours with a bf16 weight and bias on float32 x (as autocast calls it: x rounded as it is
         read); the copy + cast to NHWC bf16 alone; each CUTLASS bf16 variant on a pre-made NHWC
         bf16 x; the copy + cast + the fastest fused one; cuDNN on channels_last bf16 x.

Each result is checked against float64 torch.sigmoid(F.conv2d(x, w, b, stride=4)).sum((1, 2, 3))
(the max relative error over the batch; TF32's is of the order of 1e-3). The table last: time,
TFLOP/s of the convolution (2 * N * 95 * 95 * 64 * 8 * 36 = 42.6 GFLOP at SPEC's size) and the
time's ratio to ours (the TF32 rows to ours, the bf16 rows to ours bf16; above 1: slower).

    pip install --no-deps nvidia-cutlass==4.2.0.0   (CUTLASS's headers; needs nvcc and a Hopper GPU)
    python bench/bench_cutlass_conv2d_sigmoid_sum.py [--batch 128] [--rounds 5] [--only TEXT]

The kernels are a shared library with a C interface (no torch headers), loaded by ctypes: built
on first use by nvcc for sm_90a into bench/cutlass/build/ (a few minutes), rebuilt where the
source is newer (``--build-only`` builds it, on a machine without a GPU too).
"""
import argparse
import contextlib
import ctypes
import os
import statistics
import sys

import torch
import torch.nn.functional as F

from fused_ops import box_fold2d, conv2d_sigmoid_sum, reference
from timing import copy_bandwidth_gbs, device_name, interleaved_medians, median_ms

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "cutlass"))
import cutlass_build  # noqa: E402  (bench/cutlass/: how the library is built)

SOURCE = os.path.join(cutlass_build.HERE, "conv2d_sigmoid_sum_cutlass.cu")


class CutlassConv2dSigmoidSum(cutlass_build.Library):
    """The library's variants: ``variants`` (name, fused, dtype, tile_m, stages, smem_bytes,
    threads) and ``run``."""

    def __init__(self, path: str):
        super().__init__(path, "cutlass_conv2d_sigmoid_sum",
                         ("name", "fused", "dtype", "tile_m", "stages", "smem_bytes", "threads"),
                         ("fused", "tile_m", "stages", "smem_bytes", "threads"))
        self.lib.cutlass_conv2d_sigmoid_sum_run.argtypes = (
            [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int] * 9 + [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int])

    def run(self, name: str, x_nhwc: torch.Tensor, w_krsc: torch.Tensor, bias: torch.Tensor, stride: int):
        """Variant `name` on NHWC x, KRSC weight and a float32 bias, no padding: fused -> (N, P, Q)
        per-pixel sums over the channels of sigmoid(conv + bias); plain -> conv + bias (N, P, Q, K)
        float32. On the current stream."""
        variant = self.variant(name)
        element = torch.float32 if variant["dtype"] == "tf32" else torch.bfloat16
        for t, what in ((x_nhwc, "x"), (w_krsc, "weight")):
            if not (t.is_cuda and t.dim() == 4 and t.dtype == element and t.is_contiguous()):
                raise ValueError(f"{name}: {what} must be a contiguous 4-D CUDA {element} tensor")
        if not (bias.is_cuda and bias.dtype == torch.float32 and bias.is_contiguous()):
            raise ValueError(f"{name}: bias must be a contiguous float32 CUDA tensor")
        n, h, w, c = x_nhwc.shape
        k, r, s, _ = w_krsc.shape
        p, q = (h - r) // stride + 1, (w - s) // stride + 1
        if variant["fused"]:
            pixels = n * p * q
            tile = variant["tile_m"]
            out = torch.empty(-(-pixels // tile) * tile, device=x_nhwc.device)
        else:
            out = torch.empty(n, p, q, k, device=x_nhwc.device)
        super().run(name, x_nhwc.data_ptr(), w_krsc.data_ptr(), bias.data_ptr(), out.data_ptr(), n, h, w, c, k, r, s,
                    stride, stride, torch.cuda.current_stream(x_nhwc.device).cuda_stream)
        return out[:pixels].view(n, p, q) if variant["fused"] else out


def to_nhwc(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """NCHW x as a contiguous (N, H, W, C) tensor of `dtype`: one copy (and cast) kernel."""
    n, c, h, w = x.shape
    return torch.empty((n, h, w, c), dtype=dtype, device=x.device).copy_(x.permute(0, 2, 3, 1))


def cutlass_call(ext, variant: dict, x_nhwc, w_krsc, bias):
    """A CUTLASS variant's conv2d_sigmoid_sum: the fused one's per-pixel sums added per item; the
    plain one's conv + bias through PyTorch's sigmoid and sum."""
    name = variant["name"]
    if variant["fused"]:
        return lambda: ext.run(name, x_nhwc, w_krsc, bias, 4).sum(dim=(1, 2))
    return lambda: torch.sigmoid(ext.run(name, x_nhwc, w_krsc, bias, 4)).sum(dim=(1, 2, 3))


def fastest(calls: dict, device) -> str:
    """The name of the fastest of `calls` by a short median each (to pick which one to pair with the copy)."""
    return min(calls, key=lambda name: median_ms(calls[name], device, reps=10))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--build-only", action="store_true", help="build the CUTLASS library, then stop")
    parser.add_argument("--only", action="append", metavar="TEXT",
                        help="time only the CUTLASS variants whose name contains TEXT (repeatable; default: all)")
    args = parser.parse_args()
    library = cutlass_build.build_library(SOURCE)
    if args.build_only:
        return
    device = torch.device("cuda")
    if torch.cuda.get_device_capability(device) != (9, 0):
        sys.exit(f"bench_cutlass_conv2d_sigmoid_sum: the CUTLASS kernels are sm_90a (Hopper) only; "
                 f"this is {device_name(device)}")
    ext = CutlassConv2dSigmoidSum(library)

    torch.manual_seed(0)
    original = reference.Conv2dAvgPoolSigmoidSum(8, 64, 3, 4).to(device).eval()
    x = torch.rand(args.batch, 8, 384, 384, device=device)
    weight = box_fold2d(original.conv.weight.detach(), (4, 4), 16)
    bias = original.conv.bias.detach()
    with torch.no_grad():
        expected = torch.sigmoid(F.conv2d(x.double(), weight.double(), bias.double(), stride=4)).sum(dim=(1, 2, 3))

    # the operands each caller holds ready (made outside the timed calls)
    x_nhwc = to_nhwc(x, torch.float32)
    x_nhwc_bf16 = to_nhwc(x, torch.bfloat16)
    w_krsc = weight.permute(0, 2, 3, 1).contiguous()
    weight_bf16, bias_bf16 = weight.to(torch.bfloat16), bias.to(torch.bfloat16)
    w_krsc_bf16 = w_krsc.to(torch.bfloat16)
    bias_bf16_as_f32 = bias_bf16.float()  # (CUTLASS's epilogue takes a float32 bias: the same values)
    x_cl = x.contiguous(memory_format=torch.channels_last)
    weight_cl = weight.contiguous(memory_format=torch.channels_last)
    x_cl_bf16 = x_cl.to(torch.bfloat16)
    weight_cl_bf16 = weight_cl.to(torch.bfloat16)

    flop = 2 * args.batch * 95 * 95 * 64 * 8 * 36
    read = x.numel() * x.element_size()
    copy = copy_bandwidth_gbs(device, 1 << 28)
    print(f"{device_name(device)}; x {tuple(x.shape)} float32, TF32 {torch.backends.cudnn.allow_tf32}; "
          f"convolution {flop / 1e9:.1f} GFLOP, input {read / 1e6:.0f} MB; copy {copy:.0f} GB/s")
    variants = [v for v in ext.variants if not args.only or any(text in v["name"] for text in args.only)]
    print("CUTLASS variants (sm_90a, KernelImplicitTmaWarpSpecializedSm90, cluster 1x1x1; c16: input column pairs "
          "read as 16 channels):")
    for v in variants:
        print(f"  {v['name']:<30} stages {v['stages']:>2}, shared memory {v['smem_bytes'] / 1024:5.1f} KiB, "
              f"{v['threads']} threads")

    cutlass32 = {v["name"]: cutlass_call(ext, v, x_nhwc, w_krsc, bias) for v in variants if v["dtype"] == "tf32"}
    cutlass16 = {v["name"]: cutlass_call(ext, v, x_nhwc_bf16, w_krsc_bf16, bias_bf16_as_f32)
                 for v in variants if v["dtype"] == "bf16"}
    fused = {v["name"] for v in variants if v["fused"]}
    best = {}  # the fastest fused variant of each precision, to pair with the copy
    with torch.no_grad():
        for group in (cutlass32, cutlass16):
            for name in list(group):
                try:
                    group[name]()
                    torch.cuda.synchronize()
                except RuntimeError as e:  # (a variant CUTLASS refuses at run time: reported, left out)
                    print(f"left out: {e}")
                    del group[name]
        for precision, group in (("tf32", cutlass32), ("bf16", cutlass16)):
            if any(name in fused for name in group):
                best[precision] = fastest({n: c for n, c in group.items() if n in fused}, device)

    # name -> (call, precision: the "ours" row its ratio is taken against); the copies alone have no
    # result to check
    rows = {
        "ours": (lambda: conv2d_sigmoid_sum(x, weight, bias, 4, 0), "tf32"),
        "cuDNN": (lambda: torch.sigmoid(F.conv2d(x, weight, bias, 4)).sum(dim=(1, 2, 3)), "tf32"),
        "cuDNN channels_last": (lambda: torch.sigmoid(F.conv2d(x_cl, weight_cl, bias, 4)).sum(dim=(1, 2, 3)), "tf32"),
        "copy NCHW->NHWC": (lambda: to_nhwc(x, torch.float32), "tf32"),
    }
    if "tf32" in best:
        rows[f"copy + {best['tf32']}"] = (
            lambda: ext.run(best["tf32"], to_nhwc(x, torch.float32), w_krsc, bias, 4).sum(dim=(1, 2)), "tf32")
    rows.update({name: (call, "tf32") for name, call in cutlass32.items()})
    # bf16: ours as autocast calls it (float32 x, bf16 weight and bias), float32 sums as CUTLASS's
    rows["ours bf16"] = (lambda: conv2d_sigmoid_sum(x, weight_bf16, bias_bf16, 4, 0, dtype=torch.float32), "bf16")
    rows["cuDNN bf16 channels_last"] = (
        lambda: torch.sigmoid(F.conv2d(x_cl_bf16, weight_cl_bf16, bias_bf16, 4).float()).sum(dim=(1, 2, 3)), "bf16")
    rows["copy+cast NCHW->NHWC bf16"] = (lambda: to_nhwc(x, torch.bfloat16), "bf16")
    if "bf16" in best:
        rows[f"copy+cast + {best['bf16']}"] = (
            lambda: ext.run(best["bf16"], to_nhwc(x, torch.bfloat16), w_krsc_bf16, bias_bf16_as_f32, 4)
            .sum(dim=(1, 2)), "bf16")
    rows.update({name: (call, "bf16") for name, call in cutlass16.items()})
    calls = {name: call for name, (call, _) in rows.items()}
    copies = {"copy NCHW->NHWC", "copy+cast NCHW->NHWC bf16"}

    with torch.no_grad():
        errors = {}
        for name, call in calls.items():
            if name in copies:
                continue
            errors[name] = ((call().double() - expected).abs() / expected.abs()).max().item()
        torch.cuda.synchronize()
        times = interleaved_medians(calls, device, {name: 20 for name in calls}, args.rounds,
                                    lambda name: contextlib.nullcontext())

    ms = {name: statistics.median(rounds) for name, rounds in times.items()}
    ours = {"tf32": ms["ours"], "bf16": ms["ours bf16"]}
    width = max(map(len, rows)) + 2
    print(f"\n{'variant':<{width}}{'ms':>8}{'TFLOP/s':>9}{'vs ours':>9}{'max rel err':>13}")
    for name, (_, group) in rows.items():
        if name == "ours bf16":
            print()
        err = f"{errors[name]:>13.1e}" if name in errors else f"{'':>13}"
        tflops = f"{flop / ms[name] / 1e9:>9.0f}" if name in errors else f"{'':>9}"
        print(f"{name:<{width}}{ms[name]:>8.3f}{tflops}{ms[name] / ours[group]:>9.2f}{err}")


if __name__ == "__main__":
    main()
