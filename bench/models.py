"""The whole-model benchmark: the four architectures (SPEC.md A-D) in float32,
or under autocast (--autocast bfloat16|float16), run as ``python -m fused_ops``
runs them (fused_ops.cli: the fused drop-in and its peers, the original eager,
tuned by hand, torch.compile of it and, with --max-autotune,
torch.compile(mode="max-autotune"); checked, timed, their peak memory
measured), an eval forward and a training step (forward + backward) in one
call. Writes models-<device>.json (models-<device>-autocast-<dtype>.json under
autocast) under bench/results/ (or --out) and prints a short table last.
SPEC's sizes on a GPU; on a CPU (reduced sizes by default, tiny for a test) it
runs too, but that is not the GPU result.

    python bench/models.py [--device cuda] [--size spec|reduced|tiny] [--reps N] [--autocast bfloat16|float16]
                           [--no-compile] [--max-autotune] [--out DIR]
"""
import argparse
import os

import torch

from fused_ops import cli
from fused_ops.architectures import SIZES
from timing import device_name, write_result

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def run(cli_argv: list[str]) -> dict:
    """Both modes through fused_ops.cli, with its options cli_argv (float32, under autocast where they say so):
    the device's name, torch's version, the sizes, the autocast dtype (None without), whether every check
    passed, and each mode's result (the CLI's JSON) under "eval" and "train"."""
    args = cli.parse_args(["--dtype", "float32", *cli_argv])
    modes = {mode: cli.run_mode(args, train=mode == "train") for mode in ("eval", "train")}
    return dict(device=device_name(args.device), device_type=args.device.type, torch=torch.__version__,
                dtype="float32", autocast=cli.dtype_name(args.autocast), size=args.size,
                ok=all(m["ok"] for m in modes.values()), **modes)


def write(result: dict, out_dir: str) -> str:
    """result as out_dir/models-<device>[-autocast-<dtype>].json: the path."""
    return write_result(result, out_dir, "models")


def print_table(result: dict) -> None:
    """Per model, the eval forward and the training step: the check, times, the fused speed-ups, peak memory."""
    print(f"\nwhole models on {result['eval']['device']}: torch {result['torch']}, {cli.describe_precision(result)}, "
          f"{result['size']} sizes, {result['eval']['timing']}")
    if result["device_type"] != "cuda":
        print("on a CPU: a test run, not the GPU result")
    if result["size"] != "spec":
        print(f"{result['size']} sizes: smaller inputs than SPEC's (the same models)")
    print(f"{'model':<36}{'step':<11}{'check':>6}{cli.TIMES_HEADER}")
    for eval_row, train_row in zip(result["eval"]["rows"], result["train"]["rows"]):
        print(f"{eval_row['model'] + ' ' + eval_row['name']:<36}{'eval fwd':<11}{cli.check_column(eval_row):>6}"
              f"{cli.format_times(eval_row)}")
        print(f"{'':<36}{'train step':<11}{cli.check_column(train_row):>6}{cli.format_times(train_row)}")
    for note in cli.TIMES_NOTES:
        print(note)


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the exit status: 0 when every check passed, 1 otherwise."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda where there is a GPU, else cpu)")
    parser.add_argument("--size", choices=SIZES, help="input sizes (default: spec on a GPU, reduced on a CPU)")
    parser.add_argument("--reps", help=f"timed calls per variant (default: {cli.DEFAULT_REPS['cuda']} on a GPU, "
                                       f"{cli.DEFAULT_REPS['cpu']} on a CPU)")
    parser.add_argument("--autocast", choices=cli.AUTOCAST_DTYPES,
                        help="every forward under torch.autocast to this dtype, the backward outside it "
                             "(default: none, float32 throughout)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile of the originals")
    parser.add_argument("--max-autotune", action="store_true",
                        help="also time torch.compile(mode=\"max-autotune\") of the originals (slow to compile)")
    parser.add_argument("--compile-fused", action="store_true",
                        help="also time torch.compile of the fused module (its eager call's host time)")
    parser.add_argument("--out", default=RESULTS,
                        help="directory for models-<device>[-autocast-<dtype>].json (default: bench/results)")
    args = parser.parse_args(argv)

    cli_argv = [f"--{flag}" for flag in ("no-compile", "max-autotune", "compile-fused") if getattr(args, flag.replace("-", "_"))]
    for option in ("device", "size", "reps", "autocast"):
        if getattr(args, option):
            cli_argv += [f"--{option}", getattr(args, option)]
    result = run(cli_argv)
    print(f"wrote {write(result, args.out)}")
    print_table(result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
