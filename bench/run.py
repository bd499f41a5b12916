"""The one benchmark call: builds fused_ops, runs the whole test suite (the CUDA
tests included where there is a GPU), times every fused op against the eager
PyTorch tail and torch.compile of it, then the four whole models (bench/models.py:
eval forward and training step, the fused module against the original eager,
tuned by hand and compiled, peak memory) and the configuration grid
(bench/configs.py: 40 constructor configurations at batch 1, 8 and SPEC's, eval
and training step, fused against eager and tuned), each in float32 and again
under bfloat16 autocast, where two GPUs are visible data-parallel training
on them (bench/distributed.py under torchrun, NCCL), and where `make kernelbench`
fetched KernelBench's four problem files (third_party/kernelbench/) KernelBench's
own protocol on them (bench/kernelbench.py), and the first calls and changing shapes
(bench/first_calls.py: new modules' first calls, a server's changing batch sizes, ragged
training); writes JSON under bench/results/
(and under $OUT when that is set), and prints short tables last.

    python bench/run.py [--skip-build] [--skip-tests] [--test-shard K/N] [--tests-k EXPR]
                        [--only tests|tails|models|configs|distributed|kernelbench|first_calls]
                        [--no-compile] [--max-autotune] [--no-autocast] [--device cuda]

On the lent GPU machines the whole suite outlasts one command (about 27 minutes on one H100): on a
machine of several GPUs it runs one shard per GPU at once (with pytest-xdist, each in its share of
the cores); on one GPU run it as shards, one call each, e.g. `python bench/run.py --only tests
--test-shard 1/4`, or only the CUDA cases, `--tests-k "not cpu"`.
"""
import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = ["bench_avg_pool2d_sigmoid_sum", "bench_max_pool3d_mean", "bench_max_pool3d_cascade_sum",
              "bench_batch_norm_gap"]
KERNELBENCH_PROBLEMS = os.path.join(ROOT, "third_party", "kernelbench")  # `make kernelbench`


def build():
    env = dict(os.environ)
    env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # H100/H200; set it for other GPUs
    env.setdefault("MAX_JOBS", str(os.cpu_count() or 2))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "."],
                   cwd=ROOT, env=env, check=True)


def collected_tests(select: str | None = None) -> list[str]:
    """The suite's test ids (those pytest's -k `select` keeps), as paths from /."""
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             "--rootdir", ROOT, os.path.join(ROOT, "tests"), *(["-k", select] if select else [])],
                            cwd="/", capture_output=True, text=True, check=True)
    ids = [line for line in listed.stdout.splitlines() if "::" in line]
    return [os.path.join(ROOT, test_id) if not test_id.startswith("/") else test_id for test_id in ids]


def shard_tests(shard: str, select: str | None = None, ids: list[str] | None = None) -> list[str]:
    """The test ids of shard "K/N" (K in 1..N): every N-th of `ids` (default: the suite's, those
    pytest's -k `select` keeps) from the K-th on, so that the N shards split every test file's cases
    (the whole suite on a GPU takes longer than one command may run on the lent machines)."""
    k, n = (int(v) for v in shard.split("/"))
    if not 1 <= k <= n:
        raise SystemExit(f"--test-shard: K/N with 1 <= K <= N, got {shard}")
    return (collected_tests(select) if ids is None else ids)[k - 1::n]


def pytest_command(selection: list[str], workers: int) -> list[str]:
    """pytest over `selection`, in `workers` processes where pytest-xdist is there (tests spread one by one:
    a file's in one process would leave test_compile_shapes' minutes to one)."""
    parallel = ["-n", str(workers)] if workers > 1 and importlib.util.find_spec("xdist") else []
    # (--durations: where the GPU suite's time goes, in the log)
    return [sys.executable, "-X", "faulthandler", "-m", "pytest", "-q", "-rfE", "--durations=40", "-p",
            "no:cacheprovider", *parallel, "--rootdir", ROOT, *selection]


