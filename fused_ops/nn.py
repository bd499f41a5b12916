"""Drop-in replacements for the architectures of ``fused_ops.reference``.

Each has the original's constructor, parameters, buffers and state_dict keys
(built under the same seed it draws the same initial parameters), and
``from_module(original)`` wraps an existing instance, sharing its parameters.
"""
import torch
from torch import Tensor, nn

from . import _autocast, reference, rewrites
from .ops import (avg_pool2d_sigmoid_sum, batch_norm_gap, max_pool3d_cascade_sum, max_pool3d_mean,
                  parity_max_pool3d_cascade_sum, parity_max_pool3d_mean)
from .sync_batch_norm import sync_batch_norm_gap, sync_process_group


def _adopt(cls, original: nn.Module, **members: type | tuple[type, ...]) -> nn.Module:
    """A `cls` instance that shares `original`'s members (no copies): its
    submodules, parameters and plain attributes, each named with the type it
    must have."""
    for name, kind in members.items():
        if not isinstance(getattr(original, name, None), kind):
            kinds = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise TypeError(
                f"{cls.__name__}.from_module: expected a module with a {kinds} "
                f"attribute '{name}', got {type(original).__name__}"
            )
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    for name in members:
        setattr(module, name, getattr(original, name))
    module.train(original.training)
    return module


def _check_input(name: str, x: Tensor, in_channels: int, unbatched_ok: bool) -> None:
    """A 5-D (batch, channels, depth, height, width) floating-point input of `in_channels`
    channels, or, where the original takes it (unbatched_ok), a 4-D one without the batch."""
    if x.dim() != 5 and not (unbatched_ok and x.dim() == 4):
        expected = "a 4-D (unbatched) or 5-D (batched) input" if unbatched_ok else "a 5-D input"
        raise ValueError(
            f"{name}: expected {expected} (batch, channels, depth, height, width), "
            f"got {x.dim()}-D input of shape {tuple(x.shape)}"
        )
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name}: input must be a floating-point tensor, got {x.dtype}")
    if x.shape[-4] != in_channels:
        raise ValueError(f"{name}: expected {in_channels} input channels, got input of shape {tuple(x.shape)}")


def _check_fusable_max_pool(name: str, pool: nn.MaxPool3d, ceil_mode_ok: bool) -> None:
    if pool.dilation not in (1, (1, 1, 1), [1, 1, 1]) or pool.return_indices or (pool.ceil_mode and not ceil_mode_ok):
        unsupported = "dilation != 1, return_indices" + ("" if ceil_mode_ok else " or ceil_mode")
        raise ValueError(f"{name}: the fused max-pool does not support {unsupported}, got {pool}")


