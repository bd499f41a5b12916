"""KernelBench's own correctness and timing protocol (issue 42) run on its four level-2 problem files that the
drop-in modules replace: each problem's ``Model`` is the reference, the drop-in (``fused_ops.nn``) the
candidate in place of KernelBench's ``ModelNew``. Writes kernelbench-<device>.json under bench/results/ (or
--out) and prints a table last.

The protocol is KernelBench's (github.com/ScalingIntelligence/KernelBench at KERNELBENCH_COMMIT), reimplemented
here (none of its code copied) after its src/kernelbench/eval.py (eval_kernel_against_ref,
run_and_check_correctness, set_seed, get_tolerance_for_precision, _process_input_tensor) and
src/kernelbench/timing.py (time_execution_with_cuda_event, clear_l2_cache, get_timing_stats), with the trial
counts of its scripts (scripts/run_and_check.py, eval_from_generations.py: 5 correctness trials, 100 timed).
Per problem:
- the problem file is executed in a fresh namespace, which gives Model, get_init_inputs and get_inputs
  (load_original_model_and_inputs); --batch N sets its module-level batch_size first (not KernelBench's: a
  CPU smoke run);
- set_seed(42) (torch.manual_seed and torch.cuda.manual_seed), the init inputs drawn (tensors among them cast
  to the precision and moved to the device); under no_grad, set_seed(42) and the reference built, then
  set_seed(42) again and the candidate built with the same init inputs, both on the CPU, then both moved to
  the device and cast to the precision;
- correctness: torch.manual_seed(42), then one seed per trial drawn as torch.randint(0, 2**32 - 1, (1,));
  under no_grad, per trial: set_seed(trial seed), fresh inputs from get_inputs() (cast, moved), the
  reference called, then the candidate on the same inputs, each followed by a synchronization; a shape
  mismatch or an exception of the candidate fails the problem at once; a trial passes where
  torch.allclose(reference, candidate, atol=tol, rtol=tol), tol 1e-4 for float32 (1e-2 for float16 and
  bfloat16: torchbench's); the problem passes where every trial does. KernelBench records the max and mean
  absolute difference of failing trials; here every trial's are recorded;
- timing, of a correct candidate only, then of the reference (its excessive-speedup check), each on inputs
  drawn after set_seed(42), outside no_grad (as KernelBench times: autograd records the forward, the
  parameters requiring gradients): 3 warm-up calls, each synchronized; torch.cuda.empty_cache(); then 1 + 100
  calls, the first discarded, each between CUDA events on the current stream after a synchronization and an
  L2 flush (a 256 MiB int64 tensor filled), synchronized after; the mean over the 100 is the time (KernelBench
  rounds it to 3 significant digits: the JSON keeps it whole); speedup = reference mean / candidate mean,
  flagged above 10x (excessive_speedup).
KernelBench sets no precision or backend flag (TF32, cudnn.benchmark, determinism) and neither does this: they
are PyTorch's defaults (cuDNN convolutions TF32 in float32 on a GPU), recorded in the JSON. KernelBench runs
on CUDA only; on a CPU (a smoke run, not KernelBench's measurement) each call is timed by the wall clock,
without an L2 flush.

The problem files are not in this repository: `make kernelbench` puts them in third_party/kernelbench/ (from
GitHub at KERNELBENCH_COMMIT, or from a local clone: `make kernelbench KERNELBENCH_REPO=<git dir>`).

    python bench/kernelbench.py [--device cuda] [--problems DIR] [--batch N] [--trials N] [--correct-trials N]
                                [--precision fp32|fp16|bf16] [--out DIR ...]

A CPU smoke run: --device cpu --batch 1 --trials 1 --correct-trials 2 with FUSED_OPS_AUTOTUNE=0 in the
environment takes about 30 s on 2 cores (with the autotuner on, the drop-ins' first calls time every
formulation, forward and backward where autograd records: minutes at these sizes on a CPU).
"""
import argparse
import hashlib
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass

import torch

import fused_ops.nn
from fused_ops import autotune
from fused_ops._timing import device_name, device_slug, provenance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
PROBLEMS_DIR = os.path.join(ROOT, "third_party", "kernelbench")
KERNELBENCH_COMMIT = "423217d9fda91e0c2d67e4a43bf62f96f6d104f1"  # the Makefile's; the JSON names the files' own


