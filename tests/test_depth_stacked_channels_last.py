"""fused_ops.depth_stacked_channels_last against the same copy built with plain PyTorch (F.pad and slicing,
in float64), bit for bit: it is a copy with a cast.

For x (N, I, D, H, W): out (N, M, Hs, Ws, taps, I) with
out[n, m, h, w, a, i] = x[n, i, start[0] + stride * m + a, start[1] + h, start[2] + w] inside x, else 0.
"""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import DTYPES, LAYOUTS_5D, cuda_kernel_names, in_layout_5d, make_input, poison_cuda_allocator
from fused_ops import depth_stacked_channels_last

OP = torch.ops.fused_ops.depth_stacked_channels_last.default

BAD = (ValueError, TypeError, RuntimeError)


def reference(x, taps, stride, start, size):
    """The op in float64 on the CPU: x zero-padded so that every index the output reads lies inside,
    the `taps` depth slices of stride `stride` stacked last, channels moved after them."""
    v = x.detach().cpu().double()
    last = [start[0] + stride * (size[0] - 1) + taps - 1, start[1] + size[1] - 1, start[2] + size[2] - 1]
    before = [max(0, -s) for s in start]
    after = [max(0, e - (v.shape[2 + d] - 1)) for d, e in enumerate(last)]
    v = F.pad(v, (before[2], after[2], before[1], after[1], before[0], after[0]))
    o = [s + b for s, b in zip(start, before)]
    depths = [v[:, :, o[0] + a:o[0] + a + stride * size[0]:stride, o[1]:o[1] + size[1], o[2]:o[2] + size[2]]
              for a in range(taps)]
    return torch.stack(depths, -1).permute(0, 2, 3, 4, 5, 1)  # (N, M, Hs, Ws, taps, I)


def check(x, taps, stride, start, size, dtype=None):
    """The op (wrapper) on x against the reference cast to the output's dtype: equal, bit for bit."""
    poison_cuda_allocator()
    out = depth_stacked_channels_last(x, taps, stride, start, size, dtype=dtype)
    expected = reference(x, taps, stride, start, size).to(x.dtype if dtype is None else dtype)
    assert out.shape == (x.shape[0], *size, taps, x.shape[1])
    assert out.dtype == expected.dtype and out.device == x.device and out.is_contiguous()
    assert torch.equal(out.cpu(), expected), f"taps={taps} stride={stride} start={start} size={size}"
    return out


def test_reference_helper():
    """The reference against the definition, element by element."""
    x = torch.arange(2 * 3 * 5 * 4 * 6, dtype=torch.float64).reshape(2, 3, 5, 4, 6) + 1
    for taps, stride, start, size in [(3, 2, (-2, -1, -3), (4, 6, 11)), (2, 1, (1, 1, 2), (3, 2, 3)),
                                      (1, 3, (4, 3, 5), (2, 2, 2))]:
        out = reference(x, taps, stride, start, size).tolist()
        xl = x.tolist()
        for n, m, h, w, a, i in itertools.product(range(2), range(size[0]), range(size[1]), range(size[2]),
                                                  range(taps), range(3)):
            d, hh, ww = start[0] + stride * m + a, start[1] + h, start[2] + w
            inside = 0 <= d < 5 and 0 <= hh < 4 and 0 <= ww < 6
            assert out[n][m][h][w][a][i] == (xl[n][i][d][hh][ww] if inside else 0)


# (x shape, taps, stride, start, size)
CONFIGS = [
    # padding on every side: negative starts, windows past the end
    ((2, 3, 5, 6, 7), 3, 1, (-1, -2, -3), (5, 9, 11)),
    ((1, 8, 9, 5, 4), 4, 2, (-1, -1, -1), (5, 7, 6)),
    ((2, 1, 7, 3, 5), 5, 3, (-2, -1, -2), (3, 5, 9)),
    # cropping: the window starts inside and ends before the end
    ((1, 3, 9, 8, 10), 2, 2, (1, 2, 3), (3, 4, 5)),
    ((2, 32, 6, 5, 7), 2, 1, (1, 1, 1), (3, 3, 5)),
    # taps x channels over two staged passes of the CUDA kernel, the second partial (60 = 32 + 28)
    ((1, 20, 5, 6, 7), 3, 1, (0, -1, 0), (3, 8, 7)),
    # both: cropped in one dimension, padded in another
    ((1, 8, 8, 7, 9), 3, 3, (2, -1, 1), (2, 9, 7)),
    # taps 1, stride 1: a plain cropped channels-last copy
    ((2, 3, 4, 5, 6), 1, 1, (0, 0, 0), (4, 5, 6)),
    # an architecture-like case: I = 8, taps 4, stride 2, one element of padding
    ((2, 8, 8, 9, 10), 4, 2, (-1, -1, -1), (4, 11, 12)),
    # windows wholly outside x
    ((1, 3, 3, 3, 3), 2, 1, (5, -6, 4), (2, 3, 2)),
]
CONFIG_IDS = [f"{s}-t{t}-s{st}-{o}-{z}" for s, t, st, o, z in CONFIGS]


