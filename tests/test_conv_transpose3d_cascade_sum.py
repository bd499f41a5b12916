"""fused_ops.conv_transpose3d_cascade_sum (architecture B's forward less the bias: a transposed
convolution, max_pool3d(stride), max_pool3d(kernel2), the channel sum; one kernel on an sm_90 GPU, its
float32 operands as bf16x3 (PyTorch's default float32 matmul precision, "highest") or TF32 ("high",
"medium"), or bfloat16; aten.conv_transpose3d + parity_max_pool3d_cascade_sum elsewhere) against PyTorch's ops in float64, its
picks against the composite's, and B's module, whose rewrite takes it on a GPU, against the original.

  out[n, 0, c] = sum over o of max_pool3d(max_pool3d(conv_transpose3d(x, w, stride, padding, output_padding),
                 stride), kernel2)[n, o, c]

Random data: normwise within the dtype's tolerance of float64 (conftest's RTOL, float32's for bf16x3;
TF32 2e-3, the README's for TF32 convolutions). Integer-valued data (every product and float32 sum exact, in TF32 too): the
float64 result exactly and the float64 composite's picks, ties and non-finite values included."""

import pytest
import torch
import torch.nn.functional as F

from conftest import (DEVICES, RTOL, build_pair, cuda_kernel_names, matmul_precision, misaligned,
                      poison_cuda_allocator, requires_sm90)
from fused_ops import conv_transpose3d_cascade_sum
from fused_ops.ops import conv_transpose3d_cascade_sum_path

OP = torch.ops.fused_ops.conv_transpose3d_cascade_sum.default
BY_ATEN = "aten.conv_transpose3d + parity_max_pool3d_cascade_sum"
# the kernel's operands: (x's dtype, torch.get_float32_matmul_precision(), the path's name)
OPERANDS = {"bf16x3": (torch.float32, "highest", "bf16x3 transposed cascade sum"),
            "tf32": (torch.float32, "high", "tf32 transposed cascade sum"),
            "bfloat16": (torch.bfloat16, "highest", "bf16 transposed cascade sum")}
KERNEL_NAME = "conv_transpose3d_cascade_sum_kernel"
TF32_RTOL = 2e-3

# (batch, C_in, C_out, x's (D, H, W), kernel, stride, padding, output_padding, kernel2)
SMALL = (2, 3, 4, (4, 5, 6), (3, 3, 3), (2, 2, 2), (1, 1, 1), (0, 0, 0), (2, 2, 2))
MIXED = (1, 2, 3, (5, 4, 6), (4, 5, 3), (3, 2, 1), (2, 0, 1), (1, 1, 0), (2, 3, 2))
# the kernel's: 32 input channels, stride 2, kernel2 3, at most 3 taps a class and dim
SPEC_LIKE = (2, 32, 64, (8, 8, 8), (5, 5, 5), (2, 2, 2), (2, 2, 2), (0, 0, 0), (3, 3, 3))
# odd: 40 output channels, an odd number of output rows (the last tile's second half outside), 11
# output columns (a second column tile of one), output_padding, a kernel per dim
ODD = (3, 32, 40, (7, 17, 35), (5, 3, 4), (2, 2, 2), (2, 1, 1), (0, 1, 1), (3, 3, 3))
# few taps: kernel 6 in depth, 2 in height (one tap a class), 1 in width (the odd classes none), one
# output depth, 12 taps a depth (fewer than bfloat16's weight stages)
FEW_TAPS = (2, 32, 17, (5, 6, 7), (6, 2, 1), (2, 2, 2), (2, 0, 0), (1, 1, 0), (3, 3, 3))
# two taps a class in depth (kernel 3, padding 1): slices loaded that no tap of a class reads
DEPTH_TAPS_2 = (2, 32, 64, (7, 8, 9), (3, 5, 5), (2, 2, 2), (1, 2, 2), (0, 0, 0), (3, 3, 3))
GEOMETRIES = [SMALL, MIXED, SPEC_LIKE, ODD, FEW_TAPS, DEPTH_TAPS_2]
IDS = ["small", "mixed", "spec-like", "odd", "few-taps", "depth-taps-2"]
KERNEL_GEOMETRIES = [SPEC_LIKE, ODD, FEW_TAPS, DEPTH_TAPS_2]
KERNEL_IDS = ["spec-like", "odd", "few-taps", "depth-taps-2"]