@dataclass(frozen=True)
class Problem:
    """A KernelBench level-2 problem file and the drop-in (fused_ops.nn) that replaces its Model."""
    letter: str  # the architecture (SPEC.md)
    name: str  # the file's name without .py
    module: str  # the drop-in's class in fused_ops.nn

    @property
    def file(self) -> str:
        return self.name + ".py"


PROBLEMS = (Problem("A", "8_Conv3d_Divide_Max_GlobalAvgPool_BiasAdd_Sum", "Conv3dDivMaxPoolGAPBiasSum"),
            Problem("B", "78_ConvTranspose3d_Max_Max_Sum", "ConvTranspose3dMaxPoolMaxPoolSum"),
            Problem("C", "65_Conv2d_AvgPool_Sigmoid_Sum", "Conv2dAvgPoolSigmoidSum"),
            Problem("D", "77_ConvTranspose3d_Scale_BatchNorm_GlobalAvgPool", "ConvTranspose3dScaleBatchNormGAP"))

# KernelBench's protocol (see the docstring): its seed, trial counts, timing and tolerances.
SEED = 42
CORRECT_TRIALS = 5
PERF_TRIALS = 100
WARMUP_CALLS = 3
DISCARD_FIRST = 1
L2_FLUSH_SHAPE = (32, 1024, 1024)  # int64: 256 MiB, more than an H200's L2
EXCESSIVE_SPEEDUP = 10.0
PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def set_seed(seed: int) -> None:
    """KernelBench's set_seed: the CPU generator and the current CUDA device's (queued where CUDA is not yet
    initialized, a no-op without CUDA)."""
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_problem(path: str, batch: int | None = None) -> dict:
    """The problem file at `path` executed in a fresh namespace (as KernelBench loads its reference): its
    namespace, which has Model, get_init_inputs and get_inputs; with `batch`, its module-level batch_size set
    to it first (get_inputs reads it when called)."""
    with open(path) as f:
        source = f.read()
    namespace = {"__name__": "kernelbench_" + os.path.splitext(os.path.basename(path))[0], "__file__": path}
    exec(compile(source, path, "exec"), namespace)
    missing = [name for name in ("Model", "get_init_inputs", "get_inputs") if name not in namespace]
    if missing:
        raise ValueError(f"{path}: a KernelBench problem defines Model, get_init_inputs and get_inputs; "
                         f"missing {', '.join(missing)}")
    if batch is not None:
        if not isinstance(namespace.get("batch_size"), int):
            raise ValueError(f"{path}: --batch sets the problem's module-level batch_size, which it does not define")
        if batch < 1:
            raise ValueError(f"--batch: a positive batch size, got {batch}")
        namespace["batch_size"] = batch
    return namespace


def to_device(values: list, device: torch.device, dtype: torch.dtype) -> list:
    """KernelBench's _process_input_tensor on each value: tensors cast to `dtype` and moved to `device`,
    anything else as it is."""
    return [v.to(dtype=dtype).to(device=device) if isinstance(v, torch.Tensor) else v for v in values]