def run_tests(log_dir: str, shard: str | None = None, select: str | None = None) -> str:
    """Runs the suite (or one shard of it: shard_tests; or what pytest's -k `select` keeps); the whole log
    goes to log_dir/tests.log. On a machine of several GPUs without `shard`, one shard per GPU at once
    (CUDA_VISIBLE_DEVICES), each in its share of the cores. Returns pytest's closing line(s)."""
    import torch

    gpus = torch.cuda.device_count() if shard is None else 1
    if gpus > 1:
        ids = collected_tests(select)
        shards = [(shard_tests(f"{k}/{gpus}", ids=ids), dict(os.environ, CUDA_VISIBLE_DEVICES=str(k - 1)))
                  for k in range(1, gpus + 1)]
    else:
        selection = (shard_tests(shard, select) if shard
                     else [os.path.join(ROOT, "tests"), *(["-k", select] if select else [])])
        shards = [(selection, dict(os.environ))]
    workers = max(1, (os.cpu_count() or 1) // len(shards)) if len(shards) > 1 else 1
    os.makedirs(log_dir, exist_ok=True)
    # each shard's log written as it runs (what a killed run got to stays), then joined into tests.log
    paths = [os.path.join(log_dir, f"tests-{k}.log") for k in range(1, len(shards) + 1)]
    files = [open(path, "w") for path in paths]
    running = [subprocess.Popen(pytest_command(selection, workers), cwd="/", env=env, stdout=f,
                                stderr=subprocess.STDOUT, text=True) for (selection, env), f in zip(shards, files)]
    for p, f in zip(running, files):
        p.wait()
        f.close()
    logs = []
    for path in paths:
        with open(path) as f:
            logs.append(f.read())
        os.remove(path)
    with open(os.path.join(log_dir, "tests.log"), "w") as f:
        f.write("\n".join(logs))
    summaries = []
    for log in logs:
        print(log[-3000:])
        summary = [line for line in log.splitlines() if re.search(r"\d+ (passed|failed)", line)]
        summaries.append((summary[-1] if summary else "pytest exited with no summary").strip("= "))
    return "; ".join(summaries)


def time_tails(device: str, batch: int | None, compile_tail: bool, tests: str) -> dict:
    """Every tail's variants at its architecture's default size (batch: 2 on a CPU unless given): the result."""
    import torch

    from timing import copy_bandwidth_gbs, device_name

    copy_gbs = copy_bandwidth_gbs(device, (2 << 30) if device == "cuda" else (64 << 20))
    rows = []
    for module in BENCHMARKS:
        bench = __import__(module)
        shape = (batch or (bench.DEFAULT_SHAPE[0] if device == "cuda" else 2), *bench.DEFAULT_SHAPE[1:])
        rows += bench.run(device, shape, compile_tail=compile_tail)
    return dict(device=device_name(device), torch=torch.__version__, copy_bandwidth_gbs=copy_gbs, tests=tests,
                rows=rows)


def print_tails_table(result: dict) -> None:
    """Per tail and variant: times, the share of the copy bandwidth, the speed-ups over eager."""
    rows, copy_gbs = result["rows"], result["copy_bandwidth_gbs"]
    print(f"\n{result['device']}, torch {result['torch']}, copy bandwidth {copy_gbs:.0f} GB/s (read+write); "
          f"tests: {result['tests']}")
    header = (f"{'op':<24}{'variant':<9}{'fwd ms':>8}{'bwd ms':>8}{'fwd %copy':>10}{'bwd %copy':>10}{'fwd x':>7}"
              f"{'bwd x':>7}{'eval fwd ms':>12}")
    print(header)
    eager = {r["op"]: r for r in rows if r["variant"] == "eager"}
    for r in rows:
        e = eager[r["op"]]
        fwd_pct = r["forward_bytes"] / r["forward_ms"] / 1e6 / copy_gbs * 100
        bwd_pct = r["backward_bytes"] / r["backward_ms"] / 1e6 / copy_gbs * 100
        # tails with an eval mode (a batch norm's): forward in eval mode too
        eval_fwd = f"{r['eval_forward_ms']:>12.3f}" if "eval_forward_ms" in r else ""
        print(f"{r['op']:<24}{r['variant']:<9}{r['forward_ms']:>8.3f}{r['backward_ms']:>8.3f}"
              f"{fwd_pct:>9.0f}%{bwd_pct:>9.0f}%{e['forward_ms'] / r['forward_ms']:>7.2f}{e['backward_ms'] / r['backward_ms']:>7.2f}"
              f"{eval_fwd}")
        if "train_forward_ms" in r:
            print(f"{'':<24}train forward (saves {r['saved_bytes'] / 2**20:.1f} MiB) {r['train_forward_ms']:.3f} ms; "
                  f"backward op alone {r['backward_op_ms']:.3f} ms")


def run_distributed(precisions: list[list[str]]) -> list[tuple[bool, str]]:
    """bench/distributed.py on two GPUs (torchrun, NCCL, NVLink multicast off), once per precision:
    (every check passed, the output's last lines: its tables) each."""
    results = []
    for precision in precisions:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               os.path.join(ROOT, "bench", "distributed.py"), *precision],
                              env=dict(os.environ, NCCL_NVLS_ENABLE="0"), capture_output=True, text=True)
        ok = done.returncode == 0 and "distributed: all ok" in done.stdout
        results.append((ok, done.stdout[-3000:] + ("" if ok else done.stderr[-3000:])))
    return results


