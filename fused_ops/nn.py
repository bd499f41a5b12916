"""Drop-in replacements for the architectures of ``fused_ops.reference``.

Each has the original's constructor, parameters, buffers and state_dict keys
(built under the same seed it draws the same initial parameters), and
``from_module(original)`` wraps an existing instance, sharing its parameters.

Where a module is deployed rather than run (``torch.jit.script``, ``torch.jit.trace``, either
ONNX exporter: ``_deploying``), it runs its original's forward, standard ops that every
TorchScript and ONNX runtime has; torch.compile and torch.export keep the fused ops.
"""
import math
import types

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.module import (_global_backward_hooks, _global_backward_pre_hooks, _global_forward_hooks,
                                     _global_forward_pre_hooks)

from . import _autocast, _graphed, autotune, reference, rewrites
from ._members import REGISTRY_CLASSES, member
from ._trace import traced
from .ops import (avg_pool2d_sigmoid_sum, batch_norm_gap, conv_transpose3d_batch_norm_eval_mean,
                  max_pool3d_cascade_sum, max_pool3d_mean, parity_max_pool3d_mean)
from .ops._common import _records
from .sync_batch_norm import sync_batch_norm_gap, sync_process_group


def _deploying() -> bool:
    """Whether a call is traced for deployment: by ``torch.jit.trace`` (and so the TorchScript ONNX
    exporter) or by the torch.export of the ONNX exporter (``torch.onnx.export``'s default). Then a
    drop-in runs its original's forward (``torch.jit.script`` compiles only that branch): a graph of
    standard ops, the original's, whose traced shapes follow the input's (nothing of the autotuner's
    keys or the fused ops' size arguments baked in). Cheap in eager calls: the ONNX query only
    under torch.export."""
    return torch.jit.is_tracing() or (torch.compiler.is_exporting() and torch.onnx.is_in_onnx_export())


def _as_original_forward(forward):
    """An original's forward as a drop-in's `_original_forward` method (``_deploying``): a copy under
    that name, since torch.jit.script compiles a method that forward calls under its function's name."""
    return types.FunctionType(forward.__code__, forward.__globals__, "_original_forward", forward.__defaults__,
                              forward.__closure__)


def _adopt(cls, original: nn.Module, **members: type | tuple[type, ...]) -> nn.Module:
    """A `cls` instance that shares `original`'s members (no copies): its
    submodules, parameters and plain attributes, each named with the type it
    must have."""
    for name, kind in members.items():
        if not isinstance(getattr(original, name, None), kind):
            kinds = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise TypeError(
                f"{cls.__name__}.from_module: expected a module with a {kinds} "
                f"attribute '{name}', got {type(original).__name__}"
            )
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    for name in members:
        setattr(module, name, getattr(original, name))
    module.training = original.training  # (its own flag: each member keeps its own, a frozen batch norm's)
    return module


def _check_input(name: str, x: Tensor, in_channels: int, unbatched_ok: bool) -> None:
    """A 5-D (batch, channels, depth, height, width) floating-point input of `in_channels`
    channels, or, where the original takes it (unbatched_ok), a 4-D one without the batch."""
    if x.dim() != 5 and not (unbatched_ok and x.dim() == 4):
        expected = "a 4-D (unbatched) or 5-D (batched) input" if unbatched_ok else "a 5-D input"
        raise ValueError(
            f"{name}: expected {expected} (batch, channels, depth, height, width), "
            f"got {x.dim()}-D input of shape {tuple(x.shape)}"
        )
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name}: input must be a floating-point tensor, got {x.dtype}")
    if x.shape[-4] != in_channels:
        raise ValueError(f"{name}: expected {in_channels} input channels, got input of shape {tuple(x.shape)}")


def _fusable_max_pool(pool: nn.MaxPool3d, ceil_mode_ok: bool) -> bool:
    """Whether the fused max-pool kernels compute `pool` (else the original's ops do)."""
    return pool.dilation in (1, (1, 1, 1), [1, 1, 1]) and (ceil_mode_ok or not pool.ceil_mode)


def _check_pool_returns_values(name: str, pool: nn.MaxPool3d) -> None:
    if pool.return_indices:
        raise ValueError(f"{name}: a max-pool that returns indices gives the next op a tuple, got {pool}")


def _conv_config(conv: nn.Module) -> tuple:
    return (type(conv), conv.weight.shape, conv.weight.dtype, conv.bias is None, conv.stride, conv.padding,
            conv.dilation, conv.groups, conv.padding_mode, getattr(conv, "output_padding", None))


def _pool_config(pool: nn.Module) -> tuple:
    return (type(pool), pool.kernel_size, pool.stride, pool.padding, getattr(pool, "dilation", None), pool.ceil_mode,
            getattr(pool, "count_include_pad", None), getattr(pool, "divisor_override", None))


