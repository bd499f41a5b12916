"""First calls and changing shapes (issue 43): what a user who meets new shapes pays, every model,
fused against the original eager, tuned by hand (channels last, cudnn.benchmark) and torch.compile
(its recompilations count), and the fused modules with the autotuner off (their rules).

Each model's variant runs in a process of its own (as a user's process runs the one it has: what
another variant loaded or planned before, cuDNN's plans, kernels loaded at their first launch, is
not there), its CUDA context made before the first timing (a user's model.cuda() makes it); each
sequence starts afresh (new modules, the tuner's choices and Dynamo's caches cleared) and is timed
whole by the wall clock, its first calls included, synchronized once at the end:
  - first call: one eval call (no autograd) and one training step of a new module at the sequence's
    largest batch;
  - serving: SERVING_CALLS eval calls without autograd over batch sizes 1..max_batch in a seeded
    random order;
  - ragged training: EPOCHS epochs of STEPS training steps (forward and every parameter's gradient)
    of batch max_batch, the last step of each epoch ragged (batch max_batch // 2 + 1).
On a GPU at SPEC's sizes but the batch (max_batch 16), float32 and under bf16 autocast; on a CPU at
the main job's reduced sizes but the batch (max_batch 4), fewer calls (the short sequence: 8 eval
calls over 4 batch sizes, 4 training steps), each variant's processes run 5 times, the median of
each sequence kept (one process's sequence on the 2-core CPU moves by about 20 % from run to run).
Writes bench/results/first-calls-<device>[-autocast-bf16].json and prints a table of seconds per
sequence and the fused module's ratio to the original eager.

    python bench/first_calls.py [--device cuda|cpu] [--no-compile] [--no-autocast | --autocast-only] [--models A,B]
                                [--repeats N]
"""
import argparse
import copy
import json
import os
import random
import statistics
import subprocess
import sys
import time

import torch

from fused_ops import autotune, cli
from fused_ops.architectures import ARCHITECTURES
from timing import device_name, provenance, write_result

SETTINGS = {"cuda": dict(size="spec", max_batch=16, serving_calls=48, epochs=3, steps=8, repeats=1),
            "cpu": dict(size="reduced", max_batch=4, serving_calls=8, epochs=1, steps=4, repeats=5)}
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
VARIANTS = ("eager", "tuned", "compile", "fused", "fused, tuner off")


def build(variant: str, original: torch.nn.Module, arch) -> torch.nn.Module:
    """The module `variant` times, new: its caches and the tuner's choices cleared."""
    autotune.clear()
    autotune.set_enabled(variant != "fused, tuner off")
    if variant == "tuned":
        return cli.Tuned(original)
    if variant == "compile":
        torch._dynamo.reset()  # (only here: importing Dynamo first would spare the others' first calls its cost)
        return torch.compile(copy.deepcopy(original))
    if variant.startswith("fused"):
        return arch.fused_from(copy.deepcopy(original))
    return copy.deepcopy(original)


def call(module, x: torch.Tensor, train: bool, autocast_dtype) -> None:
    module.train(train)
    with torch.set_grad_enabled(train), cli.autocast(x.device, autocast_dtype):
        out = module(x)
    if train:
        torch.autograd.grad(out.float().sum(), list(module.parameters()))


