"""The four architectures of ``fused_ops.reference`` (SPEC.md A to D): their
default constructor arguments and input shapes at three sizes.

- ``spec``: SPEC's default sizes (the default on a GPU);
- ``reduced``: the same models on smaller inputs, which a 2-core CPU runs in
  tens of milliseconds a call (the default on a CPU): a batch of 1 or 2 (2 for
  D, whose training output is its batch norm's bias for a batch of one), and
  half SPEC's spatial size for B and D, whose whole one would take a CPU over
  0.1 s a call;
- ``tiny``: the smallest inputs the models accept comfortably, for smoke tests.

The models themselves (channels, kernels, pools) are SPEC's at every size.
"""
from dataclasses import dataclass

from torch import nn

from . import nn as fused_nn
from . import reference

SIZES = ("spec", "reduced", "tiny")


@dataclass(frozen=True)
class Architecture:
    letter: str
    name: str  # the class in fused_ops.reference and fused_ops.nn
    args: tuple  # SPEC's default constructor arguments
    input_shapes: dict[str, tuple[int, ...]]  # (batch, channels, *spatial) by size

    def build_original(self) -> nn.Module:
        return getattr(reference, self.name)(*self.args)

    def fused_from(self, original: nn.Module) -> nn.Module:
        """The fused drop-in around `original`, sharing its parameters and buffers."""
        return getattr(fused_nn, self.name).from_module(original)

    def input_shape(self, size: str, batch: int | None = None) -> tuple[int, ...]:
        shape = self.input_shapes[size]
        return shape if batch is None else (batch, *shape[1:])


ARCHITECTURES = (
    Architecture("A", "Conv3dDivMaxPoolGAPBiasSum", (8, 16, 3, 2.0, 2, (16, 1, 1, 1), 1),
                 {"spec": (128, 8, 16, 64, 64), "reduced": (2, 8, 16, 64, 64), "tiny": (1, 8, 4, 8, 8)}),
    Architecture("B", "ConvTranspose3dMaxPoolMaxPoolSum", (32, 64, 5, 2, 2),
                 {"spec": (16, 32, 32, 32, 32), "reduced": (1, 32, 16, 16, 16), "tiny": (1, 32, 4, 4, 4)}),
    Architecture("C", "Conv2dAvgPoolSigmoidSum", (8, 64, 3, 4),
                 {"spec": (128, 8, 384, 384), "reduced": (1, 8, 384, 384), "tiny": (1, 8, 10, 10)}),
    Architecture("D", "ConvTranspose3dScaleBatchNormGAP", (64, 128, 5, 2.0),
                 {"spec": (16, 64, 16, 32, 32), "reduced": (2, 64, 8, 16, 16), "tiny": (2, 64, 2, 4, 4)}),
)
