"""conv_transpose3d_batch_norm_eval_mean (architecture D's eval forward): the wrapper and the op's fake."""
import math

import torch
from torch import Tensor

from ._common import _check_tensors, _check_transposed_convolution_fake, _expand, _ops, _result_dtype


def conv_transpose3d_batch_norm_eval_mean(x: Tensor, weight: Tensor, bias: Tensor | None, bn_weight: Tensor | None,
                                          bn_bias: Tensor | None, running_mean: Tensor, running_var: Tensor,
                                          stride=1, output_padding=0, scale=1.0, eps: float = 1e-5, *,
                                          dtype: torch.dtype | None = None) -> Tensor:
    """``F.adaptive_avg_pool3d(F.batch_norm(scale * F.conv_transpose3d(x, weight, bias, stride, 0,
    output_padding), running_mean, running_var, bn_weight, bn_bias, False, 0, eps), 1)`` as (N, O): architecture
    D's eval forward, for a transposed convolution without padding, dilation or groups. Affine in x's spatial
    sums there (every input element meets every tap inside the output): x summed over its planes, then one
    kernel maps the sums by the weight's tap sums, the bias, the scale and the batch norm, in float64
    (csrc/conv_transpose3d_batch_norm_eval_mean.h); nothing derived from the parameters is kept between calls.

    x: (N, I, D, H, W); weight (I, O, kt, kr, ks) and bias (O) of x's dtype; bn_weight, bn_bias, running_mean,
    running_var (O) of one floating dtype (x's, or float32 for a 16-bit x). scale: finite (the mean of
    scale * y is scale * mean(y) for a finite scale only). dtype: the result's, x's (None) or its accumulation
    type. Not differentiable.
    """
    _check_tensors("conv_transpose3d_batch_norm_eval_mean", x=x, weight=weight, running_mean=running_mean,
                   running_var=running_var)
    if not torch.compiler.is_compiling() and not math.isfinite(scale):  # (a compiler's scale may be symbolic)
        raise ValueError(f"conv_transpose3d_batch_norm_eval_mean: scale must be finite, got {scale}")
    return _ops.conv_transpose3d_batch_norm_eval_mean(x, weight, bias, bn_weight, bn_bias, running_mean, running_var,
                                                      _expand(stride, 3, "stride"),
                                                      _expand(output_padding, 3, "output_padding"), float(scale),
                                                      float(eps), dtype)


@torch.library.register_fake("fused_ops::conv_transpose3d_batch_norm_eval_mean")
def _conv_transpose3d_batch_norm_eval_mean_fake(x, weight, bias, bn_weight, bn_bias, running_mean, running_var, stride,
                                                output_padding, scale, eps, dtype=None):
    what = "conv_transpose3d_batch_norm_eval_mean"
    _check_transposed_convolution_fake(x, weight, what)
    for name, t in (("bias", bias), ("bn_weight", bn_weight), ("bn_bias", bn_bias), ("running_mean", running_mean),
                    ("running_var", running_var)):
        torch._check(t is None or (t.dim() == 1 and t.shape[0] == weight.shape[1]),
                     lambda: f"{what}: {name} must be 1-D with one element per output channel ({weight.shape[1]})")
    return x.new_empty((x.shape[0], weight.shape[1]), dtype=_result_dtype(x, dtype, what))
