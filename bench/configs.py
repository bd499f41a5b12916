"""The configuration-grid benchmark (issue 17, item 4): the four architectures
(SPEC.md A-D) at CONFIGS' constructor arguments (kernels, pools, strides,
paddings, channel counts, odd spatial sizes; SPEC's own four among them), each
at batch 1, 8 and SPEC's, an eval forward and a training step, the fused
drop-in checked against the original and timed against it eager and tuned by
hand, as ``python -m fused_ops`` does (fused_ops.cli: prepare, check, Tuned,
timed_call, variant_settings; medians of fused_ops._timing.median_ms).

Each variant is warmed up (at least 3 calls, and 50 ms on a GPU), then the three
are timed in turn over cli.TIMING_ROUNDS rounds (fused_ops._timing.interleaved_medians): a
number of calls adapted to its time per call (about 200 ms of calls on a GPU, 5
to 100 of them; --reps fixes it), spread over the rounds; its time is the median
of its rounds' medians (each round's are kept in the JSON). After its warm-up the fused module's
formulation is recorded where the module says it (a method ``formulation(x)``
returning a string, called under the step's settings; null where it has none).
Writes configs-<device>[-autocast-<dtype>].json under bench/results/ (or --out),
after each row ("complete": false until the last: the whole grid outlasts one
command on the lent GPU machines; --resume keeps the rows of that file measured
under the same settings and measures the rest; on a machine of several GPUs a
process a GPU, each over every N-th configuration, their rows merged), and prints a table last, a row
per configuration, batch and step, then the worst cases.

    python bench/configs.py [--device cuda] [--size spec|tiny] [--configs A,B-s1p0k3,'C-p*']
                            [--batches 1,8,spec] [--steps eval,train] [--reps N]
                            [--autocast bfloat16|float16] [--out DIR] [--gpus N] [--resume] [--estimate]
    python bench/configs.py --markdown bench/results/configs-nvidia-h200.json   # the README's table
"""
import argparse
import fnmatch
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from fused_ops import cli
from fused_ops.architectures import ARCHITECTURES, Architecture
from timing import device_name, interleaved_medians, provenance, result_path, warm_up, write_result

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SIZES = ("spec", "tiny")
STEPS = ("eval", "train")
SPEC_BATCH = {a.letter: a.input_shapes["spec"][0] for a in ARCHITECTURES}  # A 128, B 16, C 128, D 16
# Timed calls per variant, where --reps does not fix them: about TARGET_MS of calls, between MIN_REPS and
# MAX_REPS; each variant first warmed up with WARMUP_CALLS calls and, on a GPU, for at least WARMUP_MS.
TARGET_MS = {"cuda": 200.0, "cpu": 50.0}
MIN_REPS, MAX_REPS = 5, {"cuda": 100, "cpu": 30}
# The variants are timed in turn, cli.TIMING_ROUNDS rounds of (their timed calls / rounds, at least
# ROUND_MIN_REPS) calls each; a variant's time is the median of its rounds' medians.
ROUND_MIN_REPS = 3
WARMUP_CALLS, WARMUP_MS = 3, 50.0
VARIANTS = ("eager", "tuned", "fused")


@dataclass(frozen=True)
class Config:
    """A named configuration: an Architecture (fused_ops.architectures) with its own constructor arguments
    and input shapes, "spec" (at SPEC's batch; spatial sizes chosen so that one eager training step takes
    at most about 50 ms on an H200) and "tiny" (batch 1, for CPU smoke runs)."""
    name: str
    arch: Architecture

    @property
    def letter(self) -> str:
        return self.arch.letter


def config(name: str, letter: str, args: tuple, spec: tuple[int, ...], tiny: tuple[int, ...]) -> Config:
    """A configuration of architecture `letter`: its constructor arguments, and its input's (channels,
    *spatial) at the spec and tiny sizes."""
    (default,) = [a for a in ARCHITECTURES if a.letter == letter]
    return Config(name, Architecture(letter, default.name, args,
                                     {"spec": (SPEC_BATCH[letter], *spec), "tiny": (1, *tiny)}))


def spec_config(default: Architecture) -> Config:
    """SPEC's own configuration of an architecture, at SPEC's sizes."""
    return Config(f"{default.letter}-spec", Architecture(default.letter, default.name, default.args,
                                                         {"spec": default.input_shapes["spec"],
                                                          "tiny": (1, *default.input_shapes["tiny"][1:])}))


