"""fused_ops.conv_transpose3d_batch_norm_eval_mean (architecture D's eval forward: the spatial mean of
batch_norm(scale * conv_transpose3d(x)) with running statistics, for a transposed convolution without
padding) against PyTorch's ops in float64, every dtype, with and without the optional tensors, integer-
valued data, non-finite values, bad input, opcheck; and D's module taking it in eval mode, seeing
its parameters and statistics as they are on each call.

  out[n, o] = (scale * (bias[o] + sum_i s[n, i] sum_t w[i, o, t] / |out|) - running_mean[o])
              * gamma[o] / sqrt(running_var[o] + eps) + beta[o],   s = x's spatial sums"""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import DTYPES, RTOL, build_pair, cuda_kernel_names, poison_cuda_allocator
from fused_ops import autotune, conv_transpose3d_batch_norm_eval_mean

OP = torch.ops.fused_ops.conv_transpose3d_batch_norm_eval_mean.default

# (batch, C_in, C_out, x's (D, H, W), kernel, stride, output_padding)
GEOMETRIES = {"spec-like": (2, 8, 6, (3, 4, 5), (5, 5, 5), (1, 1, 1), (0, 0, 0)),
              "strided": (3, 3, 5, (4, 3, 2), (2, 3, 4), (2, 1, 3), (1, 0, 2)),
              "one": (1, 1, 1, (1, 1, 1), (1, 1, 1), (1, 1, 1), (0, 0, 0)),
              # (planes of 18000 elements: two of the CUDA kernel's chunks of 16384 each)
              "two-chunks": (2, 3, 4, (20, 30, 30), (2, 2, 2), (1, 1, 1), (0, 0, 0))}


def case(geometry, dtype, device, affine=True, bias=True, integers=False, seed=0):
    batch, c_in, c_out, size, kernel = geometry[:5]
    g = torch.Generator().manual_seed(seed)
    draw = ((lambda *s: torch.randint(-3, 4, s, generator=g).double()) if integers
            else (lambda *s: torch.rand(s, generator=g, dtype=torch.float64) - 0.5))
    x = draw(batch, c_in, *size) + (0 if integers else 0.5)
    tensors = dict(weight=draw(c_in, c_out, *kernel), bias=draw(c_out) if bias else None,
                   bn_weight=draw(c_out) if affine else None, bn_bias=draw(c_out) if affine else None,
                   running_mean=draw(c_out), running_var=draw(c_out).abs() + 0.5)
    param_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    moved = {k: None if v is None else v.to(device, dtype if k in ("weight", "bias") else param_dtype)
             for k, v in tensors.items()}
    return x.to(device, dtype), moved


def reference(x, t, geometry, scale, eps):
    """PyTorch's ops in float64 on the CPU."""
    d = {k: None if v is None else v.double().cpu() for k, v in t.items()}
    y = F.conv_transpose3d(x.double().cpu(), d["weight"], d["bias"], geometry[5], 0, geometry[6]) * scale
    y = F.batch_norm(y, d["running_mean"], d["running_var"], d["bn_weight"], d["bn_bias"], False, 0.0, eps)
    return y.mean(dim=(2, 3, 4))


def call(x, t, geometry, scale=2.0, eps=1e-3, dtype=None):
    return conv_transpose3d_batch_norm_eval_mean(x, t["weight"], t["bias"], t["bn_weight"], t["bn_bias"],
                                                 t["running_mean"], t["running_var"], geometry[5], geometry[6],
                                                 scale, eps, dtype=dtype)