def _conv_channels_last(conv: nn.Module, x: Tensor) -> Tensor | None:
    """conv(x) with its input and weight channels last (the input converted and cast to the
    convolution's dtype in one copy, the weight likewise on each call), and so its output: the
    tuned original's layout. On a GPU None where that copy of x would be more memory than the
    original takes (x not channels last, and no autocast, whose cast of x the copy replaces): a
    call's peak stays at most the original's. (On a CPU oneDNN reorders a contiguous input itself:
    with the copy the four models' peak RSS stayed at or under the original's, 2-core CPU.)"""
    fmt = torch.channels_last_3d if x.dim() == 5 else torch.channels_last
    if x.is_cuda and _autocast.cast_dtype(x) is None and not x.is_contiguous(memory_format=fmt):
        return None
    weight, dtype = conv.weight, rewrites.kernel_dtype(x, conv.weight)
    x = x.to(dtype=_autocast.conv_dtype(x), memory_format=fmt)
    if not weight.is_contiguous(memory_format=fmt) or weight.dtype != dtype:
        weight = weight.to(dtype=dtype, memory_format=fmt)
    return _conv(conv, x, weight)


def _has_hooks(module: nn.Module) -> bool:
    """Whether calling `module` runs hooks, forward or backward, its own or global ones (pruning and
    weight_norm set the weight in a pre-hook, observers and feature extractors read the output, a
    backward hook reads its gradients): the formulations that compute its part themselves then do
    not hold."""
    return _global_hooks() or _own_hooks(module)


def _global_hooks() -> bool:
    return bool(_global_forward_hooks or _global_forward_pre_hooks or _global_backward_hooks
                or _global_backward_pre_hooks)


def _own_hooks(module: nn.Module) -> bool:
    return bool(module._forward_pre_hooks or module._forward_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def _any_hooks(modules, but: nn.Module | None = None) -> bool:
    """Whether calling any of `modules` (but `but`) runs hooks (_has_hooks)."""
    return _global_hooks() or any([_own_hooks(module) for module in modules if module is not but])


def _conv(conv: nn.Module, x: Tensor, weight: Tensor | None = None) -> Tensor:
    """conv(x) (with `weight` for conv.weight where given), the functional op called directly
    (a module call's host time counts where a whole call is host-bound), or the module itself
    where it has hooks."""
    if weight is None and _has_hooks(conv):
        return conv(x)
    weight = member(conv, "weight") if weight is None else weight
    bias = member(conv, "bias")
    if isinstance(conv, nn.ConvTranspose3d):
        return F.conv_transpose3d(x, weight, bias, conv.stride, conv.padding, conv.output_padding, conv.groups,
                                  conv.dilation)
    return conv._conv_forward(x, weight, bias)


def _as_original(out: Tensor, x: Tensor, ops: tuple[str, ...]) -> Tensor:
    """A fused op's result in the dtype the original's tail `ops` return for x: the same as
    the fused op's but under autocast (``fused_ops._autocast``)."""
    if _autocast.cast_dtype(x) is None:
        return out
    return out.to(_autocast.tail_dtype(_autocast.conv_dtype(x), x.device.type, ops))


def _max_pool3d(pool: nn.MaxPool3d, y: Tensor) -> Tensor:
    return F.max_pool3d(y, pool.kernel_size, pool.stride, pool.padding, pool.dilation, pool.ceil_mode)


def scaled_batch_norm_gap(y: Tensor, scale, bn: nn.BatchNorm3d) -> Tensor:
    """``F.adaptive_avg_pool3d(bn(y * scale), 1)`` by ``batch_norm_gap`` under nn.BatchNorm3d's
    rules: the running statistics normalized with in eval mode and updated in training mode with
    track_running_stats (in place, as the module updates them)."""
    running = not bn.training or bn.track_running_stats
    return batch_norm_gap(y, scale, bn.weight, bn.bias,
                          bn.running_mean if running else None, bn.running_var if running else None,
                          bn.num_batches_tracked if bn.training and bn.track_running_stats else None,
                          training=bn.training, momentum=bn.momentum, eps=bn.eps)


class _Formulations:
    """The formulations of a module's function and the choice among them
    (``fused_ops.autotune``). A subclass gives `_config()` (what its choice depends on besides
    the call), `_run(name, x)` (the formulation's result, or None where it does not hold) and,
    where they differ from the defaults, `_CONV` and `_order(x)` (the formulations to consider,
    the rule's first: the last always holds)."""

    _CONV = "conv"  # the name of the module's convolution
    FORMULATIONS: tuple[str, ...] = autotune.FORMULATIONS  # every formulation the module has

    def _order(self, x: Tensor) -> tuple[str, ...]:
        return _order(x)

    def _dispatch(self, x: Tensor):
        # (nothing to compute, or an input the convolution refuses, on another device than its weight or of
        # another dtype outside autocast, which the formulations' casts would take: the original's ops give its
        # empty result, or its error)
        conv = member(self, self._CONV)
        weight, bias = member(conv, "weight"), member(conv, "bias")
        if x.numel() == 0 or x.device != weight.device or (
                (x.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype))
                and _autocast.cast_dtype(x) is None):
            return self._original_forward(x)
        return autotune.choose(self, self._config, self._formulations, self._call, x, self._graph_stamp)[1]

    # Set by fused_ops.fusion where a member was replaced, after fuse(), by a module of another type.
    _members_replaced = False

    def _runs_original(self) -> bool:
        """Whether the original's forward runs, calling each member as the original does: a member other
        than the convolution runs hooks when called (_has_hooks: a pool's forward hook that records or
        changes its output, say), which the fused tails would skip, or a member is of another type than
        the formulations compute (_members_replaced). (The convolution's hooks keep the fused tails: its
        formulations then call it as a module.)"""
        return self._members_replaced or _any_hooks(self._modules.values(), but=self._modules[self._CONV])

    def _formulations(self, x: Tensor) -> tuple[str, ...]:
        order = self._order(x)
        if _has_hooks(getattr(self, self._CONV)):
            order = tuple([name for name in order if name in autotune.OWN_CONVOLUTION])
        return order

    def _call(self, name: str, x: Tensor) -> Tensor | None:
        if name not in autotune.OWN_CONVOLUTION and _has_hooks(member(self, self._CONV)):
            return None  # (hooks registered since the choice was made)
        return self._run(name, x)

    def _graph_stamp(self) -> tuple | None:
        """What a CUDA graph of the module's call depends on besides the call's signature
        (``fused_ops._graphed``): its configuration and where its parameters and buffers live;
        None while its convolution has hooks (Python run on each call)."""
        if _has_hooks(getattr(self, self._CONV)):
            return None
        return self._config(), _graphed.tensor_pointers(self)

    def _graph_budget(self, x: Tensor) -> int:
        """The most device memory the module's CUDA graphs may hold together once a call with x captures
        one (fused_ops._graphed): the bytes of the convolution's output, which the original's ops hold
        whole in any call (eval or training): a lower bound of the original's peak, so that no capture
        takes its call beyond it. (At a batch of one A's and B's graphs hold 22-36 MiB, their outputs 0.8
        and 31.5 MB.)"""
        return rewrites.conv_output_bytes(getattr(self, self._CONV), x)

    def formulation(self, x: Tensor) -> str | None:
        """The formulation tuned for a call with x now (the same mode, gradient recording and
        autocast state), or None where none was tuned (no call yet, the autotuner off, a
        compiled call, a rule or a forced one)."""
        x = self._dispatched_input(x)
        return None if x is None else autotune.kept_choice(autotune.call_key(self, self._config(), x))

    def graphed(self, x: Tensor) -> bool:
        """Whether calls like this one with x now (the same mode, gradient recording and
        autocast state) replay the tuned formulation from a CUDA graph (``fused_ops._graphed``):
        the tuner settled on one for them and it was captured (the signature's HOT_CALLS-th call)
        and kept (within _graph_budget)."""
        x = self._dispatched_input(x)
        return (x is not None and autotune.kept_graphed(autotune.call_key(self, self._config(), x))
                and autotune.graph_captured(self, x))

    def tuned_timings(self, x: Tensor) -> dict[str, tuple[float, float]]:
        """The formulations timed for calls with x now (as ``formulation``): {name: (median forward ms on
        the device, median host ms to queue it)}; empty where none was timed."""
        x = self._dispatched_input(x)
        return {} if x is None else autotune.kept_timings(autotune.call_key(self, self._config(), x))

    def _dispatched_input(self, x: Tensor) -> Tensor | None:
        return x


