"""Architecture D's weight gradient -- ConvTranspose3d(64 -> 128, kernel 5, stride 1, padding 0)
on x (16, 64, 16, 32, 32), grad_y (16, 128, 20, 36, 36) -- by cuDNN and by CUTLASS 3.x Hopper
implicit-GEMM kernels (bench/cutlass/conv3d_wgrad_cutlass.cu, its header says what each variant
computes), in one run (interleaved rounds, CUDA events, median over the rounds), float32 (TF32
allowed: torch.backends.cudnn.allow_tf32 = True) and bf16:

  cuDNN     the transposed convolution's weight gradient as PyTorch's autograd calls it
            (aten.convolution_backward(grad_y, x, w, ..., transposed=True, ...,
            output_mask [False, True, False])) on NCDHW and on channels_last_3d tensors; the
            weight gradient of the equivalent stride-1 conv3d (w_conv = w flipped, in/out
            swapped, padding 4: its flip back not timed) on both layouts.
  copies    the operands' layout changes alone: NCDHW x and grad_y to NDHWC (CUTLASS's wgrad and
            wgrad-pad formulations) and to x (C, H, W, D, N), grad_y (C_out, P, Q, Z, N) (fprop2d,
            the TF32 one) -- the casts to bf16 included in the bf16 group.
  CUTLASS   each variant on operands made beforehand in its layout: wgrad (no padding; out
            (C_in, T, R, S, C_out)), wgrad-pad (grad_y and x as the stride-1 conv3d's wgrad with
            TMA padding 4, as cuDNN's conv3d rows: out (C_out, T, R, S, C_in) flipped), fprop2d
            (per-depth-tap 2-D fprop with the (depth, batch) pairs as channels); "splitN": their
            reduction split into N concurrent launches (CUTLASS 4.2's Hopper convolutions have no
            split-K or stream-K schedule).
  to IOTRS  each CUTLASS output layout's conversion to grad_w's (C_in, C_out, T, R, S) alone
            (permute; flip and permute for wgrad-pad's).

Each result (converted to (C_in, C_out, T, R, S)) is checked against the float64 weight gradient
of the float32 inputs (aten.convolution_backward in float64 on the GPU): the normwise max relative
error max|got - ref| / max|ref| (TF32's ~1e-3; bf16's includes the inputs' rounding). The table
last: time, TFLOP/s of the transposed convolution's 2 * N * C_in * C_out * D * H * W * 125 FLOP
(537 GFLOP at SPEC's size: the padded stride-1 conv3d's implicit GEMM, wgrad-pad's, multiplies
849 GFLOP, zeros included), the time's ratio to the fastest cuDNN row of its precision (above 1:
slower), the error.

    pip install --no-deps nvidia-cutlass==4.2.0.0   (CUTLASS's headers; needs nvcc and a Hopper GPU)
    cd bench && python bench_d_weight_grad_cutlass.py [--batch 16] [--rounds 5] [--only TEXT]
        [--cudnn-benchmark]

The kernels are a shared library with a C interface (no torch headers), loaded by ctypes: built
on first use by nvcc for sm_90a into bench/cutlass/build/ (several minutes), rebuilt where the
source is newer (``--build-only`` builds it, ``--list`` builds it and lists its variants: both on
a machine without a GPU too; ``--library PATH`` loads a prebuilt one, for a GPU machine without
CUTLASS's headers).
"""
import argparse
import contextlib
import ctypes
import os
import statistics
import sys

import torch

from timing import device_name, interleaved_medians

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "cutlass"))
import cutlass_build  # noqa: E402  (bench/cutlass/: how the library is built)

SOURCE = os.path.join(cutlass_build.HERE, "conv3d_wgrad_cutlass.cu")
C_IN, C_OUT, KERNEL, DEPTH, SIZE = 64, 128, 5, 16, 32
STRIDE, ZERO, ONE = [1, 1, 1], [0, 0, 0], [1, 1, 1]
PAD = [KERNEL - 1] * 3
MASK = [False, True, False]


