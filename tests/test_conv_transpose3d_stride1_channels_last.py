"""fused_ops.conv_transpose3d_stride1_channels_last (a stride-1 transposed convolution returned
channels_last_3d: CUTLASS's Hopper 3-D fprop on an sm_90 GPU, aten.conv_transpose3d elsewhere) against
the float64 transposed convolution, and D's rewrite, whose forward takes it on a GPU, against the
original.

  y[n, o, z, h, w] = bias[o] + sum over i, t, r, s of x[n, i, z + p - t, h + p - r, w + p - s] * w[i, o, t, r, s]

Each result normwise within its dtype's tolerance of the float64 one, max |got - exact| / max |exact|
(the reference sums 16-bit inputs as they are): conftest's RTOL; TF32 (on a GPU) 2e-3, the README's for
TF32 convolutions."""
import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICES, RTOL, build_pair, misaligned, requires_sm90
from fused_ops import autotune, conv_transpose3d_stride1_channels_last, rewrites
from fused_ops.ops import conv_transpose3d_stride1_channels_last_path
from fused_ops.rewrites import conv_transpose3d_batch_norm as d_rewrite

OP = torch.ops.fused_ops.conv_transpose3d_stride1_channels_last.default
BY_ATEN = "aten.conv_transpose3d"
TF32_RTOL = 2e-3

# (batch, C_in, C_out, x's (D, H, W), kernel, padding)
ODD = (3, 5, 7, (4, 6, 5), (2, 3, 4), (1, 0, 2))
BATCH_1 = (1, 4, 6, (3, 4, 5), (3, 3, 3), (0, 0, 0))
ONE_TAP = (2, 3, 2, (2, 3, 4), (1, 1, 1), (0, 0, 0))
# channels multiples of 16 bytes in float32 and bfloat16: the CUTLASS paths on an sm_90 GPU
SPEC_LIKE = (2, 16, 64, (6, 7, 9), (5, 3, 4), (0, 0, 0))
PADDED = (3, 24, 40, (5, 6, 7), (5, 5, 5), (4, 2, 1))
GEOMETRIES = [ODD, BATCH_1, ONE_TAP, SPEC_LIKE, PADDED]
IDS = ["odd", "batch1", "1x1x1", "spec-like", "padded"]


def case(geometry, dtype=torch.float64, device="cpu", seed=0, bias=True):
    """x uniform in [0, 1), the weight and bias in [-1/2, 1/2), drawn in float64."""
    batch, c_in, c_out, size, kernel, _ = geometry
    g = torch.Generator().manual_seed(seed)
    x = torch.rand((batch, c_in, *size), generator=g, dtype=torch.float64)
    weight = torch.rand((c_in, c_out, *kernel), generator=g, dtype=torch.float64) - 0.5
    b = torch.rand(c_out, generator=g, dtype=torch.float64) - 0.5 if bias else None
    return [None if t is None else t.to(device, dtype) for t in (x, weight, b)]


def reference(x, weight, bias, padding):
    """F.conv_transpose3d in float64 on the CPU."""
    return F.conv_transpose3d(x.double().cpu(), weight.double().cpu(), None if bias is None else bias.double().cpu(),
                              padding=padding)


def check(actual, x, weight, bias, padding, dtype, tf32=False, what=""):
    """actual (x's dtype, channels_last_3d, on x's device) normwise within dtype's tolerance of the
    float64 transposed convolution of the operands as given (16-bit values included)."""
    expected = reference(x, weight, bias, padding)
    assert actual.dtype == x.dtype and actual.device == x.device and actual.shape == expected.shape, what
    assert actual.permute(0, 2, 3, 4, 1).is_contiguous(), f"{what}: not channels_last_3d"
    error = ((actual.double().cpu() - expected).abs().max() / expected.abs().max()).item()
    assert error <= (TF32_RTOL if tf32 else RTOL[dtype]), f"{what}: normwise error {error:.3g}"



