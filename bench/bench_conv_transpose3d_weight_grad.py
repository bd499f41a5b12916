"""conv_transpose3d_weight_grad (architecture D's weight gradient; on an sm_90 GPU our TF32 shifted-rows
kernel and CUTLASS's bf16 wgrad, csrc/cuda/conv_transpose3d_weight_grad.cu) against aten.convolution_backward's (cuDNN's on
a GPU) on NCDHW and on channels_last_3d operands (made beforehand), in float32 with TF32 allowed
(PyTorch's default) and in bfloat16, in one run (interleaved rounds; CUDA events on a GPU, the wall
clock on a CPU; medians over the rounds). The op's rows include its operands' layout copies. Each
result is checked against the float64 weight gradient (aten.convolution_backward in float64 on the
device): the normwise max relative error max|got - ref| / max|ref|. Then D's training step in
float32 (x needing no gradient): the rewrite (its weight gradient by the op), the rewrite with the
weight gradient by aten.convolution_backward (as before the op), and the original eager.

D's transposed convolution (64 -> 128, kernel 5, stride 1, no padding) on x of
fused_ops.architectures' D shapes: --size spec (16, 64, 16, 32, 32; the default on a GPU), reduced
(2, 64, 8, 16, 16; the default on a CPU) or tiny; --batch N for another batch. The table last: time,
TFLOP/s of 2 N C_in C_out D H W k^3, the time over the faster cuDNN row of the same dtype, the error.

    cd bench && python3 bench_conv_transpose3d_weight_grad.py [--size spec] [--batch N] [--rounds 5]
"""
import contextlib

import torch

from fused_ops import architectures, conv_transpose3d_weight_grad, reference
from fused_ops import nn as fnn
from fused_ops.ops import conv_transpose3d_weight_grad_path
from fused_ops.rewrites import conv_transpose3d_batch_norm as d_rewrite  # (whose backward calls the op)
from timing import convolution_arguments, module_training_step, run_against_cudnn


D = next(a for a in architectures.ARCHITECTURES if a.letter == "D")
C_OUT, KERNEL = D.args[1], D.args[2]
STRIDE, ZERO = [1, 1, 1], [0, 0, 0]


def by_aten(grad_y, x, kernel_size, weight=None):
    """The weight gradient by aten.convolution_backward, as PyTorch's autograd calls it."""
    if weight is None:
        weight = torch.empty(x.shape[1], grad_y.shape[1], *kernel_size, dtype=x.dtype, device=x.device)
    return torch.ops.aten.convolution_backward(grad_y, x, weight, None, STRIDE, ZERO, STRIDE, True, ZERO, 1,
                                               [False, True, False])[1]


@contextlib.contextmanager
def rewrite_weight_grad_by_aten():
    """D's rewrite with its weight gradient by aten.convolution_backward inside the block."""
    op = d_rewrite.conv_transpose3d_weight_grad
    d_rewrite.conv_transpose3d_weight_grad = by_aten
    try:
        yield
    finally:
        d_rewrite.conv_transpose3d_weight_grad = op


def main():
    args, device, shape = convolution_arguments(__doc__.splitlines()[0], "D")
    kernel = [KERNEL] * 3
    n, c_in, *size = shape
    torch.manual_seed(0)
    x = torch.rand(shape, device=device)
    grad_y = torch.randn(n, C_OUT, *[s + KERNEL - 1 for s in size], device=device)
    with torch.no_grad():
        expected = by_aten(grad_y.double(), x.double(), kernel)

    rows = {}  # name -> (call, dtype, checked)
    paths = {}
    for dtype, suffix in ((torch.float32, "tf32"), (torch.bfloat16, "bf16")):
        xs, gs = x.to(dtype), grad_y.to(dtype)
        xc, gc = (t.contiguous(memory_format=torch.channels_last_3d) for t in (xs, gs))
        w = torch.empty(c_in, C_OUT, *kernel, dtype=dtype, device=device)
        wc = w.contiguous(memory_format=torch.channels_last_3d)
        paths[suffix] = conv_transpose3d_weight_grad_path(gs, xs, kernel)
        rows[f"op {suffix}"] = (lambda gs=gs, xs=xs: conv_transpose3d_weight_grad(gs, xs, kernel), suffix, True)
        rows[f"op channels_last {suffix}"] = (lambda gc=gc, xc=xc: conv_transpose3d_weight_grad(gc, xc, kernel),
                                              suffix, True)
        rows[f"cuDNN NCDHW {suffix}"] = (lambda gs=gs, xs=xs, w=w: by_aten(gs, xs, kernel, w), suffix, True)
        rows[f"cuDNN channels_last {suffix}"] = (lambda gc=gc, xc=xc, wc=wc: by_aten(gc, xc, kernel, wc), suffix,
                                                 True)

    torch.manual_seed(0)
    original = reference.ConvTranspose3dScaleBatchNormGAP(*D.args).to(device).train()
    fused = fnn.ConvTranspose3dScaleBatchNormGAP.from_module(original)
    step_grad = torch.rand(n, C_OUT, 1, 1, 1, device=device)
    rows["D step, rewrite"] = (module_training_step(fused, x, step_grad, "rewrite"), "step", False)
    rows["D step, rewrite, cuDNN weight grad"] = (module_training_step(fused, x, step_grad, "rewrite"), "step", False)
    rows["D step, original"] = (module_training_step(original, x, step_grad), "step", False)

    settings = {"D step, rewrite, cuDNN weight grad": rewrite_weight_grad_by_aten}
    run_against_cudnn(rows, expected, args, device, lambda name: settings.get(name, contextlib.nullcontext)(),
                      f"x {tuple(x.shape)}, grad_y {tuple(grad_y.shape)}, kernel {KERNEL}", paths,
                      2 * n * c_in * C_OUT * size[0] * size[1] * size[2] * KERNEL ** 3)


if __name__ == "__main__":
    main()
