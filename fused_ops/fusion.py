"""``fused_ops.fuse(model)``: the four architectures' chains found in any model and run by the
drop-in modules' formulations.

The model is traced by ``torch.fx.symbolic_trace``; each chain that starts at a convolution
and goes on, one op after another, through one of the four tails below is replaced by one call
of the matching ``fused_ops.nn`` module, built around the model's own convolution, pools, batch
norm and parameters (shared, not copied: the ``state_dict`` keeps its keys, optimizers keep
their parameters). Each replacement is a call of a submodule of the result (copied, pickled and
moved with it) that holds the fused module outside the module tree (its members are the model's)
and gives it the model's train / eval mode at each call. Everything else is left as it
was traced. A chain is taken only where each op's result feeds the next op alone; where one is
used elsewhere too, or the next op is not the chain's, the report says so.

A convolution may be a module or its functional call (``F.conv3d(x, w, b)``), and so may a
batch norm where the graph knows its input's shape (``F.batch_norm`` in the graphs
torch.compile captures): a functional one is rebuilt as a module on the meta device whose
tensors are bound to the call's (the model's parameters, set in it; or, in torch.compile's
graphs, where parameters and buffers are the graph's inputs, bound at each call by
``torch.func.functional_call``: ``fused_ops.compile_patterns`` runs this matching there).

The chains (module and functional spellings alike; d, s: Python numbers; b: a parameter):

- A: ``Conv3d`` → ``/ d`` (``torch.div``, ``.div``) → ``MaxPool3d`` / ``F.max_pool3d`` → a
  global average (``AdaptiveAvgPool3d(1)``, ``F.adaptive_avg_pool3d(·, 1)``,
  ``.mean((2, 3, 4), keepdim=True)``) → ``+ b`` (a parameter) → ``torch.sum(·, dim=k)``;
- B: ``ConvTranspose3d`` → max-pool → max-pool → ``.sum(1, keepdim=True)``;
- C: ``Conv2d`` → ``AvgPool2d`` / ``F.avg_pool2d`` → sigmoid → ``.sum((1, 2, 3))``;
- D: ``ConvTranspose3d`` → ``* s`` → ``BatchNorm3d`` → ``AdaptiveAvgPool3d(1)`` /
  ``F.adaptive_avg_pool3d(·, 1)``;

and, where no whole chain holds (another producer, a convolution whose result is used elsewhere
too), the tails alone, each replaced by its fused op: ``AvgPool2d → sigmoid → .sum((1, 2, 3))``
(``avg_pool2d_sigmoid_sum``); ``[/ d →] max-pool → global average`` (``max_pool3d_mean``);
``max-pool → max-pool → .sum(1, keepdim=True)`` (``max_pool3d_cascade_sum``); ``* s →
BatchNorm3d → AdaptiveAvgPool3d(1)`` (``batch_norm_gap``, the running statistics updated as the
module updates them). A tail's call runs the traced ops instead where the fused op does not take
the pools (dilation; ceil_mode for the cascade) or the input's rank (an unbatched input) or dtype.
"""
from __future__ import annotations

import copy
import dataclasses
import operator
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from . import _autocast, _trace
from . import nn as fnn
from .nn import _any_hooks, _fusable_max_pool, scaled_batch_norm_gap
from .ops import avg_pool2d_sigmoid_sum, max_pool3d_cascade_sum, max_pool3d_mean

_NO_MEMBER = object()  # a matched op that gives the fused module no member


@dataclasses.dataclass
class FuseReport:
    """What ``fuse`` did: `fused` lists each replaced chain or tail (its name: the architecture's
    letter, or "A-tail" etc.; the traced nodes' names, or the fused op's node where `exported`),
    `skipped` each that began to match and stopped (its name, the node where it began, why);
    `traced` is False where the model could not be traced (`reason`), `exported` True where
    torch.export traced it instead."""
    traced: bool = True
    reason: str = ""
    exported: bool = False  # (symbolic tracing failed and torch.export at example_inputs ran)
    fused: list[tuple[str, list[str]]] = dataclasses.field(default_factory=list)
    skipped: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        if not self.traced:
            return f"fused_ops.fuse: the model was not traced ({self.reason}); nothing fused"
        how = f" (torch.export: symbolic tracing failed: {self.reason})" if self.exported else ""
        lines = [f"fused_ops.fuse: {len(self.fused)} chain(s) fused{how}"]
        lines += [f"  fused {letter}: {' -> '.join(nodes)}" for letter, nodes in self.fused]
        lines += [f"  not fused {letter} at {node}: {why}" for letter, node, why in self.skipped]
        return "\n".join(lines)