def test_the_definition():
    """The CPU op and the reference are the sum over taps that defines the transposed convolution."""
    x, weight, bias = case(ODD)
    padding = ODD[5]
    n, _, d, h, w = x.shape
    kernel = weight.shape[2:]
    full = torch.zeros(n, weight.shape[1], *[s + k - 1 for s, k in zip((d, h, w), kernel)], dtype=torch.float64)
    for t in range(kernel[0]):
        for r in range(kernel[1]):
            for s in range(kernel[2]):
                full[:, :, t:t + d, r:r + h, s:s + w] += torch.einsum("nizhw,io->nozhw", x, weight[:, :, t, r, s])
    pd, ph, pw = padding
    direct = full[:, :, pd:full.shape[2] - pd, ph:full.shape[3] - ph, pw:full.shape[4] - pw] + bias.view(1, -1, 1, 1, 1)
    torch.testing.assert_close(reference(x, weight, bias, padding), direct, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(conv_transpose3d_stride1_channels_last(x, weight, bias, padding), direct, rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_float64(geometry, device, with_bias):
    x, weight, bias = case(geometry, device=device, bias=with_bias)
    check(conv_transpose3d_stride1_channels_last(x, weight, bias, geometry[5]), x, weight, bias, geometry[5],
          torch.float64)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_float32_without_tf32(geometry, device):
    """TF32 off (the suite's setting): full float32 on every path."""
    x, weight, bias = case(geometry, torch.float32, device)
    if device == "cuda":
        assert conv_transpose3d_stride1_channels_last_path(x, weight, bias, geometry[5]).startswith(BY_ATEN)
    check(conv_transpose3d_stride1_channels_last(x, weight, bias, geometry[5]), x, weight, bias, geometry[5],
          torch.float32)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_float32_with_tf32(geometry, device, tf32, with_bias):
    x, weight, bias = case(geometry, torch.float32, device, bias=with_bias)
    check(conv_transpose3d_stride1_channels_last(x, weight, bias, geometry[5]), x, weight, bias, geometry[5],
          torch.float32, tf32=device == "cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_16_bit(geometry, dtype, device):
    x, weight, bias = case(geometry, dtype, device)
    check(conv_transpose3d_stride1_channels_last(x, weight, bias, geometry[5]), x, weight, bias, geometry[5], dtype)



@pytest.mark.parametrize("layout", ["channels_last_3d", "transposed", "sliced", "misaligned"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("device", DEVICES)
def test_strided_inputs(layout, dtype, device, tf32):
    """x, the weight and the bias in other layouts (on an sm_90 GPU: x read in place where it is
    channels_last_3d and 16-byte aligned, else copied; "misaligned" lays x out channels-last one
    element off an aligned address)."""
    batch, c_in, c_out, size, kernel, padding = SPEC_LIKE
    if layout == "sliced":  # every other channel of twice as many
        x, weight, bias = case((batch, 2 * c_in, 2 * c_out, size, kernel, padding), dtype, device)
        x, weight, bias = x[:, ::2], weight[::2, ::2], bias[::2]
    else:
        x, weight, bias = case(SPEC_LIKE, dtype, device)
        if layout == "channels_last_3d":
            x, weight = (t.contiguous(memory_format=torch.channels_last_3d) for t in (x, weight))
        elif layout == "transposed":  # H and W swapped in memory
            x, weight = (t.transpose(3, 4).contiguous().transpose(3, 4) for t in (x, weight))
        else:
            x = misaligned(x, (0, 2, 3, 4, 1))
    assert not x.is_contiguous()
    check(conv_transpose3d_stride1_channels_last(x, weight, bias, padding), x, weight, bias, padding, dtype,
          tf32=dtype == torch.float32 and device == "cuda")


@pytest.mark.parametrize("device", DEVICES)
def test_empty(device):
    """No batch: an empty y; no input channels or positions: y is the bias (or zeros) everywhere."""
    weight = torch.rand(3, 4, 2, 3, 4, device=device)
    bias = torch.rand(4, device=device)
    y = conv_transpose3d_stride1_channels_last(torch.rand(0, 3, 4, 5, 6, device=device), weight, bias)
    assert y.shape == (0, 4, 5, 7, 9)
    for x, w in [(torch.rand(2, 3, 0, 5, 6, device=device), weight),
                 (torch.rand(2, 0, 4, 5, 6, device=device), torch.rand(0, 4, 2, 3, 4, device=device))]:
        y = conv_transpose3d_stride1_channels_last(x, w, bias)
        assert y.shape == (2, 4, x.shape[2] + 1, 7, 9)
        torch.testing.assert_close(y, bias.view(1, -1, 1, 1, 1).expand(y.shape), rtol=0, atol=0)
        assert not conv_transpose3d_stride1_channels_last(x, w, None).any()


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for geometry in (ODD, SPEC_LIKE):
        x, weight, bias = case(geometry, torch.float32, device)
        torch.library.opcheck(OP, (x, weight, bias, list(geometry[5])))
        torch.library.opcheck(OP, (x, weight, None, list(geometry[5])))


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_casts_as_conv_transpose3d(device):
    """Under autocast the op casts x, the weight and the bias to autocast's dtype and returns that
    dtype, as F.conv_transpose3d does; float64 is left alone."""
    x, weight, bias = case(SPEC_LIKE, torch.float32, device)
    with torch.autocast(device, dtype=torch.bfloat16):
        y = conv_transpose3d_stride1_channels_last(x, weight, bias)
        expected_dtype = F.conv_transpose3d(x, weight, bias).dtype
        y64 = conv_transpose3d_stride1_channels_last(x.double(), weight.double(), bias.double())
    assert y.dtype == expected_dtype == torch.bfloat16 and y64.dtype == torch.float64
    check(y, *[t.to(torch.bfloat16) for t in (x, weight, bias)], (0, 0, 0), torch.bfloat16)
    # the path op names the path of the call autocast makes
    with torch.autocast(device, dtype=torch.bfloat16):
        path = conv_transpose3d_stride1_channels_last_path(x, weight, bias)
    assert path == conv_transpose3d_stride1_channels_last_path(*[t.to(torch.bfloat16) for t in (x, weight, bias)])


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_raises_clearly(device):
    x, weight, bias = case(ODD, torch.float32, device)
    padding = ODD[5]
    with pytest.raises(ValueError, match="x must be 5-D"):
        conv_transpose3d_stride1_channels_last(x[0], weight, bias, padding)
    with pytest.raises(ValueError, match="weight must be 5-D"):
        conv_transpose3d_stride1_channels_last(x, weight[0], bias, padding)
    with pytest.raises(TypeError, match="x must be floating point"):
        conv_transpose3d_stride1_channels_last(x.long(), weight.long(), None, padding)
    with pytest.raises(TypeError, match="must have x's dtype"):
        conv_transpose3d_stride1_channels_last(x, weight.double(), bias, padding)
    with pytest.raises(TypeError, match="bias .* must have x's dtype"):
        conv_transpose3d_stride1_channels_last(x, weight, bias.double(), padding)
    with pytest.raises(ValueError, match="channels"):
        conv_transpose3d_stride1_channels_last(x[:, :4], weight, bias, padding)
    with pytest.raises(ValueError, match="bias must be"):
        conv_transpose3d_stride1_channels_last(x, weight, bias[:3], padding)
    with pytest.raises(ValueError, match=r"padding must lie in \[0, kernel size\)"):
        conv_transpose3d_stride1_channels_last(x, weight, bias, (2, 0, 0))
    with pytest.raises(ValueError, match="output would be empty"):
        conv_transpose3d_stride1_channels_last(x[:, :, :1], weight, bias, (1, 0, 0))
    with pytest.raises(ValueError, match="padding must have 1 or 3 elements"):
        OP(x, weight, bias, [1, 0])
    with pytest.raises(TypeError, match="x must be a Tensor"):
        conv_transpose3d_stride1_channels_last(x.tolist(), weight, bias, padding)
    if device == "cuda":
        with pytest.raises(ValueError, match="weight is on cpu, x on cuda"):
            conv_transpose3d_stride1_channels_last(x, weight.cpu(), bias, padding)
        with pytest.raises(ValueError, match="bias is on cpu, x on cuda"):
            conv_transpose3d_stride1_channels_last(x, weight, bias.cpu(), padding)


def test_path_on_the_cpu():
    x, weight, bias = case(SPEC_LIKE, torch.float32)
    assert conv_transpose3d_stride1_channels_last_path(x, weight, bias) == BY_ATEN


# --------------------------------------------------------------------------
# The CUTLASS paths (an sm_90 GPU, a build with CUTLASS)
# --------------------------------------------------------------------------



@pytest.fixture
def cutlass():
    """Skips where this build has no CUTLASS kernels (setup.py found no CUTLASS headers)."""
    x, weight, bias = case(ONE_TAP, device="cuda")
    if conv_transpose3d_stride1_channels_last_path(x, weight, bias).endswith("(built without CUTLASS)"):
        pytest.skip("this build has no CUTLASS kernels")


TF32_PATH, BF16_PATH = "cutlass tf32 fprop3d 128x128x32 cluster 4", "cutlass bf16 fprop3d 128x128x64"
# (geometry, dtype): partial tiles of positions and channels, paddings, one tap, a 1-position x
CUTLASS_CASES = [
    (SPEC_LIKE, torch.float32), (PADDED, torch.float32), (SPEC_LIKE, torch.bfloat16), (PADDED, torch.bfloat16),
    ((2, 4, 4, (3, 5, 6), (2, 3, 2), (1, 0, 1)), torch.float32),  # 16-byte channels, a tile of 4 of 128
    ((1, 8, 136, (1, 1, 1), (5, 5, 5), (0, 0, 0)), torch.bfloat16),  # channels over a tile, one x position
    ((2, 72, 24, (4, 4, 4), (1, 1, 1), (0, 0, 0)), torch.float32),  # input channels over the tile's K
]
IDS_CUTLASS = [f"{str(d).removeprefix('torch.')}-{'x'.join(map(str, g[:3]))}-k{'x'.join(map(str, g[4]))}"
               for g, d in CUTLASS_CASES]


@requires_sm90
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("geometry,dtype", CUTLASS_CASES, ids=IDS_CUTLASS)
def test_cutlass_paths(geometry, dtype, with_bias, tf32, cutlass):
    """On an sm_90 GPU in a build with CUTLASS, these sizes take the CUTLASS kernels, within TF32's
    (or bfloat16's) bound; integer-valued data exactly as float64 gives it rounded to the dtype
    (TF32 and bfloat16 hold the small integers, float32 sums them exactly, the epilogue rounds once)."""
    x, weight, bias = case(geometry, dtype, "cuda", bias=with_bias)
    path = conv_transpose3d_stride1_channels_last_path(x, weight, bias, geometry[5])
    assert path == (TF32_PATH if dtype == torch.float32 else BF16_PATH)
    check(conv_transpose3d_stride1_channels_last(x, weight, bias, geometry[5]), x, weight, bias, geometry[5], dtype,
          tf32=dtype == torch.float32, what=path)
    xi, wi = (torch.randint(-3, 4, t.shape, device="cuda").to(dtype) for t in (x, weight))
    bi = None if bias is None else torch.randint(-3, 4, bias.shape, device="cuda").to(dtype)
    exact = reference(xi, wi, bi, geometry[5])
    torch.testing.assert_close(conv_transpose3d_stride1_channels_last(xi, wi, bi, geometry[5]).cpu(),
                               exact.to(dtype), rtol=0, atol=0)


@requires_sm90
def test_what_the_cutlass_paths_leave_to_aten(tf32, cutlass):
    """float16, float64, float32 without TF32, channels not a multiple of 16 bytes and empty inputs
    run aten.conv_transpose3d."""
    batch, c_in, c_out, size, kernel, padding = SPEC_LIKE
    cases = {"float16": case(SPEC_LIKE, torch.float16, "cuda"), "float64": case(SPEC_LIKE, torch.float64, "cuda"),
             "C_in 6": case((batch, 6, c_out, size, kernel, padding), torch.float32, "cuda"),
             "C_out 10": case((batch, c_in, 10, size, kernel, padding), torch.float32, "cuda"),
             "bf16 C_in 12": case((batch, 12, c_out, size, kernel, padding), torch.bfloat16, "cuda"),
             "bf16 C_out 4": case((batch, c_in, 4, size, kernel, padding), torch.bfloat16, "cuda"),
             "empty": case((0, c_in, c_out, size, kernel, padding), torch.float32, "cuda")}
    for what, (x, weight, bias) in cases.items():
        assert conv_transpose3d_stride1_channels_last_path(x, weight, bias, padding) == BY_ATEN, what
        if x.numel():
            check(conv_transpose3d_stride1_channels_last(x, weight, bias, padding), x, weight, bias, padding, x.dtype,
                  tf32=x.dtype == torch.float32, what=what)
    x, weight, bias = case(SPEC_LIKE, torch.float32, "cuda")
    cudnn = torch.backends.cudnn
    with cudnn.flags(enabled=True, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic, allow_tf32=False):
        assert conv_transpose3d_stride1_channels_last_path(x, weight, bias, padding) == BY_ATEN


@requires_sm90
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cuda_graph_capture(dtype, tf32, cutlass):
    """Captured in a CUDA graph, a replay on new values gives the eager call's result."""
    x, weight, bias = case(SPEC_LIKE, dtype, "cuda")
    padding = SPEC_LIKE[5]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (warm up outside the capture, as torch.cuda.graph's documentation asks)
        conv_transpose3d_stride1_channels_last(x, weight, bias, padding)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = conv_transpose3d_stride1_channels_last(x, weight, bias, padding)
    for t, new in zip((x, weight, bias), case(SPEC_LIKE, dtype, "cuda", seed=1)):
        t.copy_(new)
    graph.replay()
    torch.testing.assert_close(captured, conv_transpose3d_stride1_channels_last(x, weight, bias, padding), rtol=0,
                               atol=0)


# --------------------------------------------------------------------------
# D's rewrite: the forward by the op on an sm_90 GPU
# --------------------------------------------------------------------------

D_ARGS, D_SHAPE = (16, 64, (5, 3, 4), 2.0), (4, 16, 8, 6, 10)


def relative_error(actual, reference, scale=None):
    """max |actual - reference| / scale, by default max |reference|."""
    scale = reference.abs().max().item() if scale is None else scale
    return (actual.double().cpu() - reference).abs().max().item() / scale


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["float32", "autocast-bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_d_rewrite_is_the_original(device, autocast, tf32):
    """D's training step (TF32 allowed), the rewrite forced, in float32 or under bf16 autocast: the
    output and every parameter's gradient within twice the original's error against a float64 run
    (gradients relative to the largest), or within the dtype's bound where that is larger: TF32's
    on a GPU (the weight gradient's TF32 kernels differ from cuDNN's), half a unit of bf16's last
    place under autocast (D's conv bias gets a gradient that is zero but for rounding); on an sm_90
    GPU in a build with CUTLASS the op ran (and then its weight gradient op too)."""
    original, fused = build_pair("ConvTranspose3dScaleBatchNormGAP", D_ARGS)
    exact, _ = build_pair("ConvTranspose3dScaleBatchNormGAP", D_ARGS)
    original.to(device).train()
    fused.to(device).train()
    exact.double().train()
    x = torch.rand(D_SHAPE, generator=torch.Generator().manual_seed(0))
    grad = torch.rand(D_SHAPE[0], D_ARGS[1], 1, 1, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out_exact = exact(x.double())
    grads_exact = torch.autograd.grad(out_exact, list(exact.parameters()), grad)
    x, grad = x.to(device), grad.to(device)
    results = []
    for module, setting in ((original, "original"), (fused, "rewrite")):
        with autotune.force(setting), torch.profiler.profile() as profile:
            with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                out = module(x)
            results.append((out, torch.autograd.grad(out, list(module.parameters()), grad.to(out.dtype))))
    ran = {e.name for e in profile.events()}
    dtype = autocast or torch.float32
    expect_op = device == "cuda" and rewrites._stride1_by_cutlass(x, fused.conv_transpose, dtype)
    if device == "cuda" and torch.cuda.get_device_capability() == (9, 0):
        cutlass_build = not conv_transpose3d_stride1_channels_last_path(
            *case(ONE_TAP, device="cuda")).endswith("(built without CUTLASS)")
        assert expect_op == (cutlass_build and dtype in d_rewrite._STRIDE1_BY_CUTLASS)
    assert ("fused_ops::conv_transpose3d_stride1_channels_last" in ran) == expect_op
    assert ("fused_ops::conv_transpose3d_weight_grad" in ran) == (device == "cuda" and (autocast is None or expect_op))
    (out, grads), (fused_out, fused_grads) = results
    assert fused_out.dtype == out.dtype and fused_out.shape == out.shape
    assert relative_error(fused_out, out_exact) <= 2 * relative_error(out, out_exact) + 1e-6, "output"
    largest = max([g.abs().max().item() for g in grads_exact])
    resolution = torch.finfo(dtype).eps / 2 if autocast else TF32_RTOL if device == "cuda" else 0.0
    for (name, p), g, fused_g, exact_g in zip(fused.named_parameters(), grads, fused_grads, grads_exact, strict=True):
        assert fused_g.dtype == p.dtype, name
        bound = max(2 * relative_error(g, exact_g, largest), resolution) + 1e-6
        assert relative_error(fused_g, exact_g, largest) <= bound, f"grad {name}"


@pytest.mark.parametrize("device", DEVICES)
def test_d_rewrite_with_padding_past_the_kernel(device):
    """A padding the op refuses (at least the kernel size; nn.ConvTranspose3d takes it where the
    output stays non-empty): D's rewrite under bf16 autocast takes the parity-class convolution
    and gives the original's output."""
    original, fused = build_pair("ConvTranspose3dScaleBatchNormGAP", (16, 64, 3, 2.0))
    for m in (original, fused):
        m.conv_transpose.padding = (3, 1, 3)
        m.to(device).train()
    x = torch.rand(2, 16, 8, 6, 10, generator=torch.Generator().manual_seed(0)).to(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        assert not rewrites._stride1_by_cutlass(x, fused.conv_transpose, torch.bfloat16)
        expected = original(x)
        with autotune.force("rewrite"):
            out = fused(x)
    torch.testing.assert_close(out, expected, rtol=5e-2, atol=5e-2)