def build_models(problem: dict, candidate_cls, device: torch.device, dtype: torch.dtype,
                 seed: int = SEED) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(reference, candidate) built as eval_kernel_against_ref builds Model and ModelNew: from the same init
    inputs, each constructed right after set_seed(seed) under no_grad, then moved and cast."""
    set_seed(seed)
    init_inputs = to_device(problem["get_init_inputs"](), device, dtype)
    with torch.no_grad():
        set_seed(seed)
        reference = problem["Model"](*init_inputs)
    with torch.no_grad():
        set_seed(seed)
        candidate = candidate_cls(*init_inputs)
        reference = reference.to(device=device, dtype=dtype)
        candidate = candidate.to(device=device, dtype=dtype)
        synchronize(device)
    return reference, candidate


def check_correctness(reference, candidate, get_inputs, device: torch.device, dtype: torch.dtype,
                      trials: int = CORRECT_TRIALS, seed: int = SEED) -> dict:
    """run_and_check_correctness: `trials` trials on fresh inputs from seeds drawn from `seed`; the count that
    passed torch.allclose at the precision's tolerance, each trial's max and mean absolute difference and the
    reference's largest magnitude, and the reason the check stopped early (a shape mismatch, the candidate's
    exception) under "error"."""
    tolerance = TOLERANCE[dtype]
    torch.manual_seed(seed)
    seeds = [torch.randint(0, 2**32 - 1, (1,)).item() for _ in range(trials)]
    result = dict(trials=trials, passed=0, tolerance=tolerance, seeds=seeds, max_difference=[], avg_difference=[],
                  reference_max_abs=[], error=None)
    with torch.no_grad():
        for trial_seed in seeds:
            set_seed(trial_seed)
            inputs = to_device(get_inputs(), device, dtype)
            set_seed(trial_seed)
            reference = reference.to(device=device, dtype=dtype)
            set_seed(trial_seed)
            candidate = candidate.to(device=device, dtype=dtype)
            expected = reference(*inputs)
            synchronize(device)
            try:
                actual = candidate(*inputs)
                synchronize(device)
            except Exception as e:  # KernelBench's runtime_error: the check ends here
                result["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
                return result
            if actual.shape != expected.shape:
                result["error"] = f"output shape mismatch: expected {tuple(expected.shape)}, got {tuple(actual.shape)}"
                return result
            difference = (expected - actual).abs()
            result["max_difference"].append(difference.max().item())
            result["avg_difference"].append(difference.mean().item())
            result["reference_max_abs"].append(expected.abs().max().item())  # (the scale rtol applies to)
            result["passed"] += bool(torch.allclose(expected, actual, atol=tolerance, rtol=tolerance))
    return result


def flush_l2(device: torch.device) -> None:
    """KernelBench's clear_l2_cache: a tensor larger than the L2 written, then freed."""
    torch.empty(L2_FLUSH_SHAPE, dtype=torch.int64, device=device).fill_(42)


def time_calls(model, inputs: list, device: torch.device, trials: int = PERF_TRIALS, warmup: int = WARMUP_CALLS,
               discard_first: int = DISCARD_FIRST) -> list[float]:
    """time_execution_with_cuda_event: model(*inputs)'s time in milliseconds in each of `trials` calls, after
    `warmup` calls (each synchronized) and `discard_first` discarded ones; each timed call begins after a
    synchronization and an L2 flush, between CUDA events on the current stream. On a CPU (not KernelBench's),
    the wall clock around each call, no flush."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        model(*inputs)
        synchronize(device)
    if cuda:
        torch.cuda.empty_cache()
    times = []
    for trial in range(trials + discard_first):
        synchronize(device)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            flush_l2(device)
            start.record()
            model(*inputs)
            end.record()
            synchronize(device)
            ms = start.elapsed_time(end)
        else:
            began = time.perf_counter()
            model(*inputs)
            ms = (time.perf_counter() - began) * 1e3
        if trial >= discard_first:
            times.append(ms)
    return times


def timing_stats(times: list[float]) -> dict:
    """get_timing_stats' fields (unrounded): mean, std (population), min, max in milliseconds, num_trials."""
    return dict(mean=statistics.fmean(times), std=statistics.pstdev(times), min=min(times), max=max(times),
                num_trials=len(times))


