"""Which formulation a drop-in module of ``fused_ops.nn`` runs: a first-call autotuner.

Each module computes its function by one of several formulations (``fused_ops.nn``):
``rewrite`` (an exact rewrite of its convolution, ``fused_ops.rewrites``, and a fused tail),
``fused`` (its convolution as the original's, then the fused tail), ``original`` (the
original's own ops), and ``fused_channels_last`` (the fused one with the convolution's input
and weight channels last, where that copies no more than the original does: x channels last
already, or cast by autocast anyway; the original's own ops so, the original tuned by hand, are
no formulation: their cuDNN plans' workspaces took more memory than the original's own, 1068 MiB
against 338 for SPEC's D's training step under bf16 autocast on an H200). Which is fastest depends on the
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
under the user's setting, as the original's calls do. Where a call may be replayed from a
CUDA graph (on a GPU, on the default stream, either recording gradients or in eval mode
recording none: ``fused_ops._graphed``), the fastest formulation is also timed replayed from
a graph of its call (and of its backward), and kept so where that is faster (a batch of
one: the host's time per op is most of a call); ``FUSED_OPS_CUDA_GRAPHS=0`` leaves that
candidate out. Candidates within PREFERRED_MARGIN of the fastest count as ties, which the
original's own ops win, and between a graph and none the graph where the call is host-bound
(queueing it takes the host at least half the time the call takes to finish: the host's
moments vary), else no graph (a replay's copy of the input into the graph's static input is
device time).

Under a torch.func transform (grad, vjp, jacrev, vmap, ...) every module runs the original's own
ops, untimed and forced or not (functorch transforms them; ``choose``). Nothing is timed, and each
module takes its rule (the first formulation of its list that holds: the rewrite on a GPU, else
the fused tail) where the autotuner is off
(``FUSED_OPS_AUTOTUNE=0`` in the environment, or ``set_enabled(False)``), under
torch.compile, torch.export and any trace of fake tensors (the compile patterns' pass:
the compiler sees the rule's formulation), and while a
CUDA graph is being captured and the key was not tuned before (capture after warm-up
calls, as ``torch.cuda.make_graphed_callables`` does, to capture the tuned one). Every
formulation computes the original's function: the tests check each one (``force``) against
the original, so the choice changes the speed, not what is computed (its roundings differ
as the original's do between cuDNN algorithms).
"""
import contextlib
import functools
import os
import statistics
import time
from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor, nn

from . import _graphed, _trace

FORMULATIONS = ("rewrite", "fused", "fused_channels_last", "original")


def _environment_flag(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "off", "no")


_ENABLED = _environment_flag("FUSED_OPS_AUTOTUNE")
_GRAPHS_ENABLED = _environment_flag("FUSED_OPS_CUDA_GRAPHS")  # (the graphed candidate, fused_ops._graphed)
_CHOICES: dict[tuple, tuple[str, bool]] = {}  # key -> (formulation, replayed from a CUDA graph)
_FORCED: list[str] = []
_LAST = [None]  # the formulation the latest call ran
# The innermost torch.func transform of the call, or None (choose)
_functorch_interpreter = torch._C._functorch.peek_interpreter_stack
_FunctorchInterpreter = torch._C._functorch.CInterpreter
_GENERATION = [0]  # advanced by clear() and set_enabled(): the modules' remembered choices lapse
# Each candidate is timed over ROUNDS rounds (candidates interleaved), each round a run of
# calls at least ROUND_MS long (at most MAX_CALLS calls), after one warm-up call; the median
# round decides. (A host-bound training step at a batch of one, 0.3-0.9 ms, varies by tens of
# percent from call to call on an H200's host: rounds of one call chose a different
# formulation in each of three tunings, rounds of 4 ms the same one.)
ROUNDS, ROUND_MS, MAX_CALLS = 5, 4.0, 50


def set_enabled(enabled: bool) -> None:
    """Turns the autotuner on or off for this process (the environment's FUSED_OPS_AUTOTUNE
    sets the start value)."""
    global _ENABLED
    _ENABLED = bool(enabled)
    _GENERATION[0] += 1


def is_enabled() -> bool:
    return _ENABLED


def clear() -> None:
    """Forgets every choice made so far and the modules' CUDA graphs (``fused_ops._graphed``)."""
    _CHOICES.clear()
    _graphed.drop()
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


