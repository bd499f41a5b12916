"""``python -m fused_ops`` (or ``fused-ops``): runs the four architectures eager
and fused, checks that they agree, and shows the speed-ups.

For each architecture it builds the original (``fused_ops.reference``, SPEC's
default constructor arguments, seeded) and the fused drop-in
(``fused_ops.nn.<Name>.from_module``) around a deep copy of it: the same
weights, and buffers of its own, so that each starts a training step from the
same running statistics. It compares the two, then times the fused module and
its peers, the ways a user could run the original (SPEC's "How speed is
judged"): eager, tuned by hand (channels_last, cudnn.benchmark: Tuned),
torch.compile, and with --max-autotune torch.compile(mode="max-autotune"); and
measures the memory one call of each takes on a GPU: a forward in eval mode
without autograd, or with --mode train (--train) a training step (train mode,
forward and backward to every parameter; the input needs no gradient), or with
--mode both the one then the other. With --autocast, every forward runs under
torch.autocast (the backward outside it, as AMP does). It prints a table, and
writes JSON and a PNG chart of the speed-ups over each peer to --out, per mode.
"""
import argparse
import contextlib
import copy
import json
import math
import os
import re
import statistics
import sys
import time

import torch

from . import autotune, has_cuda_kernels
from ._timing import device_name, device_slug, interleaved_medians, provenance
from .architectures import ARCHITECTURES, SIZES

SEED = 0
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# The fused module's peers, the ways to run the original that it is timed against, in the order
# of the table and the chart: their JSON keys (<peer>_ms, ...) and the chart's names.
PEERS = {"eager": "eager", "tuned": "tuned (channels_last, cudnn.benchmark)", "compile": "torch.compile",
         "autotune": "torch.compile max-autotune"}
# The largest relative error (relative_errors) that passes outright. Both run
# the same convolutions under the same settings (TF32 or not on a GPU), so they
# differ by the tails' roundings. Measured on a CPU at the reduced sizes, the
# largest: 3.5e-13 in float64; 1.5e-6 in float32 (A-C), 5e-5 for D's training
# gradients (2.5e-4 at SPEC's spatial size: see check); 8e-4 in float16 and 7e-3
# in bfloat16 (C; the fused tails accumulate in float32, the eager ones round
# each op's result).
# float32's is KernelBench's (atol = rtol = 1e-4 against the original in the same settings), with TF32
# convolutions too (PyTorch's default): the fused modules use TF32 only as far as they pass it (SPEC.md).
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def check_tolerance(dtype: torch.dtype, device: torch.device) -> float:
    """The check's tolerance for a run in `dtype` (under autocast: the autocast dtype) on `device`."""
    return TOLERANCE[dtype]


# The variants are timed in turn over TIMING_ROUNDS rounds (fused_ops._timing.interleaved_medians).
TIMING_ROUNDS = 5
DEFAULT_REPS = {"cuda": 50, "cpu": 20}


def progress(message: str) -> None:
    print(f"[fused_ops] {message}", file=sys.stderr, flush=True)


