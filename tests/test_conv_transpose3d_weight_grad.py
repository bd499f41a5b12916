"""fused_ops.conv_transpose3d_weight_grad (the weight gradient of a stride-1, unpadded transposed
convolution: CUTLASS's Hopper kernels on an sm_90 GPU, aten.convolution_backward elsewhere) against
the float64 weight gradient, and D's rewrite, whose backward takes it on a GPU, against the original.

  grad_w[i, o, t, r, s] = sum over n, z, h, w of x[n, i, z, h, w] * grad_y[n, o, z + t, h + r, w + s]

Each result normwise within its dtype's tolerance of the float64 one, max |got - exact| / max |exact|
(the reference sums 16-bit inputs as they are): conftest's RTOL; TF32 (on a GPU) 2e-3, the README's for
TF32 convolutions (each operand truncated to a 10-bit mantissa: ~1e-3 of the sums; measured 6e-4 at
SPEC's size)."""
import pytest
import torch

from conftest import DEVICES, RTOL, build_pair, misaligned, requires_cuda, requires_sm90
from fused_ops import autotune, conv_transpose3d_weight_grad, rewrites
from fused_ops.ops import conv_transpose3d_weight_grad_path

OP = torch.ops.fused_ops.conv_transpose3d_weight_grad.default
BY_ATEN = "aten.convolution_backward"

# (batch, C_in, C_out, x's (D, H, W), kernel)
ODD = (3, 5, 7, (4, 6, 5), (2, 3, 4))
BATCH_1 = (1, 4, 6, (3, 4, 5), (3, 3, 3))
ONE_TAP = (2, 3, 2, (2, 3, 4), (1, 1, 1))
# SPEC-like (D's 5-tap depth kernel, channels multiples of 16, D * N a multiple of 32): the CUTLASS paths on an
# sm_90 GPU, TF32 (128 x 64 tiles, no split) and bfloat16
SPEC_LIKE = (4, 16, 64, (8, 6, 10), (5, 3, 4))
GEOMETRIES = [ODD, BATCH_1, ONE_TAP, SPEC_LIKE]
IDS = ["odd", "batch1", "1x1x1", "spec-like"]


def case(geometry, dtype=torch.float64, device="cpu", seed=0):
    """grad_y and x for a geometry: x uniform in [0, 1), grad_y in [-1/2, 1/2), drawn in float64."""
    batch, c_in, c_out, size, kernel = geometry
    g = torch.Generator().manual_seed(seed)
    x = torch.rand((batch, c_in, *size), generator=g, dtype=torch.float64)
    grad_y = torch.rand((batch, c_out, *[s + k - 1 for s, k in zip(size, kernel)]), generator=g,
                        dtype=torch.float64) - 0.5
    return grad_y.to(device, dtype), x.to(device, dtype)


def reference(grad_y, x, kernel):
    """PyTorch's weight gradient of conv_transpose3d(x, w) in float64 on the CPU."""
    w = torch.empty(x.shape[1], grad_y.shape[1], *kernel, dtype=torch.float64)
    return torch.ops.aten.convolution_backward(grad_y.double().cpu(), x.double().cpu(), w, None, [1, 1, 1], [0, 0, 0],
                                               [1, 1, 1], True, [0, 0, 0], 1, [False, True, False])[1]


TF32_RTOL = 2e-3


def check(actual, grad_y, x, kernel, dtype, tf32=False, what=""):
    """actual (x's dtype, contiguous, on x's device) normwise within dtype's tolerance (module
    docstring) of the float64 gradient of grad_y and x as given (16-bit values included)."""
    assert actual.dtype == x.dtype and actual.device == x.device and actual.is_contiguous(), what
    assert actual.shape == (x.shape[1], grad_y.shape[1], *kernel), what
    expected = reference(grad_y, x, kernel)
    error = ((actual.double().cpu() - expected).abs().max() / expected.abs().max()).item()
    assert error <= (TF32_RTOL if tf32 else RTOL[dtype]), f"{what}: normwise error {error:.3g}"