class _FusedCall(nn.Module):
    """The call that replaces a chain or a tail: `module` (the chain's drop-in module, or a _TailModule)
    on its input x. Its other arguments: the tensors the graph gives at each call for `tensor_names`
    (bound into the module by torch.func.functional_call), then the model's attributes as they are now for
    the tensors the module holds itself (`captured_names`: a functional convolution's weight, A's added
    parameter) and for its members that are the model's modules (`member_names`: _check_members). A
    tensor that is no longer the one held (a parameter assigned anew, load_state_dict with assign=True,
    .to() that makes new parameters) is held from then on; under functional_call's own binding, a
    torch.func transform or a trace, it is bound for the call alone (hold). A submodule of the graph
    module, so that a copy, a pickle or a move takes it along; `module` is outside the module tree (its
    members are the model's own: registered twice, they would repeat in the state_dict). follow_mode:
    `module`'s own training flag follows this call's (the graph module's: its train() and eval() reach its
    submodules), its members keeping theirs (a frozen batch norm's); else (a functional batch norm) it
    keeps its own."""

    def __init__(self, module: nn.Module, follow_mode: bool, tensor_names: list[str],
                 captured: dict[str, torch.Tensor], members: list[str]):
        super().__init__()
        object.__setattr__(self, "module", module)  # (not a submodule)
        self.follow_mode, self.tensor_names = follow_mode, tensor_names
        self.captured_names, self.captured = list(captured), tuple(captured.values())  # (a tuple: not registered)
        self.member_names = list(members)  # (the members that are the model's modules, passed at each call)

    def extra_repr(self) -> str:
        module = self.module
        name = module.build.__name__.strip("_") if isinstance(module, _TailModule) else type(module).__name__
        bound = f", binding {', '.join(self.tensor_names)}" if self.tensor_names else ""
        held = f", holding {', '.join(self.captured_names)}" if self.captured_names else ""
        return f"{name}{bound}{held}"

    def forward(self, x, *given):
        if self.follow_mode:
            self.module.training = self.training
        count = len(self.tensor_names)
        bound = dict(zip(self.tensor_names, given[:count]))
        bound.update(self.refresh(given[count:]))
        if not bound:
            return self.module(x)
        return torch.func.functional_call(self.module, bound, (x,))

    def _check_members(self, present: tuple) -> None:
        """The model's modules that `module` holds as members, as the model has them now (`present`): one
        replaced is held from then on. A tail then runs its traced ops, which call it; a drop-in takes one of
        the same type (it checks what it computes from its members itself) or a batch norm converted to
        nn.SyncBatchNorm (which it synchronizes), and runs its original's forward, which calls each member,
        for any other (a pool made nn.Identity, say). (Both: _members_replaced.)"""
        for name, now in zip(self.member_names, present):
            held = getattr(self.module, name)
            if now is held:
                continue
            setattr(self.module, name, now)
            if isinstance(self.module, _TailModule):
                self.module._members_replaced = True
                self.module.rebuild()
            elif type(now) is not type(held) and not (isinstance(held, nn.BatchNorm3d)
                                                      and isinstance(now, nn.SyncBatchNorm)):
                self.module._members_replaced = True

    def refresh(self, present: tuple) -> dict:
        """The model's attributes that `module` holds, as they are now (`present`: the captured tensors',
        then the member modules'): see hold and _check_members; returns hold's."""
        count = len(self.captured_names)
        self._check_members(present[count:])
        return self.hold(present[:count])

    def hold(self, present: tuple) -> dict:
        """Holds the captured tensors' present values (`present`, in captured_names' order) where they
        changed; returns {name: tensor} of those to bind for this call alone (a tensor of another type than
        the one held: functional_call's plain tensor for a parameter; or under a transform or a trace)."""
        bound = {}
        for index, (name, now) in enumerate(zip(self.captured_names, present)):
            held = self.captured[index]
            if now is held:
                continue
            if type(now) is not type(held) or _trace.transformed() or _trace.traced(now):
                bound[name] = now
                continue
            owner, _, attribute = name.rpartition(".")
            setattr(self.module.get_submodule(owner), attribute, now)
            self.captured = (*self.captured[:index], now, *self.captured[index + 1:])
        return bound


@dataclasses.dataclass(frozen=True)
class _Bound:
    """A member rebuilt from a functional call (a module on the meta device, a meta parameter)
    and the nodes that give its tensors at each call: {its parameter's or buffer's name ("" for
    the member itself): node}."""
    member: Any
    tensors: dict[str, fx.Node]


# ---------------------------------------------------------------------------------------------
# One op of a chain: matchers. Each takes (node, the previous node, the traced model) and gives
# the fused module's member the op holds (_NO_MEMBER for none), or None where the node is not
# that op applied to the previous node's result.


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _static(value) -> bool:
    """Whether an argument holds no value the graph computes (a node, a symbolic number: a
    size torch.compile made dynamic): a constant the fused call may take as it is."""
    found = []
    fx.node.map_aggregate(value, lambda v: found.append(v)
                          if isinstance(v, (fx.Node, torch.SymInt, torch.SymFloat, torch.SymBool)) else None)
    return not found


def _arguments(node: fx.Node, names: tuple[str, ...], defaults: dict[str, Any],
               tensors: tuple[str, ...] = ()) -> dict[str, Any] | None:
    """The call's arguments after its input, by name (positional ones in `names`' order), with
    `defaults` for those not given; None where it passes one not in `names`, or one the graph
    computes other than the `tensors` it names."""
    given = dict(zip(names, node.args[1:]))
    if len(node.args) - 1 > len(names) or any(key in given or key not in names for key in node.kwargs):
        return None
    a = {**defaults, **given, **node.kwargs}
    return a if all(_static(value) for key, value in a.items() if key not in tensors) else None


def _is_call(node: fx.Node, functions: tuple = (), methods: tuple = ()) -> bool:
    return ((node.op == "call_function" and node.target in functions)
            or (node.op == "call_method" and node.target in methods))


def _module(node: fx.Node, model: fx.GraphModule, kind: type) -> nn.Module | None:
    if node.op != "call_module":
        return None
    module = model.get_submodule(node.target)
    return module if type(module) is kind else None