class Conv2dAvgPoolSigmoidSum(nn.Module):
    """conv2d -> avg_pool2d -> sigmoid -> sum over (C, H, W). Where the pool's
    windows do not pad (``fused_ops.rewrites.conv2d_avg_pool``), the pool is
    folded into the convolution, which runs over space-to-depth input, and
    the sigmoid and sum follow; otherwise the tail is fused into one kernel
    (``fused_ops.avg_pool2d_sigmoid_sum``)."""

    def __init__(self, in_channels, out_channels, kernel_size, pool_kernel_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.avg_pool = nn.AvgPool2d(pool_kernel_size)

    @classmethod
    def from_module(cls, original: nn.Module) -> "Conv2dAvgPoolSigmoidSum":
        return _adopt(cls, original, conv=nn.Conv2d, avg_pool=nn.AvgPool2d)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4:
            # (the original's sum over dims 1, 2, 3 refuses an unbatched 3-D input too)
            raise ValueError(
                f"{type(self).__name__}: expected a 4-D input (batch, channels, height, width), "
                f"got {x.dim()}-D input of shape {tuple(x.shape)}"
            )
        pool = self.avg_pool
        pooled = rewrites.conv2d_avg_pool(x, self.conv, pool)
        if pooled is not None:
            return torch.sigmoid(pooled).sum(dim=(1, 2, 3))
        out = avg_pool2d_sigmoid_sum(
            self.conv(x),
            pool.kernel_size,
            pool.stride,
            pool.padding,
            pool.ceil_mode,
            pool.count_include_pad,
            pool.divisor_override,
        )
        return out.to(_autocast.tail_dtype(_autocast.conv_dtype(x), x.device.type,
                                           ("aten::avg_pool2d", "aten::sigmoid", "aten::sum.dim_IntList")))


class Conv3dDivMaxPoolGAPBiasSum(reference.Conv3dDivMaxPoolGAPBiasSum):
    """conv3d -> / divisor -> max_pool3d -> global average pool -> + bias -> sum
    over sum_dim. On a GPU, where the pool's windows tile the convolution's
    output (``fused_ops.rewrites.conv3d_max_pool_windows``), the divisor is folded
    into the convolution, which computes the windows side by side, and
    ``fused_ops.parity_max_pool3d_mean`` pools and averages them; otherwise
    the division, the pool and the average are fused into one kernel over the
    convolution's output (``fused_ops.max_pool3d_mean``). The bias and the sum
    are applied to the (B, C, 1, 1, 1) result as the original does. The constructor is the
    original's (the same members, parameters drawn in the same order);
    ``global_avg_pool`` stays for its structure, the fused op computes it."""

    @classmethod
    def from_module(cls, original: nn.Module) -> "Conv3dDivMaxPoolGAPBiasSum":
        return _adopt(cls, original, conv=nn.Conv3d, divisor=(int, float), max_pool=nn.MaxPool3d,
                      global_avg_pool=nn.AdaptiveAvgPool3d, bias=nn.Parameter, sum_dim=int)

    def forward(self, x: Tensor) -> Tensor:
        name = type(self).__name__
        _check_input(name, x, self.conv.in_channels, unbatched_ok=True)
        pool = self.max_pool
        _check_fusable_max_pool(name, pool, ceil_mode_ok=True)
        batched = x.dim() == 5
        if not batched:
            x = x.unsqueeze(0)
        rewritten = rewrites.conv3d_max_pool_windows(x, self.conv, pool, self.divisor) if x.is_cuda else None
        if rewritten is not None:
            windows, channel_bias = rewritten
            mean = parity_max_pool3d_mean(windows)
            if channel_bias is not None:
                mean = mean + channel_bias
        else:
            mean = max_pool3d_mean(self.conv(x), pool.kernel_size, pool.stride, pool.padding, pool.ceil_mode,
                                   self.divisor)
        pooled = mean[:, :, None, None, None] if batched else mean[0, :, None, None, None]
        out = torch.sum(pooled + self.bias, dim=self.sum_dim)
        # the original's dtype: its global average's (the pools' under autocast), plus the bias, summed
        average_dtype = _autocast.tail_dtype(_autocast.conv_dtype(x), x.device.type,
                                             ("aten::max_pool3d", "aten::adaptive_avg_pool3d"))
        return out.to(_autocast.tail_dtype(torch.promote_types(average_dtype, self.bias.dtype), x.device.type,
                                           ("aten::sum.dim_IntList",)))


class ConvTranspose3dMaxPoolMaxPoolSum(reference.ConvTranspose3dMaxPoolMaxPoolSum):
    """conv_transpose3d -> max_pool3d -> max_pool3d -> sum over channels
    (keepdim). On a GPU, where the first pool's windows are the transposed
    convolution's stride classes and the second pool's tile its output
    (``fused_ops.rewrites.conv_transpose3d_max_pool_windows``), a convolution
    computes the first pool's windows side by side and
    ``fused_ops.parity_max_pool3d_cascade_sum`` pools and sums them; otherwise
    the two pools and the sum are fused into one kernel over the transposed
    convolution's output (``fused_ops.max_pool3d_cascade_sum``). The constructor is the original's
    (the same members, parameters drawn in the same order)."""

    @classmethod
    def from_module(cls, original: nn.Module) -> "ConvTranspose3dMaxPoolMaxPoolSum":
        return _adopt(cls, original, conv_transpose=nn.ConvTranspose3d, max_pool1=nn.MaxPool3d,
                      max_pool2=nn.MaxPool3d)

    def forward(self, x: Tensor) -> Tensor:
        name = type(self).__name__
        _check_input(name, x, self.conv_transpose.in_channels, unbatched_ok=True)
        first, second = self.max_pool1, self.max_pool2
        if x.dim() == 4:
            # Unbatched, the original's sum over dim 1 adds depth planes, not channels:
            # its own ops (the fused op sums channels).
            return torch.sum(second(first(self.conv_transpose(x))), dim=1, keepdim=True)
        _check_fusable_max_pool(name, first, ceil_mode_ok=False)
        _check_fusable_max_pool(name, second, ceil_mode_ok=False)
        rewritten = (rewrites.conv_transpose3d_max_pool_windows(x, self.conv_transpose, first, second)
                     if x.is_cuda else None)
        if rewritten is not None:
            windows, channel_bias = rewritten
            out = parity_max_pool3d_cascade_sum(windows, second.kernel_size)
            if channel_bias is not None:  # each channel's maximum carries its bias into the sum
                out = out + channel_bias.sum()
        else:
            out = max_pool3d_cascade_sum(self.conv_transpose(x), first.kernel_size, second.kernel_size,
                                         stride1=first.stride, padding1=first.padding, stride2=second.stride,
                                         padding2=second.padding)
        return out.to(_autocast.tail_dtype(_autocast.conv_dtype(x), x.device.type,
                                           ("aten::max_pool3d", "aten::sum.dim_IntList")))


class ConvTranspose3dScaleBatchNormGAP(reference.ConvTranspose3dScaleBatchNormGAP):
    """conv_transpose3d -> * scale_factor -> batch_norm3d -> global average
    pool; the scale, the batch norm and the pool fused into one op
    (``fused_ops.batch_norm_gap``), which updates the running statistics as
    nn.BatchNorm3d does, on the device. Normalizing with running statistics
    (eval mode), the output is affine in the input's spatial sums where the
    transposed convolution does not pad (``fused_ops.rewrites.conv_transpose3d_spatial_mean_map``,
    the batch norm folded in): one reduction of x and a small matmul. With batch
    statistics on a GPU, a stride-1 transposed convolution runs as a convolution
    (``fused_ops.rewrites.conv_transpose3d_stride1``). The constructor is the original's (the
    same members, parameters and buffers, drawn in the same order);
    ``batch_norm`` holds the parameters, buffers and settings the fused op
    reads (affine, track_running_stats, momentum, eps), ``global_avg_pool``
    stays for its structure. An nn.SyncBatchNorm there (convert_sync_batchnorm)
    takes its training statistics over its process group where nn.SyncBatchNorm
    would (``fused_ops.sync_batch_norm``), on any device its backend serves."""

    @classmethod
    def from_module(cls, original: nn.Module) -> "ConvTranspose3dScaleBatchNormGAP":
        return _adopt(cls, original, conv_transpose=nn.ConvTranspose3d, scale_factor=(int, float),
                      batch_norm=(nn.BatchNorm3d, nn.SyncBatchNorm), global_avg_pool=nn.AdaptiveAvgPool3d)

    def forward(self, x: Tensor) -> Tensor:
        name = type(self).__name__
        _check_input(name, x, self.conv_transpose.in_channels, unbatched_ok=False)
        if self.global_avg_pool.output_size not in (1, (1, 1, 1), [1, 1, 1]):
            raise ValueError(f"{name}: the fused op pools to (1, 1, 1), got {self.global_avg_pool}")
        bn = self.batch_norm
        # nn.BatchNorm3d's rules: the running statistics are normalized with
        # in eval mode and updated in training mode with track_running_stats.
        running = not bn.training or bn.track_running_stats
        batch_stats = bn.training or bn.running_mean is None
        out_dtype = _autocast.tail_dtype(_autocast.conv_dtype(x), x.device.type,
                                         ("aten::batch_norm", "aten::adaptive_avg_pool3d"))
        if not batch_stats:
            mapped = self._running_stats_map(x)
            if mapped is not None:
                weight, shift = mapped
                out = torch.addmm(shift, rewrites.spatial_sums(x), weight)
                return out[:, :, None, None, None].to(out_dtype)
        y = rewrites.conv_transpose3d_stride1(x, self.conv_transpose) if x.is_cuda else None
        if y is None:
            y = self.conv_transpose(x)
        group = sync_process_group(bn)
        if group is not None:
            out = sync_batch_norm_gap(y, self.scale_factor, bn, group)
        else:
            out = batch_norm_gap(y, self.scale_factor, bn.weight, bn.bias,
                                 bn.running_mean if running else None, bn.running_var if running else None,
                                 bn.num_batches_tracked if bn.training and bn.track_running_stats else None,
                                 training=bn.training, momentum=bn.momentum, eps=bn.eps)
        return out.to(out_dtype)

    def _running_stats_map(self, x: Tensor) -> tuple[Tensor, Tensor] | None:
        """(W (I, O), b (O)) in float64 with the output, normalized with the running
        statistics, ``s @ W + b`` for x's spatial sums s (N, I): the spatial mean of the
        transposed convolution is affine in s (``rewrites.conv_transpose3d_spatial_mean_map``)
        and so is the batch norm per channel, out = (scale * mean - running_mean) * rstd *
        weight + bias. None where the transposed convolution pads. Kept for the next call
        while the parameters, buffers and x's size stay (their versions), where no gradient
        is being recorded (a graph would need the parameters') and outside torch.compile."""
        conv, bn = self.conv_transpose, self.batch_norm
        tensors = [t for t in (conv.weight, conv.bias, bn.weight, bn.bias, bn.running_mean, bn.running_var)
                   if t is not None]
        keep = not torch.is_grad_enabled() and not torch.compiler.is_compiling()
        key = (x.shape[1:], x.device, self.scale_factor, bn.eps,
               tuple([(t.data_ptr(), t._version) for t in tensors])) if keep else None
        kept = getattr(self, "_kept_running_stats_map", None)
        if key is not None and kept is not None and kept[0] == key:
            return kept[1]
        mapped = rewrites.conv_transpose3d_spatial_mean_map(x, conv)
        if mapped is not None:
            weight, bias = mapped
            gain = (bn.running_var.double() + bn.eps).rsqrt()  # rstd * weight
            if bn.weight is not None:
                gain = gain * bn.weight.double()
            shift = (self.scale_factor * bias - bn.running_mean.double()) * gain
            if bn.bias is not None:
                shift = shift + bn.bias.double()
            mapped = weight * (self.scale_factor * gain), shift
        if key is not None:
            self._kept_running_stats_map = key, mapped
        return mapped
