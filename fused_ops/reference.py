"""The original architectures, in plain PyTorch eager (../SPEC.md): the reference
semantics the fused drop-in modules of ``fused_ops.nn`` reproduce."""
import torch
from torch import nn


class Conv2dAvgPoolSigmoidSum(nn.Module):
    """Architecture C: conv2d -> avg_pool2d -> sigmoid -> sum over (C, H, W)."""

    def __init__(self, in_channels, out_channels, kernel_size, pool_kernel_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.avg_pool = nn.AvgPool2d(pool_kernel_size)

    def forward(self, x):
        x = self.conv(x)
        x = self.avg_pool(x)
        x = torch.sigmoid(x)
        return torch.sum(x, dim=[1, 2, 3])