def timed(fn, device: torch.device) -> float:
    """Seconds of fn(), synchronized at the end."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    began = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - began


def sequences(arch, variant: str, device: torch.device, settings: dict, autocast_dtype) -> dict:
    """{sequence: seconds} of one variant of one model."""
    torch.manual_seed(cli.SEED)
    original = arch.build_original().to(device)
    shape = arch.input_shape(settings["size"])[1:]
    rng = random.Random(0)
    batches = [1 + i % settings["max_batch"] for i in range(settings["serving_calls"])]
    rng.shuffle(batches)
    inputs = {b: torch.rand(b, *shape, device=device) for b in range(1, settings["max_batch"] + 1)}
    largest, ragged = inputs[settings["max_batch"]], inputs[settings["max_batch"] // 2 + 1]
    steps = [largest] * (settings["steps"] - 1) + [ragged]
    result = {}
    for train in (False, True):
        module = build(variant, original, arch)
        result["first training step" if train else "first eval call"] = timed(
            lambda: call(module, largest, train, autocast_dtype), device)
    module = build(variant, original, arch)
    result["serving"] = timed(lambda: [call(module, inputs[b], False, autocast_dtype) for b in batches], device)
    module = build(variant, original, arch)
    result["ragged training"] = timed(
        lambda: [call(module, x, True, autocast_dtype) for _ in range(settings["epochs"]) for x in steps], device)
    return result


def in_own_process(arch, variant: str, device: torch.device, settings: dict, autocast_dtype) -> dict:
    """sequences(...) in a child process of its own (this script with --variant): {sequence: seconds}."""
    command = [sys.executable, os.path.abspath(__file__), "--device", str(device), "--variant", arch.letter,
               variant, "--settings", json.dumps(settings)]
    if autocast_dtype is not None:
        command += ["--autocast", cli.dtype_name(autocast_dtype)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"first_calls: {arch.letter} {variant} failed in its process:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def one_variant(args) -> int:
    """The child's part: one model's variant, its sequences' seconds as a JSON line."""
    device = torch.device(args.device)
    if device.type == "cuda":  # (the CUDA context, which a user's model.cuda() makes before any call)
        torch.zeros(1, device=device)
        torch.cuda.synchronize(device)
    letter, variant = args.variant
    arch = next(a for a in ARCHITECTURES if a.letter == letter)
    autocast_dtype = getattr(torch, args.autocast) if args.autocast else None
    print(json.dumps(sequences(arch, variant, device, json.loads(args.settings), autocast_dtype)))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    parser.add_argument("--no-autocast", action="store_true", help="float32 only (on a GPU: also bf16 autocast)")
    parser.add_argument("--autocast-only", action="store_true", help="bf16 autocast only (on a GPU)")
    parser.add_argument("--models", default="A,B,C,D")
    parser.add_argument("--repeats", type=int, help="processes per variant, each sequence's median kept "
                                                    "(default: 1 on a GPU, 5 on a CPU)")
    parser.add_argument("--out", default=None, help="the JSON's folder (default: bench/results)")
    # (a child's: one model's variant in its own process)
    parser.add_argument("--variant", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    parser.add_argument("--autocast", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        return one_variant(args)
    device = torch.device(args.device)
    settings = dict(SETTINGS[device.type], **({"repeats": args.repeats} if args.repeats else {}))
    variants = [v for v in VARIANTS if not (args.no_compile and v == "compile")]
    precisions = ([] if args.autocast_only else [None]) + ([] if args.no_autocast or device.type != "cuda"
                                                            else [torch.bfloat16])
    archs = [a for a in ARCHITECTURES if a.letter in args.models.split(",")]
    for autocast_dtype in precisions:
        rows = []
        result = dict(device=device_name(device), torch=torch.__version__, **provenance(),
                      autocast=cli.dtype_name(autocast_dtype), settings=settings, rows=rows)
        for arch in archs:
            for variant in variants:
                runs = [in_own_process(arch, variant, device, settings, autocast_dtype)
                        for _ in range(settings["repeats"])]
                seconds = {name: statistics.median(run[name] for run in runs) for name in runs[0]}
                rows.append(dict(model=arch.letter, variant=variant, seconds=seconds))
                print(f"{arch.letter} {variant}: " + ", ".join(f"{k} {v:.3f} s" for k, v in seconds.items()),
                      file=sys.stderr, flush=True)
                path = write_result(result, args.out or RESULTS, "first-calls")  # (the rows so far)
        precision = "bf16 autocast" if autocast_dtype else "float32"
        print(path)
        print(f"\n{result['device']}, {precision}, seconds (fused / eager in brackets)")
        names = list(rows[0]["seconds"])
        print(f"{'model':<6}{'variant':<18}" + "".join(f"{n:>22}" for n in names))
        for row in rows:
            eager = next(r for r in rows if r["model"] == row["model"] and r["variant"] == "eager")["seconds"]
            cells = [f"{row['seconds'][n]:.4f} ({row['seconds'][n] / eager[n]:.2f}x)" if row["variant"] == "fused"
                     else f"{row['seconds'][n]:.4f}" for n in names]
            print(f"{row['model']:<6}{row['variant']:<18}" + "".join(f"{c:>22}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