def parse_models(parser: argparse.ArgumentParser, words: list[str]) -> list:
    """The architectures named by letter or class name (any case), comma or space separated, in A-D order."""
    given = [w for word in words for w in re.split(r"[,\s]+", word) if w]
    known = {key.lower() for a in ARCHITECTURES for key in (a.letter, a.name)}
    unknown = [w for w in given if w.lower() not in known]
    if unknown:
        names = ", ".join(f"{a.letter} ({a.name})" for a in ARCHITECTURES)
        parser.error(f"unknown model {', '.join(unknown)}; choose from {names}")
    wanted = {w.lower() for w in given}
    return [a for a in ARCHITECTURES if {a.letter.lower(), a.name.lower()} & wanted]


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m fused_ops",
        description="Runs the four architectures (SPEC.md A-D) fused and as their peers (eager, tuned by hand, "
                    "compiled); checks that the fused modules agree with the originals; prints the speed-ups and peak "
                    "memory, and writes JSON and a PNG chart.")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda where there is a GPU, else cpu)")
    parser.add_argument("--models", nargs="+", default=["A,B,C,D"], metavar="MODEL",
                        help="letters A-D or class names, comma or space separated (default: all four)")
    parser.add_argument("--size", choices=SIZES,
                        help="input sizes: SPEC's, reduced (batch 1-2, spatial halved for B and D) or tiny "
                             "(default: spec on a GPU, reduced on a CPU)")
    parser.add_argument("--batch", type=positive_int, help="batch size of every input (default: the size's)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="default: float32")
    parser.add_argument("--mode", choices=("eval", "train", "both"), default="eval",
                        help="what is checked and timed: an eval forward, a training step (forward and backward), "
                             "or both, one after the other (default: eval)")
    parser.add_argument("--train", dest="mode", action="store_const", const="train", help="the same as --mode train")
    parser.add_argument("--autocast", choices=AUTOCAST_DTYPES,
                        help="run every forward (original eager, tuned, compiled, fused) under torch.autocast to "
                             "this dtype, the backward outside it; input and parameters float32")
    parser.add_argument("--no-compile", action="store_true",
                        help="skip torch.compile of the originals (its default mode; --max-autotune still runs)")
    parser.add_argument("--max-autotune", action="store_true",
                        help="also time torch.compile(mode=\"max-autotune\") of the originals (slow to compile: "
                             "it benchmarks candidate kernels)")
    parser.add_argument("--compile-fused", action="store_true",
                        help="also time torch.compile of the fused module (how much host time its eager call "
                             "spends around the kernels)")
    parser.add_argument("--reps", type=positive_int,
                        help=f"timed calls per variant, after 3 warm-up calls (default: {DEFAULT_REPS['cuda']} on a "
                             f"GPU, {DEFAULT_REPS['cpu']} on a CPU)")
    parser.add_argument("--out", default="fused_ops_results",
                        help="directory for the JSON and the PNG (default: ./fused_ops_results)")
    args = parser.parse_args(argv)

    args.models = parse_models(parser, args.models)
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        parser.error(f"--device: not a device: {args.device!r} (cpu, cuda or cuda:N)")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device: {device.type} is not supported (cpu, cuda or cuda:N)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error(f"--device {args.device}: no CUDA device is available to this torch ({torch.__version__})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            parser.error(f"--device {args.device}: there are {torch.cuda.device_count()} CUDA devices")
        if not has_cuda_kernels():
            parser.error("--device cuda: this build of fused_ops has no CUDA kernels (built for the CPU only)")
    if args.autocast and args.dtype != "float32":
        parser.error(f"--autocast {args.autocast}: the input and parameters must be float32 (--dtype float32), "
                     f"not {args.dtype}")
    args.device = device
    args.dtype = DTYPES[args.dtype]
    args.autocast = args.autocast and AUTOCAST_DTYPES[args.autocast]
    args.size = args.size or ("spec" if device.type == "cuda" else "reduced")
    args.reps = args.reps or DEFAULT_REPS[device.type]
    return args


def relative_error(actual: torch.Tensor, expected: torch.Tensor, scale: float | None = None) -> float:
    """max |actual - expected| / scale, in float64; scale defaults to max |expected|.
    NaN where either has a NaN the other lacks."""
    actual, expected = actual.double(), expected.double()
    if actual.isnan().ne(expected.isnan()).any():
        return float("nan")
    diff = (actual - expected).nan_to_num(0.0).abs().max().item()
    scale = expected.nan_to_num(0.0).abs().max().item() if scale is None else scale
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def relative_errors(actual: dict, expected: dict) -> dict[str, float]:
    """relative_error of each of step_results' tensors. A parameter's gradient
    is relative to the largest element of any parameter's gradient (normwise
    over the model's gradient): a gradient that is zero up to rounding (a conv
    bias's before a training batch norm) has no scale of its own."""
    grads = [t for name, t in expected.items() if name.startswith("grad ")]
    grad_scale = max(t.abs().max().item() for t in grads) if grads else None
    return {name: relative_error(actual[name], t, grad_scale if name.startswith("grad ") else None)
            for name, t in expected.items()}


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """"float32" for torch.float32; None for None."""
    return dtype and str(dtype).removeprefix("torch.")


def autocast(device: torch.device, dtype: torch.dtype | None):
    """torch.autocast to dtype on device's type; where dtype is None, no context."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def step_results(model: torch.nn.Module, x: torch.Tensor, train: bool, grad: torch.Tensor | None,
                 autocast_dtype: torch.dtype | None = None) -> dict:
    """The tensors the check compares, by name: the output of model(x); in
    training (a step with output gradient `grad`), each parameter's gradient
    and each buffer after the step too. The forward under autocast to
    autocast_dtype where given, the backward outside it."""
    if not train:
        with torch.no_grad(), autocast(x.device, autocast_dtype):
            return {"output": model(x)}
    names, params = zip(*model.named_parameters())
    with autocast(x.device, autocast_dtype):
        out = model(x)
    grads = torch.autograd.grad(out, params, grad)
    return ({"output": out.detach()} | {f"grad {n}": g for n, g in zip(names, grads)}
            | {f"buffer {n}": b.clone() for n, b in model.named_buffers()})


def check(original: torch.nn.Module, fused: torch.nn.Module, x: torch.Tensor, train: bool,
          grad: torch.Tensor | None, tolerance: float, autocast_dtype: torch.dtype | None = None) -> dict:
    """The fused module against the original at x (the modules share nothing),
    both under autocast to autocast_dtype where given: `errors`,
    relative_errors of fused against original, and `ok`. A tensor passes
    within `tolerance`; or else, below float64, where the fused one is within
    the tolerance of a float64 run of the original (without autocast), or at
    most twice as far from it as the original's own (eager) run is. That is for
    results whose roundings in the original are larger than the tolerance: a
    16-bit eager module rounds every op's result; architecture D's training
    output and its convolution's gradients are small differences of large
    terms (a batch norm's output sums to zero per channel). Then
    `fused_vs_float64`, `original_vs_float64` and `tuned_vs_float64` hold
    those errors (the last for comparison: the original tuned by hand,
    channels last with cudnn_benchmark, rounds differently). A tensor whose dtype differs from
    the original's fails, whatever its values: `dtype_mismatch` names it, with
    both dtypes."""
    unstepped = copy.deepcopy(original)  # for the float64 run, before the step updates running statistics
    expected = step_results(original, x, train, grad, autocast_dtype)
    actual = step_results(fused, x, train, grad, autocast_dtype)
    errors = relative_errors(actual, expected)
    result = dict(errors=errors, ok=all(e <= tolerance for e in errors.values()))  # NaN fails
    if not result["ok"] and x.dtype != torch.float64:
        with cudnn_benchmark():
            tuned = {name.replace("original.", "", 1): t
                     for name, t in step_results(Tuned(unstepped), x, train, grad, autocast_dtype).items()}
        exact = step_results(unstepped.double(), x.double(), train, None if grad is None else grad.double())
        fused_err, original_err = relative_errors(actual, exact), relative_errors(expected, exact)
        tuned_err = relative_errors(tuned, exact)
        ok = all(e <= tolerance or fused_err[name] <= max(tolerance, 2 * original_err[name])
                 for name, e in errors.items())
        result = dict(errors=errors, ok=ok, fused_vs_float64=fused_err, original_vs_float64=original_err,
                      tuned_vs_float64=tuned_err)
    mismatch = {name: f"{dtype_name(t.dtype)} (original: {dtype_name(expected[name].dtype)})"
                for name, t in actual.items() if t.dtype != expected[name].dtype}
    if mismatch:
        result.update(ok=False, dtype_mismatch=mismatch)
    return result


def settled_check(original: torch.nn.Module, fused: torch.nn.Module, x: torch.Tensor, train: bool,
                  grad: torch.Tensor | None, tolerance: float, autocast_dtype: torch.dtype | None = None) -> dict:
    """check, of the formulation the fused module's calls settled on (the first check's call took its rule's),
    once the original's buffers are copied into the fused module's: each ran a different number of timed
    training steps, which move running statistics."""
    with torch.no_grad():
        for mine, theirs in zip(fused.buffers(), original.buffers(), strict=True):
            mine.copy_(theirs)
    return check(original, fused, x, train, grad, tolerance, autocast_dtype)


def timed_call(model: torch.nn.Module, x: torch.Tensor, train: bool, grad: torch.Tensor | None,
               autocast_dtype: torch.dtype | None = None):
    """What is timed: model(x), or a training step (forward, and the gradients of every parameter); the forward
    under autocast to autocast_dtype where given, the backward outside it, as AMP does."""
    def forward():
        with autocast(x.device, autocast_dtype):
            return model(x)
    if not train:
        return forward
    params = list(model.parameters())
    return lambda: torch.autograd.grad(forward(), params, grad)


def channels_last(t: torch.Tensor) -> torch.Tensor:
    """t in channels_last memory format (channels_last_3d for 5-D); of another rank, t itself."""
    memory_format = {4: torch.channels_last, 5: torch.channels_last_3d}.get(t.dim())
    return t if memory_format is None else t.contiguous(memory_format=memory_format)


class Tuned(torch.nn.Module):
    """The original tuned by hand, the peer "tuned": a copy of it with its
    weights in channels_last memory format (channels_last_3d for 5-D), whose
    forward converts the input to that format (a copy, timed with the call).
    It is timed with cudnn_benchmark() on."""

    def __init__(self, original: torch.nn.Module):
        super().__init__()
        self.original = copy.deepcopy(original)
        for param in self.original.parameters():
            param.data = channels_last(param.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.original(channels_last(x))


@contextlib.contextmanager
def cudnn_benchmark():
    """torch.backends.cudnn.benchmark on (cuDNN tries its algorithms for each new configuration and keeps the
    fastest), its previous setting restored after."""
    previous = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = previous


def peak_extra_mib(call, device: torch.device, module: torch.nn.Module | None = None) -> float | None:
    """The most memory one call() allocates on a GPU beyond what was allocated
    before it (the model and input among that), in MiB, from the CUDA caching
    allocator's statistics, plus what `module`'s CUDA graphs hold (fused_ops.autotune.memory:
    their private pools, kept between calls, in which a replay allocates); None on a CPU, which
    keeps no such statistics."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    call()
    graphs = 0 if module is None else autotune.memory(module)["bytes"]
    return (torch.cuda.max_memory_allocated(device) - before + graphs) / 2**20


def largest(errors: dict[str, float]) -> float:
    """The largest of the errors, NaN counting as the largest."""
    return max(errors.values(), key=lambda e: math.inf if math.isnan(e) else e)


def prepare(arch, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype, train: bool,
            autocast_dtype: torch.dtype | None = None):
    """arch's original (seeded, on device in dtype, in training or eval mode), the input x of `shape`
    (uniform in [0, 1)), in training the output's gradient (else None), and the fused drop-in around a deep
    copy of the original made after that gradient's forward (which updates running statistics in training):
    (original, fused, x, grad)."""
    torch.manual_seed(SEED)
    original = arch.build_original().to(device, dtype).train(train)
    x = torch.rand(shape, device=device, dtype=dtype)
    grad = None  # the output's gradient, in training
    if train:
        with torch.no_grad(), autocast(device, autocast_dtype):
            grad = torch.rand_like(original(x))
    fused = arch.fused_from(copy.deepcopy(original))
    return original, fused, x, grad


def verdict(checked: dict, tolerance: float) -> str:
    """check's result in words: ok or FAILED, the tensors beyond the tolerance, the float64 run's errors and
    any dtype that differs."""
    words = "ok" if checked["ok"] else "FAILED"
    beyond = [name for name, e in checked["errors"].items() if not e <= tolerance]
    if beyond:
        words += f"; beyond the tolerance: {', '.join(beyond)}"
    if "fused_vs_float64" in checked:
        words += (f" (against float64: fused {largest(checked['fused_vs_float64']):.2e}, "
                  f"original {largest(checked['original_vs_float64']):.2e}, "
                  f"tuned {largest(checked['tuned_vs_float64']):.2e})")
    if "dtype_mismatch" in checked:
        words += "; dtype differs: " + ", ".join(f"{name} {d}" for name, d in checked["dtype_mismatch"].items())
    return words


@contextlib.contextmanager
def variant_settings(variant: str, train: bool):
    """What a variant is timed under: autograd on in training (off in eval), and cudnn_benchmark for "tuned"."""
    with torch.set_grad_enabled(train), (cudnn_benchmark() if variant == "tuned" else contextlib.nullcontext()):
        yield


def run_architecture(arch, args, train: bool) -> dict:
    """Builds, checks and times one architecture (a training step, or an eval forward): its row of the results."""
    shape = arch.input_shape(args.size, args.batch)
    tag = f"[{arch.letter}]"
    progress(f"{tag} building {arch.name}{arch.args} and its fused drop-in; input {'x'.join(map(str, shape))}")
    original, fused, x, grad = prepare(arch, shape, args.device, args.dtype, train, args.autocast)

    tolerance = check_tolerance(args.autocast or args.dtype, args.device)
    checked = check(original, fused, x, train, grad, tolerance, args.autocast)
    max_err = largest(checked["errors"])
    progress(f"{tag} check: max relative error {max_err:.2e} over {len(checked['errors'])} tensor(s), "
             f"tolerance {tolerance:.0e}: {verdict(checked, tolerance)}")

    peers = {"eager": original, "tuned": Tuned(original)}
    compile_s = {}
    compiled = [(peer, mode) for peer, mode, wanted in (("compile", None, not args.no_compile),
                                                        ("autotune", "max-autotune", args.max_autotune)) if wanted]
    if compiled:
        # Every original of a class runs the same forward, whose compiled graphs dynamo keeps together, up to
        # torch._dynamo.config.recompile_limit (8) before it runs the rest eager (bench/run.py's models step
        # with --max-autotune makes 8: both modes, float32 and autocast): one architecture's and mode's at a time.
        torch._dynamo.reset()
    for peer, mode in compiled:
        progress(f"{tag} compiling the original (torch.compile{f', mode={mode}' if mode else ''}; "
                 f"the first call compiles)")
        peers[peer] = torch.compile(original, mode=mode)
        with torch.set_grad_enabled(train):
            start = time.perf_counter()
            timed_call(peers[peer], x, train, grad, args.autocast)()
            if args.device.type == "cuda":
                torch.cuda.synchronize(args.device)
            compile_s[peer] = time.perf_counter() - start
        progress(f"{tag} compiled in {compile_s[peer]:.1f} s")
    variants = peers | {"fused": fused}
    if getattr(args, "compile_fused", False):  # not a peer: the fused module's own host time, measured
        variants["fused_compiled"] = torch.compile(fused)
    calls = {variant: timed_call(model, x, train, grad, args.autocast) for variant, model in variants.items()}
    # the variants in turn, TIMING_ROUNDS rounds of args.reps / TIMING_ROUNDS calls: the median of each one's rounds
    rounds = interleaved_medians(calls, args.device, dict.fromkeys(calls, math.ceil(args.reps / TIMING_ROUNDS)),
                                 TIMING_ROUNDS, lambda variant: variant_settings(variant, train))
    times, peaks = {variant: statistics.median(r) for variant, r in rounds.items()}, {}
    for variant, call in calls.items():
        with variant_settings(variant, train):
            peaks[variant] = peak_extra_mib(call, args.device, fused if variant == "fused" else None)
        peak = "" if peaks[variant] is None else f", peak {peaks[variant]:.0f} MiB over what was allocated before"
        progress(f"{tag} {variant}: {times[variant]:.3f} ms{peak}")
    with variant_settings("fused", train), autocast(args.device, args.autocast):  # (the timed calls' key)
        formulation, graphed = fused.formulation(x), fused.graphed(x)
    progress(f"{tag} the fused module's calls settled on {formulation or 'no formulation yet'}"
             f"{', replayed from a CUDA graph' if graphed else ''}")
    settled = settled_check(original, fused, x, train, grad, tolerance, args.autocast)
    progress(f"{tag} check of the settled formulation: max relative error {largest(settled['errors']):.2e}: "
             f"{verdict(settled, tolerance)}")
    best = min(peers, key=times.get)
    progress(f"{tag} best peer: {best} ({times[best]:.3f} ms), the fused module's speed-up over it "
             f"{times[best] / times['fused']:.2f}x")
    speedups = {f"speedup_vs_{peer}": times[peer] / times["fused"] for peer in peers}
    row = dict(model=arch.letter, name=arch.name, args=list(arch.args), input_shape=list(shape), **checked,
               max_rel_err=max_err, tolerance=tolerance, eager_ms=times["eager"], tuned_ms=times["tuned"],
               compile_ms=times.get("compile"), compile_s=compile_s.get("compile"), fused_ms=times["fused"],
               speedup_vs_eager=speedups["speedup_vs_eager"], speedup_vs_tuned=speedups["speedup_vs_tuned"],
               speedup_vs_compile=speedups.get("speedup_vs_compile"), best_peer=best, best_peer_ms=times[best],
               vs_best_peer=times[best] / times["fused"], eager_peak_mib=peaks["eager"],
               tuned_peak_mib=peaks["tuned"], compile_peak_mib=peaks.get("compile"), fused_peak_mib=peaks["fused"],
               memory_ok=peaks["fused"] is None or peaks["fused"] <= peaks["eager"], fused_formulation=formulation,
               fused_graphed=graphed, settled_errors=settled["errors"], settled_verdict=verdict(settled, tolerance))
    row["ok"] = checked["ok"] and settled["ok"]
    if "fused_compiled" in times:
        row |= dict(fused_compiled_ms=times["fused_compiled"], fused_vs_compiled=times["fused_compiled"] / times["fused"])
        progress(f"{tag} the fused module eager: {row['fused_vs_compiled']:.2f}x the speed of it compiled")
    if "autotune" in peers:
        row |= dict(autotune_ms=times["autotune"], autotune_s=compile_s["autotune"],
                    speedup_vs_autotune=speedups["speedup_vs_autotune"], autotune_peak_mib=peaks["autotune"])
    return row


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device_name(device)}, TF32 convolutions {'on' if torch.backends.cudnn.allow_tf32 else 'off'}"
    return f"CPU, {torch.get_num_threads()} threads on {os.cpu_count()} cores"


def describe_precision(result: dict) -> str:
    """The input's dtype and, where the run was under autocast, its dtype: "float32, autocast=bfloat16"."""
    return result["dtype"] + (f", autocast={result['autocast']}" if result["autocast"] else "")


TIMES_HEADER = (f"{'eager ms':>10}{'tuned ms':>10}{'compile ms':>11}{'fused ms':>10}{'vs eager':>10}{'vs compile':>11}"
                f"{'vs best':>16}{'peak MiB e/t/c/f':>20}")
TIMES_NOTES = ("tuned: the original with channels_last weights and input (the input's conversion timed), "
               "cudnn.benchmark on",
               "vs eager / vs compile: the speed-up of fused, eager (or compiled) time / fused time (> 1: fused is faster)",
               "vs best: the speed-up over the fastest peer (eager, tuned, compile, autotune: torch.compile "
               "max-autotune, those timed), named",
               "peak MiB e/t/c/f: eager/tuned/compile/fused, the most memory one call allocated beyond what was "
               "allocated before it (CUDA allocator statistics; - on a CPU); ! where fused's exceeds eager's")


def format_times(r: dict) -> str:
    """A row's times, the fused module's speed-ups and peak memory, in TIMES_HEADER's columns."""
    compiled = "-" if r["compile_ms"] is None else f"{r['compile_ms']:.3f}"
    vs_eager = f"{r['speedup_vs_eager']:.2f}x"
    vs_compile = "-" if r["speedup_vs_compile"] is None else f"{r['speedup_vs_compile']:.2f}x"
    vs_best = f"{r['vs_best_peer']:.2f}x {r['best_peer']}"
    peaks = [r[f"{variant}_peak_mib"] for variant in ("eager", "tuned", "compile", "fused")]
    peak = "-" if peaks == [None] * 4 else "/".join("-" if p is None else f"{p:.0f}" for p in peaks)
    peak += "" if r.get("memory_ok", True) else "!"
    return (f"{r['eager_ms']:>10.3f}{r['tuned_ms']:>10.3f}{compiled:>11}{r['fused_ms']:>10.3f}{vs_eager:>10}"
            f"{vs_compile:>11}{vs_best:>16}{peak:>20}")


def check_column(r: dict) -> str:
    """A row's check: ok or FAIL, marked * where it took a float64 run to decide."""
    return ("ok" if r["ok"] else "FAIL") + ("*" if "fused_vs_float64" in r else "")


def print_table(result: dict) -> None:
    """The results, one architecture a row: the check, times in ms, the fused module's speed-ups, peak memory."""
    print(f"fused_ops on {result['device']}: torch {result['torch']}, {describe_precision(result)}, {result['mode']}, "
          f"{result['timing']}")
    if result["size"] != "spec":
        print(f"{result['size']} sizes: smaller inputs than SPEC's (the same models); SPEC's with --size spec")
    print(f"{'model':<36}{'input':<19}{'max rel err':>12}{'check':>7}{TIMES_HEADER}")
    for r in result["rows"]:
        print(f"{r['model'] + ' ' + r['name']:<36}{'x'.join(map(str, r['input_shape'])):<19}{r['max_rel_err']:>12.1e}"
              f"{check_column(r):>7}{format_times(r)}")
    print("max rel err: max |fused - original| / max |original| over the output"
          + (", every parameter's gradient and buffer" if result["train"] else ""))
    for note in TIMES_NOTES:
        print(note)
    for r in result["rows"]:
        if "fused_vs_float64" in r:
            print(f"* {r['model']}: beyond the tolerance ({r['tolerance']:.0e}) of the original; against a float64 "
                  f"run, fused {largest(r['fused_vs_float64']):.1e}, original {largest(r['original_vs_float64']):.1e}, "
                  f"tuned {largest(r['tuned_vs_float64']):.1e} (passes: fused within the tolerance or 2x the "
                  f"original's)")
        if "dtype_mismatch" in r:
            print(f"{r['model']}: the fused module's dtype differs from the original's: "
                  + ", ".join(f"{name} {d}" for name, d in r["dtype_mismatch"].items()))


def write_chart(path: str, result: dict) -> bool:
    """A bar chart of the fused module's speed-ups over each peer timed at path, on a log scale, the bars
    drawn from 1 (parity) and labelled with their values; False where matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    rows = result["rows"]
    peers = [peer for peer in PEERS if rows[0].get(f"speedup_vs_{peer}") is not None]
    fig = Figure(figsize=(2.2 + max(1.6, 0.45 * len(peers)) * len(rows), 4.6), layout="constrained")
    ax = fig.add_subplot()
    ax.set_yscale("log")
    width = 0.8 / len(peers)
    for i, peer in enumerate(peers):
        positions = [j + (i - (len(peers) - 1) / 2) * width for j in range(len(rows))]
        speedups = [r[f"speedup_vs_{peer}"] for r in rows]
        container = ax.bar(positions, [s - 1 for s in speedups], width, bottom=1, label=f"fused vs {PEERS[peer]}")
        ax.bar_label(container, labels=[f"{s:.2f}x" for s in speedups], fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.margins(y=0.15)
    ax.set_xticks(range(len(rows)), [f"{r['model']}\n{r['name']}" for r in rows], fontsize=7)
    ax.set_ylabel("speed-up (peer's time / fused time, log scale)")
    ax.set_title(f"fused_ops speed-ups: {result['device']}\n{describe_precision(result)}, {result['mode']}, "
                 f"{result['size']} sizes", fontsize=9)
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=120)
    return True


def run_mode(args, train: bool) -> dict:
    """Builds, checks and times every architecture of args in one mode (a training step, or an eval forward): the
    result, as the table shows it and the JSON holds it."""
    mode = "training step (forward + backward)" if train else "eval forward"
    autocast_note = f" under autocast to {dtype_name(args.autocast)}" if args.autocast else ""
    progress(f"{describe_device(args.device)}; {dtype_name(args.dtype)}{autocast_note}; {mode}; "
             f"{args.size} sizes; models {', '.join(a.letter for a in args.models)}")
    rows = [run_architecture(arch, args, train) for arch in args.models]
    timing = "CUDA-event" if args.device.type == "cuda" else "wall-clock"
    return dict(device=describe_device(args.device), device_type=args.device.type, torch=torch.__version__,
                dtype=dtype_name(args.dtype), autocast=dtype_name(args.autocast), mode=mode, train=train,
                size=args.size, timing=f"{timing} medians of {args.reps} calls in {TIMING_ROUNDS} interleaved rounds",
                **provenance(), ok=all(r["ok"] for r in rows), rows=rows)


def write_result(result: dict, stem: str) -> list[str]:
    """result as stem.json and its chart as stem.png (where matplotlib is installed): the paths written."""
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    if write_chart(stem + ".png", result):
        return [stem + ".json", stem + ".png"]
    progress("matplotlib is not installed: no chart (pip install matplotlib)")
    return [stem + ".json"]


def main(argv: list[str] | None = None) -> int:
    """Runs the CLI; returns the exit status: 0 when every check passed, 1 otherwise."""
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    status = 0
    for i, mode in enumerate(("eval", "train") if args.mode == "both" else (args.mode,)):
        result = run_mode(args, train=mode == "train")
        if i:
            print()
        print_table(result)
        precision = result["dtype"] + (f"-autocast-{result['autocast']}" if result["autocast"] else "")
        stem = os.path.join(args.out, f"{device_slug(device_name(args.device))}-{precision}-{mode}")
        print("wrote " + ", ".join(write_result(result, stem)))
        if not result["ok"]:
            failed = ", ".join(f"{r['model']} ({r['max_rel_err']:.2e}"
                               + ("; dtype differs)" if "dtype_mismatch" in r else ")")
                               for r in result["rows"] if not r["ok"])
            print(f"FAILED: the fused module differs from the original beyond the tolerance "
                  f"({describe_precision(result)}, {result['mode']}): {failed}")
            status = 1
        over = [r for r in result["rows"] if not r.get("memory_ok", True)]
        if over:
            print(f"FAILED: the fused module's peak memory exceeds the original's ({describe_precision(result)}, "
                  f"{result['mode']}): " + ", ".join(f"{r['model']} ({r['fused_peak_mib']:.0f} MiB against "
                                                     f"{r['eager_peak_mib']:.0f})" for r in over))
            status = 1
    return status