def _tensor_value(node, model: fx.GraphModule) -> torch.Tensor | None:
    """The tensor a node gives, where known before running the graph: a traced attribute's, or
    the example value torch.compile's graphs carry (a fake tensor)."""
    if not isinstance(node, fx.Node):
        return None
    value = _attribute(node, model) if node.op == "get_attr" else node.meta.get("example_value", node.meta.get("val"))
    return value if isinstance(value, torch.Tensor) else None


def _attribute(node: fx.Node, model: nn.Module):
    """What a get_attr node gives now (None where the model has no such attribute)."""
    value = model
    for atom in node.target.split("."):
        value = getattr(value, atom, None)
    return value


# a convolution module's functional spelling: (the function, its arguments after the input)
_FUNCTIONAL_CONVOLUTIONS = {
    nn.Conv2d: (F.conv2d, ("weight", "bias", "stride", "padding", "dilation", "groups")),
    nn.Conv3d: (F.conv3d, ("weight", "bias", "stride", "padding", "dilation", "groups")),
    nn.ConvTranspose3d: (F.conv_transpose3d, ("weight", "bias", "stride", "padding", "output_padding", "groups",
                                              "dilation")),
}


def _convolution(kind: type) -> Callable:
    """The convolution module of `kind`, or its functional spelling (torch.compile's graphs
    have no modules) rebuilt as one on the meta device, its weight and bias bound to the call's."""
    function, names = _FUNCTIONAL_CONVOLUTIONS[kind]

    def match(node, previous, model):
        module = _module(node, model, kind)
        if module is not None:
            return module if len(node.args) == 1 and not node.kwargs else None
        if not (node.op == "call_function" and node.target is function and node.args[:1] == (previous,)):
            return None
        a = _arguments(node, names, {"bias": None, "stride": 1, "padding": 0, "output_padding": 0, "dilation": 1,
                                     "groups": 1}, tensors=("weight", "bias"))
        weight = a and _tensor_value(a.get("weight"), model)
        if weight is None or (a["bias"] is not None and _tensor_value(a["bias"], model) is None):
            return None
        groups = a["groups"]
        channels = (weight.shape[0], weight.shape[1] * groups)  # (O, I); a transposed one's: (I, O)
        if kind is nn.ConvTranspose3d:
            channels, extra = channels[::-1], {"output_padding": a["output_padding"]}
        else:
            extra = {}
        try:
            module = kind(channels[1], channels[0], tuple(weight.shape[2:]), stride=a["stride"], padding=a["padding"],
                          dilation=a["dilation"], groups=groups, bias=a["bias"] is not None, device="meta", **extra)
        except (TypeError, ValueError):  # (arguments the module refuses: PyTorch's call would too)
            return None
        return _Bound(module, {"weight": a["weight"], **({"bias": a["bias"]} if a["bias"] is not None else {})})
    return match


def _number_operand(node: fx.Node, previous: fx.Node, functions: tuple, methods: tuple,
                    commutative: bool) -> float | None:
    """The number `previous`'s result is divided or multiplied by (the other operand)."""
    if not _is_call(node, functions, methods) or len(node.args) != 2 or node.kwargs:
        return None
    first, second = node.args
    if first is previous and _number(second):
        return second
    return first if commutative and second is previous and _number(first) else None


def _division(node, previous, model):
    """/ d by a non-zero number (the fused ops refuse a zero divisor, PyTorch's division gives inf)
    of a floating tensor where its dtype is known (an integer tensor's true division stays)."""
    divisor = _number_operand(node, previous, (operator.truediv, torch.div, torch.true_divide),
                              ("div", "true_divide", "__truediv__"), commutative=False)
    value = _tensor_value(previous, model)
    return divisor if divisor != 0 and (value is None or value.dtype.is_floating_point) else None


def _scale(node, previous, model):
    return _number_operand(node, previous, (operator.mul, torch.mul), ("mul", "__mul__"), commutative=True)


def _max_pool3d(node, previous, model):
    module = _module(node, model, nn.MaxPool3d)
    if module is not None:
        return module if node.args == (previous,) and not node.kwargs and not module.return_indices else None
    if not (node.op == "call_function" and node.args[:1] == (previous,)):
        return None
    if node.target is F.max_pool3d:
        a = _arguments(node, ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices"),
                       {"stride": None, "padding": 0, "dilation": 1, "ceil_mode": False, "return_indices": False})
    elif node.target is torch.max_pool3d:
        a = _arguments(node, ("kernel_size", "stride", "padding", "dilation", "ceil_mode"),
                       {"stride": (), "padding": 0, "dilation": 1, "ceil_mode": False})
    else:
        return None
    if a is None or a.get("return_indices") or "kernel_size" not in a:
        return None
    return nn.MaxPool3d(a["kernel_size"], a["stride"] or None, a["padding"], a["dilation"], ceil_mode=a["ceil_mode"])


def _avg_pool2d(node, previous, model):
    module = _module(node, model, nn.AvgPool2d)
    if module is not None:
        return module if node.args == (previous,) and not node.kwargs else None
    if not (node.op == "call_function" and node.target is F.avg_pool2d and node.args[:1] == (previous,)):
        return None
    a = _arguments(node, ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override"),
                   {"stride": None, "padding": 0, "ceil_mode": False, "count_include_pad": True,
                    "divisor_override": None})
    if a is None or "kernel_size" not in a:
        return None
    return nn.AvgPool2d(a["kernel_size"], a["stride"], a["padding"], a["ceil_mode"], a["count_include_pad"],
                        a["divisor_override"])


def _is_whole(size) -> bool:
    return size in (1, (1, 1, 1), [1, 1, 1])


