"""The fused tails as replacements in an ATen graph: ``fused_ops.fuse``'s fallback for a model
symbolic tracing cannot trace (``torch.export``, decomposed to core ATen, then these patterns).

Inductor's pattern matcher, over a graph after decomposition, replaces, where each intermediate
result feeds the next op alone:

- ``sum(sigmoid(avg_pool2d(y)), [1, 2, 3])`` by ``avg_pool2d_sigmoid_sum``; and where ``y`` is a
  2-D convolution that the pool folds into (stride 1, no dilation or groups, a pool without
  padding whose windows are the folded convolution's), the convolution too: ``box_fold2d`` of its
  weight, then ``conv2d_sigmoid_sum`` at the pool's stride (architecture C's chain: on a GPU one
  tensor-core kernel, the convolution's output never in memory);
- a global average (``mean`` over the three spatial dims, kept) of a 3-D max-pool of ``y`` or of
  ``y / d`` by ``max_pool3d_mean`` (architecture A's tail);
- ``sum(max_pool3d(max_pool3d(y)), 1, keepdim=True)`` by ``max_pool3d_cascade_sum`` (B's tail).

Results equal the replaced ops' up to the fused kernels' rounding (the fused ops' contract).
Each inserted op's save flag is set at run time to whether autograd records it: the graph trains.
(``torch.compile`` fuses at the torch level instead, before autograd: ``fused_ops.compile_patterns``.)
"""
from __future__ import annotations

import operator
import types

import torch
from torch._inductor import pattern_matcher as pm
from torch.fx.operator_schemas import normalize_function

from . import rewrites
from .nn import _fusable_max_pool
from .ops._common import _expand, _pair, _pool_triples

aten, prims = torch.ops.aten, torch.ops.prims

_PATTERNS = pm.PatternMatcherPass(pass_name="fused_ops_export_patterns")

# the max-pools as Inductor's decomposition leaves them (its low-memory form in recent versions)
_MAX_POOLS = [aten.max_pool3d_with_indices.default]
if hasattr(prims, "_low_memory_max_pool_with_offsets"):
    _MAX_POOLS.append(prims._low_memory_max_pool_with_offsets.default)


def _schema_kwargs(node: torch.fx.Node) -> dict:
    """An aten call's arguments by their schema's names, defaults filled in."""
    normalized = normalize_function(node.target, tuple(node.args), dict(node.kwargs), normalize_to_only_use_kwargs=True)
    return dict(normalized.kwargs)


def _value(node) -> torch.Tensor:
    return node.meta["val"]


def _max_pool(node: torch.fx.Node) -> types.SimpleNamespace:
    """A 3-D max-pool node's settings (nn.MaxPool3d's names, three ints each), from either form's
    arguments (input, kernel, stride, padding, dilation, ceil_mode; an empty stride: the kernel)."""
    args = list(node.args[1:]) + [None] * 5
    kernel, stride, padding, dilation, ceil_mode = args[:5]
    kernel, stride, padding = _pool_triples(kernel, stride or None, padding or 0)
    return types.SimpleNamespace(kernel_size=kernel, stride=stride, padding=padding,
                                 dilation=_expand(dilation or 1, 3, "dilation"), ceil_mode=bool(ceil_mode),
                                 return_indices=False)


def _dims(dims, rank: int) -> list[int]:
    return sorted(d % rank for d in dims)


# --- C: sum(sigmoid(avg_pool2d(y)), [1, 2, 3]), and the convolution before it -----------------


def _average_sigmoid_sum_check(match: pm.Match) -> bool:
    out = match.output_node()
    keepdim = out.args[2] if len(out.args) > 2 else False
    return not keepdim and not out.kwargs and _dims(out.args[1], 4) == [1, 2, 3] and _value(out.args[0]).dim() == 4


