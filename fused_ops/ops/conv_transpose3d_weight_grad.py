"""conv_transpose3d_weight_grad (D's weight gradient): the wrapper, conv_transpose3d_weight_grad_path
(which implementation a call takes) and the op's fake."""
import torch
from torch import Tensor

from ._common import _check_tensors, _expand, _ops


def conv_transpose3d_weight_grad(grad_y: Tensor, x: Tensor, kernel_size) -> Tensor:
    """The weight gradient of ``conv_transpose3d(x, w)`` of stride 1 without padding, dilation or
    groups (w (I, O, *kernel_size)): ``grad_w[i, o, t, r, s]`` = the sum over n, z, h, w of
    ``x[n, i, z, h, w] * grad_y[n, o, z + t, h + r, w + s]``, (I, O, *kernel_size) contiguous in
    x's dtype, as ``aten.convolution_backward`` returns the weight's.

    grad_y: (N, O, D + kt - 1, H + kr - 1, W + ks - 1); x: (N, I, D, H, W), of grad_y's dtype.
    On an sm_90 GPU (H100, H200) in a build with CUTLASS's headers (setup.py), CUTLASS Hopper
    kernels (csrc/cuda/conv_transpose3d_weight_grad.cu), sums in float32: float32 where PyTorch's
    convolutions use TF32 (``torch.backends.cudnn.allow_tf32``) as per-depth-tap TF32 2-D
    convolutions, bfloat16 as a 3-D weight-gradient convolution; SPEC's D on an H200, the op
    (its layout copies included): 3.04 ms against cuDNN's 6.40 in TF32 (2.94 from channels-last
    operands), 1.08 against 2.30 in bfloat16 (bench/bench_conv_transpose3d_weight_grad.py). Everything else (float16, float64,
    float32 without TF32, other devices, sizes the kernels do not take, a build without CUTLASS:
    ``conv_transpose3d_weight_grad_path`` says which) by ``aten.convolution_backward`` (cuDNN's
    on a GPU). Not differentiable.
    """
    _check_tensors("conv_transpose3d_weight_grad", grad_y=grad_y, x=x)
    return _ops.conv_transpose3d_weight_grad(grad_y, x, _expand(kernel_size, 3, "kernel_size"))


def conv_transpose3d_weight_grad_path(grad_y: Tensor, x: Tensor, kernel_size) -> str:
    """Which implementation conv_transpose3d_weight_grad takes for these arguments (under the
    current TF32 setting): a kernel's name ("tf32 shifted rows 5 shifts split5",
    "cutlass bf16 wgrad 64x128x64"), or "aten.convolution_backward" (on a GPU, with " (built
    without CUTLASS)" where the build has no CUTLASS kernels)."""
    return _ops.conv_transpose3d_weight_grad_path(grad_y, x, _expand(kernel_size, 3, "kernel_size"))


@torch.library.register_fake("fused_ops::conv_transpose3d_weight_grad")
def _conv_transpose3d_weight_grad_fake(grad_y, x, kernel_size):
    what = "conv_transpose3d_weight_grad"
    torch._check(x.dim() == 5 and grad_y.dim() == 5,
                 lambda: f"{what}: x and grad_y must be 5-D, got {x.dim()} and {grad_y.dim()}")
    torch._check(x.dtype.is_floating_point and grad_y.dtype == x.dtype,
                 lambda: f"{what}: x and grad_y must have one floating dtype, got {x.dtype} and {grad_y.dtype}")
    k = _expand(list(kernel_size), 3, "kernel_size")
    torch._check(grad_y.shape[0] == x.shape[0] and all(grad_y.shape[2 + d] == x.shape[2 + d] + k[d] - 1
                                                       for d in range(3)),
                 lambda: f"{what}: grad_y's shape {tuple(grad_y.shape)} does not suit x's {tuple(x.shape)} and "
                         f"kernel_size {k}")
    return x.new_empty((x.shape[1], grad_y.shape[1], *k))