def untimed_order(order: Sequence[str]) -> list[str]:
    """The formulations a call that is not timed tries, in turn: the forced one (force) first
    where it is one of `order`, then `order` (the rule's)."""
    return [f for f in _FORCED[-1:] if f in order] + list(order)


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


def choose(module: nn.Module, config: Callable[[], tuple], formulations: Callable[[Tensor], Sequence[str]],
           run: Callable[[str, Tensor], Tensor | None], x: Tensor,
           graph_stamp: Callable[[], Hashable | None] = lambda: None) -> tuple[str, Tensor]:
    """(name, result) of the formulation the call takes: forced, kept from an earlier call
    with its key (call_key of `config()`), timed now (the first call with it), or the rule
    (the first of `formulations(x)`, in order, whose `run(name, x)` is not None: the last
    must always hold). Where the tuner found it faster, the kept formulation is replayed from
    a CUDA graph (``fused_ops._graphed``) while `graph_stamp()` (the module's configuration
    and tensor memory, None where its call may not be graphed) stays as at the capture. The
    module remembers its latest call's signature and choice, so that a call like the one
    before runs it without building the key or the list of formulations (host time: at a
    batch of one a whole call on a GPU takes about 0.1 ms); where it no longer holds (run
    gives None), the call chooses again. Under a torch.func transform (grad, vjp, jacrev, vmap, ...;
    compiled too) the call runs the original's own ops, which functorch transforms: it cannot
    transform the fused ops' C++ autograd, nor vmap a layout change."""
    transform = _functorch_interpreter()
    # (dynamo reads the query's None as true; the type as it is)
    if transform is not None and isinstance(transform, _FunctorchInterpreter):
        _LAST[0] = "original"
        return "original", run("original", x)
    if _FORCED:
        name, out = run_first(run, untimed_order(formulations(x)), x)
        _LAST[0] = name
        return name, out
    if _trace.traced(x):
        return run_first(run, formulations(x), x)
    signature = _signature(module, x)
    memo = module.__dict__.get("_fused_ops_choice")
    if memo is not None and memo[0] == _GENERATION[0] and memo[1] == signature:
        name, graphed = memo[2]
        out = _replay(module, signature, graph_stamp, run, name, x) if graphed else None
        if out is None:
            out = _run_benchmarked(run, name, x)
        if out is not None:
            _LAST[0] = name
            return name, out
    order = formulations(x)
    tuned = _ENABLED and len(order) > 1
    key = _key(module, config(), signature) if tuned else None
    choice = _CHOICES.get(key) if tuned else None
    if choice is None and (not tuned or _capturing(x)):
        name, out = run_first(run, order, x)
        choice = (name, False)
    else:
        if choice is None:
            choice = _CHOICES[key] = _tune(module, order, run, x, signature, graph_stamp)
        name = choice[0]
        out = _replay(module, signature, graph_stamp, run, name, x) if choice[1] else None
        if out is None:
            out = _run_benchmarked(run, name, x)
        if out is None:
            name, out = run_first(run, order, x)
            choice = (name, False)
    if not _capturing(x):
        module.__dict__["_fused_ops_choice"] = (_GENERATION[0], signature, choice)
    _LAST[0] = name
    return name, out


# The formulations that call the module's convolution as the original does (its own weight and
# layout, as a module where it has hooks): run under the user's cudnn.benchmark setting, with the
# plans the original gets. The others rearrange it or change its layout: their plans are
# searched, as by the original tuned by hand.
OWN_CONVOLUTION = frozenset(("fused", "original"))


def _run_benchmarked(run, name: str, x: Tensor) -> Tensor | None:
    """run(name, x), on a GPU with cudnn.benchmark on for the convolutions of a formulation not
    in OWN_CONVOLUTION, the user's setting back after. PyTorch keeps one cuDNN plan per
    convolution, searched or guessed, whichever call came first: a search for the original's own
    convolution would change the user's eager calls' plans too, and at small batches a
    searched plan (the least GPU time: split reductions, layout kernels) often costs more
    host time than the guessed one; a rearranged convolution guessed would leave its guess to
    every later call."""
    if name in OWN_CONVOLUTION or not x.is_cuda or torch._C._get_cudnn_benchmark():
        return run(name, x)
    torch._C._set_cudnn_benchmark(True)
    try:
        return run(name, x)
    finally:
        torch._C._set_cudnn_benchmark(False)


