"""The fused ops' Python faces, one module per op, named as the op (``parity_max_pool3d`` holds
both parity ops, ``parity_max_pool3d_mean`` and ``parity_max_pool3d_cascade_sum``): each holds the
op's thin Python wrapper (its arguments expanded and checked, what the backward needs saved only
where autograd records), its private helpers and its fake (meta) implementations for torch.compile
and torch.export (``torch.library.register_fake``, of the op and of its backward op); ``_common``
holds the helpers several ops share. Importing the package (``import fused_ops`` does) imports
every op's module, which registers every fake.

The kernels themselves are registered by the C++ extension under ``torch.ops.fused_ops``: every
schema is declared in csrc/ops.cpp (``TORCH_LIBRARY(fused_ops, m)``), each op's kernels beside
their sources (csrc/cpu/<op>.cpp, csrc/cuda/<op>.cu), autograd included: each differentiable op's
Autograd kernel, wired to its handwritten backward op, is in csrc/autograd/ (a Python one,
torch.library.register_autograd, cost about 10 us of host time per call, even under no_grad).
"""
from .avg_pool2d_sigmoid_sum import avg_pool2d_sigmoid_sum
from .conv2d_sigmoid_sum import conv2d_sigmoid_sum
from .conv3d_max_pool3d_mean import conv3d_max_pool3d_mean
from .max_pool3d_mean import max_pool3d_mean
from .max_pool3d_cascade_sum import max_pool3d_cascade_sum
from .parity_max_pool3d import parity_max_pool3d_cascade_sum, parity_max_pool3d_mean
from .depth_stacked_channels_last import depth_stacked_channels_last
from .batch_norm_gap import batch_norm_gap
from .conv_transpose3d_batch_norm_eval_mean import conv_transpose3d_batch_norm_eval_mean
from .conv_transpose3d_cascade_weight_grad import conv_transpose3d_cascade_weight_grad
from .conv_transpose3d_weight_grad import conv_transpose3d_weight_grad, conv_transpose3d_weight_grad_path
from .conv_transpose3d_stride1_channels_last import (conv_transpose3d_stride1_channels_last,
                                                     conv_transpose3d_stride1_channels_last_path)
from .conv_transpose3d_cascade_sum import conv_transpose3d_cascade_sum, conv_transpose3d_cascade_sum_path
from .box_fold2d import box_fold2d
from .channel_sums import channel_sums

__all__ = ["avg_pool2d_sigmoid_sum", "conv2d_sigmoid_sum", "conv3d_max_pool3d_mean", "max_pool3d_mean",
           "max_pool3d_cascade_sum", "parity_max_pool3d_mean", "parity_max_pool3d_cascade_sum",
           "depth_stacked_channels_last", "batch_norm_gap", "conv_transpose3d_batch_norm_eval_mean",
           "conv_transpose3d_cascade_weight_grad", "conv_transpose3d_weight_grad", "conv_transpose3d_weight_grad_path",
           "conv_transpose3d_stride1_channels_last", "conv_transpose3d_stride1_channels_last_path",
           "conv_transpose3d_cascade_sum", "conv_transpose3d_cascade_sum_path", "box_fold2d", "channel_sums"]
