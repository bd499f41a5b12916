"""Data-parallel training of the drop-in modules: two gloo ranks on the CPU, each
with its slice of a batch, against one process on the whole batch (the
original architecture, fused_ops.reference). Architecture D converted with
nn.SyncBatchNorm.convert_sync_batchnorm normalizes with the statistics of the
whole batch (fused_ops.sync_batch_norm); under DistributedDataParallel every
module's gradients are one process's.

Losses: rank r's is (out_r * R_r).sum(), R_r its slice of a fixed random weight R
(a uniform weight would make P = sum g (m - mu) vanish). Their sum over the ranks
is the one process's loss (out * R).sum(), so each rank's input gradient is
that loss's on its slice, and DDP's parameter gradients, the ranks' mean, are
that loss's divided by the world size."""
import contextlib
import datetime
import gc
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from conftest import assert_close_to_reference, make_input, requires_cuda
from fused_ops import autotune, reference, rewrites
from fused_ops import nn as fnn

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "distributed.py")

requires_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed with the gloo backend (two CPU ranks)",
)

WORLD_SIZE = 2
D = "ConvTranspose3dScaleBatchNormGAP"
TRAIN_THEN_EVAL = (True, True, True, False)

# name: (architecture, constructor arguments, batch norm replacement (BatchNorm3d
# keyword arguments) or None, each rank's batch size, input (C, *spatial), modes of the steps)
CASES = {
    "D": (D, (3, 4, 3, 2.0), None, (2, 2), (3, 3, 4, 3), TRAIN_THEN_EVAL),
    "D unequal batches, momentum None": (D, (2, 5, (3, 2, 3), -1.5, 1e-3, None), None, (3, 2), (2, 3, 5, 4),
                                         TRAIN_THEN_EVAL),
    # an empty batch on one rank: the other's statistics
    "D empty batch on a rank": (D, (3, 4, 3, 2.0), None, (0, 3), (3, 3, 4, 3), TRAIN_THEN_EVAL),
    # one value per channel on each rank: nn.SyncBatchNorm takes it from a group of two
    "D one value per rank": (D, (3, 4, 1, 2.0), None, (1, 1), (3, 1, 1, 1), TRAIN_THEN_EVAL),
    # no running statistics: eval mode normalizes each rank with its own batch's
    # statistics, unsynchronized as in nn.SyncBatchNorm, so training steps only
    "D no affine, no running statistics": (D, (3, 4, 2, 0.5), {"affine": False, "track_running_stats": False},
                                           (2, 3), (3, 3, 3, 4), (True, True)),
    # the synchronized path's convolution by the stride-1 rewrite (its rule's on a GPU in
    # float32), here forced (FORCED)
    "D by the stride-1 rewrite": (D, (3, 4, 3, 2.0), None, (2, 2), (3, 3, 4, 3), TRAIN_THEN_EVAL),
    "A": ("Conv3dDivMaxPoolGAPBiasSum", (3, 4, 3, 2.0, 2, (4, 1, 1, 1), 1), None, (2, 1), (3, 9, 10, 11),
          TRAIN_THEN_EVAL),
    "B": ("ConvTranspose3dMaxPoolMaxPoolSum", (3, 4, 5, 2, 2), None, (2, 1), (3, 7, 7, 7), TRAIN_THEN_EVAL),
    "C": ("Conv2dAvgPoolSigmoidSum", (3, 5, 3, 4), None, (2, 1), (3, 19, 23), TRAIN_THEN_EVAL),
}
FORCED = {"D by the stride-1 rewrite": "rewrite"}  # case: the formulation forced (fused_ops.autotune.force)


def build(namespace, case):
    """Architecture `case` from `namespace` (fused_ops.reference or fused_ops.nn), in float64, seeded."""
    name, args, bn_kwargs, _, _, _ = CASES[case]
    torch.manual_seed(0)
    module = getattr(namespace, name)(*args)
    if bn_kwargs is not None:
        module.batch_norm = nn.BatchNorm3d(module.batch_norm.num_features, **bn_kwargs)
    return module.double()


def run_steps(model, inner, case, start, stop):
    """Steps of `case` on the slice [start, stop) of each step's batch: per
    step the output, the input's gradient, inner's parameters' gradients and
    its buffers after the step."""
    _, _, _, batches, input_size, modes = CASES[case]
    results = []
    for step, train in enumerate(modes):
        model.train(train)
        x = make_input((sum(batches), *input_size), torch.float64, "cpu", seed=step)[start:stop].requires_grad_()
        out = model(x)
        weight = make_input((sum(batches), *out.shape[1:]), torch.float64, "cpu", seed=100 + step)
        (out * weight[start:stop]).sum().backward()
        results.append({
            "out": out.detach(),
            "grad x": x.grad,
            "grads": {name: p.grad.clone() for name, p in inner.named_parameters()},
            "buffers": {name: b.clone() for name, b in inner.named_buffers()},
        })
        inner.zero_grad(set_to_none=True)
    return results


