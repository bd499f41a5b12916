"""fused_ops: fused pooling / normalization / activation / reduction tails for
convolutional networks, with handwritten backward kernels, and drop-in modules
for whole architectures (``fused_ops.nn``)."""
import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C  # noqa: F401  (registers the torch.ops.fused_ops kernels)
from . import nn, reference, rewrites
from .fusion import FuseReport, fuse
from .ops import (avg_pool2d_sigmoid_sum, batch_norm_gap, box_fold2d, channel_sums, conv2d_sigmoid_sum,
                  conv3d_max_pool3d_mean,
                  conv_transpose3d_batch_norm_eval_mean, conv_transpose3d_cascade_sum,
                  conv_transpose3d_cascade_weight_grad, conv_transpose3d_stride1_channels_last,
                  conv_transpose3d_weight_grad, depth_stacked_channels_last,
                  max_pool3d_cascade_sum, max_pool3d_mean, parity_max_pool3d_cascade_sum, parity_max_pool3d_mean)

__all__ = ["enable_compile_patterns", "disable_compile_patterns", "avg_pool2d_sigmoid_sum", "batch_norm_gap",
           "box_fold2d", "channel_sums", "conv2d_sigmoid_sum", "conv3d_max_pool3d_mean",
           "conv_transpose3d_batch_norm_eval_mean",
           "conv_transpose3d_cascade_sum",
           "conv_transpose3d_cascade_weight_grad",
           "conv_transpose3d_stride1_channels_last", "conv_transpose3d_weight_grad", "depth_stacked_channels_last",
           "max_pool3d_cascade_sum", "max_pool3d_mean", "parity_max_pool3d_cascade_sum", "parity_max_pool3d_mean",
           "nn", "reference", "rewrites", "fuse", "FuseReport", "has_cuda_kernels"]


def enable_compile_patterns() -> None:
    """torch.compile (Inductor) runs the architectures' chains and tails it finds, in training and
    in inference, by the fused ops from now on (``fused_ops.compile_patterns``)."""
    from .compile_patterns import enable_compile_patterns as enable  # (imports Inductor: on first use)
    enable()


def disable_compile_patterns() -> None:
    """Undoes enable_compile_patterns."""
    from .compile_patterns import disable_compile_patterns as disable
    disable()


def has_cuda_kernels() -> bool:
    """Whether this build of the extension holds the CUDA kernels."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(
        "fused_ops::avg_pool2d_sigmoid_sum", "CUDA"
    )