def _replace_average_sigmoid_sum(match: pm.Match, *args, **kwargs) -> None:
    sigmoid = match.output_node().args[0]
    pool_node = sigmoid.args[0]
    p = _schema_kwargs(pool_node)
    kernel = _pair(p["kernel_size"], "kernel_size")
    pool = types.SimpleNamespace(kernel_size=kernel, stride=_pair(p["stride"] or kernel, "stride"),
                                 padding=_pair(p["padding"], "padding"), ceil_mode=p["ceil_mode"],
                                 count_include_pad=p["count_include_pad"], divisor_override=p["divisor_override"])
    y = p["input"]
    fold = y.target is aten.convolution.default and len(y.users) == 1 and _folded_convolution(y, pool)
    if fold:
        x, weight, bias = y.args[:3]

        def replacement(x, weight, bias):
            folded = torch.ops.fused_ops.box_fold2d(weight, list(fold.box), float(fold.divisor), None)
            return torch.ops.fused_ops.conv2d_sigmoid_sum(x, folded, rewrites._pool_folded_bias(bias, fold),
                                                          list(fold.stride), list(fold.padding), False, None)[0]
        match.replace_by_example(replacement, [x, weight, bias])
        return

    def replacement(y):
        return torch.ops.fused_ops.avg_pool2d_sigmoid_sum(
            y, pool.kernel_size, pool.stride, pool.padding, pool.ceil_mode, pool.count_include_pad,
            pool.divisor_override, False, None)[0]
    match.replace_by_example(replacement, [y])


def _folded_convolution(node: torch.fx.Node, pool) -> rewrites._PoolFold | None:
    """The fold (rewrites._pool_fold) of a 2-D convolution node and the pool after it, or None."""
    x, weight, bias, stride, padding, dilation, transposed, output_padding, groups = node.args
    w = _value(weight)
    if transposed or w.dim() != 4 or any(output_padding) or (bias is not None and _value(bias).dtype != w.dtype):
        return None
    conv = types.SimpleNamespace(groups=groups, padding_mode="zeros", padding=tuple(padding), dilation=tuple(dilation),
                                 stride=tuple(stride), kernel_size=tuple(w.shape[2:]), in_channels=w.shape[1] * groups,
                                 weight=w)
    xv = _value(x)
    if xv.dtype != w.dtype:
        return None
    return rewrites._pool_fold(xv, conv, pool)


for _keepdim in ((), (False,)):
    pm.register_graph_pattern(
        pm.CallFunction(aten.sum.dim_IntList,
                        pm.CallFunction(aten.sigmoid.default, pm.CallFunctionVarArgs(aten.avg_pool2d.default)),
                        pm.KeywordArg("dims"), *_keepdim),
        extra_check=_average_sigmoid_sum_check, pass_dict=_PATTERNS)(_replace_average_sigmoid_sum)


# --- A's tail: the global average of a max-pool of y (or y / d) --------------------------------


def _max_pool_mean_check(match: pm.Match) -> bool:
    mean = match.output_node()
    keepdim = mean.args[2] if len(mean.args) > 2 else False
    pool_node = mean.args[0].args[0]
    return (keepdim is True and _value(mean).dim() == 5 and _dims(mean.args[1], 5) == [2, 3, 4]
            and not mean.kwargs and _fusable_max_pool(_max_pool(pool_node), ceil_mode_ok=True))


def _replace_max_pool_mean(match: pm.Match, *args, **kwargs) -> None:
    pool_node = match.output_node().args[0].args[0]
    pool = _max_pool(pool_node)
    y, divisor = pool_node.args[0], 1.0
    number = y.args[1] if y.target is aten.div.Tensor and len(y.args) == 2 else None
    if (len(y.users) == 1 and isinstance(number, (int, float)) and not isinstance(number, bool) and number != 0
            and _value(y.args[0]).dtype == _value(y).dtype):  # (not an integer tensor's true division)
        y, divisor = y.args[0], float(number)

    def replacement(y):
        mean = torch.ops.fused_ops.max_pool3d_mean(y, pool.kernel_size, pool.stride, pool.padding, pool.ceil_mode,
                                                   divisor, False, None)[0]
        return mean.view(*mean.shape, 1, 1, 1)
    match.replace_by_example(replacement, [y])


