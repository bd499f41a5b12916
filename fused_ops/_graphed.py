"""A drop-in module's call replayed from a CUDA graph: the autotuner's candidate for calls
whose time is the host's (a batch of one: a few microseconds of GPU work per launch behind
tens of microseconds of Python and dispatch per op).

A `GraphedCall` captures one formulation's call for one input signature (shape, strides,
dtype, device) and replays it on inputs copied into its static input, the result cloned out
of the graph's memory (no later call overwrites what a call returned). It is only taken for
calls that record no gradients, in eval mode, on the default stream, on a module without
forward hooks on its convolution (``fused_ops.autotune``), and it stays valid while the
module's configuration and the memory of its parameters and buffers stay: the graph reads
them in place, so in-place updates (an optimizer step, load_state_dict) are seen, and
anything derived from them is re-derived on each replay (``fused_ops._derived`` keeps
nothing while capturing). A replaced parameter, buffer or setting makes the next call
capture again; a module whose graph has to be captured again and again stops being graphed.
"""
import threading
import weakref
from collections.abc import Callable, Hashable

import torch
from torch import Tensor, nn

# A graph whose capture holds more of the device's memory than this is dropped (its call is
# then not graphed): graphs are for small, host-bound calls (at a batch of one the SPEC
# configurations' graphs hold 20-100 MiB, what one call's intermediates take).
MEMORY_LIMIT = 256 << 20
# A module whose graph for one signature was captured this many times is no longer graphed.
MAX_CAPTURES = 4

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_GRAPHS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


class CaptureRefused(RuntimeError):
    """The call cannot be replayed from a graph (too much memory held, captured too often)."""


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


class GraphedCall:
    """run(name, x) captured for x's signature; calling it replays the graph on a new input."""

    def __init__(self, run: Callable[[str, Tensor], Tensor | None], name: str, x: Tensor, stamp: Hashable):
        device = x.device
        self.stamp = stamp
        self._lock = threading.Lock()
        self._x = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)
        self._x.copy_(x)
        side = _side_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            run(name, self._x)  # (warm-up on the capture's stream: its library handles and workspaces)
            reserved = torch.cuda.memory_reserved(device)
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                out = run(name, self._x)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(device).wait_stream(side)
        if out is None:
            raise CaptureRefused(f"formulation {name} does not hold for the captured call")
        if torch.cuda.memory_reserved(device) - reserved > MEMORY_LIMIT:
            raise CaptureRefused("the graph holds more than fused_ops._graphed.MEMORY_LIMIT bytes")
        self._graph, self._out = graph, out

    def __call__(self, x: Tensor) -> Tensor:
        with self._lock:  # (one static input and output: calls from several threads take turns)
            self._x.copy_(x)
            self._graph.replay()
            return self._out.clone()


def tensor_pointers(module: nn.Module) -> tuple[int, ...]:
    """Where each parameter and buffer of `module` (and its submodules) lives: what a graph
    reads in place."""
    return tuple([t.data_ptr() for m in module.modules() for t in (*m._parameters.values(), *m._buffers.values())
                  if t is not None])


def graphed_call(module: nn.Module, signature: Hashable, stamp: Hashable,
                 run: Callable[[str, Tensor], Tensor | None], name: str, x: Tensor) -> GraphedCall | None:
    """The module's graph of formulation `name` for calls with `signature`, captured now
    where there is none or where it was captured under another stamp (configuration and
    tensor memory); None where the call is not to be graphed (its capture was refused or
    failed: the call runs without a graph, and raises there if its input is wrong)."""
    graphs = _GRAPHS.setdefault(module, {})
    graph, captures = graphs.get(signature, (None, 0))
    if graph is not None and graph.stamp == stamp:
        return graph
    if captures >= MAX_CAPTURES:
        return None
    graphs[signature] = (None, MAX_CAPTURES)  # (the old graph's memory released before the new capture)
    del graph
    try:
        graph = GraphedCall(run, name, x, stamp)
    except RuntimeError:  # (CaptureRefused, or a capture CUDA refused)
        return None
    graphs[signature] = (graph, captures + 1)
    return graph


def drop(module: nn.Module | None = None, signature: Hashable = None) -> None:
    """Releases the graphs (and their memory) of `module`'s calls with `signature`, of all its
    calls where signature is None, of every module where module is None."""
    if module is None:
        _GRAPHS.clear()
    elif signature is None:
        _GRAPHS.pop(module, None)
    else:
        _GRAPHS.get(module, {}).pop(signature, None)
