"""Data-parallel training of the fused drop-ins, one process per GPU (issue 20):

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 bench/distributed.py [--autocast bfloat16] [--no-tf32]

Each rank runs the fused module of each architecture (D's batch norm converted with
nn.SyncBatchNorm.convert_sync_batchnorm: fused_ops.sync_batch_norm then normalizes with the
whole batch's statistics) under DistributedDataParallel, on its slice of every step's batch
(SPEC's sizes on a GPU: the batch split across the ranks), three training steps then an eval
forward, against one process running the original on the whole batch (on each rank, the same
precision): the outputs of its slice, every parameter's gradient (DDP's mean over the ranks
times their number: rank r's loss is (out_r * R_r).sum() for its slice R_r of a fixed random
R, which sums over the ranks to the whole batch's (out * R).sum()) and the running statistics.
A tensor passes within the main job's tolerance (fused_ops.cli), or else where it is as close
to a float64 run of the original as the main job's check allows (at most twice as far as the
original is). Then, for D, one training step per rank timed (CUDA events, median): the fused
module with synchronized batch norm against the converted original, both under DDP, the
fused module with per-rank batch norm (no statistics exchanged), and the exchange alone
(fused_ops.sync_batch_norm's all_gather of a (4, C) tensor per rank, and its backward's
all_reduce of a (2, C) tensor).

Prints a table on rank 0 and ends with "distributed: all ok" where every check passed (exit
status 1 otherwise). On a CPU (gloo): --device cpu, tiny sizes, the checks only (PyTorch's
nn.SyncBatchNorm runs on CUDA only): a dry run of the script.
"""
import argparse
import contextlib
import copy
import gc
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fused_ops import autotune, cli
from fused_ops._timing import device_name, median_ms
from fused_ops.architectures import ARCHITECTURES, SIZES

MODES = (True, True, True, False)  # three training steps, then an eval forward
# Timed calls make collectives (DDP's gradient all-reduce, the synchronized batch norm's
# exchange): each rank must make as many, so the warm-up is a number of calls, not a time
# (median_ms's default warms up for 50 ms: ranks made different numbers of calls and waited
# on each other for ever).
SAME_CALLS_ON_EVERY_RANK = {"warmup_ms": 0.0, "warmup_calls": 10}


def seeded_rand(shape, seed: int, device) -> torch.Tensor:
    """The same values on every rank: a CPU generator seeded per step, moved to the device."""
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)).to(device)


def step(model: nn.Module, inner: nn.Module, x: torch.Tensor, weight: torch.Tensor, train: bool, autocast_dtype,
         scale: float = 1.0) -> dict:
    """One step of `model` (inner: the module holding the parameters, model itself or the one DDP
    wraps): the output; in training, after (out * weight).sum().backward() (the forward under
    autocast, as AMP runs it), each parameter's gradient times `scale` and each buffer."""
    model.train(train)
    with torch.set_grad_enabled(train), cli.autocast(x.device, autocast_dtype):
        out = model(x)
    results = {"output": out.detach()}
    if train:
        (out.float() * weight).sum().backward()
        results |= {f"grad {n}": p.grad * scale for n, p in inner.named_parameters()}
        results |= {f"buffer {n}": b.clone() for n, b in inner.named_buffers()}
        inner.zero_grad(set_to_none=True)
    return results


def data_parallel(module: nn.Module, device, sync_batch_norm: bool) -> DistributedDataParallel:
    """module under DDP, its batch norms converted with convert_sync_batchnorm where asked: before
    wrapping on a GPU (as users do), after on a CPU (DDP refuses an nn.SyncBatchNorm in a CPU
    module; the converted layers keep the parameters and buffers DDP holds)."""
    cuda = device.type == "cuda"
    if sync_batch_norm and cuda:
        module = nn.SyncBatchNorm.convert_sync_batchnorm(module)
    ddp = DistributedDataParallel(module, device_ids=[device.index] if cuda else None)
    if sync_batch_norm and not cuda:
        nn.SyncBatchNorm.convert_sync_batchnorm(module)
    return ddp


