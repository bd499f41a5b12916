"""Which formulation a drop-in module of ``fused_ops.nn`` runs: a first-call autotuner.

Each module computes its function by one of several formulations (``fused_ops.nn``):
``rewrite`` (an exact rewrite of its convolution, ``fused_ops.rewrites``, and a fused tail),
``fused`` (its convolution as the original's, then the fused tail), ``original`` (the
original's own ops), and ``fused_channels_last`` / ``original_channels_last`` (the same with
the convolution's input and weight channels last). Which is fastest depends on the
configuration, the input's size, dtype and layout, the device, and whether a training step
is being recorded; none is fastest everywhere (a rewrite adds zero taps; at a batch of one
the host's time per launch dominates).

As ``torch.backends.cudnn.benchmark`` does for convolution algorithms, the first call of a
module for a new key (the module's class and configuration; the input's shape, strides,
dtype and device; train or eval; whether gradients are recorded, and for which of the input
and the parameters; the autocast state) times every formulation that holds for it, its
forward or, where gradients are recorded, its forward and backward (the module's buffers
restored after), and keeps the fastest for the key in this process; the later calls with
that key run it. On a GPU the rearranged and channels-last convolutions run with
cudnn.benchmark on, as the original tuned by hand would (where a rewrite is kept it beat the
original run channels last with cudnn.benchmark too); the original's own convolutions run
under the user's setting, as the original's calls do.

Nothing is timed, and each module takes its rule (the first formulation of its list that
holds: the rewrite on a GPU, else the fused tail) where the autotuner is off
(``FUSED_OPS_AUTOTUNE=0`` in the environment, or ``set_enabled(False)``), under
torch.compile and torch.export (the compiler sees the rule's formulation), and while a
CUDA graph is being captured and the key was not tuned before (capture after warm-up
calls, as ``torch.cuda.make_graphed_callables`` does, to capture the tuned one). Every
formulation computes the original's function: the tests check each one (``force``) against
the original, so the choice changes the speed, not what is computed (its roundings differ
as the original's do between cuDNN algorithms).
"""
import contextlib
import os
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from . import _derived

FORMULATIONS = ("rewrite", "fused", "fused_channels_last", "original_channels_last", "original")
_ENABLED = os.environ.get("FUSED_OPS_AUTOTUNE", "1").strip().lower() not in ("0", "false", "off", "no")
_CHOICES: dict[tuple, str] = {}
_FORCED: list[str] = []
_LAST = [None]  # the formulation the latest call ran
_GENERATION = [0]  # advanced by clear() and set_enabled(): the modules' remembered choices lapse
# Each candidate is timed over ROUNDS rounds (candidates interleaved), each round a run of
# calls at least ROUND_MS long (at most MAX_CALLS calls), after one warm-up call; the median
# round decides.
ROUNDS, ROUND_MS, MAX_CALLS = 5, 1.0, 50


def set_enabled(enabled: bool) -> None:
    """Turns the autotuner on or off for this process (the environment's FUSED_OPS_AUTOTUNE
    sets the start value)."""
    global _ENABLED
    _ENABLED = bool(enabled)
    _GENERATION[0] += 1


def is_enabled() -> bool:
    return _ENABLED


def clear() -> None:
    """Forgets every choice made so far, and the kernels kept from the parameters
    (``fused_ops._derived``): after a CUDA graph's replays changed parameters or buffers
    (replays do not advance their versions), before calling a module eagerly again."""
    _CHOICES.clear()
    _derived.clear()
    _GENERATION[0] += 1


@contextlib.contextmanager
def force(name: str):
    """Within the block every module runs formulation `name` where it holds for the call
    (``formulation`` says which ran), its rule where it does not: to test or time one."""
    _FORCED.append(name)
    try:
        yield
    finally:
        _FORCED.pop()


def _capturing(x: Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _signature(module: nn.Module, x: Tensor) -> tuple:
    """What a call's choice depends on that may change from call to call of one module."""
    device_type = x.device.type
    autocast = torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type)
    return (x.shape, x.stride(), x.dtype, x.device, module.training, torch.is_grad_enabled(), x.requires_grad,
            torch.is_inference_mode_enabled(), autocast)


def call_key(module: nn.Module, config: tuple, x: Tensor) -> tuple:
    """The key of a call in the choices shared by all modules: the module's class and
    configuration, the call's signature, and which parameters require gradients."""
    return _key(module, config, _signature(module, x))


def _key(module: nn.Module, config: tuple, signature: tuple) -> tuple:
    grads = tuple([p.requires_grad for p in module.parameters()]) if signature[5] else ()  # (grad mode)
    return type(module), config, signature, grads