def run_rank(rank, port, out_dir):
    """One rank: every case under DDP on its slices, then D with a process group
    of one (a group of each rank alone) against the plain module; saved to out_dir."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE,
                            timeout=datetime.timedelta(seconds=60))
    results = {"stride-1 rewrites": 0}
    stride1 = rewrites.conv_transpose3d_stride1

    def counted(*args):
        results["stride-1 rewrites"] += 1
        return stride1(*args)

    rewrites.conv_transpose3d_stride1 = counted
    for case, (name, _, _, batches, _, _) in CASES.items():
        module = build(fnn, case)
        model = DistributedDataParallel(module)
        if name == D:
            # converted after wrapping: DDP's constructor refuses an nn.SyncBatchNorm in a
            # CPU module; the converted batch norm keeps the parameters and buffers DDP holds
            nn.SyncBatchNorm.convert_sync_batchnorm(module)
            assert isinstance(module.batch_norm, nn.SyncBatchNorm)
        start = sum(batches[:rank])
        with autotune.force(FORCED[case]) if case in FORCED else contextlib.nullcontext():
            results[case] = run_steps(model, module, case, start, start + batches[rank])
    alone = [dist.new_group([r]) for r in range(WORLD_SIZE)][rank]
    converted, plain = nn.SyncBatchNorm.convert_sync_batchnorm(build(fnn, "D")), build(fnn, "D")
    converted.batch_norm.process_group = alone
    start = sum(CASES["D"][3][:rank])
    stop = start + CASES["D"][3][rank]
    autotune.set_enabled(False)  # (both by their rules: a tuning's calls run one formulation after another)
    results["group of one"] = [run_steps(m, m, "D", start, stop) for m in (converted, plain)]
    del model
    gc.collect()  # (the DDP wrappers' reducers hold the group: freed at exit, gloo aborted at times)
    dist.barrier()
    dist.destroy_process_group()
    torch.save(results, f"{out_dir}/rank{rank}.pt")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks():
    """Each rank's results (run_rank), both ranks spawned once for the module's
    tests; a rank that fails or hangs past the deadline fails them."""
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        processes = [context.Process(target=run_rank, args=(rank, port, out_dir)) for rank in range(WORLD_SIZE)]
        for p in processes:
            p.start()
        deadline = time.monotonic() + 180
        while (any(p.is_alive() for p in processes) and time.monotonic() < deadline
               and all(p.exitcode in (None, 0) for p in processes)):
            time.sleep(0.1)
        for p in processes:
            if p.is_alive():
                p.kill()
            p.join()
        exitcodes = [p.exitcode for p in processes]
        assert exitcodes == [0] * WORLD_SIZE, f"ranks exited with {exitcodes} (a hang is killed after 180 s)"
        return [torch.load(f"{out_dir}/rank{rank}.pt") for rank in range(WORLD_SIZE)]


def check_case(ranks, case):
    """Each rank's steps against one process's steps on the whole batch (the
    original): outputs and input gradients on its slice, DDP's parameter
    gradients times the world size, the buffers."""
    original = build(reference, case)
    expected = run_steps(original, original, case, 0, sum(CASES[case][3]))
    start = 0
    for rank, results in enumerate(ranks):
        stop = start + CASES[case][3][rank]
        for step, (actual, ref) in enumerate(zip(results[case], expected, strict=True)):
            what = f"{case}, rank {rank}, step {step}"
            assert_close_to_reference(actual["out"], ref["out"][start:stop], torch.float64, f"{what}: out",
                                      normwise=True)
            assert_close_to_reference(actual["grad x"], ref["grad x"][start:stop], torch.float64,
                                      f"{what}: grad x", normwise=True)
            # a conv bias before a batch norm in training has a gradient that cancels to 0
            largest = max(g.abs().max().item() for g in ref["grads"].values())
            assert list(actual["grads"]) == list(ref["grads"])
            for name, grad in actual["grads"].items():
                assert_close_to_reference(grad * WORLD_SIZE, ref["grads"][name], torch.float64,
                                          f"{what}: grad {name}", normwise=True, magnitude=largest)
            assert list(actual["buffers"]) == list(ref["buffers"])
            for name, buffer in actual["buffers"].items():
                if name.endswith("num_batches_tracked"):
                    assert torch.equal(buffer, ref["buffers"][name]), f"{what}: {name}"
                else:
                    assert_close_to_reference(buffer, ref["buffers"][name], torch.float64, f"{what}: {name}",
                                              normwise=True)
        start = stop


def assert_same_steps(steps, expected):
    """run_steps results equal, bit for bit."""
    for a, b in zip(steps, expected, strict=True):
        assert torch.equal(a["out"], b["out"]) and torch.equal(a["grad x"], b["grad x"])
        for key in ("grads", "buffers"):
            assert list(a[key]) == list(b[key])
            for name in a[key]:
                assert torch.equal(a[key][name], b[key][name]), f"{key} {name}"


@requires_gloo
@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][0] == D])
def test_sync_batch_norm_ddp(ranks, case):
    """D converted with convert_sync_batchnorm under DDP: the whole batch's statistics
    in training, its running statistics, one process's gradients."""
    check_case(ranks, case)
    if case in FORCED:  # (its training steps took the rewrite)
        assert all(results["stride-1 rewrites"] >= 3 for results in ranks)