@pytest.mark.parametrize("optional", ["all", "no-affine", "no-bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("geometry", list(GEOMETRIES.values()), ids=list(GEOMETRIES))
def test_against_pytorch(geometry, dtype, optional, device):
    """Random data, normwise within the dtype's tolerance of the float64 ops on the operands as given;
    the result in x's dtype, or its accumulation type where asked; on a GPU, two kernels (x's sums in
    chunks with the tap sums, then the map) and nothing else."""
    x, t = case(geometry, dtype, device, affine=optional != "no-affine", bias=optional != "no-bias")
    poison_cuda_allocator()
    out = call(x, t, geometry)
    expected = reference(x, t, geometry, 2.0, 1e-3)
    assert out.shape == expected.shape and out.dtype == dtype and out.device == x.device
    error = ((out.double().cpu() - expected).abs().max() / expected.abs().max()).item()
    assert error <= RTOL[dtype], f"normwise error {error:.3g}"
    if dtype in (torch.float16, torch.bfloat16):
        wide = call(x, t, geometry, dtype=torch.float32)
        assert wide.dtype == torch.float32 and torch.equal(wide.to(dtype), out)
    if device == "cuda":
        names = cuda_kernel_names(lambda: call(x, t, geometry))
        assert (len(names) == 2 and "chunk_and_tap_sums_kernel" in names[0]
                and "batch_norm_eval_mean_kernel" in names[1]), names


@pytest.mark.parametrize("geometry", list(GEOMETRIES.values()), ids=list(GEOMETRIES))
def test_integers_exact(geometry, device):
    """Integer-valued float64 data, scale and eps powers of two: the float64 result to rounding."""
    x, t = case(geometry, torch.float64, device, integers=True)
    t["running_var"] = t["running_var"].abs() * 0 + 3.75
    out = call(x, t, geometry, scale=0.5, eps=0.25)
    torch.testing.assert_close(out.cpu(), reference(x, t, geometry, 0.5, 0.25), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("name,where", [("spec-like", (1, 2, 1, 2, 3)), ("two-chunks", (1, 2, 19, 29, 29))],
                         ids=["spec-like", "second-chunk"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite(value, name, where, device):
    """A non-finite x gives the batch element's every output non-finite as PyTorch's ops do (NaN where
    they mix infinities of both signs through the weight's signs); one in a statistic, that channel's."""
    geometry = GEOMETRIES[name]
    x, t = case(geometry, torch.float64, device)
    x[where] = value
    t["running_mean"][geometry[2] - 2] = value
    out, expected = call(x, t, geometry), reference(x, t, geometry, 2.0, 1e-3)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-12, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("value", [float("inf"), -float("inf")])
def test_tap_signs(value, device):
    """An infinite x met through rows of taps all positive, all negative, of mixed signs or with a zero
    tap: each output's infinity or NaN as PyTorch's ops give it; 45 (input, output channel) rows of 36 taps
    (more rows than one block of the CUDA kernel sums, more taps than a warp has lanes)."""
    geometry = (2, 5, 9, (2, 3, 2), (3, 3, 4), (1, 1, 1), (0, 0, 0))
    x, t = case(geometry, torch.float64, device)
    w = t["weight"].abs() + 0.1  # o = 0, 4, 8: every tap positive
    w[:, 1::4] *= -1  # o = 1, 5: every tap negative
    w[:, 2::4, 0, 0, 0] *= -1  # o = 2, 6: mixed
    w[:, 3::4, 1, 1, 1] = 0  # o = 3, 7: a zero tap
    t["weight"] = w
    x[0, 1, 1, 2, 0] = value
    x[1, 3, 0, 0, 1] = x[1, 2, 1, 0, 1] = -value  # (two of one sign in one batch element)
    out, expected = call(x, t, geometry), reference(x, t, geometry, 2.0, 1e-3)
    assert expected.isinf().sum() == 10 and expected.isnan().sum() == 8
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-12, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("layout", ["channels_last", "sliced"])
def test_x_not_contiguous(layout, device):
    """x channels last or a slice of a larger tensor: the same results as contiguous (on a GPU its
    spatial sums by PyTorch's reduction, then the tap sums and the map)."""
    geometry = GEOMETRIES["two-chunks"]
    x, t = case(geometry, torch.float32, device)
    strided = (x.contiguous(memory_format=torch.channels_last_3d) if layout == "channels_last"
               else torch.cat([x, x], dim=4)[..., :x.shape[4]])
    assert not strided.is_contiguous()
    torch.testing.assert_close(call(strided, t, geometry), call(x, t, geometry), rtol=1e-5, atol=1e-6)
    if device == "cuda":
        names = cuda_kernel_names(lambda: call(strided, t, geometry))
        assert "chunk_and_tap_sums_kernel" in names[-2] and "batch_norm_eval_mean_kernel" in names[-1], names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("geometry", ["two-chunks", "spec-like"])  # (planes of 18000 and 60 elements)
def test_x_misaligned(geometry, dtype, device):
    """x contiguous but off a 16-byte boundary (a view at an odd offset): the same result, bit for bit, as an
    aligned copy's (on a GPU its sums read element by element rather than in vectors, in the same order;
    a plane of 60 cuts the last group of 8 that a thread adds)."""
    geometry = GEOMETRIES[geometry]
    x, t = case(geometry, dtype, device)
    shifted = torch.empty(x.numel() + 1, dtype=dtype, device=device)[1:].view(x.shape).copy_(x)
    assert shifted.is_contiguous() and shifted.data_ptr() % 16 != 0
    assert torch.equal(call(shifted, t, geometry), call(x, t, geometry))


def test_opcheck(device):
    for geometry in GEOMETRIES.values():
        for dtype in (torch.float32, torch.bfloat16):
            x, t = case(geometry, dtype, device)
            torch.library.opcheck(OP, (x, t["weight"], t["bias"], t["bn_weight"], t["bn_bias"], t["running_mean"],
                                       t["running_var"], list(geometry[5]), list(geometry[6]), 2.0, 1e-5, None))


def test_bad_input_raises_clearly(device):
    geometry = GEOMETRIES["spec-like"]
    x, t = case(geometry, torch.float32, device)
    with pytest.raises(ValueError, match="x must be 5-D"):
        call(x[0], t, geometry)
    with pytest.raises(TypeError, match="must have x's dtype"):
        call(x, dict(t, weight=t["weight"].double()), geometry)
    with pytest.raises(ValueError, match="channels"):
        call(x[:, :3], t, geometry)
    with pytest.raises(ValueError, match="running_var must be 1-D with one element per channel"):
        call(x, dict(t, running_var=t["running_var"][:3]), geometry)
    with pytest.raises(TypeError, match="bias must have the weight's dtype"):
        call(x, dict(t, bias=t["bias"].double()), geometry)
    with pytest.raises(ValueError, match=r"output_padding in \[0, stride\)"):
        call(x, t, (*geometry[:5], (1, 1, 1), (1, 0, 0)))
    with pytest.raises(TypeError, match="running_mean must be a Tensor"):
        call(x, dict(t, running_mean=[0.0]), geometry)
    for scale in (math.inf, -math.inf, math.nan):
        with pytest.raises(ValueError, match="scale must be finite"):
            call(x, t, geometry, scale=scale)
    if device == "cuda":
        with pytest.raises(ValueError, match="running_mean must be on the same device"):
            call(x, dict(t, running_mean=t["running_mean"].cpu()), geometry)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_d_module_in_eval_takes_it(dtype, device):
    """D's drop-in in eval mode without autograd takes the op (its rewrite), the original's output, and
    reads the parameters and statistics as they are on each call (changed through .data too)."""
    original, fused = build_pair("ConvTranspose3dScaleBatchNormGAP", (3, 4, 3, 2.0))
    original.to(device, dtype).eval()
    fused.to(device, dtype).eval()
    fused.load_state_dict(original.state_dict())
    x = torch.rand(2, 3, 4, 5, 6, dtype=dtype, device=device)
    tolerance = dict(rtol=1e-9, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    with torch.no_grad(), autotune.force("rewrite"):
        for _ in range(3):
            torch.testing.assert_close(fused(x), original(x), **tolerance)
            assert autotune.last_formulation() == "rewrite"
            for p in fused.state_dict().values():
                if p.is_floating_point():
                    p.data.mul_(0.75).add_(0.125)
            original.load_state_dict(fused.state_dict())
