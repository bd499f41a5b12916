"""Timing helpers of the benchmarks: the backward alone, each tail's variants
side by side, the device's measured copy bandwidth; the medians themselves
(CUDA events on a GPU, the wall clock on a CPU) are fused_ops._timing's."""
import contextlib
import json
import os
import statistics
from collections.abc import Callable

import torch

from fused_ops._timing import (device_name, device_slug, interleaved_medians, median_ms, provenance,  # noqa: F401
                              warm_up)  # (for run.py, models.py, first_calls.py, ...)


def result_path(out_dir: str, kind: str, device: str, autocast: str | None) -> str:
    """out_dir/<kind>-<device>[-autocast-<dtype>].json"""
    return os.path.join(out_dir, f"{kind}-{device_slug(device)}" + (f"-autocast-{autocast}" if autocast else "") + ".json")


def write_result(result: dict, out_dir: str, kind: str) -> str:
    """result as result_path(out_dir, kind, ...): the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = result_path(out_dir, kind, result["device"], result["autocast"])
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path


def backward_ms(fn, x, device) -> float:
    """Time of the backward of fn at x alone: one forward, then autograd.grad repeated."""
    x = x.detach().requires_grad_()
    out = fn(x)
    grad = torch.rand_like(out)
    return median_ms(lambda: torch.autograd.grad(out, x, grad, retain_graph=True), device)


def time_tails(op: str, fused, eager, x, device, compile_tail: bool, max_rel_err: float,
               forward_bytes: int | None = None, backward_bytes: int | None = None,
               eval_tails: tuple | None = None) -> list[dict]:
    """One row per variant of a tail at x: the fused op, the eager tail and
    (compile_tail) torch.compile of the eager tail; forward and backward times.
    forward_bytes: what the forward must read, where that is less than all of x;
    backward_bytes: what the backward must move, where that is more than a
    write of grad_x. eval_tails: (fused, eager) of the tail in eval mode, where
    it has one (a batch norm's): each variant's eval forward too."""
    nbytes = x.numel() * x.element_size()
    variants = {"fused": (fused, None), "eager": (eager, None)}
    if eval_tails is not None:
        variants = {"fused": (fused, eval_tails[0]), "eager": (eager, eval_tails[1])}
    if compile_tail:
        variants["compile"] = (torch.compile(eager), None if eval_tails is None else torch.compile(eval_tails[1]))
    rows = []
    for name, (fn, eval_fn) in variants.items():
        with torch.no_grad():
            fwd = median_ms(lambda: fn(x), device)
            eval_fwd = None if eval_fn is None else median_ms(lambda: eval_fn(x), device)
        bwd = backward_ms(fn, x, device)
        rows.append(dict(op=op, variant=name, shape=list(x.shape), dtype=str(x.dtype).removeprefix("torch."),
                         forward_ms=fwd, backward_ms=bwd, max_rel_err=max_rel_err,
                         # the fewest bytes each pass must move: read x (or the part of it
                         # that reaches the output) / write grad_x
                         forward_bytes=nbytes if forward_bytes is None else forward_bytes,
                         backward_bytes=nbytes if backward_bytes is None else backward_bytes))
        if eval_fwd is not None:
            rows[-1]["eval_forward_ms"] = eval_fwd
    return rows


def copy_bandwidth_gbs(device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus written."""
    src = torch.rand(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device)
    return 2 * nbytes / ms / 1e6


def module_training_step(module, x, grad, formulation=None):
    """A training step of module(x) for timing: the forward (under fused_ops.autotune.force(formulation)
    where one is named), then the backward of its result (as float32) with `grad`."""
    from fused_ops import autotune

    def step():
        with autotune.force(formulation) if formulation else contextlib.nullcontext():
            out = module(x)
        out.float().backward(grad)
    return step


def print_convolution_table(times: dict, errors: dict, flop: float, read: int, width: int = 18) -> None:
    """A row per variant: its median time over the rounds, the TFLOP/s of `flop` and the GB/s of
    `read` bytes at that time, and its error (`errors[name]`)."""
    print(f"{'variant':<{width}}{'ms':>8}{'TFLOP/s':>9}{'GB/s':>7}{'max rel err':>13}")
    for name, rounds in times.items():
        ms = statistics.median(rounds)
        print(f"{name:<{width}}{ms:>8.3f}{flop / ms / 1e9:>9.0f}{read / ms / 1e6:>7.0f}{errors[name]:>13.1e}")


def forced_call(module, x, formulation):
    """module(x) under fused_ops.autotune.force(formulation), as a call to time."""
    from fused_ops import autotune

    def call():
        with autotune.force(formulation):
            return module(x)
    return call


def with_bf16_autocast(calls: dict) -> tuple[dict, Callable]:
    """The calls and the same again under CUDA bfloat16 autocast (names ending in " bf16"), and the
    settings function interleaved_medians takes for them."""
    def settings(name):
        return torch.autocast("cuda", torch.bfloat16) if name.endswith(" bf16") else contextlib.nullcontext()
    return {**calls, **{f"{name} bf16": call for name, call in calls.items()}}, settings


def print_against_cudnn(rows: dict, ms: dict, errors: dict, flop: float) -> None:
    """The table of a benchmark of an op against cuDNN: rows {name: (call, group, checked)}, ms
    {name: median ms}, errors {name: max rel err} of the checked rows; a row per variant: its time,
    the TFLOP/s of `flop` and its error where checked, its time over the fastest row of its group
    whose name starts with "cuDNN" (groups without one: none)."""
    best = {}
    for name, (_, group, _) in rows.items():
        if name.startswith("cuDNN"):
            best[group] = min(best.get(group, ms[name]), ms[name])
    width = max(map(len, rows)) + 2
    print(f"\n{'variant':<{width}}{'ms':>9}{'TFLOP/s':>9}{'vs cuDNN':>10}{'max rel err':>13}")
    for name, (_, group, checked) in rows.items():
        tflops = f"{flop / ms[name] / 1e9:>9.0f}" if checked else f"{'':>9}"
        ratio = f"{ms[name] / best[group]:>10.2f}" if group in best else f"{'':>10}"
        error = f"{errors[name]:>13.1e}" if checked else f"{'':>13}"
        print(f"{name:<{width}}{ms[name]:>9.3f}{tflops}{ratio}{error}")
    print("vs cuDNN: the time over the faster cuDNN row of the same dtype (above 1: slower)")


def run_against_cudnn(rows: dict, expected, args, device, settings: Callable, operands: str, paths: dict,
                      flop: float) -> None:
    """The last part of the benchmarks of B's and D's convolutions: each checked row of rows {name: (call,
    group, checked)} checked against `expected` (float64: its normwise error, max |got - exact| /
    max |exact|), every row timed in interleaved rounds, each call inside settings(name) (a context
    manager), then a header line (`operands` says their shapes), the op's paths {operands' dtype: path}
    and print_against_cudnn's table."""
    from fused_ops import autotune

    scale = expected.abs().max().item()
    errors = {}
    for name, (call, _, checked) in rows.items():
        if checked:
            with torch.no_grad(), settings(name):
                errors[name] = ((call().double() - expected).abs().max() / scale).item()
    reps = args.reps or (20 if device.type == "cuda" else 3)
    times = interleaved_medians({name: call for name, (call, _, _) in rows.items()}, device,
                                {name: reps for name in rows}, args.rounds, settings)
    autotune.clear()
    ms = {name: statistics.median(rounds) for name, rounds in times.items()}
    print(f"{device_name(device)}; {operands}; {flop / 1e9:.0f} GFLOP; torch {torch.__version__}; "
          f"medians of {args.rounds} rounds of {reps} calls")
    print("the op's path: " + "; ".join(f"{dtype} {path}" for dtype, path in paths.items()))
    print_against_cudnn(rows, ms, errors, flop)


def convolution_arguments(description: str, letter: str, switches: dict | None = None) -> tuple:
    """The command line of the benchmarks of an architecture's convolutions (--device, --size,
    --batch, --rounds, --reps, and a benchmark's own `switches`: {flag: help}), parsed: (args, device, the
    input shape of architecture `letter`: spec on a GPU, reduced on a CPU by default); TF32 convolutions
    allowed (PyTorch's default)."""
    import argparse

    from fused_ops import architectures

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=architectures.SIZES, default=None,
                        help=f"{letter}'s input size (spec on a GPU, reduced on a CPU)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=None, help="timed calls per row and round (20 GPU, 3 CPU)")
    for flag, text in (switches or {}).items():
        parser.add_argument(flag, action="store_true", help=text)
    args = parser.parse_args()
    device = torch.device(args.device)
    architecture = next(a for a in architectures.ARCHITECTURES if a.letter == letter)
    torch.backends.cudnn.allow_tf32 = True
    size = args.size or ("spec" if device.type == "cuda" else "reduced")
    return args, device, architecture.input_shape(size, args.batch)


def build_extension(name: str, source: str, extra_cuda_cflags=()):
    """The torch extension `name` from bench/extensions/`source`, built for sm_90a with CUTLASS's headers
    (CuTe's wgmma, CUTLASS's kernels) and csrc/cuda's as setup.py finds them; exits where the machine has
    neither."""
    import os
    import sys
    import time

    from torch.utils.cpp_extension import load

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    import setup  # (the extension's flags: sm_90a, CUTLASS's headers)

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    arch, sm90a = setup.cuda_arch_flags()
    cutlass = setup.cutlass_root()
    if not sm90a or cutlass is None:
        sys.exit(f"{name}: needs an sm_90a build with CUTLASS's headers")
    began = time.perf_counter()
    module = load(name, [os.path.join(root, "bench", "extensions", source)],
                  extra_include_paths=[os.path.join(root, "csrc", "cuda")],
                  extra_cuda_cflags=["-O3", *arch, *setup.cutlass_nvcc_flags(cutlass), *extra_cuda_cflags])
    print(f"built {name} in {time.perf_counter() - began:.0f} s")
    return module
