"""Drop-in replacements for the architectures of ``fused_ops.reference``.

Each has the original's constructor, parameters, buffers and state_dict keys
(built under the same seed it draws the same initial parameters), and
``from_module(original)`` wraps an existing instance, sharing its parameters.
"""
from torch import Tensor, nn

from .ops import avg_pool2d_sigmoid_sum


def _adopt(cls, original: nn.Module, **submodules: type) -> nn.Module:
    """A `cls` instance that shares `original`'s submodules (no copies)."""
    for name, kind in submodules.items():
        if not isinstance(getattr(original, name, None), kind):
            raise TypeError(
                f"{cls.__name__}.from_module: expected a module with a {kind.__name__} "
                f"attribute '{name}', got {type(original).__name__}"
            )
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    for name in submodules:
        setattr(module, name, getattr(original, name))
    module.train(original.training)
    return module


class Conv2dAvgPoolSigmoidSum(nn.Module):
    """conv2d -> avg_pool2d -> sigmoid -> sum over (C, H, W), the tail fused into
    one kernel (``fused_ops.avg_pool2d_sigmoid_sum``)."""

    def __init__(self, in_channels, out_channels, kernel_size, pool_kernel_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.avg_pool = nn.AvgPool2d(pool_kernel_size)

    @classmethod
    def from_module(cls, original: nn.Module) -> "Conv2dAvgPoolSigmoidSum":
        return _adopt(cls, original, conv=nn.Conv2d, avg_pool=nn.AvgPool2d)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4:
            raise ValueError(
                f"{type(self).__name__}: expected a 4-D input (batch, channels, height, width), "
                f"got {x.dim()}-D input of shape {tuple(x.shape)}"
            )
        pool = self.avg_pool
        return avg_pool2d_sigmoid_sum(
            self.conv(x),
            pool.kernel_size,
            pool.stride,
            pool.padding,
            pool.ceil_mode,
            pool.count_include_pad,
            pool.divisor_override,
        )