def choose(module: nn.Module, config: Callable[[], tuple], formulations: Callable[[], Sequence[str]],
           run: Callable[[str], Tensor | None], x: Tensor) -> tuple[str, Tensor]:
    """(name, result) of the formulation the call takes: forced, kept from an earlier call
    with its key (call_key of `config()`), timed now (the first call with it), or the rule
    (the first of `formulations()`, in order, whose `run(name)` is not None: the last must
    always hold). The module remembers its latest call's signature and choice, so that a
    call like the one before runs it without building the key or the list of formulations
    (host time: at a batch of one a whole call on a GPU takes about 0.1 ms); where it no
    longer holds (run gives None), the call chooses again."""
    if _FORCED:
        order = formulations()
        name, out = _run_first(run, [f for f in _FORCED[-1:] if f in order] + list(order))
        _LAST[0] = name
        return name, out
    if torch.compiler.is_compiling():
        return _run_first(run, formulations())
    signature = _signature(module, x)
    memo = module.__dict__.get("_fused_ops_choice")
    if memo is not None and memo[0] == _GENERATION[0] and memo[1] == signature:
        name = memo[2]
        out = _run_benchmarked(run, name, x)
        if out is not None:
            _LAST[0] = name
            return name, out
    order = formulations()
    tuned = _ENABLED and len(order) > 1
    key = _key(module, config(), signature) if tuned else None
    name = _CHOICES.get(key) if tuned else None
    if name is None and (not tuned or _capturing(x)):
        name, out = _run_first(run, order)
    else:
        if name is None:
            name = _CHOICES[key] = _tune(module, order, run, x)
        out = _run_benchmarked(run, name, x)
        if out is None:
            name, out = _run_first(run, order)
    if not _capturing(x):
        module.__dict__["_fused_ops_choice"] = (_GENERATION[0], signature, name)
    _LAST[0] = name
    return name, out


# The formulations that call the module's convolution as the original does (its own weight and
# layout, as a module where it has hooks): run under the user's cudnn.benchmark setting, with the
# plans the original gets. The others rearrange it or change its layout: their plans are
# searched, as by the original tuned by hand.
OWN_CONVOLUTION = frozenset(("fused", "original"))


def _run_benchmarked(run, name: str, x: Tensor) -> Tensor | None:
    """run(name), on a GPU with cudnn.benchmark on for the convolutions of a formulation not in
    OWN_CONVOLUTION, the user's setting back after. PyTorch keeps one cuDNN plan per convolution,
    searched or guessed, whichever call came first: a search for the original's own
    convolution would change the user's eager calls' plans too, and at small batches a
    searched plan (the least GPU time: split reductions, layout kernels) often costs more
    host time than the guessed one; a rearranged convolution guessed would leave its guess to
    every later call."""
    if name in OWN_CONVOLUTION or not x.is_cuda or torch._C._get_cudnn_benchmark():
        return run(name)
    torch._C._set_cudnn_benchmark(True)
    try:
        return run(name)
    finally:
        torch._C._set_cudnn_benchmark(False)


def last_formulation() -> str | None:
    """The formulation the latest call of any module ran (for tests and debugging)."""
    return _LAST[0]


def kept_choice(key: tuple) -> str | None:
    """The formulation tuned for `key`, or None where none was."""
    return _CHOICES.get(key)


def _run_first(run, formulations) -> tuple[str, Tensor]:
    for name in formulations:
        out = run(name)
        if out is not None:
            return name, out
    raise AssertionError(f"no formulation of {list(formulations)} holds")  # the last always does


def _tune(module: nn.Module, formulations: Sequence[str], run, x: Tensor) -> str:
    """The fastest of the formulations that hold, timed as the call is made: the forward,
    and where the result records gradients, the backward to what requires them. The
    module's buffers (running statistics) are restored after. A formulation that raises
    is passed over; where all do, the first one's error is raised."""
    buffers = [b for b in module.buffers()]
    saved = [b.clone() for b in buffers]
    device = x.device

    def step(name):
        def forward_backward(name):
            out = run(name)
            if out is not None and out.requires_grad:
                inputs = [t for t in (x, *module.parameters()) if t.requires_grad]
                with torch.autocast(device.type, enabled=False):
                    torch.autograd.grad(out, inputs, torch.ones_like(out), allow_unused=True)
            return out

        # the backward's convolutions searched too (not OWN_CONVOLUTION): their plans, kept by PyTorch,
        # serve the later backward calls (which run outside the module, under the user's setting)
        return lambda: _run_benchmarked(forward_backward, name, x)

    steps, errors = {}, []
    # the timing calls' saved tensors kept from any saved-tensor hooks around the call (a
    # non-reentrant checkpoint counts them, and its recomputation makes no timing calls)
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            for name in formulations:
                call = step(name)
                began = time.perf_counter()
                try:
                    if call() is None:  # does not hold
                        continue
                except Exception as error:  # (a limit of one formulation: the others may hold)
                    errors.append(error)
                    continue
                _synchronize(device)
                first_ms = (time.perf_counter() - began) * 1e3
                calls = max(1, min(MAX_CALLS, int(ROUND_MS / max(first_ms, 1e-3))))
                steps[name] = (call, calls, [])
            for _ in range(ROUNDS):
                for name, (call, calls, times) in steps.items():
                    times.append(_time_ms(call, calls, device) / calls)
    finally:
        with torch.no_grad():
            for buffer, value in zip(buffers, saved):
                buffer.copy_(value)
    if not steps:  # the input is wrong for all: the rule's error
        raise errors[0]
    return min(steps, key=lambda name: statistics.median(steps[name][2]))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(call, calls: int, device: torch.device) -> float:
    """Milliseconds of `calls` calls queued back to back: CUDA events on a GPU (the host's
    time shows where it falls behind), the wall clock on a CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    began = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - began) * 1e3
