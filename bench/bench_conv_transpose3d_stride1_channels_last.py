"""conv_transpose3d_stride1_channels_last (architecture D's forward convolution; CUTLASS's Hopper 3-D
fprop on an sm_90 GPU, csrc/cuda/conv_transpose3d_stride1_channels_last.cu) against cuDNN's transposed
convolution (NCDHW and channels_last_3d operands) and against the parity-class convolution D's
rewrite ran before (the kernel flipped, cuDNN's 2-D convolution over the depth-stacked input), in
float32 with TF32 allowed (PyTorch's default) and in bfloat16 (operands cast beforehand), in one run
(interleaved rounds; CUDA events on a GPU, the wall clock on a CPU; medians over the rounds). "op" rows
return y channels-last; "+ NCDHW" adds a copy to NCDHW; the parity rows include their stacking copy and the copy of their
channels-last output to NCDHW (what D's float32 rewrite returns). Each result is checked against the float64 transposed convolution (on
the device): the normwise max relative error max|got - ref| / max|ref|. Then D's training step (x
needing no gradient), float32 and under bf16 autocast: the rewrite (its forward as its rule says), the
rewrite with the parity-class forward and with the op's, and the original eager.

Sizes and table as bench_conv_transpose3d_weight_grad.py's (D's convolution at --size spec, reduced or
tiny, --batch N; time, TFLOP/s, the time over the faster cuDNN row of the same dtype, the error).

    cd bench && python3 bench_conv_transpose3d_stride1_channels_last.py [--size spec] [--batch N] [--rounds 5]
"""
import contextlib

import torch
import torch.nn.functional as F

from fused_ops import architectures, conv_transpose3d_stride1_channels_last, reference, rewrites
from fused_ops import nn as fnn
from fused_ops.ops import conv_transpose3d_stride1_channels_last_path
from fused_ops.rewrites import conv_transpose3d_batch_norm as d_rewrite  # (its _STRIDE1_BY_CUTLASS)
from timing import convolution_arguments, module_training_step, run_against_cudnn


D = next(a for a in architectures.ARCHITECTURES if a.letter == "D")
C_OUT, KERNEL = D.args[1], D.args[2]


def parity_forward(x, weight, bias):
    """D's rewrite's forward by the parity-class convolution with P = 1, NCDHW."""
    axes = tuple([rewrites._transposed_axis(KERNEL, 1, 0)] * 3)
    out_size = tuple([s + KERNEL - 1 for s in x.shape[2:]])
    return rewrites._TransposedConv3dStride1.apply(x, weight, bias, [0] * 3, axes, out_size, False)


@contextlib.contextmanager
def rewrite_forward_by_op(dtypes):
    """D's rewrite with its forward by the op in `dtypes` (where it takes CUTLASS), by the
    parity-class convolution in the others, inside the block."""
    rule = d_rewrite._STRIDE1_BY_CUTLASS
    d_rewrite._STRIDE1_BY_CUTLASS = dtypes
    try:
        yield
    finally:
        d_rewrite._STRIDE1_BY_CUTLASS = rule


def main():
    args, device, shape = convolution_arguments(__doc__.splitlines()[0], "D")
    n, c_in, *size = shape
    torch.manual_seed(0)
    x = torch.rand(shape, device=device)
    conv = torch.nn.ConvTranspose3d(c_in, C_OUT, KERNEL).to(device)
    weight, bias = conv.weight.detach(), conv.bias.detach()
    with torch.no_grad():
        expected = F.conv_transpose3d(x.double(), weight.double(), bias.double())

    rows = {}  # name -> (call, group, checked)
    paths = {}
    for dtype, suffix in ((torch.float32, "tf32"), (torch.bfloat16, "bf16")):
        xs, ws, bs = x.to(dtype), weight.to(dtype), bias.to(dtype)
        xc, wc = xs.contiguous(memory_format=torch.channels_last_3d), ws.contiguous(memory_format=torch.channels_last_3d)
        paths[suffix] = conv_transpose3d_stride1_channels_last_path(xs, ws, bs)
        rows[f"op {suffix}"] = (lambda xs=xs, ws=ws, bs=bs: conv_transpose3d_stride1_channels_last(xs, ws, bs),
                                suffix, True)
        rows[f"op + NCDHW {suffix}"] = (
            lambda xs=xs, ws=ws, bs=bs: conv_transpose3d_stride1_channels_last(xs, ws, bs).contiguous(), suffix, True)
        rows[f"op channels_last x {suffix}"] = (
            lambda xc=xc, ws=ws, bs=bs: conv_transpose3d_stride1_channels_last(xc, ws, bs), suffix, True)
        rows[f"parity-class {suffix}"] = (lambda xs=xs, ws=ws, bs=bs: parity_forward(xs, ws, bs), suffix, True)
        rows[f"cuDNN NCDHW {suffix}"] = (lambda xs=xs, ws=ws, bs=bs: F.conv_transpose3d(xs, ws, bs), suffix, True)
        rows[f"cuDNN channels_last {suffix}"] = (lambda xc=xc, wc=wc, bs=bs: F.conv_transpose3d(xc, wc, bs), suffix,
                                                 True)

    torch.manual_seed(0)
    original = reference.ConvTranspose3dScaleBatchNormGAP(*D.args).to(device).train()
    fused = fnn.ConvTranspose3dScaleBatchNormGAP.from_module(original)
    step_grad = torch.rand(n, C_OUT, 1, 1, 1, device=device)
    forced = {"parity forward": (), "op forward": (torch.float32, torch.bfloat16)}
    for suffix in ("f32", "bf16"):
        rows[f"D step {suffix}, rewrite"] = (module_training_step(fused, x, step_grad, "rewrite"), "step", False)
        for how in forced:
            rows[f"D step {suffix}, rewrite, {how}"] = (module_training_step(fused, x, step_grad, "rewrite"), "step",
                                                       False)
        rows[f"D step {suffix}, original"] = (module_training_step(original, x, step_grad), "step", False)

    def settings(name):
        stack = contextlib.ExitStack()
        for how, dtypes in forced.items():
            if name.endswith(how):
                stack.enter_context(rewrite_forward_by_op(dtypes))
        if name.startswith("D step bf16"):
            stack.enter_context(torch.autocast(device.type, torch.bfloat16))
        return stack

    run_against_cudnn(rows, expected, args, device, settings,
                      f"x {tuple(x.shape)}, y {tuple(expected.shape)}, kernel {KERNEL}", paths,
                      2 * n * c_in * C_OUT * size[0] * size[1] * size[2] * KERNEL ** 3)


if __name__ == "__main__":
    main()