class CutlassConv3dWgrad(cutlass_build.Library):
    """The library's variants: ``variants`` (dicts of the describe fields) and ``run``."""

    FIELDS = ("name", "dtype", "formulation", "x_layout", "grad_y_layout", "out_layout", "tile", "cluster",
              "splits", "stages", "smem_bytes", "threads")

    def __init__(self, path: str):
        super().__init__(path, "cutlass_conv3d_wgrad", self.FIELDS, ("splits", "stages", "smem_bytes", "threads"))
        self.lib.cutlass_conv3d_wgrad_workspace_bytes.restype = ctypes.c_longlong
        self.lib.cutlass_conv3d_wgrad_workspace_bytes.argtypes = [ctypes.c_int] * 10
        self.lib.cutlass_conv3d_wgrad_run.argtypes = (
            [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_longlong] + [ctypes.c_int] * 9
            + [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int])

    def workspace_bytes(self, name: str, problem: tuple) -> int:
        """problem: (n, c_in, d, h, w, c_out, kt, kr, ks) of the transposed convolution."""
        size = self.lib.cutlass_conv3d_wgrad_workspace_bytes(self.variant(name)["index"], *problem)
        if size < 0:
            raise ValueError(f"{name}: invalid problem {problem}")
        return size

    def run(self, name: str, x: torch.Tensor, grad_y: torch.Tensor, out: torch.Tensor, workspace: torch.Tensor | None,
            problem: tuple) -> torch.Tensor:
        """Variant `name` on x and grad_y in its layouts (contiguous, float32 for tf32, bfloat16 for
        bf16) into `out` (float32, its out_layout), on the current stream."""
        variant = self.variant(name)
        element = torch.float32 if variant["dtype"] == "tf32" else torch.bfloat16
        for t, what in ((x, "x"), (grad_y, "grad_y")):
            if not (t.is_cuda and t.dtype == element and t.is_contiguous()):
                raise ValueError(f"{name}: {what} must be a contiguous CUDA {element} tensor")
        if not (out.is_cuda and out.dtype == torch.float32 and out.is_contiguous()):
            raise ValueError(f"{name}: out must be a contiguous float32 CUDA tensor")
        super().run(name, x.data_ptr(), grad_y.data_ptr(), out.data_ptr(),
                    None if workspace is None else workspace.data_ptr(), 0 if workspace is None else workspace.numel(),
                    *problem, torch.cuda.current_stream(x.device).cuda_stream)
        return out


def relayout(t: torch.Tensor, dims: tuple, dtype: torch.dtype) -> torch.Tensor:
    """t permuted by dims as a contiguous tensor of `dtype`: one copy (and cast) kernel."""
    shape = [t.shape[d] for d in dims]
    return torch.empty(shape, dtype=dtype, device=t.device).copy_(t.permute(*dims))


NDHWC = (0, 2, 3, 4, 1)      # (N, C, D, H, W) -> (N, D, H, W, C)
CHWDN = (1, 3, 4, 2, 0)      # (N, C, D, H, W) -> (C, H, W, D, N): fprop2d's x and grad_y


def to_iotrs(out: torch.Tensor, layout: str) -> torch.Tensor:
    """A CUTLASS output as grad_w's (C_in, C_out, T, R, S), contiguous."""
    if layout == "ITRSO":
        return out.permute(0, 4, 1, 2, 3).contiguous()
    if layout == "OTRSI":
        return out.permute(4, 0, 1, 2, 3).contiguous()
    if layout == "OTRSI-flipped":
        return out.flip(1, 2, 3).permute(4, 0, 1, 2, 3).contiguous()
    raise ValueError(layout)


