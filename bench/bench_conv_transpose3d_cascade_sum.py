"""conv_transpose3d_cascade_sum (architecture B's forward less the bias; on an sm_90 GPU one kernel,
csrc/cuda/conv_transpose3d_cascade_sum.cu, its float32 operands as bf16x3 at PyTorch's default float32
matmul precision and as TF32 under torch.set_float32_matmul_precision("high"): rows " tf32") against the
parity-class formulation it replaces in B's rewrite (cuDNN's depth-stacked 2-D convolution of the padded parity classes, then
parity_max_pool3d_cascade_sum) and PyTorch's eager ops (cuDNN's transposed convolution, channels-last
too), in float32 with TF32 allowed (PyTorch's default), in one run (interleaved rounds; CUDA events on
a GPU, the wall clock on a CPU; medians over the rounds). Each result is checked against the float64
one (the ops in float64 on the device): the normwise max relative error max|got - ref| / max|ref|.
Then B's eval forward and training step (x needing no gradient) by the fused module and the original,
and rows under bfloat16 autocast (names ending in " bf16": the op's bf16 kernel, B's modules).

B's transposed convolution (32 -> 64, kernel 5, stride 2, padding 2), max_pool3d(2), max_pool3d(3),
the channel sum, on x of fused_ops.architectures' B shapes: --size spec (16, 32, 32, 32, 32; the
default on a GPU), reduced (1, 32, 16, 16, 16; the default on a CPU) or tiny; --batch N for another
batch. The table last: time, TFLOP/s of the transposed convolution's real work at the positions the
pools read (2 N C_in C_out taps, 125 taps per 8 stage-1 positions), the time over the faster cuDNN
row, the error.

    cd bench && python3 bench_conv_transpose3d_cascade_sum.py [--size spec] [--batch N] [--rounds 5]
"""
import contextlib

import torch
import torch.nn.functional as F

from fused_ops import architectures, conv_transpose3d_cascade_sum, reference, rewrites
from fused_ops import nn as fnn
from fused_ops.ops import conv_transpose3d_cascade_sum_path
from timing import convolution_arguments, module_training_step, run_against_cudnn

B = next(a for a in architectures.ARCHITECTURES if a.letter == "B")
C_OUT, KERNEL, STRIDE, PADDING = B.args[1:]


def eager(x, weight):
    """B's ops as the original runs them, without the bias."""
    y = F.conv_transpose3d(x, weight, None, STRIDE, PADDING)
    return F.max_pool3d(F.max_pool3d(y, STRIDE), 3).sum(1, keepdim=True)


@contextlib.contextmanager
def tf32_matmul_precision():
    """torch.set_float32_matmul_precision("high") within the block: the op's float32 operands as TF32."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def main():
    args, device, shape = convolution_arguments(__doc__.splitlines()[0], "B")
    torch.manual_seed(0)
    original = reference.ConvTranspose3dMaxPoolMaxPoolSum(*B.args).to(device)
    fused = fnn.ConvTranspose3dMaxPoolMaxPoolSum.from_module(original)
    conv, pool1, pool2 = original.conv_transpose, original.max_pool1, original.max_pool2
    x = torch.rand(shape, device=device)
    weight = conv.weight.detach()
    with torch.no_grad():
        expected = eager(x.double(), weight.double())
    axes, positions, _ = rewrites._transposed_windows_geometry(x, conv, pool1, pool2)
    x_last = x.contiguous(memory_format=torch.channels_last_3d)
    w_last = weight.contiguous(memory_format=torch.channels_last_3d)
    rows = {
        "op": (lambda: conv_transpose3d_cascade_sum(x, weight, STRIDE, PADDING, 0, 3), "tf32", True),
        "op channels_last x": (lambda: conv_transpose3d_cascade_sum(x_last, weight, STRIDE, PADDING, 0, 3), "tf32",
                               True),
        "op tf32": (lambda: conv_transpose3d_cascade_sum(x, weight, STRIDE, PADDING, 0, 3), "tf32", True),
        "parity formulation": (lambda: rewrites._cascade_sum(x, weight, (3, 3, 3), axes, positions, False)[0],
                               "tf32", True),
        "cuDNN eager": (lambda: eager(x, weight), "tf32", True),
        "cuDNN eager channels_last": (lambda: eager(x_last, w_last), "tf32", True),
    }
    paths = {"float32": conv_transpose3d_cascade_sum_path(x, weight, STRIDE, PADDING, 0, 3),
             "bf16": conv_transpose3d_cascade_sum_path(x.bfloat16(), weight.bfloat16(), STRIDE, PADDING, 0, 3)}
    with tf32_matmul_precision():
        paths["float32 at matmul precision high"] = conv_transpose3d_cascade_sum_path(x, weight, STRIDE, PADDING, 0, 3)
    rows["B eval, fused module"] = (lambda: fused(x), "module", False)
    rows["B eval, fused module tf32"] = (lambda: fused(x), "module", False)
    rows["B eval, original"] = (lambda: original(x), "module", False)
    step_grad = torch.rand(shape[0], 1, *expected.shape[2:], device=device)
    rows["B step, fused module"] = (module_training_step(fused, x, step_grad), "step", False)
    rows["B step, original"] = (module_training_step(original, x, step_grad), "step", False)
    # under bfloat16 autocast (the op's bf16 kernel; names ending in " bf16")
    rows["op bf16"] = (lambda: conv_transpose3d_cascade_sum(x, weight, STRIDE, PADDING, 0, 3), "bf16", False)
    rows["B eval, fused module bf16"] = (lambda: fused(x), "module bf16", False)
    rows["B eval, original bf16"] = (lambda: original(x), "module bf16", False)
    rows["B step, fused module bf16"] = (module_training_step(fused, x, step_grad), "step bf16", False)
    n, c_in, d, h, w = shape
    stage1 = [s // 3 * 3 for s in [((i - 1) * STRIDE - 2 * PADDING + KERNEL) // STRIDE for i in (d, h, w)]]
    flop = 2 * n * c_in * C_OUT * stage1[0] * stage1[1] * stage1[2] * KERNEL ** 3
    def settings(name):
        stack = contextlib.ExitStack()
        stack.enter_context(torch.enable_grad() if "step" in name else torch.no_grad())
        if name.endswith(" bf16"):
            stack.enter_context(torch.autocast(device.type, dtype=torch.bfloat16))
        if name.endswith(" tf32"):
            stack.enter_context(tf32_matmul_precision())
        return stack

    run_against_cudnn(rows, expected, args, device, settings, f"x {tuple(x.shape)}, kernel {KERNEL}, stride {STRIDE}",
                      paths, flop)


if __name__ == "__main__":
    main()
