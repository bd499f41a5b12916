"""Models written without fused_ops in mind that hold the architectures' chains and tails
(test_fuse.py, test_compile_patterns.py), their inputs, and the check of a fused model's step
against the original's."""
import torch
import torch.nn.functional as F
from torch import nn


class Network(nn.Module):
    """The four chains after a shared stem, each spelled another way than fused_ops.reference."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv3d(3, 8, 1)
        self.a_conv = nn.Conv3d(8, 16, 3)
        self.a_offset = nn.Parameter(torch.randn(16, 1, 1, 1))
        self.up = nn.ConvTranspose3d(8, 4, 5, stride=2, padding=2)
        self.pools = nn.Sequential(nn.MaxPool3d(2), nn.MaxPool3d(3))
        self.head2d = nn.Sequential(nn.Conv2d(3, 8, 3), nn.AvgPool2d(2), nn.Sigmoid())
        self.d_up = nn.ConvTranspose3d(8, 6, 3)
        self.d_norm = nn.BatchNorm3d(6)

    def forward(self, x, image):
        h = torch.relu(self.stem(x))
        a = F.max_pool3d(torch.div(self.a_conv(h), -1.5), 2).mean((2, 3, 4), keepdim=True)
        a = (a + self.a_offset).sum(dim=1)
        b = self.pools(self.up(h)).sum(1, keepdim=True)
        c = self.head2d(image).sum(dim=(1, 2, 3))
        d = F.adaptive_avg_pool3d(self.d_norm(self.d_up(h) * 2.0), 1)
        return a, b, c, d


def inputs(device, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return (torch.rand(2, 3, 8, 10, 12, generator=g, dtype=dtype).to(device),
            torch.rand(2, 3, 13, 14, generator=g, dtype=dtype).to(device))


def check_step(model, original, outputs, args, train):
    """The fused model's outputs (given) equal original(*args)'s in float64, and so do `model`'s
    buffers (the running statistics a training step updates); where train, after a backward of a
    weighted sum of each, `model`'s parameters' gradients (the fused model's) equal original's."""
    expected = original(*args)
    for (name, buffer), ref in zip(model.named_buffers(), original.buffers(), strict=True):
        torch.testing.assert_close(buffer, ref, rtol=1e-12, atol=1e-14, msg=name)
    for out, ref in zip(outputs, expected, strict=True):
        assert out.shape == ref.shape and out.dtype == ref.dtype
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    if train:
        sum(o.sum() * (i + 1) for i, o in enumerate(outputs)).backward()
        sum(e.sum() * (i + 1) for i, e in enumerate(expected)).backward()
        for (name, p), q in zip(model.named_parameters(), original.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


class Tails(nn.Module):
    """The tails without their chains' convolutions: after other producers, after a convolution
    whose result is used again, with a dilated pool (the traced ops run) and a 2-D input."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(3, 6, 3)
        self.strided = nn.Conv2d(3, 5, 3, stride=2)
        self.pool = nn.MaxPool3d(2)
        self.dilated = nn.MaxPool3d(2, dilation=2)
        self.norm = nn.BatchNorm3d(6, momentum=0.3)

    def forward(self, x, image):
        h = self.conv(x)
        d = F.adaptive_avg_pool3d(self.norm(1.5 * torch.relu(h)), 1)             # D-tail, the number first
        a = F.adaptive_avg_pool3d(self.pool(h / 2.0), 1)                           # A-tail, h used again
        a2 = self.dilated(torch.relu(h)).mean((2, 3, 4), keepdim=True)           # A-tail, dilated: traced ops
        b = F.max_pool3d(F.max_pool3d(torch.relu(h), 2), 2, stride=1).sum(1, keepdim=True)  # B-tail
        c = torch.sigmoid(F.avg_pool2d(torch.relu(self.strided(image)), 3, stride=2, padding=1)).sum(dim=(1, 2, 3))
        return a, a2, b, c, d, h.sum()


def tails_inputs(device, dtype=torch.float64):
    g = torch.Generator().manual_seed(6)
    return (torch.rand(2, 3, 9, 11, 12, generator=g, dtype=dtype).to(device),
            torch.rand(2, 3, 15, 17, generator=g, dtype=dtype).to(device))


class InPlace(nn.Module):
    """C's chain with its input written in place between the convolution and the tail, a second
    chain reading that input after the write, and a buffer neither reads."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        z = self.conv(x)
        x.view(-1).mul_(2.0)
        c = torch.sigmoid(F.avg_pool2d(z, 2)).sum((1, 2, 3))
        y = self.conv(x)
        self.count.add_(1)
        return c, torch.sigmoid(F.avg_pool2d(y, 2)).sum((1, 2, 3))
