"""A drop-in module's call replayed from a CUDA graph: the autotuner's candidate for calls
whose time is the host's (a batch of one: a few microseconds of GPU work per launch behind
tens of microseconds of Python and dispatch per op).

A `GraphedCall` captures one formulation's call for one input signature (shape, strides,
dtype, device) and replays it on inputs copied into its static input, the result cloned out
of the graph's memory (no later call overwrites what a call returned): for calls that record
no gradients, in eval mode. A `GraphedStep` captures a call that records gradients and its
backward, as ``torch.cuda.make_graphed_callables`` does, and replays them through one autograd
node; the gradients are cloned out too. Its graph holds one call's saved activations, so a call
made while an earlier one's backward is still to come (its autograd graph alive, not yet
freed by a backward) runs without the graph. Either is taken only on the default stream, on a
module without forward hooks on its convolution (``fused_ops.autotune``), and stays valid while
the module's configuration and the memory of its parameters and buffers stay: the graph reads
them in place, so in-place updates (an optimizer step, load_state_dict, ``.data``) are seen, and
anything derived from them is derived again on each replay (the modules keep nothing derived from
their parameters; autocast's cast cache is off during a capture). A replaced parameter, buffer or
setting makes the next call capture again; a module whose graph has to be captured again and
again stops being graphed.
"""
import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable, Hashable

import torch
from torch import Tensor, nn

# A graph that holds more of the device's memory than this, or than its call's budget (the module's:
# what the original's ops hold at least in that call), is dropped (its call is then not graphed):
# graphs are for small, host-bound calls (at a batch of one the SPEC configurations' graphs hold
# 2-36 MiB, whole allocator segments: 20 MiB for any allocation of 1-10 MiB).
MEMORY_LIMIT = 256 << 20
# A module whose graph for one signature was captured this many times is no longer graphed.
MAX_CAPTURES = 4
# Graphs kept per module (one per signature): beyond it the least recently replayed is released.
MAX_GRAPHS = 8

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_GRAPHS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()

Run = Callable[[str, Tensor], Tensor | None]


class CaptureRefused(RuntimeError):
    """The call cannot be replayed from a graph (too much memory held, captured too often)."""


@contextlib.contextmanager
def _on_side_stream(device: torch.device):
    """The block's work on a side stream (a capture may not run on the default one), ordered
    after the work queued before it and before the work queued after it; autocast, where it
    is on, without its cast cache (a cast kept from before a capture would be read, not
    recomputed, by every replay)."""
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    autocast = torch.is_autocast_enabled(device.type)
    with torch.cuda.stream(stream), torch.autocast(device.type, dtype=torch.get_autocast_dtype(device.type),
                                                   enabled=autocast, cache_enabled=False):
        yield
    torch.cuda.current_stream(device).wait_stream(stream)