def _adaptive_average(node, previous, model):
    """AdaptiveAvgPool3d to one element (the module or F.adaptive_avg_pool3d)."""
    return _global_average(node, previous, model, mean_too=False)


def _global_average(node, previous, model, mean_too=True):
    """AdaptiveAvgPool3d to one element, or (mean_too) a mean over the three spatial dims keeping
    them: the same values, and the same dtype under autocast after a max-pool (which autocast
    runs in float32 on the CPU), not after a batch norm (the pool runs in float32 there, the mean not)."""
    module = _module(node, model, nn.AdaptiveAvgPool3d)
    if module is not None:
        return module if node.args == (previous,) and not node.kwargs and _is_whole(module.output_size) else None
    if node.op == "call_function" and node.target is F.adaptive_avg_pool3d and node.args[:1] == (previous,):
        a = _arguments(node, ("output_size",), {})
        return nn.AdaptiveAvgPool3d((1, 1, 1)) if a is not None and _is_whole(a.get("output_size")) else None
    if mean_too and _is_call(node, (torch.mean,), ("mean",)) and node.args[:1] == (previous,):
        a = _arguments(node, ("dim", "keepdim", "dtype"), {"keepdim": False, "dtype": None})
        dims = a and a.get("dim")
        if (a is not None and a["keepdim"] is True and a["dtype"] is None and isinstance(dims, (tuple, list))
                and sorted(d % 5 for d in dims) == [2, 3, 4] and len(dims) == 3):
            return nn.AdaptiveAvgPool3d((1, 1, 1))
    return None


def _parameter_added(node, previous, model):
    """+ b: the model's parameter b, or (in torch.compile's graphs, where parameters are the
    graph's inputs) a floating tensor the graph gives, bound to a meta parameter of its shape."""
    if not _is_call(node, (operator.add, torch.add), ("add", "__add__")) or len(node.args) != 2 or node.kwargs:
        return None
    others = [arg for arg in node.args if arg is not previous]
    value = _tensor_value(others[0], model) if len(others) == 1 else None
    if value is None:
        return None
    if others[0].op == "get_attr":  # (the model's parameter, held by the fused module: _bind)
        return _Bound(value, {"": others[0]}) if isinstance(value, nn.Parameter) else None
    if not value.dtype.is_floating_point:
        return None
    return _Bound(nn.Parameter(torch.empty(value.shape, dtype=value.dtype, device="meta")), {"": others[0]})


def _sum_arguments(node: fx.Node, previous: fx.Node) -> dict | None:
    if not (_is_call(node, (torch.sum,), ("sum",)) and node.args[:1] == (previous,)):
        return None
    a = _arguments(node, ("dim", "keepdim", "dtype"), {"keepdim": False, "dtype": None})
    return a if a is not None and a["dtype"] is None and "dim" in a else None


def _sum_over_one_dim(node, previous, model):
    """torch.sum(·, dim=k) (A's sum_dim, an int, not keeping it)."""
    a = _sum_arguments(node, previous)
    dim = a and a["dim"]
    dim = dim[0] if isinstance(dim, (tuple, list)) and len(dim) == 1 else dim
    return dim if a is not None and not a["keepdim"] and isinstance(dim, int) else None


def _channel_sum_kept(node, previous, model):
    """.sum(1, keepdim=True) (B's; dim 1 as such: an unbatched input sums its depth there, as the
    drop-in module does)."""
    a = _sum_arguments(node, previous)
    return _NO_MEMBER if a is not None and a["keepdim"] is True and a["dim"] in (1, (1,), [1]) else None


def _sum_over_chw(node, previous, model):
    """.sum((1, 2, 3)) (C's; those dims as such: a 3-D input is refused there, as by the drop-in)."""
    a = _sum_arguments(node, previous)
    dims = a and a["dim"]
    whole = isinstance(dims, (tuple, list)) and sorted(dims) == [1, 2, 3]
    return _NO_MEMBER if a is not None and not a["keepdim"] and whole else None


def _sigmoid(node, previous, model):
    if _module(node, model, nn.Sigmoid) is not None or _is_call(node, (torch.sigmoid,), ("sigmoid",)):
        return _NO_MEMBER if node.args == (previous,) and not node.kwargs else None
    return None


def _batch_norm3d(node, previous, model):
    """nn.BatchNorm3d, or F.batch_norm of a 5-D input with a momentum (torch.compile's graphs:
    the module's call, its num_batches_tracked counted by the graph before it) rebuilt as one on
    the meta device without num_batches_tracked, its tensors bound to the call's."""
    module = _module(node, model, nn.BatchNorm3d)
    if module is not None:
        return module if node.args == (previous,) and not node.kwargs else None
    if not (node.op == "call_function" and node.target is F.batch_norm and node.args[:1] == (previous,)):
        return None
    names = ("running_mean", "running_var", "weight", "bias")
    a = _arguments(node, (*names, "training", "momentum", "eps"),
                   {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}, tensors=names)
    if a is None or not (_number(a["momentum"]) and _number(a["eps"]) and isinstance(a["training"], bool)):
        return None
    tensors = {name: a.get(name) for name in names}
    values = {name: _tensor_value(node, model) for name, node in tensors.items()}
    y = _tensor_value(previous, model)
    if (y is None or y.dim() != 5 or any(tensors[n] is not None and values[n] is None for n in tensors)
            or (tensors["weight"] is None) != (tensors["bias"] is None)
            or (tensors["running_mean"] is None) != (tensors["running_var"] is None)
            or (tensors["running_mean"] is None and not a["training"])):
        return None
    module = nn.BatchNorm3d(y.shape[1], eps=a["eps"], momentum=a["momentum"], affine=tensors["weight"] is not None,
                            track_running_stats=tensors["running_mean"] is not None, device="meta")
    module.num_batches_tracked = None  # (counted by the graph)
    module.train(a["training"])
    return _Bound(module, {name: node for name, node in tensors.items() if node is not None})