def check_architecture(arch, args, device, rank: int, world: int) -> tuple[bool, float, int]:
    """The fused module under DDP on this rank's slices against the original on the whole batch:
    (every tensor passed, the largest relative error, tensors compared)."""
    shape = arch.input_shape(args.size)
    batch = -(-shape[0] // world) * world  # (a multiple of the ranks' number)
    share = batch // world
    start, stop = rank * share, (rank + 1) * share
    torch.manual_seed(0)
    original = arch.build_original().to(device)
    float64 = copy.deepcopy(original).double()
    ddp = data_parallel(arch.fused_from(copy.deepcopy(original)), device, sync_batch_norm=arch.letter == "D")
    fused = ddp.module
    tolerance = cli.check_tolerance(torch.float32 if args.autocast is None else cli.AUTOCAST_DTYPES[args.autocast],
                                    device)
    autocast_dtype = cli.AUTOCAST_DTYPES.get(args.autocast)
    ok, largest, compared = True, 0.0, 0
    for s, train in enumerate(MODES):
        x = seeded_rand((batch, *shape[1:]), seed=s, device=device)
        with torch.no_grad():
            out_shape = original.eval()(x[:1]).shape[1:]
        weight = seeded_rand((batch, *out_shape), seed=100 + s, device=device)
        actual = step(ddp, fused, x[start:stop], weight[start:stop], train, autocast_dtype, scale=world)
        expected = step(original, original, x, weight, train, autocast_dtype)
        exact = step(float64, float64, x.double(), weight.double(), train, None)
        for results in (expected, exact):
            results["output"] = results["output"][start:stop]
        errors = cli.relative_errors(actual, expected)
        fused_err, original_err = cli.relative_errors(actual, exact), cli.relative_errors(expected, exact)
        for name, e in errors.items():
            passed = e <= tolerance or fused_err[name] <= max(tolerance, 2 * original_err[name])
            if not passed:
                print(f"[rank {rank}] {arch.letter} step {s} {name}: error {e:.2e} (float64: fused {fused_err[name]:.2e},"
                      f" original {original_err[name]:.2e}), tolerance {tolerance:.0e}", flush=True)
            ok &= passed
            largest = max(largest, e)
            compared += 1
    return ok, largest, compared


def exchange_ms(channels: int, device, world: int) -> tuple[float, float]:
    """fused_ops.sync_batch_norm's statistics exchange alone: the forward's all_gather of a (4, C)
    float32 tensor per rank, the backward's all_reduce of a (2, C) one (median ms)."""
    local = torch.rand(4, channels, device=device)
    gathered = [torch.empty_like(local) for _ in range(world)]
    sums = torch.rand(2, channels, device=device)
    return (median_ms(lambda: dist.all_gather(gathered, local), device, **SAME_CALLS_ON_EVERY_RANK),
            median_ms(lambda: dist.all_reduce(sums), device, **SAME_CALLS_ON_EVERY_RANK))


def time_d(arch, args, device, world: int) -> dict:
    """One DDP training step of D per rank (forward on this rank's slice, backward with DDP's
    gradient all-reduce), median ms: fused with synchronized and with per-rank batch norm, the
    converted original; the statistics exchange alone."""
    shape = arch.input_shape(args.size)
    share = -(-shape[0] // world)
    x = torch.rand((share, *shape[1:]), device=device)
    autocast_dtype = cli.AUTOCAST_DTYPES.get(args.autocast)
    torch.manual_seed(0)
    original = arch.build_original().to(device)
    variants = {"fused, SyncBatchNorm": (arch.fused_from(copy.deepcopy(original)), True),
                "original, SyncBatchNorm": (copy.deepcopy(original), True),
                "fused, per-rank BatchNorm3d": (arch.fused_from(copy.deepcopy(original)), False)}
    # the synchronized path's convolution by each formulation (autotune.force): what its choice is worth
    synchronized = nn.SyncBatchNorm.convert_sync_batchnorm(arch.fused_from(copy.deepcopy(original)))
    for formulation in synchronized._synchronized_formulations(x):
        variants[f"fused, SyncBatchNorm, {formulation}"] = (arch.fused_from(copy.deepcopy(original)), True, formulation)
    times = {}
    for name, (module, sync, *forced) in variants.items():
        ddp = data_parallel(module, device, sync)
        ddp.train()
        with torch.no_grad(), cli.autocast(device, autocast_dtype):
            grad = torch.rand_like(ddp(x).float())

        def train_step():
            with cli.autocast(device, autocast_dtype), autotune.force(*forced) if forced else contextlib.nullcontext():
                out = ddp(x)
            out.float().backward(grad)

        times[name] = median_ms(train_step, device, reps=20, **SAME_CALLS_ON_EVERY_RANK)
    gather, reduce = exchange_ms(original.batch_norm.num_features, device, world)
    times["statistics all_gather (4, C)"] = gather
    times["gradient sums all_reduce (2, C)"] = reduce
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=SIZES, help="input sizes (default: spec on a GPU, tiny on a CPU)")
    parser.add_argument("--autocast", choices=cli.AUTOCAST_DTYPES)
    parser.add_argument("--models", default="A,B,C,D")
    parser.add_argument("--no-tf32", action="store_true",
                        help="float32 convolutions and matmuls without TF32 (a strict float32 comparison)")
    args = parser.parse_args()
    if args.no_tf32:
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    args.size = args.size or ("spec" if args.device == "cuda" else "tiny")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # (NVLink multicast can take a shared host's GPUs out of service)
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    precision = f"float32 under {args.autocast} autocast" if args.autocast else "float32"
    if rank == 0:
        print(f"{world} ranks, {dist.get_backend()}, {device_name(device)}, "
              f"{precision}, TF32 {torch.backends.cudnn.allow_tf32}; sizes {args.size}", flush=True)
    all_ok = True
    rows = []
    for arch in ARCHITECTURES:
        if arch.letter not in args.models.split(","):
            continue
        ok, largest, compared = check_architecture(arch, args, device, rank, world)
        verdict = torch.tensor([0.0 if ok else 1.0, largest], device=device)
        dist.all_reduce(verdict, dist.ReduceOp.MAX)
        all_ok &= verdict[0].item() == 0
        rows.append(f"{arch.letter} {arch.name:<36}{'ok' if verdict[0].item() == 0 else 'FAILED':>8}"
                    f"{verdict[1].item():>14.1e}{compared:>10}")
        if rank == 0:
            print(f"[checked] {rows[-1]}", flush=True)
    # (timed on GPUs only: PyTorch's nn.SyncBatchNorm, the converted original's, runs on CUDA only)
    d = next(arch for arch in ARCHITECTURES if arch.letter == "D")
    timings = time_d(d, args, device, world) if "D" in args.models.split(",") and device.type == "cuda" else {}
    if rank == 0:
        print(f"\n{'DDP training against one process on the whole batch':<45}{'check':>8}{'max rel err':>14}"
              f"{'tensors':>10}")
        print("\n".join(rows))
        if timings:
            print(f"\nD, one DDP training step per rank ({precision}), median ms")
            for name, ms in timings.items():
                print(f"  {name:<40}{ms:10.3f}")
        print("distributed: all ok" if all_ok else "distributed: FAILED")
    # The DDP wrappers hold the process group in their reducers, inside reference cycles: freed at
    # interpreter exit, gloo's worker threads aborted the process now and then. Free them now.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
