"""conv_transpose3d_stride1_channels_last (D's forward convolution): the wrapper,
conv_transpose3d_stride1_channels_last_path (which implementation a call takes) and the op's fake."""
import torch
from torch import Tensor

from ._common import _check_tensors, _check_transposed_convolution_fake, _expand, _ops


def conv_transpose3d_stride1_channels_last(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                                           padding=0) -> Tensor:
    """``F.conv_transpose3d(x, weight, bias, stride=1, padding=padding)`` (no dilation or groups),
    returned channels_last_3d (memory (N, D', H', W', O)) in x's dtype.

    x: (N, I, D, H, W); weight: (I, O, kt, kr, ks) and bias (O) or None, of x's dtype; padding:
    an int or 3 ints, 0 <= padding < kernel. On an sm_90 GPU (H100, H200) in a build with
    CUTLASS's headers (setup.py), CUTLASS's Hopper implicit-GEMM 3-D convolution of x with the
    kernel flipped (csrc/cuda/conv_transpose3d_stride1_channels_last.cu), the bias added in its
    epilogue, sums in float32: float32 where PyTorch's convolutions use TF32
    (``torch.backends.cudnn.allow_tf32``), bfloat16 (bench/bench_conv_transpose3d_stride1_channels_last.py
    times it). Everything else (float16, float64, float32 without TF32, other devices, channels not
    a multiple of 16 bytes, a build without CUTLASS: ``conv_transpose3d_stride1_channels_last_path``
    says which) by ``aten.conv_transpose3d``, on the CPU 16-bit operands in float32 (y rounded once:
    aten's CPU float16 convolution does not accumulate in float32 everywhere). Not differentiable.
    """
    _check_tensors("conv_transpose3d_stride1_channels_last", x=x, weight=weight)
    return _ops.conv_transpose3d_stride1_channels_last(x, weight, bias, _expand(padding, 3, "padding"))


def conv_transpose3d_stride1_channels_last_path(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                                                padding=0) -> str:
    """Which implementation conv_transpose3d_stride1_channels_last takes for these arguments (under
    the current TF32 setting): a CUTLASS kernel's name ("cutlass tf32 fprop3d 128x128x32 cluster 4"), or
    "aten.conv_transpose3d" (on a GPU, with " (built without CUTLASS)" where the build has no
    CUTLASS kernels)."""
    return _ops.conv_transpose3d_stride1_channels_last_path(x, weight, bias, _expand(padding, 3, "padding"))


@torch.library.register_fake("fused_ops::conv_transpose3d_stride1_channels_last")
def _conv_transpose3d_stride1_channels_last_fake(x, weight, bias, padding):
    what = "conv_transpose3d_stride1_channels_last"
    _check_transposed_convolution_fake(x, weight, what)
    p = _expand(list(padding), 3, "padding")
    size = [x.shape[2 + d] + weight.shape[2 + d] - 1 - 2 * p[d] for d in range(3)]
    return x.new_empty((x.shape[0], *size, weight.shape[1])).permute(0, 4, 1, 2, 3)