@pytest.mark.parametrize("shape,taps,stride,start,size", CONFIGS, ids=CONFIG_IDS)
def test_matches_reference(shape, taps, stride, start, size, device, dtype):
    check(make_input(shape, dtype, device), taps, stride, start, size)


@pytest.mark.parametrize("x_dtype,out_dtype", list(itertools.product(DTYPES, DTYPES)),
                         ids=lambda d: str(d).removeprefix("torch."))
def test_output_dtypes(x_dtype, out_dtype, device):
    """Every pair of dtypes (float32 -> bfloat16 under autocast, say): the values cast as Tensor.to casts."""
    out = check(make_input((2, 5, 6, 4, 7), x_dtype, device), 3, 2, (-1, -1, 1), (3, 6, 7), out_dtype)
    assert out.dtype == out_dtype


@pytest.mark.parametrize("x_dtype,out_dtype", list(itertools.product(DTYPES, DTYPES)),
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", [(3, 64, 5, 7, 8), (1, 32, 2, 8, 8), (2, 96, 1, 1, 136), (2, 32, 5, 7, 9)],
                         ids=["partial-tile", "one-tile", "plane-136", "plane-315"])
def test_plain_channels_last(shape, x_dtype, out_dtype, device):
    """The plain case (taps 1, stride 1, x whole and contiguous, channels a multiple of 32; planes of
    a multiple of 16 bytes: the CUDA transpose kernel's, positions a partial tile or exactly one; 315
    positions: the general kernel's): x channels-last, bit for bit as Tensor.to casts (random values,
    which 16-bit dtypes round; infinities; 257, which bfloat16 rounds to 256)."""
    x = make_input(shape, x_dtype, device)
    x.view(-1)[:3] = torch.tensor([float("inf"), -float("inf"), 257.0], dtype=x_dtype)
    out = check(x, 1, 1, (0, 0, 0), shape[2:], out_dtype)
    if device == "cuda":
        names = cuda_kernel_names(lambda: depth_stacked_channels_last(x, 1, 1, 0, shape[2:], dtype=out_dtype))
        plain = math.prod(shape[2:]) * x.element_size() % 16 == 0  # (x's planes: 16-byte vectors)
        assert any(("channels_last_kernel" if plain else "depth_stack_kernel") in n for n in names)
    assert out.dtype == out_dtype


@pytest.mark.parametrize("out_dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_wide_rows(out_dtype, device):
    """Ws = 700 with taps * I = 64, positions past the input's width on both sides; a float32 x."""
    check(make_input((1, 32, 4, 3, 690), torch.float32, device), 2, 2, (-1, -1, -4), (2, 4, 700), out_dtype)


def test_largest_rows(device):
    """taps * I = 8 * 512 float64 values per position: more vectors than a block's threads on a GPU
    (each thread loops over several of one position)."""
    check(make_input((1, 512, 9, 2, 3), torch.float64, device), 8, 1, (-1, 0, -1), (2, 2, 5))


@pytest.mark.parametrize("layout", LAYOUTS_5D)
def test_non_contiguous(layout, device, dtype):
    """x read in place at its strides: channels_last_3d, a transposed, a sliced, a misaligned, an expanded view."""
    x = in_layout_5d(make_input((2, 5, 6, 7, 9), dtype, device), layout)
    check(x, 3, 2, (-1, 1, -2), (3, 6, 9))
    check(x, 2, 1, (0, 0, 0), (3, 4, 4), torch.float32)


@pytest.mark.parametrize("shape,size", [((2, 3, 4, 5, 6), (0, 3, 3)), ((2, 3, 4, 5, 6), (2, 0, 3)),
                                        ((2, 3, 4, 5, 6), (2, 3, 0)), ((0, 3, 4, 5, 6), (2, 3, 3)),
                                        ((2, 0, 4, 5, 6), (2, 3, 3))])
def test_empty_output(shape, size, device):
    out = depth_stacked_channels_last(torch.ones(shape, device=device), 2, 1, (0, 0, 0), size, dtype=torch.bfloat16)
    assert out.shape == (shape[0], *size, 2, shape[1]) and out.dtype == torch.bfloat16 and out.numel() == 0


def test_empty_input_pads(device):
    """An x with no depth: every index lies outside, the output is all zeros."""
    check(torch.ones((1, 3, 0, 4, 5), device=device), 2, 1, (-1, 0, 0), (2, 4, 5))


@pytest.mark.parametrize("raw", [False, True], ids=["wrapper", "raw"])
@pytest.mark.parametrize(
    "shape,x_dtype,taps,stride,size,dtype,match",
    [
        ((2, 3, 4, 5), torch.float32, 2, 1, (2, 2, 2), None, "expected a 5-D input x"),
        ((1, 2, 3, 4, 5, 6), torch.float32, 2, 1, (2, 2, 2), None, "expected a 5-D input x"),
        ((1, 2, 3, 4, 5), torch.int64, 2, 1, (2, 2, 2), None, "x must be a floating-point tensor"),
        ((1, 2, 3, 4, 5), torch.float32, 0, 1, (2, 2, 2), None, "taps must be at least 1"),
        ((1, 2, 3, 4, 5), torch.float32, 2, 0, (2, 2, 2), None, "stride must be at least 1"),
        ((1, 2, 3, 4, 5), torch.float32, 2, 1, (2, -1, 2), None, "size must be non-negative"),
        ((1, 2, 3, 4, 5), torch.float32, 2, 1, (2, 2, 2), torch.int32, "dtype must be a floating-point type"),
        ((1, 2, 3, 4, 5), torch.float16, 2, 1, (2, 2, 2), torch.complex64, "dtype must be a floating-point type"),
    ],
)
def test_bad_input(shape, x_dtype, taps, stride, size, dtype, match, raw, device):
    x = torch.ones(shape, dtype=x_dtype, device=device)
    with pytest.raises(BAD, match=f"depth_stacked_channels_last: {match}"):
        if raw:
            OP(x, taps, stride, [0, 0, 0], list(size), dtype)
        else:
            depth_stacked_channels_last(x, taps, stride, 0, size, dtype=dtype)


def test_bad_argument_lengths(device):
    x = torch.ones((1, 2, 3, 4, 5), device=device)
    with pytest.raises(BAD, match="start must have 1 or 3 elements"):
        OP(x, 2, 1, [0, 0], [2, 2, 2], None)
    with pytest.raises(BAD, match="size must have 1 or 3 elements"):
        OP(x, 2, 1, [0, 0, 0], [2, 2], None)


@pytest.mark.parametrize("taps,stride,start,size", [
    (1, 2 ** 62, [0, 0, 0], [5, 1, 1]),        # start + stride (M - 1): 2^64
    (2, 1, [2 ** 63 - 1, 0, 0], [1, 1, 1]),    # + taps - 1
    (1, 1, [0, 0, 2 ** 63 - 1], [1, 1, 2]),    # start + size - 1 along W
])
def test_positions_past_int64_refused(taps, stride, start, size, device):
    """Positions past int64 are refused, not wrapped around into x (stride 2^62 over 5 depths read x's depth
    0 at m = 4)."""
    x = torch.ones((1, 1, 4, 1, 1), dtype=torch.float64, device=device)
    with pytest.raises(BAD, match="reach positions past int64"):
        OP(x, taps, stride, start, size, None)
    far = OP(x, 1, 2 ** 40, [0, 0, 0], [5, 1, 1], None)  # (large, but within int64: zeros past x)
    assert torch.equal(far.flatten().cpu(), torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64))


