"""The dtypes the original architectures compute in under ``torch.autocast``, so that
the drop-in modules compute their convolutions in the same dtype and return what
the originals return.

Autocast casts a convolution's floating-point inputs (float64 excepted) to its
low-precision dtype; the ops of the tails run in their input's dtype, except
those autocast runs in float32 on that device type (its float32 policy: the
pools on the CPU, ``torch.sum`` on CUDA). Which ops those are is read from the
dispatcher of the running PyTorch (whether the op has an autocast kernel for
the device type: the tails' ops have none under another policy) once, at import.
"""
import torch

# The aten ops of the originals' tails after their convolutions.
TAIL_OPS = ("aten::max_pool3d", "aten::adaptive_avg_pool3d", "aten::avg_pool2d", "aten::sigmoid",
            "aten::sum.dim_IntList", "aten::batch_norm")

_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}

_FLOAT32_OPS = {device_type: frozenset([op for op in TAIL_OPS
                                        if torch._C._dispatch_has_kernel_for_dispatch_key(op, key)])
                for device_type, key in _AUTOCAST_KEYS.items()}

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _enabled(device_type: str) -> bool:
    return device_type in _AUTOCAST_KEYS and torch.is_autocast_enabled(device_type)


def cast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast casts a convolution of x to (its input and parameters), or None
    where it casts nothing: autocast is off for x's device type, or x is float64."""
    device_type = x.device.type
    if _enabled(device_type) and x.dtype in (torch.float32, *_LOW_PRECISION):
        return torch.get_autocast_dtype(device_type)
    return None


def conv_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the original's convolution of x computes in and returns."""
    return cast_dtype(x) or x.dtype


def tail_dtype(dtype: torch.dtype, device_type: str, ops: tuple[str, ...]) -> torch.dtype:
    """The dtype of a `dtype` value after the original's tail ops `ops` (from TAIL_OPS),
    under the current autocast state of `device_type`: float32 from the first op
    autocast runs in float32 on, for a 16-bit value; `dtype` otherwise."""
    if dtype in _LOW_PRECISION and _enabled(device_type) and not _FLOAT32_OPS[device_type].isdisjoint(ops):
        return torch.float32
    return dtype