SPEC_CONFIGS = {a.letter: spec_config(a) for a in ARCHITECTURES}  # A-spec, ..., D-spec
# Constructor arguments: A (in, out, kernel, divisor, pool_size, bias_shape, sum_dim);
# B (in, out, kernel, stride, padding), its pools MaxPool3d(2) then MaxPool3d(3); C (in, out, kernel, pool_kernel);
# D (in, out, kernel, scale, eps, momentum). Every configuration is valid for the original at both sizes
# (its pools' outputs at least 1 wide; tests/test_bench_configs.py runs each at the tiny size).
CONFIGS = (
    SPEC_CONFIGS["A"],
    config("A-pool3", "A", (8, 16, 3, 2.0, 3, (16, 1, 1, 1), 1), (8, 17, 65, 65), (8, 5, 8, 8)),
    config("A-pool122", "A", (8, 16, 3, 2.0, (1, 2, 2), (16, 1, 1, 1), 1), (8, 16, 64, 64), (8, 3, 6, 6)),
    config("A-pool212", "A", (8, 16, 3, 2.0, (2, 1, 2), (16, 1, 1, 1), 1), (8, 15, 31, 33), (8, 4, 3, 6)),
    config("A-k5", "A", (8, 16, 5, 2.0, 2, (16, 1, 1, 1), 1), (8, 16, 47, 49), (8, 6, 6, 6)),
    config("A-k313", "A", (8, 16, (3, 1, 3), 2.0, 2, (16, 1, 1, 1), 1), (8, 16, 64, 64), (8, 4, 2, 4)),
    config("A-div-1.5", "A", (8, 16, 3, -1.5, 2, (16, 1, 1, 1), 1), (8, 16, 64, 64), (8, 4, 4, 4)),
    config("A-3to7-div3", "A", (3, 7, 3, 3.0, 2, (7, 1, 1, 1), 1), (3, 17, 63, 65), (3, 4, 5, 4)),
    config("A-sum0", "A", (8, 16, 3, 2.0, 2, (16, 1, 1, 1), 0), (8, 15, 31, 33), (8, 4, 4, 4)),
    config("A-sum2-div0.5", "A", (8, 16, 3, 0.5, 2, (16, 1, 1, 1), 2), (8, 17, 33, 31), (8, 4, 4, 4)),
    config("A-16to32", "A", (16, 32, 3, 2.0, 2, (32, 1, 1, 1), 1), (16, 16, 32, 32), (16, 4, 4, 4)),
    SPEC_CONFIGS["B"],
    config("B-s1p0k3", "B", (32, 64, 3, 1, 0), (32, 31, 33, 29), (32, 4, 4, 4)),
    config("B-s1p2k5", "B", (16, 32, 5, 1, 2), (16, 33, 31, 35), (16, 6, 6, 6)),
    config("B-s2p1k4", "B", (32, 64, 4, 2, 1), (32, 24, 24, 24), (32, 3, 3, 3)),
    config("B-s2p0k3", "B", (16, 32, 3, 2, 0), (16, 31, 31, 31), (16, 3, 3, 3)),
    config("B-s2p1k3", "B", (32, 64, 3, 2, 1), (32, 27, 25, 29), (32, 4, 4, 4)),
    config("B-7to13-s2p2k5", "B", (7, 13, 5, 2, 2), (7, 31, 29, 27), (7, 4, 4, 4)),
    config("B-s3p1k5", "B", (32, 32, 5, 3, 1), (32, 21, 23, 25), (32, 2, 2, 2)),
    config("B-s3p0k4", "B", (16, 16, 4, 3, 0), (16, 17, 19, 15), (16, 2, 2, 2)),
    config("B-64to32-s2p1k4", "B", (64, 32, 4, 2, 1), (64, 17, 15, 16), (64, 3, 3, 3)),
    SPEC_CONFIGS["C"],
    config("C-p2k3", "C", (8, 64, 3, 2), (8, 255, 257), (8, 6, 7)),
    config("C-p3k5", "C", (8, 64, 5, 3), (8, 191, 193), (8, 8, 9)),
    config("C-p5k7", "C", (8, 32, 7, 5), (8, 161, 163), (8, 11, 12)),
    config("C-p4k1", "C", (8, 64, 1, 4), (8, 383, 385), (8, 4, 5)),
    config("C-p3k1", "C", (8, 64, 1, 3), (8, 255, 253), (8, 3, 4)),
    config("C-p2k5", "C", (8, 64, 5, 2), (8, 129, 131), (8, 6, 7)),
    config("C-p5k3", "C", (8, 64, 3, 5), (8, 321, 319), (8, 7, 8)),
    config("C-3to16-p2k3", "C", (3, 16, 3, 2), (3, 255, 255), (3, 5, 5)),
    config("C-16to128-p4k3", "C", (16, 128, 3, 4), (16, 127, 129), (16, 6, 7)),
    SPEC_CONFIGS["D"],
    config("D-k3", "D", (64, 128, 3, 2.0), (64, 16, 32, 32), (64, 2, 4, 4)),
    config("D-k1", "D", (64, 128, 1, 2.0), (64, 16, 32, 32), (64, 2, 4, 4)),
    config("D-32to64-k3", "D", (32, 64, 3, 0.5), (32, 15, 31, 33), (32, 3, 3, 3)),
    config("D-eps1e-3-mom0.01", "D", (64, 128, 3, 2.0, 1e-3, 0.01), (64, 17, 31, 29), (64, 2, 3, 4)),
    config("D-mom0.5-k5", "D", (64, 64, 5, 1.5, 1e-5, 0.5), (64, 13, 27, 25), (64, 1, 2, 3)),
    config("D-3to16-k5", "D", (3, 16, 5, 2.0), (3, 31, 33, 35), (3, 2, 3, 3)),
    config("D-128to256-k3", "D", (128, 256, 3, 2.0), (128, 12, 16, 16), (128, 2, 2, 2)),
    config("D-scale-1-eps1e-4", "D", (64, 128, 3, -1.0, 1e-4, 0.2), (64, 16, 24, 24), (64, 2, 3, 3)),
)