# The formulations in the rules' order on a GPU (rewrites first) and on a CPU (the rewrites
# last but the originals: torch.compile cannot lower them there).
_ORDER = {"cuda": autotune.FORMULATIONS,
          "cpu": ("fused", "fused_channels_last", "rewrite", "original")}


def _order(x: Tensor, rewrite_first: bool = False) -> tuple[str, ...]:
    """The formulations for x in the rule's order; with rewrite_first the rewrite leads on any
    device (one that torch.compile lowers on the CPU too)."""
    if not x.is_cuda and _autocast.conv_dtype(x) in (torch.float16, torch.bfloat16):
        # 16-bit convolutions on a CPU (autocast's, or a 16-bit module's) round differently in each layout and
        # formulation, the rearranged and channels-last ones beyond twice the original's error (tests): a
        # pool's picks then move to other elements (A's bf16 weight gradient 60x the original's error)
        order = ("fused", "original")
    else:
        order = _ORDER["cuda" if x.is_cuda else "cpu"]
    return ("rewrite", *[name for name in order if name != "rewrite"]) if rewrite_first else order


# Below this many input elements a call on a GPU is launch-bound (microseconds of work): B's and C's
# rules lead with "fused" (the convolution and one tail kernel) before their rearranged formulations'
# extra launches, set-up and workspaces (H200, tiny sizes, float32 with TF32 off: B's rewrite 0.61 ms
# and 4.4 MiB against fused's 0.14 ms and 0.09 MiB, the original's 0.13 and 0.10; C's fused_conv 0.20 ms
# against fused's 0.12). SPEC's inputs hold 2^20 and more elements at batch 1.
_LAUNCH_BOUND_ELEMENTS = 1 << 15


