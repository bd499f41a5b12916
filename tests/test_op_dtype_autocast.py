"""The forward ops' result dtype (``dtype``: the input's, or its accumulation type) and their
autocast kernels (the input read as it is, the result in float32)."""
import pytest
import torch

import fused_ops
from conftest import make_input

ACCUMULATION = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float32,
                torch.float64: torch.float64}


def batch_norm_gap(x, **kw):
    """batch_norm_gap through batch statistics, with weight and bias in x's accumulation type."""
    params = torch.linspace(0.5, 1.5, 2 * x.shape[1], dtype=ACCUMULATION[x.dtype], device=x.device)
    return fused_ops.batch_norm_gap(x, 1.0, params[::2], params[1::2], training=True, **kw)


# op: (input shape, the wrapper on x, the op's arguments after x for opcheck, save flag and dtype last)
OPS = {
    "avg_pool2d_sigmoid_sum": ((2, 3, 9, 10), lambda x, **kw: fused_ops.avg_pool2d_sigmoid_sum(x, 3, 2, 1, **kw),
                               ([3, 3], [2, 2], [1, 1], False, True, None, True)),
    "max_pool3d_mean": ((2, 3, 6, 7, 8), lambda x, **kw: fused_ops.max_pool3d_mean(x, 2, **kw),
                        ([2, 2, 2], [2, 2, 2], [0, 0, 0], False, 1.0, True)),
    "max_pool3d_cascade_sum": ((2, 3, 12, 13, 12), lambda x, **kw: fused_ops.max_pool3d_cascade_sum(x, 2, 3, **kw),
                               ([2, 2, 2], [2, 2, 2], [0, 0, 0], [3, 3, 3], [3, 3, 3], [0, 0, 0], True)),
    "parity_max_pool3d_mean": ((2, 3, 4, 5, 3, 8), fused_ops.parity_max_pool3d_mean, (True,)),
    "parity_max_pool3d_cascade_sum": ((2, 6, 6, 3, 3, 8),
                                      lambda y, **kw: fused_ops.parity_max_pool3d_cascade_sum(y, 3, **kw),
                                      ([3, 3, 3], True)),
    "batch_norm_gap": ((2, 3, 4, 5, 6), batch_norm_gap, None),
}
HALF_TYPES = [torch.float16, torch.bfloat16]


def half_ids(dtype):
    return str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=half_ids)
@pytest.mark.parametrize("op", OPS)
def test_float32_result_not_rounded(op, dtype, device):
    """dtype=float32 for a 16-bit x: the op's float32 result on x.float() (the same values), with no
    rounding to 16 bits in between; dtype None: x's dtype."""
    shape, fn, _ = OPS[op]
    x = make_input(shape, dtype, device)
    out = fn(x, dtype=torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, fn(x.float()), rtol=1e-6, atol=0)
    assert fn(x).dtype == dtype
    assert fn(x, dtype=dtype).dtype == dtype
    # the 16-bit result is the float32 one rounded
    torch.testing.assert_close(fn(x), out.to(dtype), rtol=0, atol=0)


@pytest.mark.parametrize("op", OPS)
def test_wrong_dtype(op, device):
    shape, fn, _ = OPS[op]
    for x_dtype, wrong in [(torch.bfloat16, torch.float16), (torch.float16, torch.float64),
                           (torch.float32, torch.float64), (torch.float64, torch.float32),
                           (torch.float32, torch.int64)]:
        x = make_input(shape, x_dtype, device)
        with pytest.raises(TypeError, match=f"{op}: dtype must be the input's dtype"):
            fn(x, dtype=wrong)


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=half_ids)
@pytest.mark.parametrize("op", OPS)
def test_backward_of_float32_result(op, dtype, device):
    """The gradient through a float32 result is x's dtype, and is the gradient through the
    16-bit result given the same gradient cast to x's dtype."""
    shape, fn, _ = OPS[op]
    x32 = make_input(shape, dtype, device, requires_grad=True)
    x16 = make_input(shape, dtype, device, requires_grad=True)
    out = fn(x32, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    grad = torch.rand(out.shape, generator=g, dtype=torch.float32).to(device)
    out.backward(grad)
    fn(x16).backward(grad.to(dtype))
    assert x32.grad.dtype == dtype
    torch.testing.assert_close(x32.grad, x16.grad, rtol=0, atol=0)


@pytest.mark.parametrize("op", OPS)
def test_opcheck(op, device):
    shape, _, args = OPS[op]
    overload = getattr(torch.ops.fused_ops, op).default
    x = make_input(shape, torch.bfloat16, device, requires_grad=True)
    if op == "batch_norm_gap":
        weight = torch.linspace(0.5, 1.5, shape[1], device=device, requires_grad=True)
        args = (1.0, weight, torch.rand(shape[1], device=device), None, None, 1e-5)
    torch.library.opcheck(overload, (x, *args, torch.float32))


@pytest.mark.parametrize("x_dtype, result_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                                   (torch.float32, torch.float32), (torch.float64, torch.float64)],
                         ids=["bfloat16", "float16", "float32", "float64"])
@pytest.mark.parametrize("op", OPS)
def test_autocast(op, x_dtype, result_dtype, device):
    """Under autocast the input is read as it is and the result is float32 (float64 input untouched);
    the gradient is in x's dtype, and an explicit dtype is kept."""
    shape, fn, _ = OPS[op]
    x = make_input(shape, x_dtype, device, requires_grad=True)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        out = fn(x)
        kept = fn(x.detach(), dtype=x_dtype)
    assert out.dtype == result_dtype
    assert kept.dtype == x_dtype
    torch.testing.assert_close(out, fn(x.detach(), dtype=result_dtype), rtol=0, atol=0)
    out.sum().backward()
    assert x.grad.dtype == x_dtype


@pytest.mark.parametrize("key", ["AutocastCPU", "AutocastCUDA"])
def test_autocast_kernels_registered(key):
    for op in OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fused_ops::{op}", key), (op, key)