def case(geometry, dtype=torch.float64, device="cpu", seed=0, integers=False):
    """x uniform in [0, 1) and the weight in [-1/2, 1/2) (or small integers), drawn in float64."""
    batch, c_in, c_out, size, kernel = geometry[:5]
    g = torch.Generator().manual_seed(seed)
    if integers:
        x = torch.randint(-3, 4, (batch, c_in, *size), generator=g).double()
        weight = torch.randint(-2, 3, (c_in, c_out, *kernel), generator=g).double()
    else:
        x = torch.rand((batch, c_in, *size), generator=g, dtype=torch.float64)
        weight = torch.rand((c_in, c_out, *kernel), generator=g, dtype=torch.float64) - 0.5
    return x.to(device, dtype), weight.to(device, dtype)


def args(geometry):
    return [list(v) for v in geometry[5:]]


def reference(x, weight, geometry):
    """PyTorch's ops in float64 on the CPU."""
    stride, padding, output_padding, kernel2 = geometry[5:]
    y = F.conv_transpose3d(x.double().cpu(), weight.double().cpu(), None, stride, padding, output_padding)
    return F.max_pool3d(F.max_pool3d(y, stride), kernel2).sum(1, keepdim=True)


def composite(x, weight, geometry):
    """The float64 composite on the CPU: (out, picks)."""
    return OP(x.double().cpu(), weight.double().cpu(), *args(geometry), True, None)


