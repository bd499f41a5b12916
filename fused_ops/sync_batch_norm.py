"""Architecture D's fused tail (``fused_ops.batch_norm_gap``) with nn.SyncBatchNorm's
statistics: those of the whole process group's batch, in training.

Forward. Each rank's batch_norm_gap gives, per channel, for z = scale * y: the
mean a (rounded to the accumulation type), the biased variance v, and each
plane's deviation plane_dev[b] = m[b] - a from it (m[b]: the mean of plane b).
One all_gather of a (4, C) tensor per rank: its count n = B * S (S = D * H * W),
a, lo = mean_b plane_dev[b] (what the rounding of a dropped) and v. Chan's
formula combines them without cancellation, relative to a shift (the first
nonempty rank's mean, the same on every rank) so that only differences of the
spread's size are summed:
    d_r = a_r - shift + lo_r,  N = sum_r n_r,  delta = sum_r n_r d_r / N,
    mu = shift + delta,  var = (sum_r n_r v_r + sum_r n_r (d_r - delta)^2) / N,
    r = 1 / sqrt(var + eps),
    out[b] = w r (m[b] - mu) + bias,  m[b] - mu = plane_dev[b] + (a - shift - delta).
The running statistics take mu and the unbiased variance var * N / (N - 1), as
nn.SyncBatchNorm updates them (factor momentum, or with momentum None
1 / num_batches_tracked after its increment), with tensor ops on the device.

Backward, with g[b] the gradient of out[b], G = sum of g and P = sum of
g[b] (m[b] - mu) over every rank's batch (one all_reduce of a (2, C) tensor):
    grad_z[b, s] = w r (g[b] / S - G / N) - w r^3 P (z[b, s] - mu) / N
(d r / d z[b, s] = -r^3 (z[b, s] - mu) / N; mu's own derivative drops out, as
the sum of z - mu is 0), and grad_y = scale * grad_z, in one pass over y:
    grad_y[b, s] = scale w r (g[b] / S - G / N) + k mu - scale k y[b, s],
    k = scale w r^3 P / N,
with its (B, C) and (C) coefficients in float64 (k mu and scale k y cancel to
k (mu - z): in float32 that would lose the mean's ratio to the spread in precision).
grad_weight = r P_local and grad_bias = G_local, the sums over this rank's own
outputs (DistributedDataParallel averages them over the ranks).
"""
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from .ops._common import _accumulation_dtype


def sync_process_group(bn: nn.Module):
    """The process group over which nn.SyncBatchNorm.forward would synchronize
    bn's statistics, or None where it would not: bn not an nn.SyncBatchNorm,
    eval mode, torch.distributed unavailable or not initialized, a group of one."""
    if not (isinstance(bn, nn.SyncBatchNorm) and bn.training and dist.is_available() and dist.is_initialized()):
        return None
    group = bn.process_group if bn.process_group else dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


class _SyncBatchNormGap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, weight, bias, scale, bn, group):
        batch, channels = y.shape[:2]
        plane = y.shape[2] * y.shape[3] * y.shape[4]
        if batch * plane == 1:
            # batch_norm_gap refuses one value per channel; in a group, nn.SyncBatchNorm takes it
            z = (y * scale).reshape(1, channels).to(_accumulation_dtype(y.dtype))
            plane_dev, mean, var = torch.zeros_like(z), z[0], torch.zeros_like(z[0])
        else:
            _, plane_dev, mean, _, var = torch.ops.fused_ops.batch_norm_gap(y, float(scale), weight, bias, None,
                                                                          None, float(bn.eps))
        lo = plane_dev.sum(0) / max(batch, 1)
        local = torch.stack([torch.full_like(mean, batch * plane), mean, lo, var])
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, local, group)
        counts, means, los, variances = torch.stack(gathered, dim=1)  # each (ranks, C)
        first = (counts[:, 0] > 0).int().argmax().view(1)  # the first rank with a nonempty batch
        shift = means.index_select(0, first)[0]
        d = means - shift + los
        total = counts.sum(0)
        delta = (counts * d).sum(0) / total
        m2 = (counts * variances).sum(0) + (counts * (d - delta).square()).sum(0)
        rstd = (m2 / total + bn.eps).rsqrt()
        mu = shift.double() + delta.double()  # exact for float32 statistics
        centered = plane_dev + (mean - shift - delta)  # m[b] - mu
        out = centered * rstd
        if weight is not None:
            out = out * weight.to(out.dtype)
        if bias is not None:
            out = out + bias.to(out.dtype)
        if bn.track_running_stats:
            running_mean, running_var = bn.running_mean, bn.running_var
            bn.num_batches_tracked.add_(1)
            factor = (bn.momentum if bn.momentum is not None
                      else bn.num_batches_tracked.to(running_mean.dtype).reciprocal())
            running_mean.mul_(1 - factor).add_(mu.to(running_mean.dtype) * factor)
            running_var.mul_(1 - factor).add_((m2 / (total - 1)).to(running_var.dtype) * factor)
        ctx.save_for_backward(y, weight, centered, rstd, mu, total)
        ctx.scale, ctx.plane, ctx.group = scale, plane, group
        return out.view(batch, channels, 1, 1, 1).to(y.dtype)

    @staticmethod
    @once_differentiable  # (its statistics were saved without a graph: refused, never wrong, twice)
    def backward(ctx, grad_out):
        y, weight, centered, rstd, mu, total = ctx.saved_tensors
        batch, channels = centered.shape
        g = grad_out.reshape(batch, channels).to(centered.dtype)
        local = torch.stack([g.sum(0), (g * centered).sum(0)])  # this rank's G and P
        grad_y = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            sums = local.clone()
            dist.all_reduce(sums, dist.ReduceOp.SUM, ctx.group)
            big_g, p = sums
            gain = ctx.scale * rstd if weight is None else ctx.scale * weight.to(rstd.dtype) * rstd
            k = (gain * rstd.square() * p / total).double()
            term = (gain * (g / ctx.plane - big_g / total)).double() + k * mu
            # computed in float64, written in y's dtype
            grad_y = torch.addcmul(term.view(batch, channels, 1, 1, 1), y, (-ctx.scale * k).view(1, channels, 1, 1, 1),
                                   out=torch.empty_like(y))
        # (autograd casts them to the parameters' dtypes)
        if ctx.needs_input_grad[1]:
            grad_weight = rstd * local[1]
        if ctx.needs_input_grad[2]:
            grad_bias = local[0]
        return grad_y, grad_weight, grad_bias, None, None, None


def sync_batch_norm_gap(y: Tensor, scale, bn: nn.SyncBatchNorm, process_group) -> Tensor:
    """``F.adaptive_avg_pool3d(bn(y * scale), 1)`` for an nn.SyncBatchNorm bn in
    training, with the batch statistics of every rank of process_group (the
    math: this module's docstring): (B, C, 1, 1, 1) in y's dtype. Updates bn's
    running statistics, when it tracks them, as nn.SyncBatchNorm does;
    differentiable in y, bn.weight and bn.bias."""
    return _SyncBatchNormGap.apply(y, bn.weight, bn.bias, scale, bn, process_group)