def evaluate(problem: dict, candidate_cls, device: torch.device, dtype: torch.dtype,
             correct_trials: int = CORRECT_TRIALS, perf_trials: int = PERF_TRIALS, seed: int = SEED) -> dict:
    """eval_kernel_against_ref with measure_performance and its excessive-speedup check: the models built,
    checked, then (a correct candidate only) the candidate timed and the reference timed (always, as the
    check does). correctness, the trials' result, the input shapes, the times' stats (None where not timed),
    the speedup, and the formulation the drop-in ran in its timed calls (None for other candidates)."""
    reference, candidate = build_models(problem, candidate_cls, device, dtype, seed)
    check = check_correctness(reference, candidate, problem["get_inputs"], device, dtype, correct_trials, seed)
    correct = check["error"] is None and check["passed"] == check["trials"]

    def timed(model) -> tuple[dict, list]:
        synchronize(device)
        set_seed(seed)
        inputs = to_device(problem["get_inputs"](), device, dtype)
        model = model.to(device=device, dtype=dtype)
        synchronize(device)
        return timing_stats(time_calls(model, inputs, device, perf_trials)), inputs

    fused_ms, formulation, graphed, inputs = None, None, None, None
    if correct:
        fused_ms, inputs = timed(candidate)
        if hasattr(candidate, "formulation"):  # a drop-in: what its timed calls ran
            formulation, graphed = autotune.last_formulation(), candidate.graphed(inputs[0])
    reference_ms, inputs = timed(reference)
    speedup = None if fused_ms is None else reference_ms["mean"] / fused_ms["mean"]
    return dict(correct=correct, correctness=check,
                input_shapes=[list(v.shape) for v in inputs if isinstance(v, torch.Tensor)],
                reference_ms=reference_ms, fused_ms=fused_ms, speedup=speedup,
                excessive_speedup=speedup is not None and speedup > EXCESSIVE_SPEEDUP,
                formulation=formulation, graphed=graphed)


def problem_files(problems_dir: str) -> list[str]:
    """The four problem files' paths in problems_dir; a clear error where one is missing."""
    missing = [p.file for p in PROBLEMS if not os.path.isfile(os.path.join(problems_dir, p.file))]
    if missing:
        raise FileNotFoundError(f"{problems_dir} lacks KernelBench's {', '.join(missing)}: run `make kernelbench` "
                                f"(or pass --problems DIR)")
    return [os.path.join(problems_dir, p.file) for p in PROBLEMS]


def backend_settings() -> dict:
    """The precision and backend settings in force (PyTorch's defaults: neither KernelBench nor this sets them)."""
    return dict(cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
                cuda_matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
                float32_matmul_precision=torch.get_float32_matmul_precision(),
                cudnn_benchmark=torch.backends.cudnn.benchmark, cudnn_deterministic=torch.backends.cudnn.deterministic)


