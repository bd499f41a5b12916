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

The autotuner chooses among them from the calls the user makes anyway: the first call of a
key (the module's class and configuration; the input's shape with its batch size in a power-of-two
bucket, its layout, dtype and device; train or eval; whether gradients are recorded, and for
which of the input and the parameters; the autocast state) answers at once with the rule's
formulation, and so do the next ones until trying the others pays: until the key's calls have
taken 1/EXPLORE_SHARE times what trying them is expected to cost (their set-up on each new shape
included; the rule's own calls are timed only once that may be near); the next calls with the key
then run each other formulation that holds in turn, each timed as it runs (CUDA events read at a
later call, never waited for; a training call's backward from its output's gradient to its
inputs'), until each has been timed a few times; the fastest
then serves every later call with the key (``_Tuning``). ``warmup`` and ``exploring()`` try them
at once. No call is made that the user did not
make, and every formulation computes the original's function, so the choice changes the speed,
not what is computed (its roundings differ as the original's do between cuDNN algorithms). The
rearranged and channels-last convolutions of the candidates being tried, and of a key's settled
choice, run with cudnn.benchmark on (each shape's plan searched at its first such call, as by the
original tuned by hand: PyTorch keeps the first plan a convolution of a shape got, searched or
guessed, for every later call; the original's own convolutions always run under the user's setting).
Once a signature has been called HOT_CALLS times, where the calls were host-bound on a GPU
(queueing a call takes the host at least half its time on the device: a batch of one) it is
replayed from a CUDA graph of its call (``fused_ops._graphed``; ``FUSED_OPS_CUDA_GRAPHS=0`` leaves
graphs out; at most ``_graphed.MAX_GRAPHS`` per module, ``memory()`` says what they hold), captured
only while no other thread's call is in flight, kept only where its first replays are faster than the
calls without it timed beside them. Choices can be kept across processes
(``FUSED_OPS_AUTOTUNE_FILE``, ``save``, ``load``) and made ahead of time (``warmup``). One module
may be called from several threads at once.

Under a torch.func transform (grad, vjp, jacrev, vmap, ...) every module runs the original's own
ops, untimed and forced or not (functorch transforms them; ``choose``). Nothing is timed, and each
module takes its rule (the first formulation of its list that holds: the rewrite on a GPU, else
the fused tail) where the autotuner is off
(``FUSED_OPS_AUTOTUNE=0`` in the environment, or ``set_enabled(False)``), under
torch.compile, torch.export and any trace of fake tensors (the compile patterns' pass:
the compiler sees the rule's formulation), and while a
CUDA graph is being captured and the key has not settled (``warmup`` first, to capture the
tuned one). The tests check each formulation (``force``) against the original.
"""
import contextlib
import functools
import importlib.metadata
import json
import math
import os
import statistics
import threading
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
_FORCED: list[str] = []
_LAST = [None]  # the formulation the latest call ran
_GENERATION = [0]  # advanced by clear() and set_enabled(): the modules' remembered choices lapse


def set_enabled(enabled: bool) -> None:
    """Turns the autotuner on or off for this process (the environment's FUSED_OPS_AUTOTUNE
    sets the start value)."""
    global _ENABLED
    _ENABLED = bool(enabled)
    _GENERATION[0] += 1


def is_enabled() -> bool:
    return _ENABLED


def clear() -> None:
    """Forgets every choice made so far (those loaded from FUSED_OPS_AUTOTUNE_FILE too) and the
    modules' CUDA graphs (``fused_ops._graphed``)."""
    with _LOCK:
        _TUNINGS.clear()
        _SAVED.clear()
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


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """A contiguous tensor's strides (torch._prims_common.make_contiguous_strides_for's, whose first
    call imports sympy: a second on a user's first call)."""
    strides, multiplier = [], 1
    for size in reversed(shape):
        strides.append(multiplier)
        multiplier *= max(size, 1)
    return tuple(reversed(strides))


def _channels_last_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """A 4-D or 5-D channels-last tensor's strides (make_channels_last_strides_for's: C, then the
    spatial dims innermost first, then N; sizes of 0 kept, as eager's)."""
    strides, multiplier = [0] * len(shape), 1
    for dim in (1, *range(len(shape) - 1, 1, -1), 0):
        strides[dim] = multiplier
        multiplier *= shape[dim]
    return tuple(strides)


def _bucket(signature: tuple) -> tuple:
    """The signature as the choices share it: the batch size rounded up to a power of two (calls of
    batch 5 to 8 alike), the strides as x's layout (contiguous, channels last, or the strides
    themselves for any other)."""
    shape, strides = signature[:2]
    batch = 1 << max(0, shape[0] - 1).bit_length() if shape else None
    if not shape or strides == _contiguous_strides(shape):
        layout = "contiguous"
    elif len(shape) in (4, 5) and strides == _channels_last_strides(shape):
        layout = "channels_last"
    else:
        layout = strides
    return ((batch, *shape[1:]), layout, *signature[2:])


def call_key(module: nn.Module, config: tuple, x: Tensor) -> tuple:
    """The key of a call in the choices shared by all modules: the module's class and
    configuration, the call's signature in its bucket (_bucket), and which parameters require
    gradients."""
    return _key(module, config, _signature(module, x))


def _key(module: nn.Module, config: tuple, signature: tuple) -> tuple:
    grads = tuple([p.requires_grad for p in module.parameters()]) if signature[5] else ()  # (grad mode)
    return type(module), config, _bucket(signature), grads


def choose(module: nn.Module, config: Callable[[], tuple], formulations: Callable[[Tensor], Sequence[str]],
           run: Callable[[str, Tensor], Tensor | None], x: Tensor,
           graph_stamp: Callable[[], Hashable | None] = lambda: None) -> tuple[str, Tensor]:
    """(name, result) of the formulation the call takes: forced, the rule (the first of
    `formulations(x)`, in order, whose `run(name, x)` is not None: the last must always hold), or,
    with the autotuner on, the one the calls with its key (call_key of `config()`) choose as they
    come: each candidate in turn timed on real calls (_Tuning) until the fastest is known, then
    that one; where the tuner found it host-bound and the calls with this signature are many, it
    is replayed from a CUDA graph (``fused_ops._graphed``) while `graph_stamp()` (the module's
    configuration and tensor memory, None where its call may not be graphed) stays as at the
    capture. The module remembers its latest call's signature and its key's settled choice (or, while
    the key still chooses, its tuning), so that a call like the one before runs it without building
    the key or the list of formulations (host time: at a batch of one a whole call on a GPU takes
    about 0.1 ms); where a settled choice no longer holds (run gives None), the call chooses again.
    Under a torch.func transform (grad, vjp, jacrev, vmap, ...; compiled too) the call runs the
    original's own ops, which functorch transforms: it cannot transform the fused ops' C++
    autograd, nor vmap a layout change."""
    if _trace.transformed():
        _LAST[0] = "original"
        return "original", run("original", x)
    if _FORCED:
        name, out = run_first(run, untimed_order(formulations(x)), x)
        _LAST[0] = name
        return name, out
    if _trace.traced(x):
        return run_first(run, formulations(x), x)
    if not x.is_cuda:
        return _choose(module, config, formulations, run, x, graph_stamp)
    with _graphed.call_in_flight:
        return _choose(module, config, formulations, run, x, graph_stamp)


def _choose(module: nn.Module, config, formulations, run, x: Tensor, graph_stamp) -> tuple[str, Tensor]:
    signature = _signature(module, x)
    memo = module.__dict__.get("_fused_ops_choice")
    if memo is not None and memo[0] == _GENERATION[0] and memo[1] == signature:
        tuning = memo[2]
        if tuning is not None and tuning.choice is None:  # (its key still choosing: the call as below)
            if not _capturing(x) and not _saved_tensors_hooked():
                name, out = tuning.call(module, run, x, signature)
                _LAST[0] = name
                return name, out
        else:
            out = _run_settled(module, signature, tuning, graph_stamp, run, x)
            if out is not None:
                return tuning.choice[0] if tuning is not None else memo[3], out
    order = formulations(x)
    capturing = _capturing(x)
    tuning = None
    if _ENABLED and len(order) > 1:
        key = _key(module, config(), signature)
        with _LOCK:
            tuning = _TUNINGS.get(key)
            if tuning is None and not capturing:  # (a call being captured is not timed: the rule)
                tuning = _TUNINGS[key] = _Tuning(key, order)
    # (under saved-tensor hooks, a non-reentrant checkpoint's among them, untimed: its recomputation must run
    # the formulation its forward ran, which a tuning would move on from)
    if tuning is not None and tuning.choice is None and not capturing and not _saved_tensors_hooked():
        name, out = tuning.call(module, run, x, signature)
        module.__dict__["_fused_ops_choice"] = (_GENERATION[0], signature, tuning, None)
        _LAST[0] = name
        return name, out
    if tuning is not None and tuning.choice is not None:
        out = _run_settled(module, signature, tuning, graph_stamp, run, x)
        if out is not None:
            if not capturing:
                module.__dict__["_fused_ops_choice"] = (_GENERATION[0], signature, tuning, None)
            return tuning.choice[0], out
    name, out = run_first(run, order, x)
    if not capturing and (tuning is None or tuning.choice is not None):  # (the rule, kept)
        module.__dict__["_fused_ops_choice"] = (_GENERATION[0], signature, None, name)
    _LAST[0] = name
    return name, out


def _run_settled(module: nn.Module, signature: tuple, tuning: "_Tuning | None", graph_stamp, run,
                 x: Tensor) -> Tensor | None:
    """The call by its key's settled choice (tuning's, or the rule's where tuning is None: the
    module's memo), or None where that does not hold for it. A settled choice runs its rearranged
    convolutions with cudnn.benchmark on (_run_benchmarked: each signature's plan searched at its
    first call, as the candidates' were when tried; PyTorch keeps a convolution's first plan,
    searched or guessed, for every later call) and, for a signature called HOT_CALLS times where
    the tuner found the calls host-bound, from a CUDA graph."""
    if tuning is None:
        name, hot, searched, graphed = module.__dict__["_fused_ops_choice"][3], False, False, False
    else:
        name, graphed = tuning.choice
        # (no search, and no graph of ours, while a caller captures the call: it would fail the capture)
        capturing = _capturing(x)
        searched, hot = not capturing, tuning.count(signature) >= HOT_CALLS and not capturing
        graphed = graphed and tuning.replays_pay(module, signature)
    out = None
    timed = None
    if graphed and hot:
        timed = tuning.replay_timing(module, signature, x)
        if timed is None or timed[1]:
            out = _replay(module, signature, graph_stamp, run, name, x)
            if out is None:
                timed = None  # (not replayed after all: the call below is not the timed kind)
    if out is None:
        out = _run_benchmarked(run, name, x) if searched else run(name, x)
    if out is not None:
        _LAST[0] = name
        if timed is not None:
            tuning.replayed(module, signature, timed, x, out)
    return out


# Online tuning. A key's calls run its first candidate (the rule's formulation, or the one a
# neighbouring batch-size bucket settled on: _Tuning.__init__) until trying the others pays
# (_Tuning._pays): the time the key's calls have taken is at least 1/EXPLORE_SHARE times the
# expected cost of trying them, each its set-up (a new shape's first call: cuDNN's plans and
# workspaces, the first candidate's measured by the host's clock) and SAMPLES + 1 calls of up to
# twice the first's time. That takes at least (candidates - 1) (SAMPLES + 1) (ELIMINATE - 1) /
# EXPLORE_SHARE of the first's calls (80 for each other candidate): the first candidate's SAMPLES
# timings, which tell whether it pays, are taken from half that call on (_Tuning._samples_from), not
# before (a timed call costs the host ~0.4 ms on a GPU: CUDA events, the backward's tensor hooks).
# (A new shape's first call on a GPU takes milliseconds, a call of a small batch tenths of one: a
# server's rare batch sizes and a short run never try the others, and pay nothing for them.) The
# next calls run each other candidate in turn, each timed as it runs (on a
# GPU by CUDA events read at a later call, never waited for; a training call's backward timed from
# its output's gradient to the last gradient of its inputs), until each has SAMPLES timings of
# calls with shapes it ran before (a first call is set-up); the fastest median then settles the key
# (PREFERRED_MARGIN: the original's ops win ties). A candidate whose median is over ELIMINATE times
# the fastest's is not run again. A timing not read within PENDING_CALLS calls of the key (a
# training call whose backward never ran) is dropped; a key that has not settled MAX_TUNING_CALLS
# calls after its trying began settles on the fastest timed so far.
EXPLORE_SHARE = 0.05
SAMPLES, ELIMINATE, PENDING_CALLS, MAX_TUNING_CALLS = 3, 2.0, 16, 64
# Calls of one signature after which a host-bound call is replayed from a CUDA graph: a capture
# costs about a call's time or more, paid once for many calls.
HOT_CALLS = 50
# A call is host-bound where queueing it takes the host at least this share of its time on the device.
HOST_BOUND_SHARE = 0.5
# A kept graph's first SAMPLES replays after its capture are timed as the candidates' calls were (_Timing), each
# beside a call of the choice without the graph (the two in turn); where the replays' median is not below those
# calls' by PREFERRED_MARGIN, the graph is released and the key's calls with that signature are graphed no more:
# a replay copies the input in and the result out, and its host time is not always less than the call's (D's
# float32 eval at SPEC's size on an H200, one process, interleaved: 87.5 us a call replayed back to back against
# 96.7 without, 133.5 against 123.8 a call alone; session 26). (Not the choice's timings as a candidate: a
# formulation's first calls, tried first, took 0.28, 0.23 and 0.15 ms there, and kept every graph.)
# A graph's replay first copies the call's input into the graph's own (fused_ops._graphed): 2 x.nbytes of
# memory traffic at no more than GRAPH_COPY_BANDWIDTH bytes a second (above any GPU's today: an H200's 4.8
# TB/s, a B200's 8). Where that copy would take over GRAPH_COPY_SHARE of the call (the larger of the
# forward's time on the device and the host's to queue it), no graph is kept, however host-bound the call
# (C's float32 eval at SPEC's size on an H200: 0.28 ms a call, 0.56 replayed with x's 604 MB copied; a
# batch of one copies a few MB at most).
GRAPH_COPY_BANDWIDTH, GRAPH_COPY_SHARE = 8e12, 0.1


def _input_copy_ms(key: tuple) -> float:
    """The time, in ms, a graph's copy of an input of the key's bucket's shape (its batch rounded up:
    _bucket) would take at GRAPH_COPY_BANDWIDTH."""
    shape, dtype = key[2][0], key[2][2]
    return 2 * math.prod(shape) * dtype.itemsize / GRAPH_COPY_BANDWIDTH * 1e3


def steady_calls(device: torch.device | str) -> int:
    """About how many calls of one signature it takes before its calls run as they will from then on
    (each formulation timed, then HOT_CALLS on a GPU and a graph's replays timed): what a benchmark of the
    steady state warms up
    with (fused_ops._timing.warm_up)."""
    # (a module's candidates: FORMULATIONS, and A's and C's fused convolution)
    tuning = (SAMPLES + 1) * (len(FORMULATIONS) + 1) + 5 if _ENABLED else 0
    return tuning + (HOT_CALLS + 2 * SAMPLES if torch.device(device).type == "cuda" else 0)


_LOCK = threading.RLock()  # (the choices' state: one module may be called from several threads)
_TUNINGS: dict[tuple, "_Tuning"] = {}
_EXPLORING = [0]  # (how many exploring() contexts are open)


@contextlib.contextmanager
def exploring():
    """Within it, a key whose calls have not settled tries its candidates from its next call on,
    whether or not that pays yet (_Tuning._pays): what ``warmup`` and a benchmark's warm-up
    (``fused_ops._timing.warm_up``) do, to reach the steady state in a few dozen calls. (For every
    thread while it is open.)"""
    with _LOCK:
        _EXPLORING[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            _EXPLORING[0] -= 1


class _Timing:
    """One call's time: its forward's, and where it records gradients its backward's (from its
    output's gradient to the last of its inputs' gradients), in milliseconds; on a GPU by CUDA
    events on the call's stream, read once they have passed (`read`, never waiting)."""

    def __init__(self, x: Tensor):
        self.cuda = x.is_cuda
        self.marks: list = []
        self.host_ms = 0.0
        self.backward = False  # (a backward to time: marks 3 and 4)
        self.handles: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def time_backward(self, out: Tensor, inputs: list[Tensor]) -> None:
        """Marks the backward's start (out's gradient computed) and end (the last of the inputs'),
        by tensor hooks, which autograd.grad runs as backward() does."""
        self.backward = True
        left = [len(inputs)]

        def reached(grad):
            left[0] -= 1
            if left[0] == 0:
                self.mark()
                self.close()
        self.handles = [out.register_hook(lambda grad: self.mark())] + [t.register_hook(reached) for t in inputs]

    def close(self) -> None:
        """Removes the backward's hooks (the parameters' would run at every later backward)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def read(self) -> tuple[float, float, float] | None:
        """(ms, the forward's ms, the host's ms queueing the forward) once every mark has passed,
        else None."""
        if len(self.marks) < (4 if self.backward else 2):
            return None
        if self.cuda:
            if not self.marks[-1].query():
                return None
            spans = [a.elapsed_time(b) for a, b in zip(self.marks[::2], self.marks[1::2])]
        else:
            spans = [(b - a) * 1e3 for a, b in zip(self.marks[::2], self.marks[1::2])]
        return sum(spans), spans[0], self.host_ms


def _read_passed(pending: list, keep: Callable, stale: Callable) -> bool:
    """Reads the pending timings (entries (the call they were made at, ..., their _Timing, ...)) that have
    passed, each kept by keep(entry, read); a timing read, or stale(entry) (not read within PENDING_CALLS
    calls: a backward that never ran), is closed (its hooks removed) and leaves `pending`. Whether any was
    read."""
    any_read = False
    for entry in list(pending):
        read = entry[2].read()
        if read is not None:
            keep(entry, read)
            any_read = True
        if read is not None or stale(entry):
            entry[2].close()
            pending.remove(entry)
    return any_read


def _batch_bits(key: tuple) -> int:
    """The bit length of key's batch-size bucket."""
    return key[2][0][0].bit_length()


def _settled_neighbour(key: tuple) -> "_Tuning | None":
    """The settled tuning of key's nearest batch-size bucket (otherwise the same key), or None."""
    bucket = key[2]
    near = [t for k, t in list(_TUNINGS.items()) if t.choice is not None and k[:2] == key[:2] and k[3] == key[3]
            and k[2][1:] == bucket[1:] and k[2][0][1:] == bucket[0][1:]]
    return min(near, key=lambda t: abs(_batch_bits(t.key) - _batch_bits(key)), default=None)


class _Tuning:
    """A key's choice as its calls make it (the comment above SAMPLES): `choice` None while
    candidates are timed, then (formulation, replayed from a CUDA graph)."""

    def __init__(self, key: tuple, order: Sequence[str]):
        self.key = key
        self.candidates = list(order)
        self.dropped: set[str] = set()  # candidates this key's own calls dropped: far slower, not holding, raising
        neighbour = _settled_neighbour(key)
        if neighbour is not None and neighbour.choice[0] in order:
            # its choice first; the others but those it dropped where its batch is within twice this one's
            # (the fastest changes with the batch: A-k313's rewrite, far slower at batch 8, is ~4x faster
            # than the others at 128)
            name = neighbour.choice[0]
            near = abs(_batch_bits(neighbour.key) - _batch_bits(key)) <= 1
            dropped = neighbour.dropped if near else set()
            self.candidates = [name] + [n for n in order if n != name and n not in dropped]
        self.timings: dict[str, list[tuple[float, float, float]]] = {name: [] for name in order}  # (_Timing.read)
        self.started: dict[str, int] = dict.fromkeys(order, 0)  # calls run, timed or not
        self.pending: list[tuple[int, str, _Timing]] = []  # (call, name, timing)
        self.firsts: dict[str, list[float]] = {name: [] for name in order}  # host ms of its first calls of a signature
        self.ran: set[tuple[str, tuple]] = set()  # (candidate, signature) run
        self.untimed = 0  # calls not timed (the first candidate's, before trying the others)
        self.readings = 0  # timings read (of first calls too)
        self.pays_terms: tuple | None = None  # _pays's terms as of `readings`
        self.explored: int | None = None  # the call at which trying the others began
        self.calls = 0
        self.choice: tuple[str, bool] | None = _SAVED.get(_saved_key(key)) if _SAVED else None
        self.counts: dict[tuple, int] = {}
        # a signature's replays and its calls without the graph beside them, timed (ms; below HOST_BOUND_SHARE)
        self.replays: dict[tuple, list[float]] = {}
        self.unreplayed: dict[tuple, list[float]] = {}
        # (the signature's call count, signature, timing, whether a replay's)
        self.replay_pending: list[tuple[int, tuple, _Timing, bool]] = []
        self.replays_won: dict[tuple, bool] = {}  # whether a signature's replays were faster than its calls

    def count(self, signature: tuple) -> int:
        """Counts a settled call with `signature`; how many there were."""
        count = self.counts[signature] = self.counts.get(signature, 0) + 1
        return count

    def replays_pay(self, module: nn.Module, signature: tuple) -> bool:
        """Whether calls with `signature` may be replayed from a graph: not where their first replays were
        no faster than the calls without it (a module's graph for them then released)."""
        if self.replays_won.get(signature, True):
            return True
        if _graphed.kept(module, signature):  # (another module of this key, its graph captured before the verdict)
            _graphed.refuse(module, signature)
        return False

    def replay_timing(self, module: nn.Module, signature: tuple, x: Tensor) -> "tuple[_Timing, bool] | None":
        """(a _Timing marked now, whether this call replays the graph) while the first replays of the module's
        graph for `signature` are timed, in turn with calls without it; else None: the graph not yet captured
        (this call captures it), the verdict given or enough calls timed."""
        # (no lock, no reading, on the calls of a signature judged or refused: every such call is host-bound)
        if signature in self.replays_won or not _graphed.kept(module, signature):
            return None
        with _LOCK:
            self._read_replays(module, signature)
            timed = [len(self.replays.get(signature, ())), len(self.unreplayed.get(signature, ()))]
            for _, pending, _, replay in self.replay_pending:
                if pending == signature:
                    timed[0 if replay else 1] += 1
            if signature in self.replays_won or min(timed) >= SAMPLES:
                return None
        timing = _Timing(x)
        timing.mark()
        return timing, timed[0] <= timed[1]

    def replayed(self, module: nn.Module, signature: tuple, timed: "tuple[_Timing, bool]", x: Tensor,
                 out: Tensor) -> None:
        """Marks the end of a call timed by replay_timing (its backward's too, where it records gradients:
        _Timing)."""
        timing, replay = timed
        timing.mark()
        if out.requires_grad:
            timing.time_backward(out, [t for t in (x, *module.parameters()) if t.requires_grad])
        with _LOCK:
            self.replay_pending.append((self.counts.get(signature, 0), signature, timing, replay))

    def _read_replays(self, module: nn.Module, signature: tuple) -> None:
        """Reads the timed calls that have passed; with SAMPLES replays and SAMPLES calls without the graph, the
        verdict (the comment below HOST_BOUND_SHARE). Under _LOCK."""
        _read_passed(self.replay_pending,
                     lambda entry, read: (self.replays if entry[3] else self.unreplayed).setdefault(entry[1], [])
                     .append(read[0]),
                     lambda entry: self.counts.get(entry[1], 0) - entry[0] > PENDING_CALLS)
        replays, calls = self.replays.get(signature, []), self.unreplayed.get(signature, [])
        if min(len(replays), len(calls)) >= SAMPLES and signature not in self.replays_won:
            won = statistics.median(replays) < statistics.median(calls) * (1 - PREFERRED_MARGIN)
            self.replays_won[signature] = won
            if not won:
                _graphed.refuse(module, signature)

    def call(self, module: nn.Module, run, x: Tensor, signature: tuple) -> tuple[str, Tensor]:
        with _LOCK:
            self._read()
            name = self._next()
            self.started[name] += 1
            first = (name, signature) not in self.ran  # (set-up: timed by the host's clock alone)
            self.ran.add((name, signature))
            timed = (not first and self._short(name)
                     and (self.explored is not None or self.calls >= self._samples_from()))
            self.untimed += not (first or timed)
        timing = _Timing(x) if timed else None
        if timing is not None:
            timing.mark()
        if self.explored is not None:  # (trying the others: their plans searched, as once settled: _run_settled)
            run = functools.partial(_run_benchmarked, run)
        began = time.perf_counter()
        try:
            out = run(name, x)
        except Exception as error:  # (a limit of one formulation: the others may hold)
            out = error
        host_ms = (time.perf_counter() - began) * 1e3
        if timing is not None:
            timing.host_ms = host_ms
            timing.mark()
        if not isinstance(out, Tensor):  # does not hold here, or raised: not a candidate of the key
            with _LOCK:
                if name in self.candidates and len(self.candidates) > 1:
                    self.candidates.remove(name)
                    self.dropped.add(name)
            return self._first_that_runs(run, x, [] if out is None else [out])
        if first:
            with _LOCK:
                self.firsts[name].append(host_ms)
                self.readings += 1
        if timing is None:
            return name, out
        if out.requires_grad:
            inputs = [t for t in (x, *module.parameters()) if t.requires_grad]
            timing.time_backward(out, inputs)
        with _LOCK:
            self.pending.append((self.calls, name, timing))
        return name, out

    def _first_that_runs(self, run, x: Tensor, errors: list[Exception]) -> tuple[str, Tensor]:
        """(name, result) of the first candidate left that holds and does not raise; where every
        one raises, the first error (the input is wrong for all: the rule's)."""
        for name in list(self.candidates):
            try:
                out = run(name, x)
            except Exception as error:
                errors.append(error)
                continue
            if out is not None:
                return name, out
        raise errors[0]

    def _read(self) -> None:
        self.calls += 1

        def keep(entry, read):
            self.readings += 1
            self.timings[entry[1]].append(read)
        read = _read_passed(self.pending, keep, lambda entry: self.calls - entry[0] > PENDING_CALLS)
        if not read and self.explored is None and len(self.candidates) > 1:
            return  # (no new timing: no candidate to drop, and none is tried yet)
        medians = self._medians()
        best = min(medians.values(), default=None)
        for name in self.candidates[1:]:  # (far slower: not run again)
            if name in medians and medians[name] > ELIMINATE * best:
                self.candidates.remove(name)
                self.dropped.add(name)
        if self.explored is None and len(self.candidates) > 1:
            return
        done = all(len(self.timings[name]) >= SAMPLES for name in self.candidates)
        if done or (self.explored is not None and self.calls - self.explored > MAX_TUNING_CALLS):
            self._settle()

    def _short(self, name: str) -> bool:
        """Whether name's timings, read or pending, are still short of SAMPLES."""
        pending = sum(1 for _, n, _ in self.pending if n == name)
        return len(self.timings[name]) + pending < SAMPLES

    def _samples_from(self) -> int:
        """The call from which the first candidate's timings are taken while the others are not tried
        (the comment above EXPLORE_SHARE): half the calls before trying them can first pay."""
        return int((len(self.candidates) - 1) * (SAMPLES + 1) * (ELIMINATE - 1) / EXPLORE_SHARE / 2)

    def _pays(self) -> bool:
        """Whether trying the other candidates pays now (the comment above EXPLORE_SHARE): the first
        candidate's median call and set-up (its fastest first call of a signature beyond that median)
        are known, and the key's calls have taken at least 1/EXPLORE_SHARE times the others' expected
        cost: each its set-up and SAMPLES + 1 calls of up to ELIMINATE times the first's time, less
        the first's own time for them."""
        lead = self.candidates[0]
        if len(self.timings[lead]) < SAMPLES or not self.firsts[lead]:
            return False
        state = (lead, len(self.candidates), self.readings)  # (what the terms below depend on, but the untimed)
        if self.pays_terms is None or self.pays_terms[0] != state:
            median = statistics.median([t[0] for t in self.timings[lead]])
            set_up = max(min(self.firsts[lead]) - median, 0.0)
            cost = (len(self.candidates) - 1) * (set_up + (SAMPLES + 1) * (ELIMINATE - 1) * median)
            timed = (sum(t[0] for timings in self.timings.values() for t in timings)
                     + sum(sum(firsts) for firsts in self.firsts.values()))
            self.pays_terms = (state, median, cost, timed)
        _, median, cost, timed = self.pays_terms
        return cost <= EXPLORE_SHARE * (timed + self.untimed * median)

    def _next(self) -> str:
        """The candidate to run: the settled one; the first while trying the others does not pay
        (nor has been asked for: exploring()); else the first (in the rule's order) of those run
        least often whose timings, read or pending, are still short of SAMPLES; else (all waiting
        to be read) the fastest so far."""
        if self.choice is not None:
            return self.choice[0]
        if self.explored is None:
            if not (_EXPLORING[0] or self._pays()):
                return self.candidates[0]
            self.explored = self.calls
        short = [name for name in self.candidates if self._short(name)]
        if short:
            return min(short, key=lambda name: self.started[name])
        medians = self._medians()
        return min(medians, key=medians.get) if medians else self.candidates[0]

    def _medians(self) -> dict[str, float]:
        return {name: statistics.median([t[0] for t in self.timings[name]]) for name in self.candidates
                if self.timings[name]}

    def _settle(self) -> None:
        medians = self._medians()
        if not medians:
            self.choice = (self.candidates[0], False)
        else:
            best = min(medians, key=medians.get)
            if "original" in medians and medians["original"] <= medians[best] * (1 + PREFERRED_MARGIN):
                best = "original"
            # (a host-bound call on a GPU: queueing its forward takes the host at least HOST_BOUND_SHARE of
            # the forward's time on the device, which then waits for the host)
            host_share = statistics.median([host / max(forward, 1e-6) for _, forward, host in self.timings[best]])
            call_ms = statistics.median([max(forward, host) for _, forward, host in self.timings[best]])
            graphed = (_GRAPHS_ENABLED and self.key[2][3].type == "cuda" and host_share >= HOST_BOUND_SHARE
                       and _input_copy_ms(self.key) <= GRAPH_COPY_SHARE * call_ms)
            self.choice = (best, graphed)
        for _, _, timing in self.pending:
            timing.close()
        self.pending.clear()
        _save_choice(self.key, self.choice)


# The choice between the original's ops and another formulation within this fraction of each
# other's time goes to the original's ops: closer than that, a few calls do not tell the two apart.
PREFERRED_MARGIN = 0.03


# The formulations that call the module's convolution as the original does (its own weight and
# layout, as a module where it has hooks): run under the user's cudnn.benchmark setting, with the
# plans the original gets. The others rearrange it or change its layout: their plans are
# searched, as by the original tuned by hand.
OWN_CONVOLUTION = frozenset(("fused", "original"))


def _alone() -> bool:
    """Whether the calling thread is the process's only Python thread."""
    return threading.active_count() == 1


def _run_benchmarked(run, name: str, x: Tensor) -> Tensor | None:
    """run(name, x), on a GPU with cudnn.benchmark on for the convolutions of a formulation not
    in OWN_CONVOLUTION, the user's setting back after. PyTorch keeps one cuDNN plan per
    convolution, searched or guessed, whichever call came first: a search for the original's own
    convolution would change the user's eager calls' plans too, and at small batches a
    searched plan (the least GPU time: split reductions, layout kernels) often costs more
    host time than the guessed one; a rearranged convolution guessed would leave its guess to
    every later call. The setting is the process's: switched only where no other Python thread
    runs (another thread's convolutions would search their plans meanwhile, and a search still
    running when a CUDA graph's capture begins fails the capture)."""
    if (name in OWN_CONVOLUTION or not x.is_cuda or torch._C._get_cudnn_benchmark()
            or not _alone()):
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
    saved-tensor hooks or while the graph's last replay awaits its backward. A capture that would take
    the module's graphs past module._graph_budget(x) bytes is refused (a lower bound of the original's
    peak in the call: the capture's call peaks at most at the original's), and its signature not tried
    again."""
    if _graphed.refused(module, signature):  # (host time: the calls that graphs are for are host-bound)
        return None
    kind = _graph_kind(module, x)
    if kind is None or torch._C._cuda_getCurrentRawStream(x.device.index) != 0:
        return None
    if signature[5] and _saved_tensors_hooked():  # (grad mode)
        return None
    stamp = graph_stamp()
    if stamp is None:
        return None
    graph = _graphed.graphed_call(module, signature, (stamp, kind), lambda n, t: _run_benchmarked(run, n, t), name,
                                  x, lambda: module._graph_budget(x))
    return None if graph is None else graph(x)


def last_formulation() -> str | None:
    """The formulation the latest call of any module ran (for tests and debugging)."""
    return _LAST[0]


def kept_choice(key: tuple) -> str | None:
    """The formulation the calls with `key` settled on, or None where they have not (yet)."""
    tuning = _TUNINGS.get(key)
    return None if tuning is None or tuning.choice is None else tuning.choice[0]


def kept_graphed(key: tuple) -> bool:
    """Whether the calls with `key` settled on replaying a CUDA graph (where they are host-bound;
    a signature's calls replay it from their HOT_CALLS-th on)."""
    tuning = _TUNINGS.get(key)
    return tuning is not None and tuning.choice is not None and tuning.choice[1]


def graph_captured(module: nn.Module, x: Tensor) -> bool:
    """Whether the module keeps a CUDA graph for calls like module(x) now (captured at the signature's
    HOT_CALLS-th call, not refused: its memory within the module's budget)."""
    return _graphed.kept(module, _signature(module, x))


def kept_timings(key: tuple) -> dict[str, tuple[float, float]]:
    """The timed candidates of `key`'s calls: {name: (the median forward's time on the device, the median
    host time to queue it), in ms} (the settled choice's host share decides its graph: _Tuning._settle)."""
    tuning = _TUNINGS.get(key)
    if tuning is None:
        return {}
    with _LOCK:
        return {name: (statistics.median([t[1] for t in timings]), statistics.median([t[2] for t in timings]))
                for name, timings in tuning.timings.items() if timings}


def warmup(module: nn.Module, example_inputs: Sequence[Tensor] | Tensor, max_calls: int = MAX_TUNING_CALLS) -> dict:
    """Tunes `module` (a drop-in, or a model holding drop-ins: ``fuse(model)``) ahead of time for
    calls like module(*example_inputs) in its present mode, grad mode and autocast state, as a
    server does at start-up: calls it, and where the call records gradients backpropagates a sum
    of its output, until the keys its calls meet settle (at most max_calls calls), synchronizing
    after each. Returns {each key's module class and input shape: its settled formulation}. The
    buffers the calls update (running statistics) are restored after."""
    inputs = (example_inputs,) if isinstance(example_inputs, Tensor) else tuple(example_inputs)
    before = set(_TUNINGS)
    with _graphed.buffers_restored(module), exploring():
        for _ in range(max_calls):
            out = module(*inputs)
            if isinstance(out, Tensor) and out.requires_grad:
                wanted = [t for t in (*inputs, *module.parameters()) if t.requires_grad]
                torch.autograd.grad(out.float().sum(), wanted, allow_unused=True)
            for x in inputs:
                _synchronize(x.device)
            met = [t for key, t in list(_TUNINGS.items()) if key not in before]
            if all(t.choice is not None for t in met):
                break
    return {f"{t.key[0].__name__} {tuple(t.key[2][0])}": t.choice[0] for t in met if t.choice is not None}


def memory(module: nn.Module | None = None) -> dict:
    """What the modules' CUDA graphs hold (`module`'s alone where given): {"graphs": how many,
    "bytes": the device memory they hold, their pools and static tensors}. At most ``fused_ops._graphed.MAX_GRAPHS``
    per module, the least recently replayed released first."""
    return _graphed.held(module)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Choices kept across processes: FUSED_OPS_AUTOTUNE_FILE names a JSON file (off where unset), read
# at import and written (whole, atomically) as each key settles; its choices are those of this
# torch and fused_ops version and of CHOICE_RULES, per device name (a key's device).
_FILE = os.environ.get("FUSED_OPS_AUTOTUNE_FILE") or None
_SAVED: dict[str, tuple[str, bool]] = {}
# Raised whenever what a saved choice means, or the rules that made it, change (a build in place has no
# version of its own): 2, no graph where its input's copy would take over GRAPH_COPY_SHARE of the call; 3,
# the candidates timed with their plans searched (before: PyTorch's guesses, kept for good).
CHOICE_RULES = 3


def _versions() -> str:
    try:
        version = importlib.metadata.version("fused_ops")
    except importlib.metadata.PackageNotFoundError:  # (a build in place, not installed)
        version = "unknown"
    return f"torch {torch.__version__}, fused_ops {version}, rules {CHOICE_RULES}"


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _saved_key(key: tuple) -> str:
    """key as the file holds it: its module class's name, its device's name, the rest as repr."""
    module_type, config, bucket, grads = key
    device = bucket[3]
    return repr((module_type.__qualname__, _device_name(device), config, bucket[:3], bucket[4:], grads))


def load(path: str) -> int:
    """Reads the choices in file `path` made by this torch and fused_ops version (save); the calls
    whose keys it holds take them from their first call. Returns how many it read."""
    with open(path) as f:
        choices = json.load(f).get(_versions(), {})
    with _LOCK:
        _SAVED.update({key: (name, bool(graphed)) for key, (name, graphed) in choices.items()})
    return len(choices)


def save(path: str) -> None:
    """Writes every settled choice (and those read by load) into file `path`, beside the choices
    of other versions it holds."""
    with _LOCK:
        choices = dict(_SAVED) | {_saved_key(t.key): t.choice for t in _TUNINGS.values() if t.choice is not None}
    try:
        with open(path) as f:
            everything = json.load(f)
    except (OSError, ValueError):
        everything = {}
    everything[_versions()] = {key: list(choice) for key, choice in choices.items()}
    part = f"{path}.{os.getpid()}.{threading.get_ident()}"
    with open(part, "w") as f:
        json.dump(everything, f, indent=1, sort_keys=True)
    os.replace(part, path)


def _save_choice(key: tuple, choice: tuple[str, bool]) -> None:
    if _FILE is not None:
        _SAVED[_saved_key(key)] = choice
        save(_FILE)


if _FILE is not None and os.path.exists(_FILE):
    load(_FILE)


def run_first(run, formulations, x: Tensor) -> tuple[str, Tensor]:
    """(name, run(name, x)) of the first of `formulations` whose run holds (is not None): the
    last of a module's list always does."""
    for name in formulations:
        out = run(name, x)
        if out is not None:
            return name, out
    raise AssertionError(f"no formulation of {list(formulations)} holds")  # the last always does