def _lead_with(name: str, order: tuple[str, ...]) -> tuple[str, ...]:
    return (name, *[other for other in order if other != name]) if name in order else order


def _fused_first_where_launch_bound(order: tuple[str, ...], x: Tensor) -> tuple[str, ...]:
    return _lead_with("fused", order) if x.is_cuda and x.numel() < _LAUNCH_BOUND_ELEMENTS else order


def _channels_last_first_on_cpu(order: tuple[str, ...], x: Tensor) -> tuple[str, ...]:
    """On a CPU in float32 oneDNN's 3-D convolutions run faster from a channels-last input, its copy
    included, than from a contiguous one (which oneDNN reorders itself): A's and B's rules lead with
    fused_channels_last there (2-core CPU, reduced sizes, ms fused / channels last: A eval 20.2 / 9.1,
    training 33.0 / 25.7; B eval 35.4 / 27.3, training 114.7 / 71.9; C's 2-D one ran 9x slower)."""
    if x.is_cuda or x.dtype != torch.float32 or _autocast.cast_dtype(x) is not None:
        return order
    return _lead_with("fused_channels_last", order)


class Conv2dAvgPoolSigmoidSum(_Formulations, nn.Module):
    """conv2d -> avg_pool2d -> sigmoid -> sum over (C, H, W). Formulations
    (``fused_ops.autotune``): ``rewrite`` where the pool's windows do not pad
    (``fused_ops.rewrites.conv2d_avg_pool``): the pool folded into the convolution, which
    runs over space-to-depth input, then the sigmoid and the sum; ``fused_conv`` where the pool
    folds so: the folded convolution, sigmoid and sum in one op
    (``fused_ops.conv2d_sigmoid_sum``: on a GPU one tensor-core kernel); ``fused``: the
    convolution, then the tail fused into one kernel (``fused_ops.avg_pool2d_sigmoid_sum``);
    ``original``; and ``fused`` with the convolution channels last."""

    FORMULATIONS = ("fused_conv", *autotune.FORMULATIONS)

    def __init__(self, in_channels, out_channels, kernel_size, pool_kernel_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.avg_pool = nn.AvgPool2d(pool_kernel_size)

    @classmethod
    def from_module(cls, original: nn.Module) -> "Conv2dAvgPoolSigmoidSum":
        return _adopt(cls, original, conv=nn.Conv2d, avg_pool=nn.AvgPool2d)

    _original_forward = _as_original_forward(reference.Conv2dAvgPoolSigmoidSum.forward)

    def forward(self, x: Tensor) -> Tensor:
        if torch.jit.is_scripting():  # (its own if: the compiler skips what follows only so)
            return self._original_forward(x)
        if _deploying() or self._runs_original() or not isinstance(x, Tensor):  # (the original's error)
            return self._original_forward(x)
        if x.dim() != 4:
            # (the original's sum over dims 1, 2, 3 refuses an unbatched 3-D input too)
            raise ValueError(
                f"{type(self).__name__}: expected a 4-D input (batch, channels, height, width), "
                f"got {x.dim()}-D input of shape {tuple(x.shape)}"
            )
        return self._dispatch(x)

    def _config(self) -> tuple:
        return _conv_config(self.conv), _pool_config(self.avg_pool)

    def _order(self, x: Tensor) -> tuple[str, ...]:
        order = _order(x, rewrite_first=True)  # (its rewrite torch.compile lowers on a CPU too)
        if x.is_cuda:
            return _fused_first_where_launch_bound(("fused_conv", *order), x)
        if _autocast.cast_dtype(x) is not None:  # (a CPU's 16-bit convolutions: see _order)
            return order
        order = (order[0], "fused_conv", *order[1:])
        if traced(x):
            return order
        # A CPU's eager calls (2 cores, float32, ms; 1 x 8 x 16^2 / 32^2 / 64^2 / 128^2 inputs): below
        # _LAUNCH_BOUND_ELEMENTS the rearranged formulations' set-up (the folded kernel, the input's
        # space-to-depth copy) outweighs the convolution: eval original 0.070 / 0.199, rewrite 0.350 / 0.387,
        # fused_conv 0.298 / 0.286; training original 0.15 / 0.33, rewrite 0.50 / 0.54. From there on in
        # eval fused_conv 0.185 / 0.285 against the rewrite's 0.306 / 0.476 (the original's 0.79 / 2.99);
        # training the rewrite 0.79 / 1.24 (fused_conv 0.95 / 1.50).
        if x.numel() < _LAUNCH_BOUND_ELEMENTS:
            return _lead_with("original", order)
        conv = self.conv
        return order if _records(x, conv.weight, conv.bias) else _lead_with("fused_conv", order)

    def _run(self, name: str, x: Tensor) -> Tensor | None:
        pool, conv = member(self, "avg_pool"), member(self, "conv")
        if name == "fused_conv":
            out = rewrites.conv2d_avg_pool_sigmoid_sum(x, conv, pool)
            return None if out is None else _as_original(out, x, self._TAIL_OPS)
        if name == "rewrite":
            pooled = rewrites.conv2d_avg_pool(x, conv, pool)
            return None if pooled is None else torch.sum(torch.sigmoid(pooled), dim=[1, 2, 3])
        y = _conv_channels_last(conv, x) if name.endswith("channels_last") else _conv(conv, x)
        if y is None:
            return None
        if name.startswith("original"):
            y = F.avg_pool2d(y, pool.kernel_size, pool.stride, pool.padding, pool.ceil_mode, pool.count_include_pad,
                             pool.divisor_override)
            return torch.sum(torch.sigmoid(y), dim=[1, 2, 3])
        out = avg_pool2d_sigmoid_sum(y, pool.kernel_size, pool.stride, pool.padding, pool.ceil_mode,
                                     pool.count_include_pad, pool.divisor_override)
        return _as_original(out, x, self._TAIL_OPS)

    _TAIL_OPS = ("aten::avg_pool2d", "aten::sigmoid", "aten::sum.dim_IntList")


class Conv3dDivMaxPoolGAPBiasSum(_Formulations, reference.Conv3dDivMaxPoolGAPBiasSum):
    """conv3d -> / divisor -> max_pool3d -> global average pool -> + bias -> sum
    over sum_dim. Formulations (``fused_ops.autotune``) of the (B, C) average:
    ``rewrite`` where the pool's windows tile the convolution's output
    (``fused_ops.rewrites.conv3d_max_pool_windows``): the convolution computes the windows
    side by side, the divisor folded into it where that is exact, and
    ``fused_ops.parity_max_pool3d_mean`` pools and averages them; ``fused_conv`` where the
    windows tile it too: the convolution, the division, the pool and the average in one op
    (``fused_ops.conv3d_max_pool3d_mean``: on a GPU one tensor-core kernel); ``fused``: the
    division, the pool and the average fused into one kernel over the convolution's output
    (``fused_ops.max_pool3d_mean``); ``original``; and ``fused`` with the convolution
    channels last. The bias and the sum are applied to the (B, C, 1, 1, 1) result as the
    original does (by ``fused_conv``'s op itself where the bias is (C, 1, 1, 1) and the sum over
    channels, as SPEC's: a training step then one forward op and one backward node). The
    constructor is the original's (the same members, parameters drawn in the same order);
    ``global_avg_pool`` stays for its structure, the fused ops compute it."""

    FORMULATIONS = ("fused_conv", *autotune.FORMULATIONS)

    @classmethod
    def from_module(cls, original: nn.Module) -> "Conv3dDivMaxPoolGAPBiasSum":
        return _adopt(cls, original, conv=nn.Conv3d, divisor=(int, float), max_pool=nn.MaxPool3d,
                      global_avg_pool=nn.AdaptiveAvgPool3d, bias=nn.Parameter, sum_dim=int)

    _original_forward = _as_original_forward(reference.Conv3dDivMaxPoolGAPBiasSum.forward)

    def forward(self, x: Tensor) -> Tensor:
        if torch.jit.is_scripting():  # (its own if: the compiler skips what follows only so)
            return self._original_forward(x)
        if _deploying() or self._runs_original() or not isinstance(x, Tensor):  # (the original's error)
            return self._original_forward(x)
        name = type(self).__name__
        _check_input(name, x, member(self, "conv").in_channels, unbatched_ok=True)
        _check_pool_returns_values(name, member(self, "max_pool"))
        out = self._dispatch(x)
        if _autocast.cast_dtype(x) is None:  # (every formulation gives the original's dtype)
            return out
        # the original's dtype under autocast: its global average's (the pools'), plus the bias, summed
        average_dtype = _autocast.tail_dtype(_autocast.conv_dtype(x), x.device.type,
                                             ("aten::max_pool3d", "aten::adaptive_avg_pool3d"))
        return out.to(_autocast.tail_dtype(torch.promote_types(average_dtype, self.bias.dtype), x.device.type,
                                           ("aten::sum.dim_IntList",)))

    def _config(self) -> tuple:
        return _conv_config(self.conv), _pool_config(self.max_pool), self.divisor, self.sum_dim

    def _order(self, x: Tensor) -> tuple[str, ...]:
        order = _order(x)
        if x.is_cuda:
            return ("fused_conv", *order)
        # (on a CPU: PyTorch's convolution and the fused tail)
        return _channels_last_first_on_cpu((*order[:-1], "fused_conv", order[-1]), x)

    def _run(self, name: str, x: Tensor) -> Tensor | None:
        """The module's output (its bias and sum in the call: a CUDA graph of it holds them)."""
        bias, conv = member(self, "bias"), member(self, "conv")
        if name == "fused_conv" and x.dim() == 5 and self.sum_dim == 1 and \
                bias.shape == (conv.out_channels, 1, 1, 1) and self._averages_to_one():
            # the bias and the channels' sum in the op: one forward op and one backward node a step
            out = rewrites.conv3d_max_pool_mean(x, conv, member(self, "max_pool"), self.divisor,
                                                channel_bias=bias.view(-1))
            return None if out is None else out.view(-1, 1, 1, 1)
        pooled = self._pooled(name, x if x.dim() == 5 else x.unsqueeze(0))  # (B, C, 1, 1, 1)
        if pooled is None:
            return None
        return torch.sum((pooled if x.dim() == 5 else pooled[0]) + bias, dim=self.sum_dim)

    def _averages_to_one(self) -> bool:
        """Whether the global average pool's output is one element a channel (the fused ops' average)."""
        return member(self, "global_avg_pool").output_size in (1, (1, 1, 1), [1, 1, 1])

    def _pooled(self, name: str, x: Tensor) -> Tensor | None:
        """The (B, C, 1, 1, 1) average of the pooled maxima of conv(x) / divisor."""
        pool, conv = member(self, "max_pool"), member(self, "conv")
        if not name.startswith("original") and not self._averages_to_one():
            return None  # (the fused ops pool to one element)
        if name == "fused_conv":
            mean = rewrites.conv3d_max_pool_mean(x, conv, pool, self.divisor)
            return None if mean is None else mean.view(*mean.shape, 1, 1, 1)
        if name == "rewrite":
            rewritten = rewrites.conv3d_max_pool_windows(x, conv, pool, self.divisor)
            if rewritten is None:
                return None
            windows, channel_bias = rewritten
            mean = parity_max_pool3d_mean(windows)
            return (mean if channel_bias is None else mean + channel_bias).view(*mean.shape, 1, 1, 1)
        fused = name.startswith("fused")
        if fused and not _fusable_max_pool(pool, ceil_mode_ok=True):
            return None
        y = _conv_channels_last(conv, x) if name.endswith("channels_last") else _conv(conv, x)
        if y is None:
            return None
        if fused:
            mean = max_pool3d_mean(y, pool.kernel_size, pool.stride, pool.padding, pool.ceil_mode, self.divisor)
            return mean.view(*mean.shape, 1, 1, 1)
        return F.adaptive_avg_pool3d(_max_pool3d(pool, y / self.divisor), self.global_avg_pool.output_size)


class ConvTranspose3dMaxPoolMaxPoolSum(_Formulations, reference.ConvTranspose3dMaxPoolMaxPoolSum):
    """conv_transpose3d -> max_pool3d -> max_pool3d -> sum over channels
    (keepdim). Formulations (``fused_ops.autotune``): ``rewrite`` where the first pool's
    windows are the transposed convolution's stride classes and the second pool's tile its
    output (``fused_ops.rewrites.conv_transpose3d_max_pool_cascade_sum``): a convolution
    computes the first pool's windows side by side and ``fused_ops.parity_max_pool3d_cascade_sum``
    pools and sums them (in a training step on data, the weight's gradient from its picks
    alone); ``fused``: the two pools and the sum fused into one kernel over the
    transposed convolution's output (``fused_ops.max_pool3d_cascade_sum``); ``original``; and
    ``fused`` with the convolution channels last. The constructor is the original's (the
    same members, parameters drawn in the same order)."""

    @classmethod
    def from_module(cls, original: nn.Module) -> "ConvTranspose3dMaxPoolMaxPoolSum":
        return _adopt(cls, original, conv_transpose=nn.ConvTranspose3d, max_pool1=nn.MaxPool3d,
                      max_pool2=nn.MaxPool3d)

    _original_forward = _as_original_forward(reference.ConvTranspose3dMaxPoolMaxPoolSum.forward)

    def forward(self, x: Tensor) -> Tensor:
        if torch.jit.is_scripting():  # (its own if: the compiler skips what follows only so)
            return self._original_forward(x)
        if _deploying() or self._runs_original() or not isinstance(x, Tensor):  # (the original's error)
            return self._original_forward(x)
        name = type(self).__name__
        _check_input(name, x, member(self, "conv_transpose").in_channels, unbatched_ok=True)
        _check_pool_returns_values(name, member(self, "max_pool1"))
        _check_pool_returns_values(name, member(self, "max_pool2"))
        if x.dim() == 4:
            # Unbatched, the original's sum over dim 1 adds depth planes, not channels:
            # its own ops (the fused ops sum channels).
            return self._run("original", x)
        return self._dispatch(x)

    def _dispatched_input(self, x: Tensor) -> Tensor | None:
        return x if x.dim() == 5 else None

    def _order(self, x: Tensor) -> tuple[str, ...]:
        return _channels_last_first_on_cpu(_fused_first_where_launch_bound(_order(x), x), x)

    _CONV = "conv_transpose"

    def _config(self) -> tuple:
        return _conv_config(self.conv_transpose), _pool_config(self.max_pool1), _pool_config(self.max_pool2)

    def _run(self, name: str, x: Tensor) -> Tensor | None:
        first, second, conv = member(self, "max_pool1"), member(self, "max_pool2"), member(self, "conv_transpose")
        if name == "rewrite":
            rewritten = rewrites.conv_transpose3d_max_pool_cascade_sum(x, conv, first, second)
            if rewritten is None:
                return None
            out, channel_bias = rewritten
            if channel_bias is not None:  # each channel's maximum carries its bias into the sum
                out = out + channel_bias.sum()
            return _as_original(out, x, self._TAIL_OPS)
        fused = name.startswith("fused")
        if fused and not (_fusable_max_pool(first, ceil_mode_ok=False) and _fusable_max_pool(second, ceil_mode_ok=False)):
            return None
        y = _conv_channels_last(conv, x) if name.endswith("channels_last") else _conv(conv, x)
        if y is None:
            return None
        if not fused:
            return torch.sum(_max_pool3d(second, _max_pool3d(first, y)), dim=1, keepdim=True)
        out = max_pool3d_cascade_sum(y, first.kernel_size, second.kernel_size, stride1=first.stride,
                                     padding1=first.padding, stride2=second.stride, padding2=second.padding)
        return _as_original(out, x, self._TAIL_OPS)

    _TAIL_OPS = ("aten::max_pool3d", "aten::sum.dim_IntList")


class ConvTranspose3dScaleBatchNormGAP(_Formulations, reference.ConvTranspose3dScaleBatchNormGAP):
    """conv_transpose3d -> * scale_factor -> batch_norm3d -> global average pool.
    Formulations (``fused_ops.autotune``): ``fused``: the scale, the batch norm and the pool
    fused into one op (``fused_ops.batch_norm_gap``), which updates the running statistics as
    nn.BatchNorm3d does, on the device; ``rewrite``: normalizing with running statistics
    (eval mode), the output is affine in the input's spatial sums where the transposed
    convolution does not pad (``fused_ops.rewrites.conv_transpose3d_spatial_mean_map``, the
    batch norm folded in): one reduction of x and a small matmul; with batch statistics, a
    stride-1 transposed convolution run as a convolution
    (``fused_ops.rewrites.conv_transpose3d_stride1``), then the fused op; ``original``; and
    ``fused`` with the convolution channels last. The constructor is the
    original's (the same members, parameters and buffers, drawn in the same order);
    ``batch_norm`` holds the parameters, buffers and settings the fused op reads (affine,
    track_running_stats, momentum, eps), ``global_avg_pool`` stays for its structure. An
    nn.SyncBatchNorm there (convert_sync_batchnorm) takes its training statistics over its
    process group where nn.SyncBatchNorm would (``fused_ops.sync_batch_norm``), on any device
    its backend serves."""

    @classmethod
    def from_module(cls, original: nn.Module) -> "ConvTranspose3dScaleBatchNormGAP":
        return _adopt(cls, original, conv_transpose=nn.ConvTranspose3d, scale_factor=(int, float),
                      batch_norm=(nn.BatchNorm3d, nn.SyncBatchNorm), global_avg_pool=nn.AdaptiveAvgPool3d)

    _original_forward = _as_original_forward(reference.ConvTranspose3dScaleBatchNormGAP.forward)

    def forward(self, x: Tensor) -> Tensor:
        if torch.jit.is_scripting():  # (its own if: the compiler skips what follows only so)
            return self._original_forward(x)
        # (an eps of 0 or less: the original's ops, whose torch decides whether F.batch_norm takes it)
        bn = member(self, "batch_norm")
        if _deploying() or self._runs_original() or not isinstance(x, Tensor) or not bn.eps > 0:
            return self._original_forward(x)
        name = type(self).__name__
        _check_input(name, x, member(self, "conv_transpose").in_channels, unbatched_ok=False)
        pool = member(self, "global_avg_pool")
        if pool.output_size not in (1, (1, 1, 1), [1, 1, 1]):
            raise ValueError(f"{name}: the fused op pools to (1, 1, 1), got {pool}")
        group = sync_process_group(bn)
        if group is not None:
            order = autotune.untimed_order(self._synchronized_formulations(x))
            _, y = autotune.run_first(self._convolution, order, x)
            return _as_original(sync_batch_norm_gap(y, self.scale_factor, self.batch_norm, group), x, self._TAIL_OPS)
        return self._dispatch(x)

    _CONV = "conv_transpose"

    def _synchronized_formulations(self, x: Tensor) -> tuple[str, ...]:
        """The synchronized path's convolutions in turn, untimed: every rank must make the same
        collective calls (a convolution timed alone picked worse under bf16). 2 H200s, NCCL,
        SPEC's D, a DDP step per rank: in float32 the stride-1 rewrite 5.18 ms, the original's
        convolution 6.02; under bf16 autocast the original's 3.48, the rewrite 4.00 (float16 taken
        as bf16, unmeasured)."""
        order = self._formulations(x)
        if _autocast.conv_dtype(x) in (torch.float16, torch.bfloat16):
            order = ("fused", *[name for name in order if name != "fused"])
        return order

    def _config(self) -> tuple:
        bn = self.batch_norm  # (its own mode: a batch norm frozen in a training model, or trained in an eval one)
        return (_conv_config(self.conv_transpose), self.scale_factor, bn.eps, bn.momentum, bn.affine,
                bn.track_running_stats, bn.running_mean is None, bn.training, type(bn))

    def _batch_stats(self, bn: nn.Module | None = None) -> bool:
        # nn.BatchNorm3d's rule: batch statistics in training mode or without running statistics
        bn = self.batch_norm if bn is None else bn
        return bn.training or member(bn, "running_mean") is None

    def _order(self, x: Tensor) -> tuple[str, ...]:
        order = _order(x, rewrite_first=not self._batch_stats())  # (the eval map, on any device)
        if isinstance(self.batch_norm, nn.SyncBatchNorm):  # (which refuses a CPU input)
            order = tuple([name for name in order if not name.startswith("original")])
        return order

    _TAIL_OPS = ("aten::batch_norm", "aten::adaptive_avg_pool3d")

    def _graph_stamp(self) -> tuple | None:
        # (with momentum None nn.BatchNorm3d reads its count on the host each training call)
        if self.batch_norm.training and self.batch_norm.momentum is None:
            return None
        return super()._graph_stamp()

    def _run(self, name: str, x: Tensor) -> Tensor | None:
        bn = member(self, "batch_norm")
        batch_stats = self._batch_stats(bn)
        if name == "rewrite" and not batch_stats:
            out = self._running_stats_mean(x, member(self, "conv_transpose"), bn)
            return None if out is None else out.view(*out.shape, 1, 1, 1)
        y = self._convolution(name, x)
        if y is None:
            return None
        if name.startswith("original"):
            return F.adaptive_avg_pool3d(bn(y * self.scale_factor), self.global_avg_pool.output_size)
        return _as_original(scaled_batch_norm_gap(y, self.scale_factor, bn), x, self._TAIL_OPS)

    def _convolution(self, name: str, x: Tensor) -> Tensor | None:
        """The transposed convolution's output by formulation `name` (None where it does not hold)."""
        if name == "rewrite":
            return rewrites.conv_transpose3d_stride1(x, self.conv_transpose)
        if name.endswith("channels_last"):
            return _conv_channels_last(self.conv_transpose, x)
        return _conv(self.conv_transpose, x)

    def _running_stats_mean(self, x: Tensor, conv: nn.ConvTranspose3d, bn: nn.BatchNorm3d) -> Tensor | None:
        """The output (N, O) normalized with the running statistics, where the transposed convolution does
        not pad (None elsewhere): affine in x's spatial sums s (N, I) there
        (``rewrites.conv_transpose3d_spatial_mean_map``, the batch norm per channel folded in: out = (scale *
        mean - running_mean) * rstd * weight + bias). By
        ``conv_transpose3d_batch_norm_eval_mean`` (one op: x's sums, then the map from the parameters as they are
        now) where nothing records a gradient and the dtypes are the op's; else the same map in differentiable ops,
        in float64. Nothing derived from the parameters or buffers is kept between calls. (Each member's
        tensor read once a call: a module attribute's lookup is host time at a batch of one.)"""
        # (the mean of scale * y is scale * mean(y) for a finite scale only: an infinite one meets each
        # element of y, its zeros and signs, not their mean; in a trace, where a compiler may make the scale
        # symbolic, assumed)
        scale = self.scale_factor
        if not rewrites.spatial_mean_holds(x, conv) or not (traced(x) or math.isfinite(scale)):
            return None
        dtype = _autocast.tail_dtype(_autocast.conv_dtype(x), x.device.type, self._TAIL_OPS)
        conv_weight, conv_bias = member(conv, "weight"), member(conv, "bias")
        bn_weight, bn_bias = member(bn, "weight"), member(bn, "bias")
        running_mean, running_var = member(bn, "running_mean"), member(bn, "running_var")
        records = _records(x, conv_weight, conv_bias, bn_weight, bn_bias)
        # (the op's dtypes: the batch norm's tensors of one dtype, x's or float32 for a 16-bit x)
        statistics = {t.dtype for t in (bn_weight, bn_bias, running_mean, running_var) if t is not None}
        widened = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        if not records and x.dtype == conv_weight.dtype and statistics in ({x.dtype}, {widened}):
            out = conv_transpose3d_batch_norm_eval_mean(x, conv_weight, conv_bias, bn_weight, bn_bias, running_mean,
                                                        running_var, conv.stride, conv.output_padding, scale, bn.eps)
            return out if out.dtype == dtype else out.to(dtype)
        weight, bias = rewrites.conv_transpose3d_spatial_mean_map(x, conv)
        gain = (running_var.double() + bn.eps).rsqrt()  # rstd * weight
        if bn_weight is not None:
            gain = gain * bn_weight.double()
        shift = (scale * bias - running_mean.double()) * gain
        if bn_bias is not None:
            shift = shift + bn_bias.double()
        return torch.addmm(shift, rewrites.spatial_sums(x), weight * (scale * gain)).to(dtype)


# (the drop-ins define no attribute of a member's name: fused_ops._members reads their registries directly)
REGISTRY_CLASSES.update({Conv2dAvgPoolSigmoidSum, Conv3dDivMaxPoolGAPBiasSum, ConvTranspose3dMaxPoolMaxPoolSum,
                         ConvTranspose3dScaleBatchNormGAP})