pm.register_graph_pattern(
    pm.CallFunction(aten.mean.dim, pm.CallFunction(operator.getitem, pm.CallFunctionVarArgs(_MAX_POOLS), 0),
                    pm.KeywordArg("dims"), True),
    extra_check=_max_pool_mean_check, pass_dict=_PATTERNS)(_replace_max_pool_mean)


# --- B's tail: sum(max_pool3d(max_pool3d(y)), 1, keepdim=True) ---------------------------------


def _first_pool(second: torch.fx.Node) -> torch.fx.Node | None:
    """The max-pool whose values alone the max-pool `second` pools (the pattern holds the
    second's; the first's forms and argument counts vary), or None."""
    values = second.args[0]
    if not (values.op == "call_function" and values.target is operator.getitem and values.args[1] == 0
            and len(values.users) == 1):
        return None
    first = values.args[0]
    return first if first.op == "call_function" and first.target in _MAX_POOLS and len(first.users) == 1 else None


def _cascade_check(match: pm.Match) -> bool:
    out = match.output_node()
    second = out.args[0].args[0]
    first = _first_pool(second)
    return (first is not None and _value(out).dim() == 5 and _dims(out.args[1], 5) == [1] and not out.kwargs
            and all(_fusable_max_pool(_max_pool(node), ceil_mode_ok=False) for node in (first, second)))


def _replace_cascade(match: pm.Match, *args, **kwargs) -> None:
    second = match.output_node().args[0].args[0]
    first = _first_pool(second)
    pool1, pool2 = _max_pool(first), _max_pool(second)

    def replacement(y):
        return torch.ops.fused_ops.max_pool3d_cascade_sum(
            y, pool1.kernel_size, pool1.stride, pool1.padding, pool2.kernel_size, pool2.stride, pool2.padding,
            False, None)[0]
    match.replace_by_example(replacement, [first.args[0]])


pm.register_graph_pattern(
    pm.CallFunction(aten.sum.dim_IntList,
                    pm.CallFunction(operator.getitem, pm.CallFunctionVarArgs(_MAX_POOLS), 0),
                    pm.KeywordArg("dims"), True),
    extra_check=_cascade_check, pass_dict=_PATTERNS)(_replace_cascade)


# The fused ops a replacement inserts, and the name fuse's report gives each.
_FUSED = {"conv2d_sigmoid_sum": "C", "avg_pool2d_sigmoid_sum": "C-tail", "max_pool3d_mean": "A-tail",
          "max_pool3d_cascade_sum": "B-tail"}


class _SavingWhereAutogradRecords:
    """A fused op's call in an eager graph (fuse's torch.export path): its save flag (the
    argument named save_*) set at each call to whether autograd records it, as the op's Python
    wrapper sets it; the replacements insert the op with the flag off (what an inference graph
    wants)."""

    def __init__(self, op):
        self.op = op
        self.flag = next(i for i, a in enumerate(op._schema.arguments) if a.name.startswith("save_"))
        self.__name__ = self.__qualname__ = f"{op._schema.name.split('::')[1]}_saving_where_autograd_records"

    def __call__(self, *args):
        args = list(args)
        args[self.flag] = torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        return self.op(*args)


def apply_to_eager_graph(graph: torch.fx.Graph) -> list[tuple[str, list[str]]]:
    """The patterns over a graph that runs eagerly, autograd included (an exported program's
    module): each inserted fused op's save flag set at run time, the replaced ops removed. The
    replacements: (the report's name, [the fused op's node]) each."""
    before = set(graph.nodes)
    _PATTERNS.apply(graph)
    graph.eliminate_dead_code()
    fused = []
    for node in graph.nodes:
        if node in before or node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        name = node.target._schema.name.split("::")
        if name[0] == "fused_ops" and name[1] in _FUSED:
            node.target = _SavingWhereAutogradRecords(node.target)
            fused.append((_FUSED[name[1]], [node.name]))
    graph.lint()
    return fused