@contextlib.contextmanager
def buffers_restored(module: nn.Module, keep_versions: bool = False):
    """The block's calls may update the module's buffers (running statistics: calls made to
    time or capture a formulation); their values are put back after, through ``.data`` where
    keep_versions (an autograd graph recorded in the block saved some of them at their versions)."""
    buffers = list(module.buffers())
    saved = [b.clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(buffers, saved):
                (buffer.data if keep_versions else buffer).copy_(value)


def _capture(call: Callable[[], object], pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """(graph, what call() returned) of call() captured on the current stream (a side stream)."""
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
    try:
        try:
            result = call()
        finally:
            graph.capture_end()
    except BaseException:
        # A capture that CUDA invalidated ends without PyTorch's CUDA generator leaving its
        # capture state (every later random op would raise): an empty capture's begin and end
        # restore it (its eager seed and offset are untouched by either).
        empty = torch.cuda.CUDAGraph()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ("the CUDA graph is empty")
            empty.capture_begin()
            empty.capture_end()
        raise
    return graph, result


def _static_input(x: Tensor) -> Tensor:
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x)


# The least a capture's pool reserves: one of the caching allocator's small segments.
_SMALLEST_POOL = 2 << 20


def _check_held(static: list[Tensor], budget: int, pool: int = _SMALLEST_POOL) -> int:
    """What a graph holds: its static tensors and its pool (`pool` bytes: what its capture reserved, in
    the allocator's whole segments; before the capture, the least it can); refused over `budget` or
    MEMORY_LIMIT bytes."""
    held = pool + sum(t.untyped_storage().nbytes() for t in static)
    if held > min(budget, MEMORY_LIMIT):
        raise CaptureRefused(f"the graph holds {held} bytes, over its budget ({budget}) or "
                             "fused_ops._graphed.MEMORY_LIMIT")
    return held


class GraphedCall:
    """run(name, x) captured for x's signature; calling it replays the graph on a new input."""

    def __init__(self, module: nn.Module, run: Run, name: str, x: Tensor, stamp: Hashable, budget: int):
        self.stamp = stamp
        self._lock = threading.Lock()
        self._x = _static_input(x)
        _check_held([self._x], budget)  # (before its warm-up and capture)
        with _on_side_stream(x.device):
            run(name, self._x)  # (warm-up on the capture's stream: its library handles and workspaces)
            reserved = torch.cuda.memory_reserved(x.device)
            self._graph, self._out = _capture(lambda: run(name, self._x))
        if self._out is None:
            raise CaptureRefused(f"formulation {name} does not hold for the captured call")
        self.held = _check_held([self._x], budget, torch.cuda.memory_reserved(x.device) - reserved)

    def __call__(self, x: Tensor) -> Tensor:
        with self._lock:  # (one static input and output: calls from several threads take turns)
            self._x.copy_(x)
            self._graph.replay()
            return self._out.clone()


class GraphedStep:
    """run(name, x) and its backward (to x where it requires gradients and to the parameters
    that do) captured for x's signature; calling it replays the forward graph through one
    autograd node whose backward replays the backward graph, or returns None while the last
    replay's backward is still to come (the graph's activations are that call's)."""

    def __init__(self, module: nn.Module, run: Run, name: str, x: Tensor, stamp: Hashable, budget: int):
        self.stamp = stamp
        self._lock = threading.Lock()
        self._module, self._run, self._name = weakref.ref(module), run, name
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._token = torch.empty(0, device=x.device)  # (saved by each replay: freed with its autograd graph)
        self._last: weakref.ref | None = None  # the latest replay's autograd node
        # (the warm-up's update of running statistics undone)
        with buffers_restored(module), _on_side_stream(x.device), _parameters_aliased(module) as aliases:
            # (new leaves made here: the gradients' consumers on the capture's stream; a parameter's
            # own accumulator may be tied to the default stream, which a capture may not wait on)
            self._x = _static_input(x).requires_grad_(x.requires_grad)
            _check_held([self._x], budget)  # (before its warm-up and capture)
            inputs = ([self._x] if x.requires_grad else []) + [a for a in aliases if a.requires_grad]

            def backward(out, grad_out):  # (outside autocast, as AMP runs it)
                # the saved activations kept (not freed into the graph's memory for the backward's own
                # intermediates): a backward that keeps its graph may replay the backward again
                with torch.autocast(x.device.type, enabled=False):
                    return torch.autograd.grad(out, inputs, grad_out, allow_unused=True, retain_graph=True)

            out = run(name, self._x)  # (warm-up, forward and backward, on the capture's stream)
            if out is None or not out.requires_grad:
                raise CaptureRefused(f"formulation {name} does not record gradients for the captured call")
            backward(out, torch.ones_like(out))
            self._grad_out = torch.empty_like(out)  # (the captured forward's output is the warm-up's like)
            del out
            reserved = torch.cuda.memory_reserved(x.device)
            self._forward, out = _capture(lambda: run(name, self._x))
            self._backward, self._grads = _capture(lambda: backward(out, self._grad_out), self._forward.pool())
        self._out = out.detach()
        self.held = _check_held([self._x, self._grad_out], budget,
                                torch.cuda.memory_reserved(x.device) - reserved)

    def __call__(self, x: Tensor) -> Tensor | None:
        with self._lock:
            last = None if self._last is None else self._last()
            if last is not None and _holds_saved(last):
                return None
            return _ReplayedStep.apply(self, x, *self._params)

    def recorded_grads(self, x: Tensor, grad: Tensor, autocast: tuple[bool, torch.dtype]) -> list[Tensor | None]:
        """The gradients to x (where it requires them) and the parameters, their own backward
        recorded (a backward with create_graph): the call made again without the graph (whose
        activations are a replay's, not recorded) by the original's ops (the captured
        formulation where the original's does not hold), under the forward's autocast state,
        the buffers it updates restored after."""
        with buffers_restored(self._module(), keep_versions=True):
            with torch.autocast(x.device.type, enabled=autocast[0], dtype=autocast[1]):
                out = self._run("original", x)
                if out is None:
                    out = self._run(self._name, x)
            inputs = ([x] if self._x.requires_grad else []) + self._params
            grads = list(torch.autograd.grad(out, inputs, grad, create_graph=True, allow_unused=True))
        return ([] if self._x.requires_grad else [None]) + grads


@contextlib.contextmanager
def _parameters_aliased(module: nn.Module):
    """Within the block each parameter of `module` is replaced by a new leaf sharing its memory
    and its requires_grad; yields them in the order of module.parameters()."""
    owners = [(m, name, p) for m in module.modules() for name, p in m._parameters.items() if p is not None]
    aliases = {id(p): p.detach().requires_grad_(p.requires_grad) for _, _, p in owners}
    ordered = [aliases[id(p)] for p in module.parameters()]
    try:
        for m, name, p in owners:
            m._parameters[name] = aliases[id(p)]
        yield ordered
    finally:
        for m, name, p in owners:
            m._parameters[name] = p


def _holds_saved(node) -> bool:
    """Whether an autograd node still holds what it saved (its backward may still run)."""
    try:
        node.saved_tensors
    except RuntimeError:  # (freed by a backward)
        return False
    return True


class _ReplayedStep(torch.autograd.Function):
    """A GraphedStep's replay as an autograd node: the forward graph on x copied in, the backward
    graph on the incoming gradient copied in; results cloned out of the graph's memory."""

    @staticmethod
    def forward(ctx, step: GraphedStep, x: Tensor, *params: Tensor) -> Tensor:
        ctx.step = step
        ctx.autocast = torch.is_autocast_enabled(x.device.type), torch.get_autocast_dtype(x.device.type)
        ctx.save_for_backward(step._token, x)
        step._last = weakref.ref(ctx)
        step._x.copy_(x)
        step._forward.replay()
        return step._out.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        step = ctx.step
        if torch.is_grad_enabled():  # (create_graph: a graph's replay records no backward of its own)
            return None, *step.recorded_grads(ctx.saved_tensors[1], grad, ctx.autocast)
        with step._lock:
            step._grad_out.copy_(grad)
            step._backward.replay()
            grads = [None if g is None else g.clone() for g in step._grads]
        grad_x = grads.pop(0) if step._x.requires_grad else None
        return None, grad_x, *grads


def tensor_pointers(module: nn.Module) -> tuple[int, ...]:
    """Where each parameter and buffer of `module` (and its submodules) lives: what a graph
    reads in place."""
    return tuple([t.data_ptr() for m in module.modules() for t in (*m._parameters.values(), *m._buffers.values())
                  if t is not None])


# The drop-in calls on a GPU in flight in this process, in any thread: a capture runs only while its
# own call is the only one, and holds _CALLS_LOCK throughout, so that no other thread's call starts
# launching into it (an operation on the legacy stream during a capture invalidates it, and fails).
_ACTIVE = [0]
_CALLS_LOCK = threading.Lock()


class _CallInFlight:
    """`with call_in_flight:` counts the block as a drop-in call in flight (for a capture: _CALLS_LOCK). (A
    class's __enter__ and __exit__: a generator's context manager took 1.1 us a call on a 2-core CPU, this
    0.4, on every call of a drop-in on a GPU.)"""

    __slots__ = ()

    def __enter__(self) -> None:
        with _CALLS_LOCK:
            _ACTIVE[0] += 1

    def __exit__(self, *exc) -> None:
        with _CALLS_LOCK:
            _ACTIVE[0] -= 1


call_in_flight = _CallInFlight()


def graphed_call(module: nn.Module, signature: Hashable, stamp: Hashable, run: Run, name: str,
                 x: Tensor, budget: Callable[[], int]) -> GraphedCall | GraphedStep | None:
    """The module's graph of formulation `name` for calls with `signature` (a GraphedStep where
    the call records gradients, else a GraphedCall), captured now where there is none or where
    it was captured under another stamp (configuration and tensor memory); None where the call
    is not to be graphed (its capture was refused or failed, or it would take the module's graphs
    past budget() bytes: the call runs without a graph, and raises there if its input is wrong)."""
    graphs = _GRAPHS.setdefault(module, {})
    graph, captures = graphs.get(signature, (None, 0))
    if graph is not None and graph.stamp == stamp:
        graphs[signature] = graphs.pop(signature)  # (the most recently replayed last)
        return graph
    if captures >= MAX_CAPTURES:
        return None
    if not _CALLS_LOCK.acquire(blocking=False):
        return None
    try:
        if _ACTIVE[0] > 1:  # (another thread's call in flight: captured at a later call)
            return None
        graphs[signature] = (None, MAX_CAPTURES)  # (the old graph's memory released before the new capture)
        del graph
        try:  # (a call the tuner may graph in grad mode records gradients: fused_ops.autotune._graph_kind)
            room = budget() - sum(other.held for other, _ in graphs.values() if other is not None)
            graph = (GraphedStep if torch.is_grad_enabled() else GraphedCall)(module, run, name, x, stamp, room)
        except RuntimeError:  # (CaptureRefused, or a capture CUDA refused)
            return None
    finally:
        _CALLS_LOCK.release()
    graphs[signature] = (graph, captures + 1)
    for old in list(graphs)[:-MAX_GRAPHS]:  # (the least recently replayed released)
        del graphs[old]
    return graph


def refuse(module: nn.Module, signature: Hashable) -> None:
    """Releases the module's graph for calls with `signature` (and its memory) and graphs them no more."""
    graphs = _GRAPHS.setdefault(module, {})
    graphs[signature] = (None, MAX_CAPTURES)


def kept(module: nn.Module, signature: Hashable) -> bool:
    """Whether the module keeps a graph for calls with `signature` (captured, not refused)."""
    graph, _ = _GRAPHS.get(module, {}).get(signature, (None, 0))
    return graph is not None


def refused(module: nn.Module, signature: Hashable) -> bool:
    """Whether calls with `signature` are no longer graphed (refused, failed, or captured too often)."""
    graph, captures = _GRAPHS.get(module, {}).get(signature, (None, 0))
    return graph is None and captures >= MAX_CAPTURES


def held(module: nn.Module | None = None) -> dict:
    """{"graphs": how many graphs the modules keep (`module` alone where given), "bytes": the device
    memory they hold (their pools and static tensors)}."""
    modules = list(_GRAPHS.values()) if module is None else [_GRAPHS.get(module, {})]
    graphs = [graph for module_graphs in modules for graph, _ in module_graphs.values() if graph is not None]
    return {"graphs": len(graphs), "bytes": sum(graph.held for graph in graphs)}


def drop(module: nn.Module | None = None, signature: Hashable = None) -> None:
    """Releases the graphs (and their memory) of `module`'s calls with `signature`, of all its
    calls where signature is None, of every module where module is None."""
    if module is None:
        _GRAPHS.clear()
    elif signature is None:
        _GRAPHS.pop(module, None)
    else:
        _GRAPHS.get(module, {}).pop(signature, None)
