import contextlib
import functools
import importlib.machinery
import importlib.util
import os

import pytest
import torch

import fused_ops  # noqa: F401  (registers the ops)
from fused_ops import autotune
from fused_ops import nn as fnn
from fused_ops import reference

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]

# Relative tolerance of a result in `dtype` against a float64 reference: the
# SPEC's 1e-5 for float32, and a couple of roundings of the output for the
# 16-bit types (their results are accumulated in float32 and rounded once).
RTOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
requires_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                   reason="the CUTLASS kernels run on sm_90 devices")


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def full_float32_convolutions():
    """Convolutions in full float32 (TF32 off, the other cuDNN settings kept), so
    that float32 results compare at float32's tolerances; the TF32 tests turn it
    on themselves (test_rewrites.py)."""
    cudnn = torch.backends.cudnn
    with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic,
                     allow_tf32=False):
        yield


@pytest.fixture(autouse=True)
def spawned_processes_import_this_fused_ops():
    """After each test, a spawned process (test_distributed.py's ranks; they get this sys.path) still finds
    the fused_ops these tests import: a test that left ./fused_ops (the sources, without the built _C) ahead
    of the installed package on sys.path fails here, and not a later test's processes."""
    yield
    spec = importlib.machinery.PathFinder.find_spec("fused_ops")
    assert spec is not None and spec.origin == fused_ops.__file__, (
        f"sys.path now finds fused_ops at {spec and spec.origin}, not the imported {fused_ops.__file__}")


@pytest.fixture
def tf32():
    """TF32 convolutions allowed (PyTorch's default; full_float32_convolutions turns them off): the
    condition of the fused convolution kernels' TF32 paths."""
    cudnn = torch.backends.cudnn
    with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic,
                     allow_tf32=True):
        yield