def check(actual, x, weight, geometry, rtol, what=""):
    expected = reference(x, weight, geometry)
    assert actual.shape == expected.shape and actual.device == x.device, what
    error = ((actual.double().cpu() - expected).abs().max() / expected.abs().max()).item()
    assert error <= rtol, f"{what}: normwise error {error:.3g}"


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_float64(geometry, device):
    x, weight = case(geometry, torch.float64, device)
    out = conv_transpose3d_cascade_sum(x, weight, *geometry[5:])
    assert out.dtype == torch.float64
    check(out, x, weight, geometry, 1e-12)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_float32_without_tf32(geometry, device):
    """TF32 off: full float32 (the composite) on every device."""
    x, weight = case(geometry, torch.float32, device)
    assert conv_transpose3d_cascade_sum_path(x, weight, *geometry[5:]).startswith(BY_ATEN)
    check(conv_transpose3d_cascade_sum(x, weight, *geometry[5:]), x, weight, geometry, RTOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
def test_picks_are_the_parity_cascades(device):
    """The saved picks are parity_max_pool3d_cascade_sum's of the convolution's windows (stage-2
    offset * P^3 + class), which conv_transpose3d_cascade_weight_grad reads."""
    x, weight = case(SMALL, torch.float64, device, integers=True)
    stride, padding, output_padding, kernel2 = args(SMALL)
    out, picks = OP(x, weight, stride, padding, output_padding, kernel2, True, None)
    y = F.conv_transpose3d(x, weight, None, stride, padding, output_padding)
    m = [o // s // k * k for o, s, k in zip(y.shape[2:], stride, kernel2)]
    windows = (y[:, :, :2 * m[0], :2 * m[1], :2 * m[2]].reshape(2, 4, m[0], 2, m[1], 2, m[2], 2)
               .permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(2, *m, 4, 8))
    expected, expected_picks = torch.ops.fused_ops.parity_max_pool3d_cascade_sum(windows, kernel2, True, None)
    assert torch.equal(out, expected) and torch.equal(picks, expected_picks)
    assert picks.shape == (2, *out.shape[2:], 4) and picks.dtype == torch.uint8


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device, tf32):
    for geometry in (SMALL, SPEC_LIKE):
        x, weight = case(geometry, torch.float32, device)
        for save in (False, True):
            torch.library.opcheck(OP, (x, weight, *args(geometry), save, None))


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_casts_as_the_original(device, tf32):
    """Under autocast the op casts x and the weight to autocast's dtype, as F.conv_transpose3d does,
    and returns float32 (the original's sum under autocast); float64 is left alone; the path op
    names the path of the call autocast makes."""
    x, weight = case(SPEC_LIKE, torch.float32, device)
    with torch.autocast(device, dtype=torch.bfloat16):
        out = conv_transpose3d_cascade_sum(x, weight, *SPEC_LIKE[5:])
        path = conv_transpose3d_cascade_sum_path(x, weight, *SPEC_LIKE[5:])
        out64 = conv_transpose3d_cascade_sum(x.double(), weight.double(), *SPEC_LIKE[5:])
    assert out.dtype == torch.float32 and out64.dtype == torch.float64
    low = [t.to(torch.bfloat16) for t in (x, weight)]
    assert path == conv_transpose3d_cascade_sum_path(*low, *SPEC_LIKE[5:])
    check(out, *low, SPEC_LIKE, RTOL[torch.bfloat16])


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_raises_clearly(device):
    x, weight = case(SMALL, torch.float32, device)
    geometry = SMALL[5:]
    with pytest.raises(ValueError, match="x must be 5-D"):
        conv_transpose3d_cascade_sum(x[0], weight, *geometry)
    with pytest.raises(ValueError, match="weight must be 5-D"):
        conv_transpose3d_cascade_sum(x, weight[0], *geometry)
    with pytest.raises(TypeError, match="x must be floating point"):
        conv_transpose3d_cascade_sum(x.long(), weight.long(), *geometry)
    with pytest.raises(TypeError, match="must have x's dtype"):
        conv_transpose3d_cascade_sum(x, weight.double(), *geometry)
    with pytest.raises(ValueError, match="channels"):
        conv_transpose3d_cascade_sum(x[:, :2], weight, *geometry)
    with pytest.raises(ValueError, match="must not be empty"):
        conv_transpose3d_cascade_sum(x[:0], weight, *geometry)
    with pytest.raises(ValueError, match=r"output_padding must lie in \[0, stride\)"):
        conv_transpose3d_cascade_sum(x, weight, 2, 1, 2, 2)
    with pytest.raises(ValueError, match="stride and kernel2 must be positive"):
        conv_transpose3d_cascade_sum(x, weight, 0, 1, 0, 2)
    with pytest.raises(ValueError, match="padding must be non-negative"):
        conv_transpose3d_cascade_sum(x, weight, 2, -1, 0, 2)
    with pytest.raises(ValueError, match="too small for a second-stage window"):
        conv_transpose3d_cascade_sum(x, weight, 2, 1, 0, 9)
    with pytest.raises(ValueError, match="a pick is one byte"):
        OP(x, weight, [2, 2, 2], [1, 1, 1], [0, 0, 0], [3, 3, 4], True, None)
    with pytest.raises(ValueError, match="stride must have 1 or 3 elements"):
        OP(x, weight, [2, 2], [1, 1, 1], [0, 0, 0], [2, 2, 2], False, None)
    with pytest.raises(TypeError, match="x must be a Tensor"):
        conv_transpose3d_cascade_sum(x.tolist(), weight, *geometry)
    if device == "cuda":
        with pytest.raises(ValueError, match="weight is on cpu, x on cuda"):
            conv_transpose3d_cascade_sum(x, weight.cpu(), *geometry)


def test_path_on_the_cpu(tf32):
    x, weight = case(SPEC_LIKE, torch.float32)
    assert conv_transpose3d_cascade_sum_path(x, weight, *SPEC_LIKE[5:]) == BY_ATEN


# --------------------------------------------------------------------------
# The kernel (an sm_90 GPU, a build with CUTLASS, TF32 convolutions)
# --------------------------------------------------------------------------


@pytest.fixture(params=list(OPERANDS))
def operands(request):
    """The kernel's operands (OPERANDS), their matmul precision set: x's dtype and the path's name."""
    dtype, precision, path = OPERANDS[request.param]
    with matmul_precision(precision):
        yield request.param, dtype, path


@pytest.fixture(params=["bf16x3", "tf32"])
def float32_operands(request):
    """The kernel's float32 operands: bf16x3 or TF32, their matmul precision set."""
    with matmul_precision(OPERANDS[request.param][1]):
        yield request.param


@pytest.fixture
def cutlass():
    """Skips where this build has no CUTLASS kernels (setup.py found no CUTLASS headers)."""
    x, weight = case(SPEC_LIKE, torch.float32, "cuda")
    if conv_transpose3d_cascade_sum_path(x, weight, *SPEC_LIKE[5:]).endswith("(built without CUTLASS)"):
        pytest.skip("this build has no CUTLASS kernels")


@requires_sm90
@pytest.mark.parametrize("geometry", KERNEL_GEOMETRIES, ids=KERNEL_IDS)
def test_kernel_random(geometry, operands, tf32, cutlass):
    """Random data: the kernel ran, within float32's (bf16x3), TF32's or bfloat16's bound of the float64
    result on the operands as given; the result in x's dtype, or float32 where asked."""
    name, dtype, path = operands
    x, weight = case(geometry, dtype, "cuda")
    assert conv_transpose3d_cascade_sum_path(x, weight, *geometry[5:]) == path
    poison_cuda_allocator()
    names = cuda_kernel_names(lambda: conv_transpose3d_cascade_sum(x, weight, *geometry[5:]))
    assert any(KERNEL_NAME in n for n in names)
    out = conv_transpose3d_cascade_sum(x, weight, *geometry[5:])
    assert out.dtype == dtype
    check(out, x, weight, geometry, TF32_RTOL if name == "tf32" else RTOL[dtype])
    wide = conv_transpose3d_cascade_sum(x, weight, *geometry[5:], dtype=torch.float32)
    assert wide.dtype == torch.float32 and torch.equal(wide.to(dtype), out)


@requires_sm90
@pytest.mark.parametrize("non_finite", [False, True], ids=["finite", "nan-inf"])
@pytest.mark.parametrize("geometry", KERNEL_GEOMETRIES, ids=KERNEL_IDS)
def test_kernel_integers_exact(geometry, non_finite, float32_operands, tf32, cutlass):
    """bf16x3 or TF32, integer-valued data (ties everywhere): the float64 result exactly and the float64
    composite's picks; with NaN and inf in x, the same (non-finite sums do not depend on the order; bf16x3
    keeps a non-finite x in its low part, whose products with a weight's high part keep it)."""
    x, weight = case(geometry, torch.float32, "cuda", integers=True)
    if non_finite:
        flat = x.view(-1)
        g = torch.Generator().manual_seed(1)
        for value in (float("nan"), float("inf"), float("-inf")):
            flat[torch.randint(0, flat.numel(), (3,), generator=g).cuda()] = value
    poison_cuda_allocator()
    out, picks = OP(x, weight, *args(geometry), True, None)
    expected, expected_picks = composite(x, weight, geometry)
    torch.testing.assert_close(out.cpu(), expected.float(), rtol=0, atol=0, equal_nan=True)
    assert torch.equal(picks.cpu(), expected_picks)
    out_only, none = OP(x, weight, *args(geometry), False, None)
    torch.testing.assert_close(out_only, out, rtol=0, atol=0, equal_nan=True)
    assert none.numel() == 0


@requires_sm90
@pytest.mark.parametrize("geometry", KERNEL_GEOMETRIES, ids=KERNEL_IDS)
def test_kernel_bfloat16_rounds_as_the_original(geometry, cutlass):
    """bfloat16, integer-valued data whose sums bfloat16 rounds: the convolution's sums rounded to
    bfloat16 before the pools (as the original's y is), so the CPU composite's result (float32 sum)
    and picks exactly."""
    x, weight = case(geometry, torch.bfloat16, "cuda", integers=True)
    out, picks = OP(x, weight, *args(geometry), True, torch.float32)
    expected, expected_picks = OP(x.cpu(), weight.cpu(), *args(geometry), True, torch.float32)
    torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0)
    assert torch.equal(picks.cpu(), expected_picks)