def select(parser: argparse.ArgumentParser, words: list[str]) -> list[Config]:
    """The configurations named by letter (A-D), name or name pattern (fnmatch: "C-p*"), any case, comma or
    space separated, in CONFIGS' order."""
    given = [w for word in words for w in re.split(r"[,\s]+", word) if w]

    def matches(word: str, c: Config) -> bool:
        return word.lower() == c.letter.lower() or fnmatch.fnmatch(c.name.lower(), word.lower())

    unknown = [w for w in given if not any(matches(w, c) for c in CONFIGS)]
    if unknown:
        parser.error(f"--configs: no configuration matches {', '.join(unknown)}; letters A-D or one of "
                     + ", ".join(c.name for c in CONFIGS))
    return [c for c in CONFIGS if any(matches(w, c) for w in given)]


def parse_batches(text: str) -> list[int | str]:
    """"1,8,spec" -> [1, 8, "spec"] (spec: the architecture's SPEC batch)."""
    batches = []
    for word in filter(None, re.split(r"[,\s]+", text)):
        if word != "spec" and not (word.isdigit() and int(word) > 0):
            raise argparse.ArgumentTypeError(f"expected positive integers or spec, got {word!r}")
        batches.append(word if word == "spec" else int(word))
    return batches


def parse_steps(text: str) -> list[str]:
    steps = list(filter(None, re.split(r"[,\s]+", text)))
    if not steps or any(s not in STEPS for s in steps):
        raise argparse.ArgumentTypeError(f"expected eval and/or train, got {text!r}")
    return [s for s in STEPS if s in steps]


def input_shape(c: Config, size: str, batch: int | str) -> tuple[int, ...]:
    return c.arch.input_shape(size, SPEC_BATCH[c.letter] if batch == "spec" else batch)


# ---- the estimate: H200 times scaled from bench/models.py's results by the convolution's work ----

def conv_work(c: Config, shape: tuple[int, ...]) -> tuple[float, float]:
    """(multiply-adds, output elements) of c's convolution at input `shape`."""
    n, cin, *spatial = shape
    cout, kernel = c.arch.args[1], c.arch.args[2]
    kernel = tuple(kernel) if isinstance(kernel, (tuple, list)) else (kernel,) * len(spatial)
    if c.letter in ("A", "C"):  # valid convolution
        out = [s - k + 1 for s, k in zip(spatial, kernel)]
    elif c.letter == "B":
        stride, padding = c.arch.args[3], c.arch.args[4]
        out = [(s - 1) * stride - 2 * padding + k for s, k in zip(spatial, kernel)]
    else:  # D: stride-1 transposed
        out = [s + k - 1 for s, k in zip(spatial, kernel)]
    outputs = n * cout * math.prod(out)
    if c.letter in ("A", "C"):
        return outputs * cin * math.prod(kernel), outputs
    return n * cin * math.prod(spatial) * cout * math.prod(kernel), outputs  # each input element's taps


def estimate_ms(c: Config, shape: tuple[int, ...], step: str, reference: dict) -> dict[str, float]:
    """Each variant's time per call, guessed: SPEC's configuration's measured time (reference: a
    bench/models.py result) scaled by the larger of the ratios of multiply-adds and output elements, at
    least 0.05 ms (eval) or 0.15 ms (training) of launches."""
    spec = next(Config(a.letter, a) for a in ARCHITECTURES if a.letter == c.letter)
    (row,) = [r for r in reference[step]["rows"] if r["model"] == c.letter]
    work, spec_work = conv_work(c, shape), conv_work(spec, tuple(row["input_shape"]))
    scale = max(w / s for w, s in zip(work, spec_work))
    return {v: max(0.05 if step == "eval" else 0.15, row[f"{v}_ms"] * scale) for v in VARIANTS}


def reps_for(ms: float, device_type: str) -> int:
    """Timed calls for a variant taking `ms` a call: about TARGET_MS of them, MIN_REPS to MAX_REPS."""
    return max(MIN_REPS, min(MAX_REPS[device_type], math.ceil(TARGET_MS[device_type] / max(ms, 1e-3))))


def estimate_s(items: list[tuple[Config, int | str, str]], size: str, reference: dict) -> float:
    """The grid's time on a GPU, guessed from estimate_ms: per item the check (a step of the original and of
    the fused module, and the output gradient's forward) and 30 ms of building and copying, then per variant
    its warm-up (WARMUP_CALLS calls and at least WARMUP_MS) and its reps_for calls; for
    tuned also cudnn.benchmark's search of algorithms at the new shape, guessed at 10 calls' time."""
    total = 0.0
    for c, batch, step in items:
        ms = estimate_ms(c, input_shape(c, size, batch), step, reference)
        total += 2 * ms["eager"] + ms["fused"] + 30
        for v in VARIANTS:
            total += max(WARMUP_CALLS * ms[v], WARMUP_MS) + reps_for(ms[v], "cuda") * ms[v]
        total += 10 * ms["tuned"]
    return total / 1e3