@dataclasses.dataclass(frozen=True)
class _Chain:
    letter: str
    module: type  # the fused_ops.nn module that computes it
    steps: tuple[tuple[str | None, Callable], ...]  # (the member an op gives, its matcher)


CHAINS = (
    _Chain("A", fnn.Conv3dDivMaxPoolGAPBiasSum,
           (("conv", _convolution(nn.Conv3d)), ("divisor", _division), ("max_pool", _max_pool3d),
            ("global_avg_pool", _global_average), ("bias", _parameter_added), ("sum_dim", _sum_over_one_dim))),
    _Chain("B", fnn.ConvTranspose3dMaxPoolMaxPoolSum,
           (("conv_transpose", _convolution(nn.ConvTranspose3d)), ("max_pool1", _max_pool3d),
            ("max_pool2", _max_pool3d), (None, _channel_sum_kept))),
    _Chain("C", fnn.Conv2dAvgPoolSigmoidSum,
           (("conv", _convolution(nn.Conv2d)), ("avg_pool", _avg_pool2d), (None, _sigmoid), (None, _sum_over_chw))),
    _Chain("D", fnn.ConvTranspose3dScaleBatchNormGAP,
           (("conv_transpose", _convolution(nn.ConvTranspose3d)), ("scale_factor", _scale),
            ("batch_norm", _batch_norm3d), ("global_avg_pool", _adaptive_average))),
)


# The tails alone (where no whole chain holds), each replaced by a call of its fused op: builders
# of that call, call(y, traced), from the members the ops give. Each runs the traced ops instead where
# told to (_TailModule: under a torch.func transform, which cannot transform the fused ops' C++ autograd,
# or where a member has hooks, which the traced ops' module calls run) or where the fused op does not take
# the pools or the input's rank or dtype, and returns the traced ops' dtype under autocast.


def _in_tail_dtype(out: torch.Tensor, y: torch.Tensor, ops: tuple[str, ...]) -> torch.Tensor:
    return out.to(_autocast.tail_dtype(y.dtype, y.device.type, ops))


def _average_sigmoid_sum(avg_pool):
    def call(y, traced):
        if traced or y.dim() != 4 or not y.is_floating_point():
            return torch.sum(torch.sigmoid(avg_pool(y)), dim=(1, 2, 3))
        out = avg_pool2d_sigmoid_sum(y, avg_pool.kernel_size, avg_pool.stride, avg_pool.padding, avg_pool.ceil_mode,
                                     avg_pool.count_include_pad, avg_pool.divisor_override)
        return _in_tail_dtype(out, y, ("aten::avg_pool2d", "aten::sigmoid", "aten::sum.dim_IntList"))
    return call


def _max_pool_mean(max_pool, global_avg_pool, divisor=None):
    def call(y, traced):
        if traced or y.dim() != 5 or not y.is_floating_point() or not _fusable_max_pool(max_pool, ceil_mode_ok=True):
            return global_avg_pool(max_pool(y if divisor is None else y / divisor))
        mean = max_pool3d_mean(y, max_pool.kernel_size, max_pool.stride, max_pool.padding, max_pool.ceil_mode,
                               1.0 if divisor is None else divisor)
        return _in_tail_dtype(mean, y, ("aten::max_pool3d", "aten::adaptive_avg_pool3d")).view(*mean.shape, 1, 1, 1)
    return call


def _max_pool_cascade_sum(max_pool1, max_pool2):
    def call(y, traced):
        if (traced or y.dim() != 5 or not y.is_floating_point()
                or not all(_fusable_max_pool(pool, ceil_mode_ok=False) for pool in (max_pool1, max_pool2))):
            return torch.sum(max_pool2(max_pool1(y)), dim=1, keepdim=True)
        out = max_pool3d_cascade_sum(y, max_pool1.kernel_size, max_pool2.kernel_size, stride1=max_pool1.stride,
                                     padding1=max_pool1.padding, stride2=max_pool2.stride, padding2=max_pool2.padding)
        return _in_tail_dtype(out, y, ("aten::max_pool3d", "aten::sum.dim_IntList"))
    return call


def _scale_batch_norm_mean(scale_factor, batch_norm, global_avg_pool):
    def call(y, traced):
        if traced or y.dim() != 5:  # (BatchNorm3d's own error)
            return global_avg_pool(batch_norm(y * scale_factor))
        out = scaled_batch_norm_gap(y, scale_factor, batch_norm)
        return _in_tail_dtype(out, y, ("aten::batch_norm", "aten::adaptive_avg_pool3d"))
    return call


@dataclasses.dataclass(frozen=True)
class _Tail:
    name: str
    build: Callable  # the call that replaces it, from the members its ops give
    steps: tuple[tuple[str | None, Callable], ...]


