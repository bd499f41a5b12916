"""Tensors derived from parameters (rearranged, folded or cast kernels, channels-last
copies), kept from one call to the next while the parameters stay as they were.

A derived tensor is rebuilt when any parameter it comes from changes: another tensor
(its data pointer) or an in-place update (its ``_version``, which every in-place op and
optimizer step advances). Nothing is kept where the build must be recorded or traced:
where autograd records a gradient for one of the parameters, while compiling, and while a
CUDA graph is being captured (the graph must rebuild it from the parameters' memory on
each replay, or an optimizer step between replays would go unseen), nor from a parameter
made under inference_mode (an inference tensor has no version counter).
"""
import weakref
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch
from torch import Tensor

T = TypeVar("T")
_KEPT: dict[int, tuple[weakref.ref, dict]] = {}  # id(owner) -> (its weak reference, kind -> (stamp, value))


_PLAIN = (Tensor, torch.nn.Parameter)  # (types that are never a trace's: detect_fake_mode takes ~4 us)


def traced(t: Tensor) -> bool:
    """Whether a call with t is a trace's rather than one on memory: while Dynamo compiles, under
    a fake mode (what the call builds is fake, a real t too), or t a fake (or functional) tensor
    of AOT autograd's, export's or an Inductor pass's tracing: nothing to time, keep or capture."""
    return (torch.compiler.is_compiling()
            or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
            or (type(t) not in _PLAIN and torch._guards.detect_fake_mode(t) is not None))


def _keepable(tensors: tuple[Tensor | None, ...]) -> bool:
    owner = tensors[0]
    if traced(owner):
        return False
    if owner.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return not torch.is_grad_enabled() or not any([t is not None and t.requires_grad for t in tensors])


def derived(kind: Hashable, tensors: tuple[Tensor | None, ...], build: Callable[[], T],
            variant: Hashable = None) -> T:
    """build(), or what it returned before for `kind` while `tensors` (the first not None:
    the owner, which the kept value lives with) are the same tensors at the same versions and
    `variant` is the same (one value kept per kind: a new variant replaces the old one)."""
    if not _keepable(tensors):
        return build()
    owner = tensors[0]
    try:
        stamp = (torch.is_inference_mode_enabled(), variant,
                 tuple([None if t is None else (t.data_ptr(), t._version) for t in tensors]))
    except RuntimeError:  # an inference tensor (made under inference_mode) has no version to follow
        return build()
    entry = _KEPT.get(id(owner))
    if entry is None or entry[0]() is not owner:
        entry = (weakref.ref(owner, lambda _, key=id(owner): _KEPT.pop(key, None)), {})
        _KEPT[id(owner)] = entry
    kept = entry[1].get(kind)
    if kept is not None and kept[0] == stamp:
        return kept[1]
    value = build()
    values = value if isinstance(value, tuple) else (value,)
    if not any([v is owner or getattr(v, "_base", None) is owner for v in values]):
        entry[1][kind] = (stamp, value)  # (a value that is the owner, or a view of it, would keep it alive)
    return value


def clear() -> None:
    """Forgets every kept value (rebuilt on the next call)."""
    _KEPT.clear()