def test_refuses_an_input_requiring_grad(device):
    """Not differentiable: the wrapper refuses an x that requires grad under grad mode, and runs
    the copy under no_grad or on a detached x."""
    x = make_input((1, 2, 3, 4, 5), torch.float32, device, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"depth_stacked_channels_last: not differentiable, and x requires grad "
                       r"\(run it under torch.no_grad\(\) or on a detached x\)"):
        depth_stacked_channels_last(x, 2, 1, 0, (2, 4, 5))
    expected = depth_stacked_channels_last(x.detach(), 2, 1, 0, (2, 4, 5))
    with torch.no_grad():
        assert torch.equal(depth_stacked_channels_last(x, 2, 1, 0, (2, 4, 5)), expected)
    assert not expected.requires_grad


def test_opcheck(device):
    x = make_input((2, 3, 5, 6, 7), torch.float32, device)
    torch.library.opcheck(OP, (x, 3, 2, [-1, -1, -1], [3, 8, 9], None))
    torch.library.opcheck(OP, (x, 2, 1, [1, 2, 0], [3, 4, 7], torch.bfloat16))
    torch.library.opcheck(OP, (x.to(memory_format=torch.channels_last_3d).half(), 1, 3, [0, 0, 0], [2, 6, 7],
                               torch.float32))


def test_autocast(device):
    """Under autocast the op runs as called: x's dtype for None, a named dtype kept."""
    x = make_input((2, 3, 5, 6, 7), torch.float32, device)
    expected = depth_stacked_channels_last(x, 2, 2, (-1, 0, 0), (3, 6, 7), dtype=torch.bfloat16)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        same = depth_stacked_channels_last(x, 2, 2, (-1, 0, 0), (3, 6, 7))
        cast = depth_stacked_channels_last(x, 2, 2, (-1, 0, 0), (3, 6, 7), dtype=torch.bfloat16)
    assert same.dtype == torch.float32 and torch.equal(same.to(torch.bfloat16), expected)
    assert torch.equal(cast, expected)


@pytest.mark.parametrize("key", ["AutocastCPU", "AutocastCUDA"])
def test_autocast_kernels_registered(key):
    assert torch._C._dispatch_has_kernel_for_dispatch_key("fused_ops::depth_stacked_channels_last", key)


def test_torch_compile(device):
    """torch.compile(fullgraph=True) of a function calling the wrapper: equal to eager."""
    def f(t):
        return depth_stacked_channels_last(t * 2, 3, 2, (-1, -1, 0), (3, 7, 6), dtype=torch.bfloat16).float() + 1

    x = make_input((2, 4, 6, 5, 6), torch.float32, device)
    assert torch.equal(torch.compile(f, fullgraph=True)(x), f(x))