TAILS = (
    _Tail("A-tail", _max_pool_mean, (("divisor", _division), ("max_pool", _max_pool3d),
                                     ("global_avg_pool", _global_average))),
    _Tail("A-tail", _max_pool_mean, (("max_pool", _max_pool3d), ("global_avg_pool", _global_average))),
    _Tail("B-tail", _max_pool_cascade_sum, (("max_pool1", _max_pool3d), ("max_pool2", _max_pool3d),
                                            (None, _channel_sum_kept))),
    _Tail("C-tail", _average_sigmoid_sum, (("avg_pool", _avg_pool2d), (None, _sigmoid), (None, _sum_over_chw))),
    _Tail("D-tail", _scale_batch_norm_mean, (("scale_factor", _scale), ("batch_norm", _batch_norm3d),
                                             ("global_avg_pool", _adaptive_average))),
)


class _TailModule(nn.Module):
    """A tail's call (its _Tail's build over its members) as a module whose submodules are the
    members that are modules, so that a _FusedCall binds the graph's tensors into them. The call
    (a closure over the members) is rebuilt from the members wherever they are copied or unpickled."""

    def __init__(self, tail: "_Tail", members: dict):
        super().__init__()
        for name, member in members.items():
            setattr(self, name, member)
        self.build, self.member_names = tail.build, list(members)
        self._members_replaced = False  # (a member replaced after fuse: its traced ops from then on)
        self.rebuild()

    def __getstate__(self):
        return {name: value for name, value in super().__getstate__().items() if name != "call"}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.rebuild()

    def rebuild(self) -> None:
        self.call = self.build(**{name: getattr(self, name) for name in self.member_names})

    def forward(self, y):
        return self.call(y, self._members_replaced or _trace.transformed() or _any_hooks(self._modules.values()))


def _input(start: fx.Node) -> fx.Node | None:
    """The node a chain's or tail's first op applies to: its first argument that is a node (the
    second for ``s * y``)."""
    return next((arg for arg in start.args if isinstance(arg, fx.Node)), None)


def _match(chain, start: fx.Node, model: fx.GraphModule) -> tuple[list[fx.Node], dict] | tuple[int, str]:
    """The chain's (or tail's) nodes from `start` and the members they give, or how far it matched
    and why it stopped there. Its first op applies to _input(start)."""
    nodes, members = [], {}
    node, previous = start, _input(start)
    for index, (member, matches) in enumerate(chain.steps):
        if index > 0:
            users = list(previous.users)
            if len(users) != 1:
                return index, f"its result is used by {len(users)} nodes ({', '.join(u.name for u in users)})"
            node = users[0]
        value = matches(node, previous, model)
        if value is None:
            return index, f"{node.name} is not the chain's next op ({chain.steps[index][1].__name__.strip('_')})"
        if member is not None:
            members[member] = value
        nodes.append(node)
        previous = node
    return nodes, members


_IN_PLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                       operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
                       operator.irshift, operator.imatmul}

# calls whose result may share its first argument's memory (a write into one is a write into the other)
_VIEW_METHODS = {"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "expand", "expand_as", "squeeze",
                 "unsqueeze", "flatten", "unflatten", "narrow", "select", "t", "contiguous", "detach", "__getitem__",
                 "as_strided", "movedim", "swapaxes", "diagonal", "split", "chunk", "unbind", "type_as", "to"}
_VIEW_FUNCTIONS = {operator.getitem, torch.reshape, torch.transpose, torch.permute, torch.squeeze, torch.unsqueeze,
                   torch.flatten, torch.narrow, torch.select, torch.movedim, torch.swapaxes, torch.split, torch.chunk,
                   torch.unbind, torch.diagonal, torch.as_strided}


def _written(node: fx.Node) -> list[fx.Node]:
    """The nodes a call may write into (x.add_(...), x += ..., x[i] = v, F.relu(x, inplace=True),
    a mutable ATen op's mutated arguments); none for a call that writes nothing."""
    target = node.target
    if node.op == "call_method":
        in_place = ((target.endswith("_") and not target.startswith("__")) or target.startswith("__i")
                    or target == "__setitem__")
    elif node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
        return [arg for arg, spec in zip(node.args, target._schema.arguments)
                if isinstance(arg, fx.Node) and spec.alias_info is not None and spec.alias_info.is_write]
    elif node.op == "call_function":
        name = getattr(target, "__name__", "")
        in_place = (target in _IN_PLACE_OPERATORS or target is operator.setitem
                    or (name.endswith("_") and not name.endswith("__")))
    else:
        in_place = False
    in_place = in_place or node.kwargs.get("inplace") is True
    return [node.args[0]] if in_place and node.args and isinstance(node.args[0], fx.Node) else []


def _memory(node: fx.Node) -> fx.Node:
    """The node whose memory `node`'s result may share, through calls that may return a view."""
    while (node.op == "call_method" and node.target in _VIEW_METHODS
           or node.op == "call_function" and node.target in _VIEW_FUNCTIONS) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _read_memory(nodes: list[fx.Node]) -> set[fx.Node]:
    """The memory a match reads from outside it (its input, its parameters: _memory of each)."""
    own = set(nodes)
    return {_memory(arg) for n in nodes for arg in n.all_input_nodes if arg not in own}


def _writes_into(node: fx.Node, memory: set[fx.Node]) -> bool:
    """Whether `node` writes in place into any of `memory` (_read_memory's nodes)."""
    return any(_memory(w) in memory for w in _written(node))


def _effect_between(nodes: list[fx.Node]) -> fx.Node | None:
    """The first node between a match's first and last (in the graph's order, not its own) with
    an effect the fused call, placed at the last, would move past: an impure one (torch.compile's
    autocast and grad-mode switches, ...), or a write into memory the match reads (its input, its
    parameters, a view of them); None where there is none."""
    own, read = set(nodes), _read_memory(nodes)
    node = nodes[0].next
    while node is not nodes[-1]:
        if node not in own and (node.is_impure() or _writes_into(node, read)):
            return node
        node = node.next
    return None