def _graph_kind(module: nn.Module, x: Tensor) -> tuple | None:
    """Whether a call may be replayed from a CUDA graph, as far as its signature says: None
    where it may not; else () for an eval call recording no gradients (no running statistics
    to update), or, for a call recording gradients, which parameters require them (the graph
    computes their gradients). On a GPU, with graphs allowed (``FUSED_OPS_CUDA_GRAPHS``)."""
    if not _GRAPHS_ENABLED or not x.is_cuda:
        return None
    if not torch.is_grad_enabled():
        return None if module.training else ()
    requires_grad = tuple([p.requires_grad for p in module.parameters()])
    return requires_grad if x.requires_grad or any(requires_grad) else None


def _keep_saved(t: Tensor) -> Tensor:
    return t


def _saved_tensors_hooked() -> bool:
    """Whether saved-tensor hooks of the caller's (a non-reentrant checkpoint, offloading) are
    active: they must see the call's own saved tensors (a checkpoint recomputes the call and
    matches what it saves), not a replay's."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and hooks[0] is not _keep_saved


def _replay(module: nn.Module, signature: tuple, graph_stamp, run, name: str, x: Tensor) -> Tensor | None:
    """The call replayed from the module's graph of `name` (captured now where it has none
    for this stamp), or None where it may not be: a call that may not be graphed (_graph_kind:
    the module's mode or the parameters' requires_grad may have changed since the choice),
    another stream than the default one (a capture in progress, or streams that could overlap
    the static input's use), graph_stamp() None, a call recording gradients under the caller's
    saved-tensor hooks or while the graph's last replay awaits its backward."""
    kind = _graph_kind(module, x)
    if kind is None or torch._C._cuda_getCurrentRawStream(x.device.index) != 0:
        return None
    if signature[5] and _saved_tensors_hooked():  # (grad mode)
        return None
    stamp = graph_stamp()
    if stamp is None:
        return None
    graph = _graphed.graphed_call(module, signature, (stamp, kind), lambda n, t: _run_benchmarked(run, n, t), name,
                                  x)
    return None if graph is None else graph(x)


def last_formulation() -> str | None:
    """The formulation the latest call of any module ran (for tests and debugging)."""
    return _LAST[0]


def kept_choice(key: tuple) -> str | None:
    """The formulation tuned for `key`, or None where none was."""
    choice = _CHOICES.get(key)
    return None if choice is None else choice[0]


def kept_graphed(key: tuple) -> bool:
    """Whether the calls with `key` are replayed from CUDA graphs (the tuner found it faster)."""
    choice = _CHOICES.get(key)
    return choice is not None and choice[1]


def run_first(run, formulations, x: Tensor) -> tuple[str, Tensor]:
    """(name, run(name, x)) of the first of `formulations` whose run holds (is not None): the
    last of a module's list always does."""
    for name in formulations:
        out = run(name, x)
        if out is not None:
            return name, out
    raise AssertionError(f"no formulation of {list(formulations)} holds")  # the last always does


def _tune(module: nn.Module, formulations: Sequence[str], run, x: Tensor, signature: tuple,
          graph_stamp) -> tuple[str, bool]:
    """(name, graphed): the fastest of the formulations that hold, timed as the call is made:
    the forward, and where the result records gradients, the backward to what requires them;
    then, where the call may be graphed, the fastest replayed from a CUDA graph against itself.
    The module's buffers (running statistics) are restored after. A formulation that raises
    is passed over; where all do, the first one's error is raised."""
    device = x.device
    graphable = _graph_kind(module, x) is not None and not _saved_tensors_hooked()

    def forward_backward(call):
        def step(name, x):
            out = call(name, x)
            if out is not None and out.requires_grad:
                inputs = [t for t in (x, *module.parameters()) if t.requires_grad]
                with torch.autocast(device.type, enabled=False):
                    torch.autograd.grad(out, inputs, torch.ones_like(out), allow_unused=True)
            return out
        return step

    # the backward's convolutions searched too (not OWN_CONVOLUTION): their plans, kept by PyTorch,
    # serve the later backward calls (which run outside the module, under the user's setting)
    unreplayed = forward_backward(run)
    replayed = forward_backward(lambda name, x: _replay(module, signature, graph_stamp, run, name, x))
    errors = []
    # the timing calls' saved tensors kept from any saved-tensor hooks around the call (a
    # non-reentrant checkpoint counts them, and its recomputation makes no timing calls)
    with _graphed.buffers_restored(module), torch.autograd.graph.saved_tensors_hooks(_keep_saved, _keep_saved):
        steps = {}
        for name in formulations:
            call = functools.partial(_run_benchmarked, unreplayed, name, x)
            try:
                if call() is None:  # does not hold
                    continue
            except Exception as error:  # (a limit of one formulation: the others may hold)
                errors.append(error)
                continue
            steps[name] = call
        if not steps:  # the input is wrong for all: the rule's error
            raise errors[0]
        # where a graph may replay the call, the formulations compared by their time on the device
        # (what a replay takes; the host's time per op varies by tens of percent from moment to moment),
        # then the fastest replayed against itself unreplayed; where the graph loses, by the time a call
        # takes unreplayed
        best = _fastest(steps, device, preferred="original", device_time=graphable)
        graphed = graphable and replayed(best, x) is not None
        if graphed:
            graphed = _fastest({False: steps[best], True: functools.partial(replayed, best, x)}, device,
                               preferred=_host_bound(steps[best], device))
        if graphable and not graphed:
            best = _fastest(steps, device, preferred="original")
    if not graphed:
        _graphed.drop(module, signature)
    return best, graphed


# A candidate preferred by _fastest (the original's own ops; a graph where the call is
# host-bound, else no graph) is taken where it is within this fraction of the fastest: closer
# than that, rounds of a few milliseconds do not tell the two apart, and the original's ops lose
# nothing against the original, a graph nothing to the host's moments, no graph no input copy.
PREFERRED_MARGIN = 0.03


def _fastest(calls: dict, device: torch.device, preferred: Hashable = None, device_time: bool = False):
    """The key of the fastest of `calls` (each timed over ROUNDS rounds, the calls interleaved,
    after one synchronized call that sets how many calls a round makes): the median round
    decides; `preferred` wins where it is within PREFERRED_MARGIN of the fastest. With
    device_time (on a GPU), each round's calls are queued behind a wait on the device long
    enough for the host to queue them all: their time on the device, not the host's."""
    counts, times, host_ms = {}, {key: [] for key in calls}, {}
    for key, call in calls.items():
        began = time.perf_counter()
        call()
        host_ms[key] = (time.perf_counter() - began) * 1e3
        _synchronize(device)
        first_ms = (time.perf_counter() - began) * 1e3
        counts[key] = max(1, min(MAX_CALLS, int(ROUND_MS / max(first_ms, 1e-3))))
    device_time = device_time and device.type == "cuda"
    for _ in range(ROUNDS):
        for key, call in calls.items():
            wait_ms = 2 * counts[key] * host_ms[key] + 0.05 if device_time else 0.0
            times[key].append(_time_ms(call, counts[key], device, wait_ms) / counts[key])
    medians = {key: statistics.median(rounds) for key, rounds in times.items()}
    best = min(medians, key=medians.get)
    if preferred in medians and medians[preferred] <= medians[best] * (1 + PREFERRED_MARGIN):
        return preferred
    return best


def _host_bound(call, device: torch.device) -> bool:
    """Whether queueing call() takes the host at least half as long as the whole call takes
    (medians of 3 synchronized calls)."""
    host, whole = [], []
    for _ in range(3):
        _synchronize(device)
        began = time.perf_counter()
        call()
        host.append(time.perf_counter() - began)
        _synchronize(device)
        whole.append(time.perf_counter() - began)
    return statistics.median(host) >= 0.5 * statistics.median(whole)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(call, calls: int, device: torch.device, wait_ms: float = 0.0) -> float:
    """Milliseconds of `calls` calls queued back to back: CUDA events on a GPU (the host's
    time shows where it falls behind, unless the device first waits wait_ms for it to queue
    the calls), the wall clock on a CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if wait_ms > 0:
            torch.cuda._sleep(int(wait_ms * _sleep_cycles_per_ms(device)))
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


_SLEEP_CYCLES_PER_MS: dict[torch.device, float] = {}


def _sleep_cycles_per_ms(device: torch.device) -> float:
    """How many cycles of torch.cuda._sleep the device spins per millisecond (measured once)."""
    if device not in _SLEEP_CYCLES_PER_MS:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10 ** 6)
        end.record()
        end.synchronize()
        _SLEEP_CYCLES_PER_MS[device] = 10 ** 6 / max(start.elapsed_time(end), 1e-3)
    return _SLEEP_CYCLES_PER_MS[device]