def out_shape(layout: str, c_in: int, c_out: int, k: int) -> tuple:
    return (c_in, k, k, k, c_out) if layout == "ITRSO" else (c_out, k, k, k, c_in)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=10, help="timed calls per row and round")
    parser.add_argument("--build-only", action="store_true", help="build the CUTLASS library, then stop")
    parser.add_argument("--list", action="store_true", help="build the library, list its variants (no GPU), stop")
    parser.add_argument("--only", action="append", metavar="TEXT",
                        help="time only the CUTLASS variants whose name contains TEXT (repeatable; default: all)")
    parser.add_argument("--cudnn-benchmark", action="store_true",
                        help="torch.backends.cudnn.benchmark = True (cuDNN times its algorithms; default: heuristics)")
    parser.add_argument("--library", metavar="PATH",
                        help="load this prebuilt library (e.g. one built elsewhere by --build-only) and build nothing")
    args = parser.parse_args()
    library = args.library or cutlass_build.build_library(SOURCE)
    if args.build_only:
        return
    ext = CutlassConv3dWgrad(library)
    variants = [v for v in ext.variants if not args.only or any(text in v["name"] for text in args.only)]
    print("CUTLASS variants (sm_90a, KernelImplicitTmaWarpSpecializedSm90; splitN: N concurrent launches):")
    for v in variants:
        print(f"  {v['name']:<40} x {v['x_layout']}, grad_y {v['grad_y_layout']}, out {v['out_layout']:<13} "
              f"stages {v['stages']:>2}, shared memory {v['smem_bytes'] / 1024:5.1f} KiB, {v['threads']} threads")
    if args.list:
        problem = (args.batch, C_IN, DEPTH, SIZE, SIZE, C_OUT, KERNEL, KERNEL, KERNEL)
        for v in variants:
            print(f"  {v['name']:<40} workspace {ext.workspace_bytes(v['name'], problem) / 2**20:.1f} MiB")
        return

    device = torch.device("cuda")
    if torch.cuda.get_device_capability(device) != (9, 0):
        sys.exit(f"bench_d_weight_grad_cutlass: the CUTLASS kernels are sm_90a (Hopper) only; "
                 f"this is {device_name(device)}")
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = args.cudnn_benchmark

    n = args.batch
    problem = (n, C_IN, DEPTH, SIZE, SIZE, C_OUT, KERNEL, KERNEL, KERNEL)
    torch.manual_seed(0)
    x = torch.randn(n, C_IN, DEPTH, SIZE, SIZE, device=device)
    w = torch.randn(C_IN, C_OUT, KERNEL, KERNEL, KERNEL, device=device)
    y_size = [s + KERNEL - 1 for s in (DEPTH, SIZE, SIZE)]
    grad_y = torch.randn(n, C_OUT, *y_size, device=device)
    w_conv = w.flip(2, 3, 4).transpose(0, 1).contiguous()  # the stride-1 conv3d's weight (C_out, C_in, T, R, S)

    with torch.no_grad():
        expected = torch.ops.aten.convolution_backward(
            grad_y.double(), x.double(), w.double(), None, STRIDE, ZERO, ONE, True, ZERO, 1, MASK)[1]
        torch.cuda.synchronize()
    scale = expected.abs().max().item()

    flop = 2 * n * C_IN * C_OUT * DEPTH * SIZE * SIZE * KERNEL ** 3
    gemm_flop_padded = 2 * n * C_OUT * y_size[0] * y_size[1] * y_size[2] * C_IN * KERNEL ** 3
    print(f"{device_name(device)}; x {tuple(x.shape)}, grad_y {tuple(grad_y.shape)}, weight {tuple(w.shape)}; "
          f"TF32 {torch.backends.cudnn.allow_tf32}, cudnn.benchmark {torch.backends.cudnn.benchmark}; "
          f"{flop / 1e9:.0f} GFLOP (the padded conv3d's GEMM: {gemm_flop_padded / 1e9:.0f})")

    # the operands each caller holds ready (made outside the timed calls)
    dtypes = {"tf32": torch.float32, "bf16": torch.bfloat16}
    cast = {p: (x.to(dt), grad_y.to(dt), w.to(dt), w_conv.to(dt)) for p, dt in dtypes.items()}
    cl = torch.channels_last_3d
    cast_cl = {p: tuple(t.contiguous(memory_format=cl) for t in ts) for p, ts in cast.items()}
    operands = {}  # (precision, "NDHWC" | "CHWDN") -> (x, grad_y)
    for p, dt in dtypes.items():
        operands[p, "NDHWC"] = (relayout(x, NDHWC, dt), relayout(grad_y, NDHWC, dt))
        operands[p, "CHWDN"] = (relayout(x, CHWDN, dt), relayout(grad_y, CHWDN, dt))

    # name -> (call, precision, to grad_w (C_in, C_out, T, R, S) for the error check, or None: not checked)
    rows = {}
    for p in dtypes:
        xs, gs, ws, wcs = cast[p]
        xc, gc, wc, wcc = cast_cl[p]
        suffix = "" if p == "tf32" else " bf16"

        def convt(g, xx, ww):
            return lambda: torch.ops.aten.convolution_backward(g, xx, ww, None, STRIDE, ZERO, ONE, True, ZERO, 1,
                                                               MASK)[1]

        def conv(g, xx, ww):
            return lambda: torch.ops.aten.convolution_backward(g, xx, ww, None, STRIDE, PAD, ONE, False, ZERO, 1,
                                                               MASK)[1]

        def from_conv(gw):  # the conv3d's weight gradient (C_out, C_in, T, R, S) as grad_w
            return gw.flip(2, 3, 4).transpose(0, 1)

        rows[f"cuDNN convT NCDHW{suffix}"] = (convt(gs, xs, ws), p, lambda r: r)
        rows[f"cuDNN convT channels_last{suffix}"] = (convt(gc, xc, wc), p, lambda r: r)
        rows[f"cuDNN conv3d pad4 NCDHW{suffix}"] = (conv(gs, xs, wcs), p, from_conv)
        rows[f"cuDNN conv3d pad4 channels_last{suffix}"] = (conv(gc, xc, wcc), p, from_conv)
        dt = dtypes[p]
        rows[f"copy x, grad_y -> NDHWC{suffix}"] = (
            lambda dt=dt: (relayout(x, NDHWC, dt), relayout(grad_y, NDHWC, dt)), p, None)
        rows[f"copy x, grad_y -> CHWDN, KPQZN{suffix}"] = (
            lambda dt=dt: (relayout(x, CHWDN, dt), relayout(grad_y, CHWDN, dt)), p, None)

    outputs = {}  # layout -> an output of that layout, for the conversion rows
    cutlass_rows = {}
    for v in variants:
        name, p, layout = v["name"], v["dtype"], v["out_layout"]
        xs, gs = operands[p, "NDHWC" if v["x_layout"] == "NDHWC" else "CHWDN"]
        out = torch.empty(out_shape(layout, C_IN, C_OUT, KERNEL), device=device)
        size = ext.workspace_bytes(name, problem)
        workspace = torch.empty(size, dtype=torch.uint8, device=device) if size else None

        def call(name=name, xs=xs, gs=gs, out=out, workspace=workspace):
            return ext.run(name, xs, gs, out, workspace, problem)
        try:
            call()
            torch.cuda.synchronize()
        except RuntimeError as e:  # (a variant CUTLASS refuses at run time: reported, left out)
            print(f"left out: {e}")
            continue
        outputs.setdefault(layout, out)
        cutlass_rows[name] = (call, p, lambda r, layout=layout: to_iotrs(r, layout))
    rows.update(cutlass_rows)
    for layout, out in outputs.items():
        rows[f"to IOTRS from {layout}"] = (lambda out=out, layout=layout: to_iotrs(out, layout), "tf32", None)

    errors = {}
    with torch.no_grad():
        for name, (call, _, convert) in rows.items():
            if convert is not None:
                got = convert(call()).double()
                errors[name] = ((got - expected).abs().max() / scale).item()
        torch.cuda.synchronize()
        calls = {name: call for name, (call, _, _) in rows.items()}
        times = interleaved_medians(calls, device, {name: args.reps for name in calls}, args.rounds,
                                    lambda name: contextlib.nullcontext())

    ms = {name: statistics.median(rounds) for name, rounds in times.items()}
    best = {p: min(ms[name] for name, (_, q, _) in rows.items() if q == p and name.startswith("cuDNN"))
            for p in dtypes}
    width = max(map(len, rows)) + 2
    print(f"\n{'variant':<{width}}{'ms':>8}{'TFLOP/s':>9}{'vs cuDNN':>10}{'max rel err':>13}")
    order = ([name for name in rows if rows[name][1] == "tf32"], [name for name in rows if rows[name][1] == "bf16"])
    for group in order:
        for name in group:
            p = rows[name][1]
            err = f"{errors[name]:>13.1e}" if name in errors else f"{'':>13}"
            tflops = f"{flop / ms[name] / 1e9:>9.0f}" if name in errors else f"{'':>9}"
            print(f"{name:<{width}}{ms[name]:>8.3f}{tflops}{ms[name] / best[p]:>10.2f}{err}")
        print()
    print("vs cuDNN: the time over the fastest cuDNN row of the same precision (the conversion rows: over TF32's)")


if __name__ == "__main__":
    main()