def progress(message: str) -> None:
    print(f"[kernelbench] {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict:
    """Every problem through evaluate(): the result (see main's JSON)."""
    device, dtype = torch.device(args.device), PRECISIONS[args.precision]
    if device.type == "cuda":
        # (as KernelBench does; an index: torch 2.11's set_device refuses a bare "cuda")
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    paths = problem_files(args.problems)
    commit_file = os.path.join(args.problems, "COMMIT")  # written by `make kernelbench`
    commit = open(commit_file).read().strip() if os.path.isfile(commit_file) else None
    rows = []
    for problem, path in zip(PROBLEMS, paths):
        with open(path, "rb") as f:
            sha256 = hashlib.sha256(f.read()).hexdigest()
        row = dict(letter=problem.letter, problem=problem.name, module=problem.module, sha256=sha256)
        progress(f"{problem.letter} {problem.name} against fused_ops.nn.{problem.module}")
        try:
            namespace = load_problem(path, args.batch)
            row.update(init_inputs=namespace["get_init_inputs"](), batch_size=namespace.get("batch_size"))
            row.update(evaluate(namespace, getattr(fused_ops.nn, problem.module), device, dtype,
                                args.correct_trials, args.trials))
        except Exception as e:  # recorded, and the other problems still run
            traceback.print_exc()
            row.update(correct=False, error=f"{type(e).__name__}: {e}")
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # (as KernelBench's cleanup does between evaluations)
    return dict(device=device_name(device), device_type=device.type, torch=torch.__version__, **provenance(),
                kernelbench_commit=commit, problems_dir=os.path.abspath(args.problems), precision=args.precision,
                tolerance=TOLERANCE[dtype], batch=args.batch, seed=SEED, correct_trials=args.correct_trials,
                perf_trials=args.trials, warmup_calls=WARMUP_CALLS, discard_first=DISCARD_FIRST,
                timing="cuda events, L2 flushed" if device.type == "cuda" else "wall clock (CPU: not KernelBench's)",
                settings=backend_settings(), ok=all(row["correct"] for row in rows), rows=rows)


def result_name(result: dict) -> str:
    """kernelbench-<device>[-batch<N>][-<precision>].json (the suffixes where not KernelBench's defaults)."""
    batch = f"-batch{result['batch']}" if result["batch"] is not None else ""
    precision = f"-{result['precision']}" if result["precision"] != "fp32" else ""
    return f"kernelbench-{device_slug(result['device'])}{batch}{precision}.json"


def write(result: dict, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, result_name(result))
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path


def print_table(result: dict) -> None:
    """A row per problem: the drop-in, correct trials, the largest difference, the tolerance, both times,
    the speedup."""
    settings = result["settings"]
    commit = (result["kernelbench_commit"] or "unknown")[:7]
    batch = "the problems' own" if result["batch"] is None else result["batch"]
    tf32 = f", cuDNN TF32 {'on' if settings['cudnn_allow_tf32'] else 'off'}" if result["device_type"] == "cuda" else ""
    print(f"\nKernelBench level 2 (commit {commit}) on {result['device']}: torch {result['torch']}, "
          f"{result['precision']}{tf32}, batch {batch}; {result['correct_trials']} correctness trials, "
          f"{result['perf_trials']} timed ({result['timing']}, {result['warmup_calls']} warm-up, "
          f"{result['discard_first']} discarded), means")
    if result["device_type"] != "cuda":
        print("on a CPU: a smoke run, not KernelBench's measurement")
    print(f"{'problem':<50}{'our module':<35}{'correct':>8}{'max diff':>10}{'tol':>8}{'original ms':>12}"
          f"{'fused ms':>10}{'speedup':>9}")
    for row in result["rows"]:
        check = row.get("correctness")
        if check is None:
            print(f"{row['problem']:<50}{row['letter'] + ' ' + row['module']:<35}  error: {row['error']}")
            continue
        max_diff = f"{max(check['max_difference']):.1e}" if check["max_difference"] else "-"
        fused = f"{row['fused_ms']['mean']:.3g}" if row["fused_ms"] else "-"
        speedup = f"{row['speedup']:.2f}x" if row["speedup"] is not None else "-"
        print(f"{row['problem']:<50}{row['letter'] + ' ' + row['module']:<35}"
              f"{check['passed']:>4}/{check['trials']:<3}{max_diff:>10}{check['tolerance']:>8.0e}"
              f"{row['reference_ms']['mean']:>12.3g}{fused:>10}{speedup:>9}")
        if check["error"]:
            print(f"{'':<50}{check['error']}")
        if row["excessive_speedup"]:
            print(f"{'':<50}speedup over {EXCESSIVE_SPEEDUP:g}x: KernelBench flags it (excessive_speedup)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda, cuda:N or cpu (default: cuda where there is a GPU)")
    parser.add_argument("--problems", default=PROBLEMS_DIR,
                        help="directory of the four problem files (default: third_party/kernelbench, "
                             "`make kernelbench`)")
    parser.add_argument("--batch", type=int, default=None,
                        help="set each problem's batch_size (default: the problems' own; smaller for a CPU run)")
    parser.add_argument("--trials", type=int, default=PERF_TRIALS,
                        help=f"timed calls per model (default: KernelBench's {PERF_TRIALS})")
    parser.add_argument("--correct-trials", type=int, default=CORRECT_TRIALS,
                        help=f"correctness trials (default: KernelBench's {CORRECT_TRIALS})")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="KernelBench's precision: models and inputs cast to it (default fp32)")
    parser.add_argument("--out", action="append",
                        help="directory for kernelbench-<device>.json (repeat for several; default bench/results)")
    args = parser.parse_args(argv)
    if args.trials < 1 or args.correct_trials < 1:
        parser.error("--trials and --correct-trials: at least 1")
    args.out = args.out or [RESULTS]
    return args


def main(argv: list[str] | None = None) -> int:
    """Runs the protocol; the exit status: 0 where every problem's drop-in passed, 1 otherwise."""
    args = parse_args(argv)
    try:
        problem_files(args.problems)
    except FileNotFoundError as e:  # the problems not fetched
        print(f"bench/kernelbench.py: {e}", file=sys.stderr)
        return 2
    result = run(args)
    for out_dir in args.out:
        print(f"wrote {write(result, out_dir)}")
    print_table(result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