def run_kernelbench(device: str, batch: int | None, out_dirs: list[str],
                    problems: str = KERNELBENCH_PROBLEMS) -> tuple[bool, str] | None:
    """bench/kernelbench.py (KernelBench's protocol on its four problem files) in a process of its own, under
    PyTorch's default settings as KernelBench runs, its JSON into each of out_dirs: (every drop-in passed, its
    table), or None where `problems` is not there. On a CPU at batch 1 (unless given) and 3 timed calls:
    KernelBench's sizes take minutes a call there."""
    if not os.path.isdir(problems):
        return None
    argv = ["--device", device, "--problems", problems, *[arg for d in out_dirs for arg in ("--out", d)]]
    cpu = device.split(":")[0] == "cpu"
    if batch or cpu:
        argv += ["--batch", str(batch or 1)]
    if cpu:
        argv += ["--trials", "3"]
    # (its progress on stderr as it runs; its table, on stdout, printed with the others)
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "kernelbench.py"), *argv],
                          stdout=subprocess.PIPE, text=True)
    return done.returncode == 0, done.stdout


def run_first_calls(device: str, no_compile: bool, no_autocast: bool, out_dirs: list[str]) -> tuple[bool, str]:
    """bench/first_calls.py (its JSON into each of out_dirs): (it succeeded, its tables)."""
    argv = ["--device", device] + (["--no-compile"] if no_compile else []) + (["--no-autocast"] if no_autocast else [])
    outputs, ok = [], True
    for out_dir in out_dirs[:1]:
        done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "first_calls.py"), *argv, "--out", out_dir],
                              stdout=subprocess.PIPE, text=True, cwd=os.path.join(ROOT, "bench"))
        ok, outputs = ok and done.returncode == 0, outputs + [done.stdout]
    for path in [line for line in "".join(outputs).splitlines() if line.endswith(".json")]:
        for out_dir in out_dirs[1:]:
            shutil.copy(path, out_dir)
    return ok, "".join(outputs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-build", action="store_true")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--test-shard", metavar="K/N",
                        help="run only the K-th of N shards of the suite (every N-th test; on the lent GPU machines "
                             "the whole suite outlasts one command: run the shards in separate calls)")
    parser.add_argument("--tests-k", metavar="EXPR", help="run only the tests pytest's -k EXPR keeps")
    parser.add_argument("--only", choices=("tests", "tails", "models", "configs", "distributed", "kernelbench",
                                           "first_calls"),
                        help="only the tests (no timing), or time only the tails, only the whole models, only the "
                             "configuration grid, only data-parallel training on two GPUs, only KernelBench's "
                             "protocol, or only the first calls and changing shapes (bench/first_calls.py) "
                             "(default: the tests, then the others)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile variants")
    parser.add_argument("--max-autotune", action="store_true",
                        help="whole models: also time torch.compile(mode=\"max-autotune\") (slow to compile)")
    parser.add_argument("--no-autocast", action="store_true",
                        help="whole models and the grid: float32 only (default: float32, then under bfloat16 "
                             "autocast)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--batch", type=int, default=None,
                        help="batch size of the tails (default: the SPEC's on a GPU, 2 on a CPU) and of "
                             "KernelBench's problems (default: theirs on a GPU, 1 on a CPU)")
    args = parser.parse_args()

    if not args.skip_build:
        build()
    tests = "not run" if args.skip_tests else run_tests(os.environ.get("OUT", os.path.join(ROOT, "bench", "results")),
                                                            args.test_shard, args.tests_k)
    if args.only == "tests":
        print(tests)
        sys.exit(1 if "failed" in tests or "error" in tests else 0)

    import torch

    import configs
    import models
    from timing import device_slug

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tails = (None if args.only in ("models", "configs", "distributed", "kernelbench", "first_calls")
             else time_tails(device, args.batch, not args.no_compile, tests))
    models_argv = (["--device", device] + (["--no-compile"] if args.no_compile else [])
                   + (["--max-autotune"] if args.max_autotune else []))
    precisions = [[]] + ([] if args.no_autocast else [["--autocast", "bfloat16"]])
    whole_models = ([] if args.only in ("tails", "configs", "distributed", "kernelbench", "first_calls")
                    else [models.run(models_argv + p) for p in precisions])
    grids = ([configs.run_grid(configs.parse_args(["--device", device] + p)) for p in precisions]
             if args.only in (None, "configs") else [])
    two_gpus = device.startswith("cuda") and torch.cuda.device_count() >= 2
    if args.only == "distributed" and not two_gpus:
        print(f"distributed: needs two GPUs, {torch.cuda.device_count()} visible: not run")
    distributed = run_distributed(precisions) if args.only in (None, "distributed") and two_gpus else []
    out_dirs = [models.RESULTS] + ([os.environ["OUT"]] if os.environ.get("OUT") else [])
    kernelbench = run_kernelbench(device, args.batch, out_dirs) if args.only in (None, "kernelbench") else None
    if kernelbench is None and args.only in (None, "kernelbench"):
        print(f"kernelbench: {KERNELBENCH_PROBLEMS} not there (make kernelbench): not run")
    first_calls = (run_first_calls(device, args.no_compile, args.no_autocast, out_dirs)
                   if args.only in (None, "first_calls") else None)
    for out_dir in out_dirs:
        if tails:
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, f"tails-{device_slug(tails['device'])}.json"), "w") as f:
                json.dump(tails, f, indent=1)
        for result in whole_models:
            models.write(result, out_dir)
        for result in grids:
            configs.write(result, out_dir)

    if tails:
        print_tails_table(tails)
    for result in whole_models:
        models.print_table(result)
    for result in grids:
        configs.print_table(result)
    for _, output in distributed:
        print(output)
    if kernelbench:
        print(kernelbench[1])
    if first_calls:
        print(first_calls[1])
    if ("failed" in tests or "error" in tests or not all(result["ok"] for result in whole_models + grids)
            or not all(ok for ok, _ in distributed) or (kernelbench and not kernelbench[0])
            or (kernelbench is None and args.only == "kernelbench") or (first_calls and not first_calls[0])):
        sys.exit(1)


if __name__ == "__main__":
    main()
