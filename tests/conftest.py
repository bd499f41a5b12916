import pytest
import torch

import fused_ops  # noqa: F401  (registers the ops)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]

# Relative tolerance of a result in `dtype` against a float64 reference: the
# SPEC's 1e-5 for float32, and a couple of roundings of the output for the
# 16-bit types (their results are accumulated in float32 and rounded once).
RTOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(params=DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def dtype(request):
    return request.param


def poison_cuda_allocator():
    """Fill the CUDA caching allocator's free blocks with NaN, so that an
    output element a kernel fails to write shows up as NaN."""
    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        block = torch.full((min(free // 8, 1 << 28) // 4,), float("nan"), device="cuda")
        del block


def assert_close_to_reference(actual, reference, dtype, what=""):
    """actual (any dtype) against a float64 reference, relative to the
    reference's largest magnitude for low-precision types."""
    actual = actual.double().cpu()
    reference = reference.double().cpu()
    rtol = RTOL[dtype]
    finite = reference[reference.isfinite()]
    scale = finite.abs().max().item() if finite.numel() else 0.0
    torch.testing.assert_close(actual, reference, rtol=rtol, atol=rtol * scale * 1e-2, equal_nan=True, msg=lambda m: f"{what}\n{m}")