def reference_result(autocast_dtype: str | None) -> tuple[str, dict] | None:
    """bench/results' H200 result of bench/models.py at the same precision, the estimate's basis: (path,
    result), or None where there is none."""
    path = os.path.join(RESULTS, "models-nvidia-h200" + (f"-autocast-{autocast_dtype}" if autocast_dtype else "")
                        + ".json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return path, json.load(f)


# ---- the grid ----

def tuned(fused: torch.nn.Module, x: torch.Tensor, train: bool, autocast_dtype) -> dict:
    """What the fused module says of its calls for the step (asked under the step's autograd mode and
    autocast: their key): "formulation", its formulation(x) ("+graph" where it replays it from a CUDA graph),
    and "tuner_timings_ms", its tuned_timings(x) (median device and host ms of each formulation tried: the data
    of its graph rule); None and {} where it has no such methods."""
    if not callable(getattr(fused, "formulation", None)):
        return dict(formulation=None, tuner_timings_ms={})
    with torch.set_grad_enabled(train), cli.autocast(x.device, autocast_dtype):
        return dict(formulation=str(fused.formulation(x)) + ("+graph" if fused.graphed(x) else ""),
                    tuner_timings_ms={name: list(times) for name, times in fused.tuned_timings(x).items()})


def measure(c: Config, batch: int | str, step: str, args) -> dict:
    """One configuration at one batch and step: the check (at the fused module's first call, and again once
    its calls have settled), each variant's median time, the speed-ups, the fused module's formulation, peak
    memory. An exception (the original or fused module refusing the input, memory) makes
    a failed row with its message under "error"."""
    train = step == "train"
    shape = input_shape(c, args.size, batch)
    row = dict(config=c.name, model=c.letter, name=c.arch.name, args=list(c.arch.args), batch=shape[0],
               spec_batch=batch == "spec" or shape[0] == SPEC_BATCH[c.letter], step=step, input_shape=list(shape))
    try:
        original, fused, x, grad = cli.prepare(c.arch, shape, args.device, args.dtype, train, args.autocast)
        tolerance = cli.check_tolerance(args.autocast or args.dtype, args.device)
        checked = cli.check(original, fused, x, train, grad, tolerance, args.autocast)
        row |= dict(**checked, max_rel_err=cli.largest(checked["errors"]), tolerance=tolerance,
                    verdict=cli.verdict(checked, tolerance))
        models = {"eager": original, "tuned": cli.Tuned(original), "fused": fused}
        calls = {variant: cli.timed_call(model, x, train, grad, args.autocast) for variant, model in models.items()}
        reps = {}
        for variant, call in calls.items():
            with cli.variant_settings(variant, train):
                per_call = warm_up(call, args.device, WARMUP_MS, WARMUP_CALLS)
                if variant == "fused":
                    row |= tuned(fused, x, train, args.autocast)
            reps[variant] = args.reps or reps_for(per_call, args.device.type)
        per_round = {v: max(ROUND_MIN_REPS, math.ceil(n / cli.TIMING_ROUNDS)) for v, n in reps.items()}
        rounds = interleaved_medians(calls, args.device, per_round, cli.TIMING_ROUNDS,
                                     lambda variant: cli.variant_settings(variant, train), warmup_ms=0.0)
        for variant, times in rounds.items():
            row[f"{variant}_ms"] = statistics.median(times)
            row[f"{variant}_rounds_ms"] = times
            row[f"{variant}_reps"] = reps[variant]
        row |= dict(speedup_vs_eager=row["eager_ms"] / row["fused_ms"],
                    speedup_vs_tuned=row["tuned_ms"] / row["fused_ms"])
        for variant in ("eager", "fused"):  # (one call each: the most it allocates beyond what it had, and the
            with cli.variant_settings(variant, train):  # fused module's CUDA graphs' pools)
                row[f"{variant}_peak_mib"] = cli.peak_extra_mib(calls[variant], args.device,
                                                                fused if variant == "fused" else None)
        row["memory_ok"] = row["fused_peak_mib"] is None or row["fused_peak_mib"] <= row["eager_peak_mib"]
        settled = cli.settled_check(original, fused, x, train, grad, tolerance, args.autocast)
        row |= dict(settled_errors=settled["errors"], settled_verdict=cli.verdict(settled, tolerance),
                    ok=checked["ok"] and settled["ok"])
    except Exception as error:  # noqa: BLE001  (a row of the grid, not the end of it)
        row |= dict(ok=False, error=f"{type(error).__name__}: {error}")
        if args.device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def grid(configs: list[Config], batches: list, steps: list[str]) -> list[tuple[Config, int | str, str]]:
    return [(c, b, s) for c in configs for b in batches for s in steps]


def run(args) -> dict:
    """The grid of args: the JSON result."""
    items = grid(args.configs, args.batches, args.steps)
    reference = reference_result(cli.dtype_name(args.autocast))
    estimate = reference and estimate_s(items, args.size, reference[1])
    precision = "float32" + (f" under autocast to {cli.dtype_name(args.autocast)}" if args.autocast else "")
    cli.progress(f"{cli.describe_device(args.device)}; {precision}; {len(args.configs)} configurations x "
                 f"{len(args.batches)} batches x {len(args.steps)} steps = {len(items)} rows at {args.size} sizes"
                 + (f"; on an H200 about {estimate:.0f} s (estimated from {os.path.relpath(reference[0])})"
                    if estimate else ""))
    stamp = provenance()
    settings = grid_settings(args, stamp["commit"])
    kept = resumed_rows(grid_path(args), settings) if args.resume else {}
    if kept:
        cli.progress(f"resuming: {len(kept)} rows kept from {os.path.relpath(grid_path(args))}")
    rows, began, measured = [], time.perf_counter(), 0
    for i, (c, batch, step) in enumerate(items):
        key = row_key(c, batch, step, args.size)
        if key in kept:
            rows.append(kept[key])
            continue
        row = measure(c, batch, step, args)
        rows.append(row)
        measured += 1
        # (written after each row: a run cut short keeps what it measured, and --resume goes on from it)
        write(result_of(rows, settings, stamp["date"], time.perf_counter() - began, complete=False), args.out)
        elapsed = time.perf_counter() - began
        left = elapsed / measured * (len(items) - i - 1)
        if "error" in row:
            what = row["error"]
        else:
            settled = "" if row["settled_verdict"].startswith("ok") else f"; settled: {row['settled_verdict']}"
            what = (f"{row['verdict']} ({row['max_rel_err']:.1e}){settled}; eager {row['eager_ms']:.3f}, tuned "
                    f"{row['tuned_ms']:.3f}, fused {row['fused_ms']:.3f} ms: {row['speedup_vs_eager']:.2f}x, "
                    f"{row['speedup_vs_tuned']:.2f}x; {row['formulation']}")
        cli.progress(f"[{i + 1}/{len(items)} {c.name} batch {row['batch']} {step}] {what} "
                     f"({elapsed:.0f} s, about {left:.0f} s left)")
    return result_of(rows, settings | dict(estimate_s=estimate), stamp["date"], time.perf_counter() - began,
                     complete=True)


def run_grid(args) -> dict:
    """The grid of args: in this process, or over args.gpus processes (run_split)."""
    return run_split(args) if args.gpus > 1 else run(args)


def run_split(args) -> dict:
    """The grid of args over args.gpus processes at once, process k on GPU k (CUDA_VISIBLE_DEVICES) with every
    gpus-th configuration from the k-th, each a grid of its own written (after each row) under
    out/gpu-K-of-N/ (where --resume finds it again); their rows merged in the grid's order. The folders
    go once every row is measured."""
    n, began = args.gpus, time.perf_counter()
    folders = [os.path.join(args.out, f"gpu-{k}-of-{n}") for k in range(1, n + 1)]
    parts = [args.configs[k::n] for k in range(n)]
    batches = ",".join(str(b) for b in args.batches)
    common = ["--size", args.size, "--batches", batches, "--steps", ",".join(args.steps), "--gpus", "1",
              "--device", args.device.type, *(["--reps", str(args.reps)] if args.reps else []),
              *(["--autocast", cli.dtype_name(args.autocast)] if args.autocast else []),
              *(["--resume"] if args.resume else [])]
    cli.progress(f"the grid over {n} processes, one a GPU: {', '.join(str(len(p)) for p in parts if p)} "
                 "configurations each")
    running = []  # (folder, its process)
    for k, (part, folder) in enumerate(zip(parts, folders)):
        if not part:
            continue
        os.makedirs(folder, exist_ok=True)
        command = [sys.executable, os.path.abspath(__file__), *common, "--configs", ",".join(c.name for c in part),
                   "--out", folder]
        with open(os.path.join(folder, "log.txt"), "w") as log:  # (each process's table; its progress to stderr)
            running.append((folder, subprocess.Popen(command, stdout=log,
                                                     env=dict(os.environ, CUDA_VISIBLE_DEVICES=str(k)))))
    for folder, process in running:
        if process.wait() not in (0, 1):  # (1: a check failed; else the process broke off: its rows so far kept)
            cli.progress(f"the process of {folder} exited with {process.returncode}: see its log.txt; --resume "
                         "measures what it left")
    stamp = provenance()
    settings = grid_settings(args, stamp["commit"])
    measured = {}
    for folder in folders:
        measured |= resumed_rows(grid_path(args, folder), settings)
    items = grid(args.configs, args.batches, args.steps)
    keys = [row_key(c, batch, step, args.size) for c, batch, step in items]
    rows = [measured[key] for key in keys if key in measured]
    complete = len(rows) == len(keys)
    if complete:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
    return result_of(rows, settings, stamp["date"], time.perf_counter() - began, complete=complete)


def row_key(c: Config, batch: int | str, step: str, size: str) -> tuple:
    """A row's (config, batch, step), as its JSON row holds them (resumed_rows)."""
    return c.name, input_shape(c, size, batch)[0], step


def grid_settings(args, commit: str | None) -> dict:
    """What a grid's rows were measured under: a resumed run keeps only rows of the same settings (the same
    tree's commit among them: a grid's rows come from one tree; None where it runs from no checkout)."""
    timing = "CUDA-event" if args.device.type == "cuda" else "wall-clock"
    return dict(commit=commit, device=device_name(args.device), device_type=args.device.type,
                device_detail=cli.describe_device(args.device), torch=torch.__version__, dtype="float32",
                autocast=cli.dtype_name(args.autocast), size=args.size,
                tf32=args.device.type == "cuda" and torch.backends.cudnn.allow_tf32,
                timing=f"{timing} medians of " + (f"{args.reps} calls" if args.reps else
                                                 f"{MIN_REPS}-{MAX_REPS[args.device.type]} calls (about "
                                                 f"{TARGET_MS[args.device.type]:.0f} ms of them)")
                + f" per variant after at least {WARMUP_CALLS} warm-up calls, spread over {cli.TIMING_ROUNDS} interleaved "
                "rounds (the median of the rounds' medians)")


def result_of(rows: list[dict], settings: dict, date: str, elapsed_s: float, complete: bool) -> dict:
    """The JSON result of rows: complete is False while the grid is still being measured (a file written
    after each row); a resumed run's elapsed_s counts its own time only."""
    result = dict(settings, date=date, elapsed_s=elapsed_s, complete=complete,
                  ok=all(r["ok"] and r.get("memory_ok", True) for r in rows), rows=rows)
    result["summary"] = summarize(rows)
    return result


def grid_path(args, out: str | None = None) -> str:
    return result_path(out or args.out, "configs", device_name(args.device), cli.dtype_name(args.autocast))


def resumed_rows(path: str, settings: dict) -> dict:
    """The rows of an earlier run's path by (config, batch, step), where it was measured under settings (else
    none: a grid's rows come from one tree, device, torch, precision and timing)."""
    try:
        with open(path) as f:
            earlier = json.load(f)
    except FileNotFoundError:
        return {}
    if any(earlier.get(k) != v for k, v in settings.items()):
        return {}
    return {(r["config"], r["batch"], r["step"]): r for r in earlier["rows"]}


def summarize(rows: list[dict]) -> dict:
    """The worst cases: the lowest fused/eager speed-up overall and per architecture, how many are below 1,
    the lowest fused/tuned where the fused module took a rewrite (a formulation named "rewrite..."), and the
    rows whose check failed."""
    timed = [r for r in rows if "speedup_vs_eager" in r]

    def worst(rs: list[dict], key: str) -> dict | None:
        if not rs:
            return None
        r = min(rs, key=lambda r: r[key])
        return dict(config=r["config"], batch=r["batch"], step=r["step"], speedup=r[key],
                    formulation=r.get("formulation"))

    rewrites = [r for r in timed if (r.get("formulation") or "").startswith("rewrite")]
    return dict(worst_vs_eager=worst(timed, "speedup_vs_eager"),
                worst_vs_eager_by_model={a.letter: worst([r for r in timed if r["model"] == a.letter],
                                                         "speedup_vs_eager") for a in ARCHITECTURES},
                below_1_vs_eager=sum(r["speedup_vs_eager"] < 1.0 for r in timed),
                below_1_vs_tuned=sum(r["speedup_vs_tuned"] < 1.0 for r in timed),
                timed=len(timed), rewrites=len(rewrites),
                worst_vs_tuned_rewrite=worst(rewrites, "speedup_vs_tuned"),
                below_1_vs_tuned_rewrite=sum(r["speedup_vs_tuned"] < 1.0 for r in rewrites),
                failed=[f"{r['config']} batch {r['batch']} {r['step']}" for r in rows if not r["ok"]],
                over_memory=[f"{r['config']} batch {r['batch']} {r['step']}" for r in timed
                             if not r.get("memory_ok", True)])


def write(result: dict, out_dir: str) -> str:
    """result as out_dir/configs-<device>[-autocast-<dtype>].json: the path."""
    return write_result(result, out_dir, "configs")


def describe_worst(w: dict | None) -> str:
    return "-" if w is None else (f"{w['speedup']:.2f}x ({w['config']}, batch {w['batch']}, {w['step']}"
                                  + (f", {w['formulation']})" if w.get("formulation") else ")"))


def check_column(r: dict) -> str:
    return "ERROR" if "error" in r else cli.check_column(r)


def peak_column(r: dict) -> str:
    """eager/fused peak MiB (- on a CPU), ! where fused's exceeds eager's."""
    if r.get("fused_peak_mib") is None:
        return "-"
    return f"{r['eager_peak_mib']:.0f}/{r['fused_peak_mib']:.0f}" + ("" if r["memory_ok"] else "!")


def print_table(result: dict) -> None:
    """A row per configuration, batch and step: times, the fused speed-ups, the formulation, the check; then
    the worst cases."""
    print(f"\nconfiguration grid on {result['device_detail']}: torch {result['torch']}, "
          f"{cli.describe_precision(result)}, {result['size']} sizes, {result['timing']}")
    if result["device_type"] != "cuda":
        print("on a CPU: a test run, not the GPU result")
    rows = result["rows"]
    name_width = max([len("config")] + [len(r["config"]) for r in rows]) + 1
    form_width = max([len("formulation")] + [len(str(r.get("formulation"))) for r in rows]) + 1
    print(f"{'config':<{name_width}}{'batch':>5} {'step':<6}{'eager ms':>10}{'tuned ms':>10}{'fused ms':>10}"
          f"{'vs eager':>9}{'vs tuned':>9}{'peak MiB e/f':>14}  {'formulation':<{form_width}}{'check':<6}")
    for r in rows:
        if "error" in r:
            print(f"{r['config']:<{name_width}}{r['batch']:>5} {r['step']:<6}{r['error']}")
            continue
        print(f"{r['config']:<{name_width}}{r['batch']:>5} {r['step']:<6}{r['eager_ms']:>10.3f}{r['tuned_ms']:>10.3f}"
              f"{r['fused_ms']:>10.3f}{r['speedup_vs_eager']:>8.2f}x{r['speedup_vs_tuned']:>8.2f}x"
              f"{peak_column(r):>14}  "
              f"{str(r.get('formulation')) if r.get('formulation') is not None else '-':<{form_width}}"
              f"{check_column(r):<6}")
    s = result["summary"]
    print("vs eager / vs tuned: eager (tuned: channels_last, cudnn.benchmark, the input's conversion timed) time / "
          "fused time; eval: a forward without autograd; train: forward + backward to every parameter")
    print(f"worst fused/eager: {describe_worst(s['worst_vs_eager'])}; below 1.0: {s['below_1_vs_eager']} of "
          f"{s['timed']}")
    print("worst fused/eager per architecture: "
          + "; ".join(f"{letter} {describe_worst(w)}" for letter, w in s["worst_vs_eager_by_model"].items()
                      if w is not None))
    print(f"worst fused/tuned where a rewrite is taken: {describe_worst(s['worst_vs_tuned_rewrite'])}; below 1.0: "
          f"{s['below_1_vs_tuned_rewrite']} of {s['rewrites']} (of all rows: {s['below_1_vs_tuned']} below 1.0)")
    print("peak MiB e/f: the most memory one eager (fused) call allocated beyond what was allocated before it, ! where "
          "fused's exceeds eager's")
    if s["failed"]:
        print(f"FAILED ({len(s['failed'])}): " + "; ".join(s["failed"]))
    if s["over_memory"]:
        print(f"OVER THE ORIGINAL'S MEMORY ({len(s['over_memory'])}): " + "; ".join(s["over_memory"]))


def markdown(result: dict) -> str:
    """The README's table of a result: a row per configuration, a column per batch and step, each cell the
    fused module's speed-up over eager / over tuned (marked † where the fused module took a rewrite)."""
    batches = []  # (label, key) in the result's order: 1, 8, SPEC's
    for r in result["rows"]:
        key = "spec" if r["spec_batch"] else r["batch"]
        if key not in [k for _, k in batches]:
            batches.append(("SPEC's batch" if key == "spec" else f"batch {key}", key))
    steps = [s for s in STEPS if any(r["step"] == s for r in result["rows"])]
    cells, names = {}, []
    for r in result["rows"]:
        if r["config"] not in names:
            names.append(r["config"])
        if "error" in r:
            cell = "error"
        else:
            cell = f"{r['speedup_vs_eager']:.2f}× / {r['speedup_vs_tuned']:.2f}×"
            cell += "†" if (r.get("formulation") or "").startswith("rewrite") else ""
            cell += "" if r["ok"] else " (check failed)"
        cells[r["config"], "spec" if r["spec_batch"] else r["batch"], r["step"]] = cell
    first = {r["config"]: r for r in result["rows"]}
    header = ["config", "arguments", "input at SPEC's batch"] + [f"{label} {step}" for label, _ in batches
                                                                  for step in steps]
    lines = [f"| {' | '.join(header)} |", f"|{' --- |' * len(header)}"]
    for name in names:
        r = first[name]
        shape = [SPEC_BATCH[r["model"]], *r["input_shape"][1:]]
        args = ", ".join(str(tuple(a)) if isinstance(a, list) else str(a) for a in r["args"])
        row = [name, f"{r['model']}({args})", "×".join(map(str, shape))]
        row += [cells.get((name, key, step), "") for _, key in batches for step in steps]
        lines.append(f"| {' | '.join(row)} |")
    s = result["summary"]
    lines.append("")
    lines.append(f"Each cell: the fused module's speed-up over eager / over tuned (median times; † where it took "
                 f"a rewrite). {result['device']}, torch {result['torch']}, {cli.describe_precision(result)}, "
                 f"{result['size']} sizes. Worst over eager: {describe_worst(s['worst_vs_eager'])}, "
                 f"{s['below_1_vs_eager']} of {s['timed']} below 1.0; worst over tuned where a rewrite is taken: "
                 f"{describe_worst(s['worst_vs_tuned_rewrite'])}."
                 + (" Partial: a run cut short (`--resume` measures the rest)." if result.get("complete") is False else ""))
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda where there is a GPU, else cpu)")
    parser.add_argument("--size", choices=SIZES, help="input sizes: spec (the GPU default) or tiny (a CPU smoke "
                                                      "run, the CPU default)")
    parser.add_argument("--configs", nargs="+", default=["A,B,C,D"], metavar="CONFIG",
                        help="letters A-D, configuration names or patterns (C-p*), comma or space separated "
                             "(default: all)")
    parser.add_argument("--batches", type=parse_batches, default=[1, 8, "spec"],
                        help="batch sizes, spec for the architecture's SPEC batch (default: 1,8,spec)")
    parser.add_argument("--steps", type=parse_steps, default=list(STEPS),
                        help="eval (a forward without autograd) and/or train (a training step) (default: eval,train)")
    parser.add_argument("--reps", type=cli.positive_int,
                        help=f"timed calls per variant (default: adapted to its time per call, about "
                             f"{TARGET_MS['cuda']:.0f} ms of calls on a GPU, {MIN_REPS} to {MAX_REPS['cuda']})")
    parser.add_argument("--autocast", choices=cli.AUTOCAST_DTYPES,
                        help="every forward under torch.autocast to this dtype, the backward outside it")
    parser.add_argument("--out", default=RESULTS,
                        help="directory for configs-<device>[-autocast-<dtype>].json (default: bench/results)")
    parser.add_argument("--gpus", type=cli.positive_int,
                        help="processes at once, one a GPU, each over every N-th configuration (default: every "
                             "GPU there is, for --device cuda)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows of the JSON already in --out (written after each row) where it was "
                             "measured under the same tree (commit), device, torch, precision and timing, and measure "
                             "the rest")
    parser.add_argument("--estimate", action="store_true",
                        help="print the grid's estimated H200 time (and each configuration's) and exit")
    parser.add_argument("--markdown", metavar="FILE.json", help="print the README table of a result and exit")
    args = parser.parse_args(argv)
    if args.markdown:
        return args
    cli_argv = ["--dtype", "float32"] + (["--device", args.device] if args.device else [])
    cli_args = cli.parse_args(cli_argv + (["--autocast", args.autocast] if args.autocast else []))
    args.device, args.dtype, args.autocast = cli_args.device, cli_args.dtype, cli_args.autocast
    args.size = args.size or ("spec" if args.device.type == "cuda" else "tiny")
    args.configs = select(parser, args.configs)
    if args.gpus is None:
        args.gpus = torch.cuda.device_count() if args.device.type == "cuda" and args.device.index is None else 1
    elif args.gpus > 1 and args.device.type == "cuda" and (args.device.index is not None
                                                           or args.gpus > torch.cuda.device_count()):
        parser.error(f"--gpus {args.gpus}: with --device cuda (no index) and at most the "
                     f"{torch.cuda.device_count()} GPUs there are")
    return args