def _write_into_read(nodes: list[fx.Node]) -> fx.Node | None:
    """A node of the graph, outside the match, that writes in place into memory the match reads;
    None where there is none."""
    own, read = set(nodes), _read_memory(nodes)
    return next((node for node in nodes[0].graph.nodes if node not in own and _writes_into(node, read)), None)


def _replace(traced: fx.GraphModule, nodes: list[fx.Node], call: _FusedCall, name: str, args: tuple) -> None:
    """The matched nodes replaced by call(*args), `call` traced's submodule `name` (made unique);
    get_attr nodes left unused by them removed."""
    graph, unique, count = traced.graph, name, 0
    while hasattr(traced, unique):
        count += 1
        unique = f"{name}_{count}"
    traced.add_submodule(unique, call)
    with graph.inserting_before(nodes[-1]):
        replacement = graph.call_module(unique, args)
    nodes[-1].replace_all_uses_with(replacement)
    attributes = [arg for node in nodes for arg in node.args if isinstance(arg, fx.Node) and arg.op == "get_attr"]
    for node in reversed(nodes):
        graph.erase_node(node)
    for attribute in attributes:
        if not attribute.users:
            graph.erase_node(attribute)


def _fuse_exported(model: nn.Module, example_inputs: tuple, result: FuseReport) -> nn.Module:
    """The fallback for a model symbolic tracing cannot trace: ``torch.export`` at example_inputs
    (non-strict), decomposed to core ATen, its module with the tails that
    ``fused_ops.export_patterns`` finds replaced by the fused ops (each op's save flag set at run
    time: the module trains); or `model` itself where export fails too (the report says why)."""
    from .export_patterns import apply_to_eager_graph  # (imports Inductor: only here)
    try:
        module = torch.export.export(model, tuple(example_inputs), strict=False).run_decompositions().module()
        fused = apply_to_eager_graph(module.graph)
    except Exception as error:  # (export raises many kinds on what it cannot export)
        result.traced = False
        result.reason += f"; torch.export: {type(error).__name__}: {error}"
        return model
    module.recompile()
    result.exported, result.fused = True, fused
    return module


def fuse(model: nn.Module, example_inputs=None, *, report: bool = False):
    """`model` traced, with each of the four architectures' chains replaced by a call of its
    ``fused_ops.nn`` module (sharing the model's parameters and buffers), and where no whole chain
    holds, each tail alone by its fused op: a ``torch.fx.GraphModule`` with the model's submodules,
    parameters and state_dict keys. With report=True, also a FuseReport of what was fused and
    what was not, and why.

    A model that symbolic tracing cannot trace (control flow on shapes, say): with
    `example_inputs` (a tuple of the forward's arguments), ``torch.export`` of it at those inputs,
    with C's chain and the tails of A, B and C replaced by the fused ops
    (``fused_ops.export_patterns``), parameters shared. Export specializes: the result takes
    inputs of those shapes only and runs in the mode the model was in (its ``train()`` and
    ``eval()`` raise). Without example_inputs, or where export fails too (data-dependent control
    flow), the model is returned as it is."""
    result = FuseReport()
    try:
        tracer = _Tracer()
        graph = tracer.trace(model)
        traced = fx.GraphModule(tracer.root, graph, type(model).__name__)
    except Exception as error:  # (fx raises TraceError, TypeError, ... on what it cannot trace)
        result.reason = f"{type(error).__name__}: {error}"
        if example_inputs is None:
            result.traced = False
        else:
            model = _fuse_exported(model, example_inputs, result)
        return (model, result) if report else model
    traced.training = model.training  # (the flag alone: train() would reset its members' own, a frozen batch norm's)
    fuse_graph(traced, result, follow_mode=True)
    traced.recompile()
    _give_fused_hooks(traced)
    return (traced, result) if report else traced


class _Tracer(fx.Tracer):
    """fx's symbolic tracer, a fused call kept as one call (a fuse result fused again: its calls stay)."""

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return isinstance(module, _FusedCall) or super().is_leaf_module(module, qualified_name)


def _give_fused_hooks(fused: fx.GraphModule) -> fx.GraphModule:
    """Gives a ``fuse`` result, through its own class (fx makes one for each graph module),
    torch.jit.script's hook (_scriptable), and a deep copy and a pickling (fx's, which make a module
    of a class of their own) that give them to the copy too."""
    cls = type(fused)
    cls.__prepare_scriptable__ = _scriptable
    cls.__reduce__ = _reduce_fused
    cls.__deepcopy__ = _deepcopy_fused
    return fused


def _reduce_fused(fused: fx.GraphModule):
    rebuild, args = fx.GraphModule.__reduce__(fused)
    return _rebuild_fused, (rebuild, args)


def _rebuild_fused(rebuild, args) -> fx.GraphModule:
    return _give_fused_hooks(rebuild(*args))


def _deepcopy_fused(fused: fx.GraphModule, memo: dict) -> fx.GraphModule:
    return _give_fused_hooks(fx.GraphModule.__deepcopy__(fused, memo))