def test_the_definition():
    """The CPU op and the reference are the sum over taps that defines the weight gradient."""
    grad_y, x = case(ODD)
    kernel = ODD[4]
    size = x.shape[2:]
    direct = torch.stack([torch.einsum("nizhw,nozhw->io", x, grad_y[:, :, t:t + size[0], r:r + size[1], s:s + size[2]])
                          for t in range(kernel[0]) for r in range(kernel[1]) for s in range(kernel[2])], dim=-1)
    direct = direct.view(x.shape[1], grad_y.shape[1], *kernel)
    torch.testing.assert_close(reference(grad_y, x, kernel), direct, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(conv_transpose3d_weight_grad(grad_y, x, kernel), direct, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_float64(geometry, device):
    grad_y, x = case(geometry, device=device)
    check(conv_transpose3d_weight_grad(grad_y, x, geometry[4]), grad_y, x, geometry[4], torch.float64)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_float32_without_tf32(geometry, device):
    """TF32 off (the suite's setting): full float32 on every path."""
    grad_y, x = case(geometry, torch.float32, device)
    if device == "cuda":
        assert conv_transpose3d_weight_grad_path(grad_y, x, geometry[4]).startswith(BY_ATEN)
    check(conv_transpose3d_weight_grad(grad_y, x, geometry[4]), grad_y, x, geometry[4], torch.float32)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_float32_with_tf32(geometry, device, tf32):
    grad_y, x = case(geometry, torch.float32, device)
    check(conv_transpose3d_weight_grad(grad_y, x, geometry[4]), grad_y, x, geometry[4], torch.float32,
          tf32=device == "cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_16_bit(geometry, dtype, device):
    grad_y, x = case(geometry, dtype, device)
    check(conv_transpose3d_weight_grad(grad_y, x, geometry[4]), grad_y, x, geometry[4], dtype)



@pytest.mark.parametrize("layout", ["channels_last_3d", "transposed", "sliced", "misaligned"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("device", DEVICES)
def test_strided_inputs(layout, dtype, device, tf32):
    """x and grad_y in other layouts (on an sm_90 GPU: the CUTLASS paths' copies read them, or
    their operands' own layouts in place where 16-byte aligned: "misaligned" lays them out so one
    element off)."""
    batch, c_in, c_out, size, kernel = SPEC_LIKE
    if layout == "sliced":  # every other channel of twice as many
        grad_y, x = case((batch, 2 * c_in, 2 * c_out, size, kernel), dtype, device)
        grad_y, x = grad_y[:, ::2], x[:, ::2]
    else:
        grad_y, x = case(SPEC_LIKE, dtype, device)
        if layout == "channels_last_3d":
            grad_y, x = (t.contiguous(memory_format=torch.channels_last_3d) for t in (grad_y, x))
        elif layout == "transposed":  # H and W swapped in memory
            grad_y, x = (t.transpose(3, 4).contiguous().transpose(3, 4) for t in (grad_y, x))
        else:  # the CUTLASS paths' operand layouts: (C, H, W, D, N) for TF32, NDHWC for bfloat16
            order = (1, 3, 4, 2, 0) if dtype == torch.float32 else (0, 2, 3, 4, 1)
            grad_y, x = (misaligned(t, order) for t in (grad_y, x))
    assert not x.is_contiguous() and not grad_y.is_contiguous()
    check(conv_transpose3d_weight_grad(grad_y, x, kernel), grad_y, x, kernel, dtype,
          tf32=dtype == torch.float32 and device == "cuda")


@pytest.mark.parametrize("device", DEVICES)
def test_empty(device):
    """No batch or no input positions: an empty sum, zeros; no channels: an empty gradient."""
    for shape in [(0, 3, 4, 5, 6), (2, 3, 0, 5, 6)]:
        x = torch.rand(shape, device=device)
        grad_y = torch.rand(shape[0], 4, shape[2] + 1, shape[3] + 2, shape[4] + 3, device=device)
        grad_w = conv_transpose3d_weight_grad(grad_y, x, (2, 3, 4))
        assert grad_w.shape == (3, 4, 2, 3, 4) and not grad_w.any()
    grad_w = conv_transpose3d_weight_grad(torch.rand(2, 4, 5, 7, 9, device=device),
                                          torch.rand(2, 0, 4, 5, 6, device=device), (2, 3, 4))
    assert grad_w.shape == (0, 4, 2, 3, 4)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    grad_y, x = case(ODD, torch.float32, device)
    torch.library.opcheck(OP, (grad_y, x, list(ODD[4])))
    grad_y, x = case(SPEC_LIKE, torch.float32, device)
    torch.library.opcheck(OP, (grad_y, x, list(SPEC_LIKE[4])))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_raises_clearly(device):
    grad_y, x = case(ODD, torch.float32, device)
    kernel = ODD[4]
    with pytest.raises(ValueError, match="x must be 5-D"):
        conv_transpose3d_weight_grad(grad_y, x[0], kernel)
    with pytest.raises(ValueError, match="grad_y must be 5-D"):
        conv_transpose3d_weight_grad(grad_y[0], x, kernel)
    with pytest.raises(TypeError, match="x must be floating point"):
        conv_transpose3d_weight_grad(grad_y.long(), x.long(), kernel)
    with pytest.raises(TypeError, match="must have x's dtype"):
        conv_transpose3d_weight_grad(grad_y.double(), x, kernel)
    with pytest.raises(ValueError, match="batch"):
        conv_transpose3d_weight_grad(grad_y[:2], x, kernel)
    with pytest.raises(ValueError, match="x's plus kernel_size less 1"):
        conv_transpose3d_weight_grad(grad_y, x, (2, 3, 3))
    with pytest.raises(ValueError, match="kernel_size must be positive"):
        conv_transpose3d_weight_grad(grad_y, x, (0, 3, 4))
    with pytest.raises(ValueError, match="kernel_size must have 1 or 3 elements"):
        OP(grad_y, x, [2, 3])
    with pytest.raises(TypeError, match="grad_y must be a Tensor"):
        conv_transpose3d_weight_grad(grad_y.tolist(), x, kernel)
    if device == "cuda":
        with pytest.raises(ValueError, match="grad_y is on cpu, x on cuda"):
            conv_transpose3d_weight_grad(grad_y.cpu(), x, kernel)


def test_path_on_the_cpu():
    grad_y, x = case(SPEC_LIKE, torch.float32)
    assert conv_transpose3d_weight_grad_path(grad_y, x, SPEC_LIKE[4]) == BY_ATEN


# --------------------------------------------------------------------------
# The CUTLASS paths (an sm_90 GPU, a build with CUTLASS)
# --------------------------------------------------------------------------



@pytest.fixture
def cutlass():
    """Skips where this build has no CUTLASS kernels (setup.py found no CUTLASS headers)."""
    grad_y, x = case(ONE_TAP, device="cuda")
    if conv_transpose3d_weight_grad_path(grad_y, x, ONE_TAP[4]).endswith("(built without CUTLASS)"):
        pytest.skip("this build has no CUTLASS kernels")


# (geometry, dtype, the path on an H100 or H200, or its prefix): TF32 by the shifted rows (its shifts
# a CTA and split, as many K ranges as fill the multiprocessors, depend on ks and their count)
ROWS = "tf32 shifted rows"
CUTLASS_CASES = [
    (SPEC_LIKE, torch.float32, ROWS),
    ((8, 16, 64, (8, 6, 10), (5, 3, 4)), torch.float32, ROWS),
    ((8, 16, 32, (16, 6, 10), (5, 3, 4)), torch.float32, ROWS),
    ((4, 16, 64, (8, 6, 6), (5, 8, 8)), torch.float32, ROWS),  # ks 8: two CTAs of 4 shifts
    ((8, 16, 64, (8, 6, 6), (5, 4, 7)), torch.float32, ROWS),  # ks 7: 4 and 3 shifts
    ((8, 16, 64, (16, 6, 6), (5, 4, 4)), torch.float32, ROWS),
    ((8, 8, 64, (4, 6, 10), (1, 7, 3)), torch.float32, ROWS),  # one depth tap
    ((4, 72, 40, (8, 5, 7), (3, 2, 3)), torch.float32, ROWS),  # I over a tile
    (SPEC_LIKE, torch.bfloat16, "cutlass bf16 wgrad 64x128x64"),
    ((2, 8, 128, (3, 5, 4), (5, 5, 5)), torch.bfloat16, "cutlass bf16 wgrad 64x128x64"),
    ((3, 72, 192, (2, 3, 4), (2, 3, 1)), torch.bfloat16, "cutlass bf16 wgrad 64x128x64"),  # partial M and N tiles
    # shifted rows: odd batch, channels and rows (no alignment asked), each ks, O over a tile
    ((3, 16, 64, (8, 6, 10), (5, 3, 4)), torch.float32, ROWS),
    ((4, 6, 64, (8, 6, 10), (5, 3, 4)), torch.float32, ROWS),
    ((4, 16, 64, (7, 6, 10), (5, 3, 4)), torch.float32, ROWS),
    ((3, 5, 7, (4, 7, 9), (2, 3, 5)), torch.float32, ROWS),
    ((2, 70, 130, (3, 8, 10), (3, 3, 3)), torch.float32, ROWS),
    ((1, 9, 64, (2, 5, 6), (1, 2, 2)), torch.float32, ROWS),
    ((2, 8, 9, (5, 6, 7), (4, 1, 1)), torch.float32, ROWS),
]
IDS_CUTLASS = [f"{str(d).removeprefix('torch.')}-{'x'.join(map(str, g[:3]))}-{p.split()[-1]}"
               for g, d, p in CUTLASS_CASES]


@requires_sm90
@pytest.mark.parametrize("geometry,dtype,path", CUTLASS_CASES, ids=IDS_CUTLASS)
def test_cutlass_paths(geometry, dtype, path, tf32, cutlass):
    """On an sm_90 GPU in a build with CUTLASS, these sizes take the CUTLASS kernels, within
    TF32's (or bfloat16's) bound."""
    grad_y, x = case(geometry, dtype, "cuda")
    assert conv_transpose3d_weight_grad_path(grad_y, x, geometry[4]).startswith(path)
    check(conv_transpose3d_weight_grad(grad_y, x, geometry[4]), grad_y, x, geometry[4], dtype,
          tf32=dtype == torch.float32, what=path)


@requires_sm90
@pytest.mark.parametrize("layout", ["contiguous", "channels_last_3d"])
def test_shifted_rows_relayout_tiles(layout, tf32, cutlass):
    """The shifted rows' operands relayout to (shifts, C, N, D, H, L) by kernels of their own: from
    channels-last operands in tiles of 32 positions (across the ends of rows of L = 76, 5 shifts of
    x) by 32 channels (x's 40 and grad_y's 36: two tiles, the last partial); from NCDHW ones a row
    at a time, 4 positions a thread (x's shifts reaching before its rows' starts)."""
    geometry = (3, 40, 36, (2, 3, 70), (2, 2, 5))
    grad_y, x = case(geometry, torch.float32, "cuda")
    if layout == "channels_last_3d":
        grad_y, x = (t.contiguous(memory_format=torch.channels_last_3d) for t in (grad_y, x))
    assert conv_transpose3d_weight_grad_path(grad_y, x, geometry[4]).startswith(ROWS)
    check(conv_transpose3d_weight_grad(grad_y, x, geometry[4]), grad_y, x, geometry[4], torch.float32, tf32=True)


@requires_sm90
def test_what_the_cutlass_paths_leave_to_aten(tf32, cutlass):
    """float16, float64, float32 without TF32, and sizes the kernels do not take run
    aten.convolution_backward."""
    batch, c_in, c_out, size, kernel = SPEC_LIKE
    cases = {"float16": case(SPEC_LIKE, torch.float16, "cuda"), "float64": case(SPEC_LIKE, torch.float64, "cuda"),
             "bf16 C_out 32": case((batch, c_in, 32, size, kernel), torch.bfloat16, "cuda"),
             "bf16 C_in 12": case((batch, 12, c_out, size, kernel), torch.bfloat16, "cuda"),
             "empty": case((0, c_in, c_out, size, kernel), torch.float32, "cuda")}
    for what, (grad_y, x) in cases.items():
        taps = tuple([y - s + 1 for y, s in zip(grad_y.shape[2:], x.shape[2:])])
        assert conv_transpose3d_weight_grad_path(grad_y, x, taps) == BY_ATEN, what
        if x.numel():
            check(conv_transpose3d_weight_grad(grad_y, x, taps), grad_y, x, taps, x.dtype,
                  tf32=x.dtype == torch.float32, what=what)
    grad_y, x = case(SPEC_LIKE, torch.float32, "cuda")
    cudnn = torch.backends.cudnn
    with cudnn.flags(enabled=True, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic, allow_tf32=False):
        assert conv_transpose3d_weight_grad_path(grad_y, x, kernel) == BY_ATEN


@requires_sm90
@pytest.mark.parametrize("geometry,dtype,path", [CUTLASS_CASES[i] for i in (0, 4, 8)],
                         ids=["tf32", "tf32-ks8", "bf16"])
def test_cuda_graph_capture(geometry, dtype, path, tf32, cutlass):
    """Captured in a CUDA graph (the concurrent launches' side streams forked and joined inside it),
    a replay on new values gives the eager call's result."""
    grad_y, x = case(geometry, dtype, "cuda")
    assert conv_transpose3d_weight_grad_path(grad_y, x, geometry[4]).startswith(path)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (warm up outside the capture, as torch.cuda.graph's documentation asks)
        conv_transpose3d_weight_grad(grad_y, x, geometry[4])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = conv_transpose3d_weight_grad(grad_y, x, geometry[4])
    new_grad_y, new_x = case(geometry, dtype, "cuda", seed=1)
    grad_y.copy_(new_grad_y)
    x.copy_(new_x)
    graph.replay()
    torch.testing.assert_close(captured, conv_transpose3d_weight_grad(new_grad_y, new_x, geometry[4]), rtol=0, atol=0)


# --------------------------------------------------------------------------
# D's rewrite in a training step: the weight's gradient by the op on a GPU
# --------------------------------------------------------------------------

D_ARGS, D_SHAPE = (16, 64, (5, 3, 4), 2.0), (4, 16, 8, 6, 10)  # SPEC_LIKE's transposed convolution


@pytest.mark.parametrize("x_grad", [False, True], ids=["data", "x-grad"])
@pytest.mark.parametrize("allow_tf32", [False, True], ids=["full-float32", "tf32"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("device", DEVICES)
def test_d_rewrite_gradients_are_the_originals(dtype, allow_tf32, device, x_grad):
    """D in training, x needing no gradient (a step on data) or needing one (x's and the bias's
    gradients by PyTorch's backward beside the op), the rewrite forced: the gradients, the
    transposed convolution's weight by the op on a GPU, equal the original's within the dtype's
    tolerance of the float64 ones (as one vector, relative to the largest: the conv bias's
    gradient cancels to ~0 before the batch norm)."""
    original, fused = build_pair("ConvTranspose3dScaleBatchNormGAP", D_ARGS)
    exact, _ = build_pair("ConvTranspose3dScaleBatchNormGAP", D_ARGS)
    original.to(device, dtype).train()
    fused.to(device, dtype).train()
    exact.double().train()
    x = torch.rand(D_SHAPE, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    grad = torch.rand(D_SHAPE[0], D_ARGS[1], 1, 1, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    inputs = [x.requires_grad_()] if x_grad else []
    expected = torch.autograd.grad(exact(x), inputs + list(exact.parameters()), grad)
    largest = max(e.abs().max().item() for e in expected)
    x, grad = x.detach().to(device, dtype).requires_grad_(x_grad), grad.to(device, dtype)
    inputs = [x] if x_grad else []
    cudnn = torch.backends.cudnn
    with cudnn.flags(enabled=True, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic,
                     allow_tf32=allow_tf32):
        before = torch.autograd.grad(original(x), inputs + list(original.parameters()), grad)
        with autotune.force("rewrite"), torch.profiler.profile() as profile:
            after = torch.autograd.grad(fused(x), inputs + list(fused.parameters()), grad)
    ran = {e.name for e in profile.events()}
    assert ("fused_ops::conv_transpose3d_weight_grad" in ran) == (device == "cuda")
    tolerance = {torch.float64: 1e-9, torch.float32: TF32_RTOL if allow_tf32 and device == "cuda" else 1e-4}[dtype]
    names = ["x"] * len(inputs) + [n for n, _ in fused.named_parameters()]
    for name, a, b, e in zip(names, after, before, expected, strict=True):
        assert a.dtype == b.dtype == dtype
        assert (a.double().cpu() - e).abs().max().item() <= tolerance * largest, f"fused {name}"
        assert (b.double().cpu() - e).abs().max().item() <= tolerance * largest, f"original {name}"


@requires_cuda
def test_rewrite_create_graph_backward_as_pytorchs():
    """A backward that records a graph takes PyTorch's transposed-convolution backward (no op):
    differentiated again, the stride-1 rewrite gives F.conv_transpose3d's second-order gradients."""
    conv = torch.nn.ConvTranspose3d(3, 4, (2, 3, 2)).to("cuda", torch.float64)
    x = torch.rand(2, 3, 4, 5, 3, dtype=torch.float64, device="cuda", requires_grad=True)
    results = []
    for forward in (lambda: rewrites.conv_transpose3d_stride1(x, conv), lambda: conv(x)):
        y = forward()
        grads = torch.autograd.grad((y * y).sum(), [x, conv.weight], create_graph=True)
        results.append(torch.autograd.grad(sum(g.square().sum() for g in grads), [x, conv.weight, conv.bias]))
    for a, e in zip(*results, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)