@requires_gloo
@pytest.mark.parametrize("case", ["A", "B", "C"])
def test_ddp(ranks, case):
    check_case(ranks, case)


@requires_gloo
def test_process_group_of_one_is_the_plain_path(ranks):
    """A converted D whose process group is its rank alone computes exactly as the plain module."""
    for results in ranks:
        assert_same_steps(*results["group of one"])


def test_from_module_takes_a_converted_original():
    """from_module wraps an original whose batch norm convert_sync_batchnorm
    replaced; without an initialized process group the converted D computes
    exactly as the plain one."""
    assert not (dist.is_available() and dist.is_initialized())
    original = nn.SyncBatchNorm.convert_sync_batchnorm(build(reference, "D"))
    fused = fnn.ConvTranspose3dScaleBatchNormGAP.from_module(original)
    assert isinstance(fused.batch_norm, nn.SyncBatchNorm) and fused.batch_norm is original.batch_norm
    plain = build(fnn, "D")
    assert_same_steps(*(run_steps(m, m, "D", 0, sum(CASES["D"][3])) for m in (fused, plain)))


@requires_cuda
@pytest.mark.parametrize("autocast,first", [(None, "rewrite"), (torch.bfloat16, "fused")], ids=["float32", "bf16"])
def test_synchronized_convolutions_rule_on_a_gpu(autocast, first):
    """The synchronized path's convolution on a GPU, as measured (nn's rule): the stride-1
    rewrite in float32, the original's convolution in 16 bits; the originals never."""
    fused = nn.SyncBatchNorm.convert_sync_batchnorm(build(fnn, "D")).float().cuda()
    x = torch.rand(2, *CASES["D"][4], device="cuda")
    with torch.autocast("cuda", dtype=autocast or torch.float32, enabled=autocast is not None):
        order = fused._synchronized_formulations(x)
    assert order[0] == first and sorted(order) == ["fused", "fused_channels_last", "rewrite"]


def run_script(*args: str) -> str:
    """bench/distributed.py under torchrun with two ranks (NVLink multicast off), its output; the
    command fails the test where it exits non-zero or hangs past 15 minutes."""
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             SCRIPT, *args], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0 and "distributed: all ok" in result.stdout, result.stdout + result.stderr[-4000:]
    return result.stdout


@requires_gloo
def test_distributed_script_on_two_cpu_ranks():
    """The issue's script (bench/distributed.py) as a dry run: two gloo ranks, tiny sizes, every
    architecture's DDP steps against one process on the whole batch, each row of its table ok."""
    out = run_script("--device", "cpu")
    table = out[out.index("DDP training against one process"):].splitlines()[1:]
    for letter in "ABCD":
        assert [row for row in table if row.startswith(f"{letter} ") and " ok " in row], (letter, out)


@pytest.mark.skipif(torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
                    reason="needs two CUDA devices and NCCL")
@pytest.mark.parametrize("autocast", [None, "bfloat16"], ids=["float32", "bf16-autocast"])
def test_ddp_and_sync_batch_norm_on_two_gpus(autocast):
    """One process per GPU, NCCL: the four fused modules under DDP (D with SyncBatchNorm) at the
    reduced sizes against one process on the whole batch; the timing of D's step (the script's
    table) printed. Float32 without TF32: at these sizes TF32's rounding alone moves B's
    max-pool picks and its weight gradient by about 1e-2 (rounding x and the weight to TF32 in a
    float64 run: 1.2e-2), beyond the check, where cuDNN's kernels for the original may run in
    float32 (an H200 run: 8e-3, the original 4e-5); SPEC's sizes with TF32 are the script's own run."""
    out = run_script("--size", "reduced", *(["--autocast", autocast] if autocast else ["--no-tf32"]))
    assert "SyncBatchNorm" in out