def _scriptable(fused: fx.GraphModule) -> fx.GraphModule:
    """What torch.jit.script compiles for a ``fuse`` result: a copy of its graph module in which each
    fused call of a drop-in module is a call of that module as a submodule (script compiles modules,
    not Python callables; a drop-in scripts as its original's forward), in the result's mode; the
    model's own members shared. A call that binds the graph's tensors (a functional convolution or
    batch norm) stays, and script refuses it."""
    scriptable = fx.GraphModule(fused, copy.deepcopy(fused.graph))
    scriptable.training = fused.training  # (the flag alone: train() would reach the model's own members)
    for node in list(scriptable.graph.nodes):
        call = scriptable.get_submodule(node.target) if node.op == "call_module" else None
        if isinstance(call, _FusedCall) and not call.tensor_names:
            attributes, node.args = node.args[1:], node.args[:1]
            call.refresh(tuple([_attribute(attribute, fused) for attribute in attributes]))  # (as they are now)
            call.module.training = fused.training
            scriptable.add_submodule(node.target, call.module)
            for attribute in attributes:
                if not attribute.users:
                    scriptable.graph.erase_node(attribute)
    scriptable.recompile()
    return scriptable


def _bind(members: dict, model: fx.GraphModule) -> tuple[dict, dict, dict]:
    """The members with each _Bound one's member in its place; the tensors left to bind at each call
    ({the name under the fused module: node}); and those captured: a traced attribute set in the member
    itself where its slot takes it (a parameter for a parameter, a tensor for a buffer), or a
    parameter that is the member ({name: (its get_attr node, the tensor)}: _FusedCall checks at each
    call that the attribute still holds it)."""
    plain, tensors, captured = {}, {}, {}
    for name, value in members.items():
        if not isinstance(value, _Bound):
            plain[name] = value
            continue
        plain[name] = value.member
        for slot, node in value.tensors.items():
            tensor = _tensor_value(node, model) if node.op == "get_attr" else None
            key = f"{name}.{slot}" if slot else name
            if slot and tensor is not None and (isinstance(tensor, nn.Parameter) or slot in value.member._buffers):
                setattr(value.member, slot, tensor)
                captured[key] = (node, tensor)
            elif not slot and isinstance(tensor, nn.Parameter):
                plain[name] = tensor
                captured[key] = (node, tensor)
            else:
                tensors[key] = node
    return plain, tensors, captured


def fuse_graph(traced: fx.GraphModule, result: FuseReport, follow_mode: bool, inductor: bool = False) -> None:
    """The chains, then the tails, found in `traced`'s graph replaced in place (the report in
    `result`). follow_mode: the fused calls take `traced`'s train / eval mode at each call (a
    functional batch norm keeps its call's). inductor: the graph goes to Inductor (the compile
    patterns' pass), where a match whose memory the graph writes in place anywhere stays."""
    graph = traced.graph
    taken: set[fx.Node] = set()  # (the nodes of the chains fused so far: erased)
    for patterns, starts in ((CHAINS, ("call_module", "call_function")),
                             (TAILS, ("call_module", "call_function", "call_method"))):
        for start in list(graph.nodes):
            if start in taken or start.op not in starts:
                continue
            for pattern in patterns:
                found = _match(pattern, start, traced)
                name = pattern.letter if isinstance(pattern, _Chain) else pattern.name
                if isinstance(found[0], int):
                    if found[0] >= 2:  # (two of its ops at least: worth a word)
                        result.skipped.append((name, start.name, f"stopped after {found[0]} ops: {found[1]}"))
                    continue
                nodes, members = found
                effect = _effect_between(nodes)
                if effect is not None:
                    result.skipped.append((name, start.name, f"{effect.name} between its ops has an effect "
                                           "(a mode switch, a write into what it reads) the fused call would move past"))
                    continue
                written = _write_into_read(nodes) if inductor else None
                if written is not None:
                    # (torch 2.11's Inductor, given the rewrites' reads of an input written in place
                    # through a view, recomputed the write from the input it had already overwritten:
                    # x * 4 for x * 2. PyTorch's own ops alone do it too; 2.13's does not)
                    result.skipped.append((name, start.name, f"{written.name} writes in place into what it reads"))
                    continue
                value = _tensor_value(_input(start), traced)
                if value is not None and any(isinstance(size, torch.SymInt) for size in value.shape):
                    # (a graph compiled for dynamic shapes: the formulations are for static ones)
                    result.skipped.append((name, start.name, "its input's shape is dynamic"))
                    break
                # (a functional batch norm keeps its call's mode)
                own_mode = any(isinstance(m, _Bound) and isinstance(m.member, nn.BatchNorm3d)
                               for m in members.values())
                members, tensors, captured = _bind(members, traced)
                if isinstance(pattern, _Chain):
                    training = members["batch_norm"].training if own_mode else traced.training
                    module = pattern.module.from_module(types.SimpleNamespace(**members, training=training))
                else:
                    module = _TailModule(pattern, members)
                held = {member: node.target for (member, _), node in zip(pattern.steps, nodes)
                        if node.op == "call_module" and member is not None
                        and traced.get_submodule(node.target) is members.get(member)}  # (the model's modules)
                call = _FusedCall(module, follow_mode and not own_mode, list(tensors),
                                  {key: tensor for key, (_, tensor) in captured.items()}, list(held))
                with graph.inserting_before(nodes[0]):
                    held_nodes = [graph.get_attr(path) for path in held.values()]
                arguments = (_input(start), *tensors.values(), *[node for node, _ in captured.values()], *held_nodes)
                _replace(traced, nodes, call.train(traced.training),
                         f"fused_{name.replace('-', '_')}_{len(result.fused)}", arguments)
                taken.update(nodes)
                result.fused.append((name, [node.name for node in nodes]))
                break
    graph.lint()
