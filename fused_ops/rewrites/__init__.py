"""Exact rewrites of the architectures' convolutions (the same functions in real
arithmetic, computed by faster convolutions), used by ``fused_ops.nn``; one module
per architecture:

- ``conv3d_max_pool``: A's convolution and max-pool (``conv3d_max_pool_windows``,
  ``conv3d_max_pool_mean``);
- ``conv_transpose3d_max_pool``: B's transposed convolution and its two max-pools
  (``conv_transpose3d_max_pool_windows``, ``conv_transpose3d_max_pool_cascade_sum``,
  ``forced_picked_weight_grad``);
- ``conv2d_avg_pool_sigmoid``: C's convolution and average pool folded into one convolution
  (``conv2d_avg_pool``, ``conv2d_avg_pool_sigmoid_sum``);
- ``conv_transpose3d_batch_norm``: D's stride-1 transposed convolution (``conv_transpose3d_stride1``)
  and, in eval mode, its spatial mean (``conv_transpose3d_spatial_mean``, ``spatial_sums``, ...);

and ``_common`` what they share: the parity-class convolution of A, B and D's training step
(its docstring says how), the checks of a rewrite's conditions, the dtype of a rearranged
kernel (``kernel_dtype``).

Each function returns None where its rewrite does not hold for the
configuration; the module then runs the original formulation. The modules
run the depth-stacked convolutions (A, B, D's training step) on CUDA inputs
only: they were measured faster there (README), and torch.compile 2.11
cannot lower them on the CPU.

A name re-exported here is looked up in its own module by the code there: to replace one
(a test, a benchmark), set it on that module.
"""
from ._common import _transposed_axis, conv_output_bytes, kernel_dtype
from .conv3d_max_pool import conv3d_max_pool_mean, conv3d_max_pool_windows
from .conv_transpose3d_max_pool import (_cascade_sum, _transposed_windows_geometry, conv_transpose3d_max_pool_cascade_sum,
                                        conv_transpose3d_max_pool_windows, forced_picked_weight_grad)
from .conv_transpose3d_batch_norm import (_stride1_by_cutlass, _TransposedConv3dStride1,
                                       conv_transpose3d_spatial_mean, conv_transpose3d_spatial_mean_map,
                                       conv_transpose3d_stride1, spatial_mean_holds, spatial_sums)
from .conv2d_avg_pool_sigmoid import _pool_fold, _pool_folded_bias, _PoolFold, conv2d_avg_pool, conv2d_avg_pool_sigmoid_sum

__all__ = ["kernel_dtype", "conv_output_bytes", "conv3d_max_pool_windows", "conv3d_max_pool_mean", "conv_transpose3d_max_pool_windows",
           "conv_transpose3d_max_pool_cascade_sum", "forced_picked_weight_grad", "conv_transpose3d_stride1",
           "spatial_mean_holds", "conv_transpose3d_spatial_mean_map", "spatial_sums", "conv_transpose3d_spatial_mean",
           "conv2d_avg_pool_sigmoid_sum", "conv2d_avg_pool",
           # (private, for fused_ops.export_patterns, the tests and the benchmarks)
           "_transposed_axis", "_cascade_sum", "_transposed_windows_geometry",
           "_stride1_by_cutlass", "_TransposedConv3dStride1", "_pool_fold",
           "_pool_folded_bias", "_PoolFold"]