@requires_sm90
@pytest.mark.parametrize("layout", ["channels-last", "sliced", "misaligned", "misaligned-channels-last"])
def test_kernel_strided_inputs(layout, float32_operands, tf32, cutlass):
    """x channels-last (read in place), a slice of a larger tensor, at a misaligned address (copied)."""
    x, weight = case(SPEC_LIKE, torch.float32, "cuda", integers=True)
    if layout == "channels-last":
        x = x.contiguous(memory_format=torch.channels_last_3d)
    elif layout == "sliced":
        x = torch.cat([x, x], 4)[..., 1:1 + x.shape[4]].copy_(x)
    else:
        x = misaligned(x, (0, 2, 3, 4, 1) if layout.endswith("channels-last") else (0, 1, 2, 3, 4))
    out, picks = OP(x, weight, *args(SPEC_LIKE), True, None)
    expected, expected_picks = composite(x, weight, SPEC_LIKE)
    torch.testing.assert_close(out.cpu(), expected.float(), rtol=0, atol=0)
    assert torch.equal(picks.cpu(), expected_picks)


def kernel_items(geometry):
    """The kernel's items for a geometry of stride 2 and kernel2 3: one per batch element, output
    depth, pair of output rows and 10 output columns."""
    size, kernel, _, padding, output_padding = geometry[3:8]
    cells = [((s - 1) * 2 - 2 * p + k + op) // 2 // 3 for s, k, p, op in zip(size, kernel, padding, output_padding)]
    return geometry[0] * cells[0] * -(-cells[1] // 2) * -(-cells[2] // 10)


# the kernel's schedule (conv_transpose3d_cascade_sum.cu: schedule()) by how many times the items past the last
# whole wave fit in the multiprocessors: whole items where twice or less, else 3 depths x up to 4 class groups
SCHEDULES = {"whole": (2, 2, False), "3x1": (3, 5, True), "3x2": (6, 8, True), "3x4": (12, 1 << 30, True)}


@requires_sm90
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("kernel", [(5, 2), (4, 1)], ids=["k5p2", "k4p1"])
def test_kernel_split_items_as_whole_ones(kernel, schedule, operands, tf32, cutlass):
    """Without picks the kernel splits the items past its last whole wave (by depth, then class groups;
    with kernel 4 and padding 1 the odd depth classes read no slice of their first depth) and one more
    kernel takes the parts' maxima: bitwise the result of the run with picks, which takes every item
    whole; NaN and inf included. The batch is chosen for each schedule from the multiprocessors' count."""
    k, pad = kernel
    geometry = (1, 32, 64, (16, 16, 32), (k,) * 3, (2, 2, 2), (pad,) * 3, (0, 0, 0), (3, 3, 3))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    low, high, split = SCHEDULES[schedule]
    items = kernel_items(geometry)
    batch = next((b for b in range(1, 400) if (b * items) % sms and low <= sms // ((b * items) % sms) <= high), None)
    if batch is None:
        pytest.skip(f"no batch gives the {schedule} schedule on {sms} multiprocessors")
    geometry = (batch,) + geometry[1:]
    dtype = operands[1]
    x, weight = case(geometry, dtype, "cuda", seed=2)
    x.view(-1)[torch.randint(0, x.numel(), (4,), generator=torch.Generator().manual_seed(3)).cuda()] = \
        torch.tensor([float("nan"), float("inf"), -float("inf"), float("nan")], dtype=dtype, device="cuda")
    whole, _ = OP(x, weight, *args(geometry), True, torch.float32)
    assert whole.isnan().any() and not whole.isnan().all()
    poison_cuda_allocator()
    names = cuda_kernel_names(lambda: OP(x, weight, *args(geometry), False, torch.float32))
    assert any("cascade_parts_sum_kernel" in n for n in names) == split
    values, _ = OP(x, weight, *args(geometry), False, torch.float32)
    torch.testing.assert_close(values, whole, rtol=0, atol=0, equal_nan=True)


@requires_sm90
def test_what_the_kernel_leaves_to_the_composite(tf32, cutlass):
    """Input channels other than 32, over 64 output channels, a stride or kernel2 other than 2 and 3,
    over 3 taps a class, float64, float16 and float32 with TF32 off take the composite."""
    batch, c_in, c_out, size, kernel, stride, padding, output_padding, kernel2 = SPEC_LIKE
    cases = {"C_in 16": (batch, 16, c_out, size, kernel, stride, padding, output_padding, kernel2),
             "C_out 65": (batch, c_in, 65, size, kernel, stride, padding, output_padding, kernel2),
             "stride 3": (batch, c_in, c_out, size, kernel, (2, 2, 3), padding, output_padding, (3, 3, 2)),
             "kernel2 2": (batch, c_in, c_out, size, kernel, stride, padding, output_padding, (3, 2, 3)),
             "kernel 7": (batch, c_in, c_out, size, (5, 7, 5), stride, (2, 3, 2), output_padding, kernel2)}
    for what, geometry in cases.items():
        x, weight = case(geometry, torch.float32, "cuda")
        assert conv_transpose3d_cascade_sum_path(x, weight, *geometry[5:]) == BY_ATEN, what
        check(conv_transpose3d_cascade_sum(x, weight, *geometry[5:]), x, weight, geometry, TF32_RTOL, what)
    for dtype in (torch.float64, torch.float16):
        x, weight = case(SPEC_LIKE, dtype, "cuda")
        assert conv_transpose3d_cascade_sum_path(x, weight, *SPEC_LIKE[5:]) == BY_ATEN, dtype
    x, weight = case(SPEC_LIKE, torch.float32, "cuda")
    cudnn = torch.backends.cudnn
    with cudnn.flags(enabled=True, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic, allow_tf32=False):
        assert conv_transpose3d_cascade_sum_path(x, weight, *SPEC_LIKE[5:]) == BY_ATEN


@requires_sm90
def test_kernel_cuda_graph_capture(float32_operands, tf32, cutlass):
    """Captured in a CUDA graph, a replay on new values gives the eager call's result."""
    x, weight = case(SPEC_LIKE, torch.float32, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        OP(x, weight, *args(SPEC_LIKE), True, None)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = OP(x, weight, *args(SPEC_LIKE), True, None)
    for t, new in zip((x, weight), case(SPEC_LIKE, torch.float32, "cuda", seed=1)):
        t.copy_(new)
    graph.replay()
    out, picks = OP(x, weight, *args(SPEC_LIKE), True, None)
    assert torch.equal(captured[0], out) and torch.equal(captured[1], picks)


# --------------------------------------------------------------------------
# B's module: its rewrite takes the kernel on an sm_90 GPU
# --------------------------------------------------------------------------

# (36864 input elements: over the 2^15 below which B's rule leads with "fused", launch-bound)
B_ARGS, B_SHAPE = (32, 48, 5, 2, 2), (2, 32, 8, 9, 8)


@requires_sm90
@pytest.mark.parametrize("mode", ["eval", "train", "autocast-eval"])
def test_b_module_takes_the_kernel(mode, float32_operands, tf32, cutlass):
    """B's drop-in on integer-valued data: its forward by the kernel (bf16x3 or TF32, or bfloat16 under
    autocast), the original's output and (training) the weight's and bias's gradients exactly (the
    picks are PyTorch's); under autocast against the original under autocast."""
    original, fused = build_pair("ConvTranspose3dMaxPoolMaxPoolSum", B_ARGS)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for module in (original, fused):
            g.manual_seed(2)
            module.conv_transpose.weight.copy_(torch.randint(-2, 3, module.conv_transpose.weight.shape, generator=g))
            module.conv_transpose.bias.copy_(torch.randint(-2, 3, module.conv_transpose.bias.shape, generator=g))
            if mode == "autocast-eval":  # (the rewrite adds the bias after the pools: bfloat16 rounds y without it)
                module.conv_transpose.bias.zero_()
    x = torch.randint(-3, 4, B_SHAPE, generator=g).double()
    train = mode == "train"
    fused.cuda().train(train)
    if mode == "autocast-eval":
        original.cuda().eval()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            names = cuda_kernel_names(lambda: fused(x.float().cuda()))
            out, expected = fused(x.float().cuda()), original(x.float().cuda())
        assert out.dtype == expected.dtype == torch.float32
    else:
        original.double().train(train)
        names = cuda_kernel_names(lambda: fused(x.float().cuda()))
        out, expected = fused(x.float().cuda()), original(x)
    assert any(KERNEL_NAME in n for n in names)
    torch.testing.assert_close(out.double().cpu(), expected.double().cpu(), rtol=0, atol=0)
    if train:
        out.sum().backward()
        expected.sum().backward()
        for name in ("weight", "bias"):
            got = getattr(fused.conv_transpose, name).grad
            torch.testing.assert_close(got.double().cpu(), getattr(original.conv_transpose, name).grad, rtol=0, atol=0,
                                       msg=lambda m: f"{name}: {m}")


SPEC_B = (16, 32, 64, (32, 32, 32), (5, 5, 5), (2, 2, 2), (2, 2, 2), (0, 0, 0), (3, 3, 3))


@requires_sm90
@pytest.mark.parametrize("geometry", [SPEC_B, *KERNEL_GEOMETRIES], ids=["spec", *KERNEL_IDS])
def test_kernel_certified_picks_are_float64s(geometry, tf32, cutlass):
    """bf16x3 with picks (B's training step in float32), random data: the windows with a near tie are
    picked again from float64 sums (cascade_picks_fixup_kernel), so that the picks are the float64
    composite's, every one (bf16x3's roundings alone picked otherwise in 11 of SPEC's 10^6 windows on an
    H200); the output is the run's without picks."""
    x, weight = case(geometry, torch.float32, "cuda", seed=4)
    assert conv_transpose3d_cascade_sum_path(x, weight, *geometry[5:]) == OPERANDS["bf16x3"][2]
    poison_cuda_allocator()
    out, picks = OP(x, weight, *args(geometry), True, None)
    _, exact = OP(x.double(), weight.double(), *args(geometry), True, None)
    assert int((picks != exact).sum()) == 0
    values, _ = OP(x, weight, *args(geometry), False, None)
    torch.testing.assert_close(out, values, rtol=0, atol=0)


@requires_sm90
def test_kernel_runs_the_fixup_with_bf16x3_picks_only(tf32, cutlass):
    """The fixup kernel (cascade_picks_fixup_kernel) runs after the cascade's where bf16x3 computes picks (on
    integer-valued data every window a tie, all listed), not without picks."""
    x, weight = case(SPEC_LIKE, torch.float32, "cuda", integers=True)
    with_picks = cuda_kernel_names(lambda: OP(x, weight, *args(SPEC_LIKE), True, None))
    assert any("cascade_picks_fixup_kernel" in n for n in with_picks)
    without = cuda_kernel_names(lambda: OP(x, weight, *args(SPEC_LIKE), False, None))
    assert not any("cascade_picks_fixup_kernel" in n for n in without)