def print_estimate(args) -> None:
    """Each configuration's estimated eager times at SPEC's batch, and the grid's total, on an H200."""
    reference = reference_result(cli.dtype_name(args.autocast))
    if reference is None:
        print("no bench/results/models-nvidia-h200*.json at this precision to estimate from")
        return
    print(f"estimated on an H200 from {os.path.relpath(reference[0])} (SPEC's configurations' times scaled by "
          f"the convolution's multiply-adds or outputs), {args.size} sizes, SPEC's batch:")
    for c in args.configs:
        shape = input_shape(c, args.size, "spec")
        ms = {step: estimate_ms(c, shape, step, reference[1]) for step in STEPS}
        print(f"  {c.name:<20}{'x'.join(map(str, shape)):<22} eager eval {ms['eval']['eager']:7.2f} ms, "
              f"train {ms['train']['eager']:7.2f} ms")
    items = grid(args.configs, args.batches, args.steps)
    print(f"the grid ({len(items)} rows): about {estimate_s(items, args.size, reference[1]):.0f} s")


def main(argv: list[str] | None = None) -> int:
    """Runs the grid (or prints an estimate, or a result's markdown table); the exit status: 0 when every
    row was measured and every check passed, 1 otherwise."""
    args = parse_args(argv)
    if args.markdown:
        with open(args.markdown) as f:
            print(markdown(json.load(f)))
        return 0
    if args.estimate:
        print_estimate(args)
        return 0
    result = run_grid(args)
    print(f"wrote {write(result, args.out)}")
    print_table(result)
    return 0 if result["ok"] and result["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