def misaligned(t, order):
    """t's values in a tensor whose memory is t permuted by `order`, starting one element past an
    aligned address."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:]
    return flat.view([t.shape[d] for d in order]).permute([order.index(d) for d in range(t.dim())]).copy_(t)


@pytest.fixture(autouse=True)
def rule_formulations():
    """The modules take their rules' formulations (fused_ops.autotune), so that each test
    checks the formulation it means to; test_formulations.py forces each of the others and
    tests the autotuner."""
    enabled = autotune.is_enabled()
    autotune.set_enabled(False)
    yield
    autotune.set_enabled(enabled)
    autotune.clear()


@pytest.fixture(autouse=True)
def fresh_compile_state():
    """Each test compiles from a clean torch.compile state: compiling the same module class
    with other shapes in an earlier test would make later compiles dynamic in shape."""
    yield
    torch._dynamo.reset()


@pytest.fixture(params=DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def dtype(request):
    return request.param


@functools.cache
def built_with_cutlass() -> bool:
    """Whether this build has the CUDA kernels that need CUTLASS's headers (setup.py found them): B's
    cascade op says so of itself on a GPU (its path ends in "(built without CUTLASS)" where not)."""
    from fused_ops.ops import conv_transpose3d_cascade_sum_path

    # (B's geometry, stride 2, padding 2, kernel 5: y 7 along each dim, one second-stage cell)
    x, weight = torch.zeros(1, 32, 4, 4, 4, device="cuda"), torch.zeros(32, 64, 5, 5, 5, device="cuda")
    return not conv_transpose3d_cascade_sum_path(x, weight, 2, 2).endswith("(built without CUTLASS)")


def cuda_kernel_names(call) -> list:
    """The names of what call() ran on the GPU (kernels, copies), by the profiler: its events on the
    device only (it also lists the host's runtime calls, cudaLaunchKernel, and its own overheads)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@contextlib.contextmanager
def matmul_precision(precision):
    """torch.set_float32_matmul_precision(precision) within the block."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def make_convolution_case(x_shape, w_shape, bias, dtype, device, seed=0, integers=False):
    """x, a weight and (where `bias`) a bias for a fused convolution's tests. integers: x in
    {-2..2}, the weight in eighths of {-1, 0, 1}, the bias in eighths of {-4..4}: every product
    and float32 sum exact, in TF32 and 16 bits too, so every path gives PyTorch's float64 result;
    else x uniform in [0, 1), the weight in [-1/8, 1/8), the bias in [-1/2, 1/2)."""
    g = torch.Generator().manual_seed(seed)
    if integers:
        x = torch.randint(-2, 3, x_shape, generator=g).to(dtype)
        w = torch.randint(-1, 2, w_shape, generator=g).to(dtype) / 8
        b = torch.randint(-4, 5, (w_shape[0],), generator=g).to(dtype) / 8
    else:
        x = torch.rand(x_shape, generator=g, dtype=torch.float64).to(dtype)
        w = ((torch.rand(w_shape, generator=g, dtype=torch.float64) - 0.5) / 4).to(dtype)
        b = (torch.rand(w_shape[0], generator=g, dtype=torch.float64) - 0.5).to(dtype)
    return x.to(device), w.to(device), (b.to(device) if bias else None)


def poison_cuda_allocator():
    """Fill the CUDA caching allocator's free blocks with NaN, so that an
    output element a kernel fails to write shows up as NaN."""
    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        block = torch.full((min(free // 8, 1 << 28) // 4,), float("nan"), device="cuda")
        del block


def assert_close_to_reference(actual, reference, dtype, what="", normwise=False, magnitude=0.0):
    """actual (any dtype) against a float64 reference, relative to the
    reference's largest magnitude for low-precision types. normwise: every
    element within rtol of the reference's largest magnitude, or of
    `magnitude` where that is larger: for results that are differences of
    nearly equal sums (a plane's mean minus its channel's mean, say), whose
    rounding errors scale with the terms that cancel and not with the result."""
    actual = actual.double().cpu()
    reference = reference.double().cpu()
    rtol = RTOL[dtype]
    finite = reference[reference.isfinite()]
    scale = finite.abs().max().item() if finite.numel() else 0.0
    atol = rtol * max(scale, magnitude) if normwise else rtol * scale * 1e-2
    # (plus half the spacing of the dtype's subnormal numbers: a result below its smallest normal
    # number, a float16 gradient of a mean over many elements say, is rounded to that grid)
    atol += torch.finfo(dtype).tiny * torch.finfo(dtype).eps / 2
    torch.testing.assert_close(actual, reference, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{what}\n{m}")


# --------------------------------------------------------------------------
# Drop-in modules (fused_ops.nn) against their originals (fused_ops.reference)
# --------------------------------------------------------------------------


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def repo_script(folder: str, name: str, monkeypatch):
    """<folder>/<name>.py (bench/, tools/) as a module, its own imports found as when it runs as a script:
    its folder on the path through monkeypatch, which restores the whole sys.path after the test (a path a
    script adds itself, the repository's root say, included)."""
    monkeypatch.syspath_prepend(os.path.join(REPO, folder))
    spec = importlib.util.spec_from_file_location(f"{folder}_{name}", os.path.join(REPO, folder, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_pair(name, args, seed=0):
    """The original architecture `name` and its drop-in, each built under the same seed."""
    torch.manual_seed(seed)
    original = getattr(reference, name)(*args)
    torch.manual_seed(seed)
    fused = getattr(fnn, name)(*args)
    return original, fused


def check_same_init(name, args, keys):
    """Built under the same seed, the drop-in has the original's state_dict
    (keys `keys`, equal values) and draws as much from the generator."""
    original, fused = build_pair(name, args)
    a, b = original.state_dict(), fused.state_dict()
    assert list(a) == list(b) == keys
    for k in a:
        assert torch.equal(a[k], b[k])
    after_fused = torch.rand(3)
    torch.manual_seed(0)
    getattr(reference, name)(*args)
    assert torch.equal(after_fused, torch.rand(3))


def check_state_dict_both_ways(name, args):
    original, fused = build_pair(name, args, seed=1)
    other = getattr(fnn, name)(*args)
    other.load_state_dict(original.state_dict(), strict=True)
    original.load_state_dict(fused.state_dict(), strict=True)
    for a, b in zip(other.state_dict().values(), original.state_dict().values()):
        assert torch.equal(a, b)


def check_matches_original(original, fused, x, dtype, normwise=False, magnitude=0.0):
    """Output (shape, dtype, device, values) and the gradients of the input and
    of every parameter. normwise: assert_close_to_reference's, the output's
    with `magnitude`, and the parameters' gradients as one vector (a gradient
    that cancels to 0, as a conv bias's before a batch norm in training, at
    the scale of the others)."""
    x_ref = x.clone().requires_grad_()
    x = x.clone().requires_grad_()
    out, ref = fused(x), original(x_ref)
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.device == ref.device
    assert_close_to_reference(out, ref, dtype, normwise=normwise, magnitude=magnitude)
    grad = torch.rand_like(ref)
    out.backward(grad)
    ref.backward(grad)
    assert_close_to_reference(x.grad, x_ref.grad, dtype, "grad input", normwise=normwise)
    largest = max(q.grad.abs().max().item() for q in original.parameters()) if normwise else 0.0
    for (name, p), q in zip(fused.named_parameters(), original.parameters()):
        assert_close_to_reference(p.grad, q.grad, dtype, f"grad {name}", normwise=normwise, magnitude=largest)


def check_drop_in(name, args, input_shape, dtype, device, train=True, normwise=False):
    """The drop-in against the original, both built under the same seed, on a
    random input of `input_shape` (check_matches_original)."""
    original, fused = build_pair(name, args)
    original.to(device, dtype).train(train)
    fused.to(device, dtype).train(train)
    x = torch.rand(input_shape, dtype=dtype, device=device)
    check_matches_original(original, fused, x, dtype, normwise)


def check_from_module(name, args, members):
    """from_module wraps an original (in eval mode), sharing its `members`
    (the same objects) and every parameter; another kind of module is refused."""
    original = getattr(reference, name)(*args).eval()
    fused = getattr(fnn, name).from_module(original)
    for member in members:
        assert getattr(fused, member) is getattr(original, member), member
    assert not fused.training
    assert [p.data_ptr() for p in fused.parameters()] == [p.data_ptr() for p in original.parameters()]
    with pytest.raises(TypeError, match="from_module: expected a module with a"):
        getattr(fnn, name).from_module(torch.nn.Sequential())


def make_input(shape, dtype, device, seed=0, requires_grad=False):
    """torch.rand values (drawn in float64 on the CPU, so every dtype and device
    sees the same numbers) in dtype on device."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(shape, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)
    return x.requires_grad_(requires_grad)


def exact_pair(x, fused, ref):
    """(fused(x), ref(x)) and their gradients w.r.t. x, for one integer-valued grad_out
    (x's dtype and device), so that pooling gradients that only route it are exact."""
    a = x.detach().clone().requires_grad_()
    b = x.detach().clone().requires_grad_()
    out, expected = fused(a), ref(b)
    g = torch.Generator().manual_seed(3)
    grad = torch.randint(1, 4, expected.shape, generator=g).to(dtype=x.dtype, device=x.device)
    out.backward(grad)
    expected.backward(grad)
    return out, expected, a.grad, b.grad


LAYOUTS_5D = ["channels_last_3d", "transposed", "sliced", "misaligned", "expanded"]


def grad_memory_format(x):
    """The memory format the fused ops write a 5-D input's gradient in: channels_last_3d on the CPU
    for an x in that layout (and not plainly contiguous), as PyTorch's max_pool3d backward returns
    its input's format; contiguous otherwise (and on CUDA)."""
    if x.device.type == "cpu" and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def in_layout_5d(base, layout, sliced=(slice(None), slice(1, 4), slice(1, None), slice(None), slice(None, None, 2))):
    """base (B, C, D, H, W) in one of LAYOUTS_5D, the strides the ops must read
    in place; `sliced` is the view the "sliced" layout takes."""
    if layout == "channels_last_3d":
        return base.to(memory_format=torch.channels_last_3d)
    if layout == "transposed":
        return base.transpose(3, 4)
    if layout == "sliced":
        return base[sliced]
    if layout == "misaligned":  # contiguous, but the data starts one element past an aligned address
        return torch.empty(base.numel() + 1, dtype=base.dtype, device=base.device)[1:].view(base.shape).copy_(base)
    assert layout == "expanded", layout  # one channel repeated: stride 0
    return base[:, :1].expand(base.shape)
