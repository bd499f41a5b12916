"""``fused_ops.enable_compile_patterns()``: the fused chains and tails inside ``torch.compile``,
for models written without fused_ops in mind, in training and in inference.

Inductor runs a pass of ours over each graph Dynamo captures (its ``pre_grad_custom_pass``),
before autograd and decomposition, where the graph holds the model's torch-level calls: the
modules' functional spellings (``F.conv2d``, ``F.max_pool3d``, ``F.batch_norm``, ...), their
parameters and buffers the graph's inputs. The pass is ``fused_ops.fuse``'s matching
(``fused_ops.fusion``) over that graph: each of the four architectures' chains, where each
intermediate result feeds the next op alone, becomes a call of its drop-in module (the rule's
formulation, as under torch.compile: on a GPU, C's and A's convolution and tail in one
tensor-core kernel), the graph's tensors bound to its parameters and buffers at each call; each
tail where no whole chain holds, its fused op. Autograd then records the fused ops as it
records any op (their handwritten backwards: the compiled model trains), and autocast applies
to them as to the ops they replace (the region's casts are not in the graph yet).

A batch norm's running statistics are updated in place as ``F.batch_norm`` updates them (the
graph counts ``num_batches_tracked`` itself, before the call). Results equal the replaced ops'
up to the fused kernels' rounding (the fused ops' contract). A graph compiled for dynamic shapes
(``dynamic=True``, or Dynamo's automatic dynamic shapes after a recompilation) keeps its ops: the
formulations are compiled for static shapes (``dynamic=False`` specializes each shape).
"""
from __future__ import annotations

import functools
import glob
import hashlib
import os

import torch
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import autotune, fusion


@functools.cache
def _package_digest() -> bytes:
    """The contents of the package's Python files (its subpackages' included: ops/, rewrites/) and
    of its compiled extension: what the matching, the formulations, the fakes and the ops' schemas
    the replacements trace are."""
    digest = hashlib.sha256()
    folder = os.path.dirname(os.path.abspath(__file__))
    for path in sorted(glob.glob(os.path.join(folder, "**", "*.py"), recursive=True)
                       + glob.glob(os.path.join(folder, "_C*"))):
        with open(path, "rb") as f:
            digest.update(os.path.relpath(path, folder).encode() + f.read())
    return digest.digest()


class _FusedOpsPass(CustomGraphPass):
    """fusion's matching over a graph, as Inductor's pre-grad custom pass. Its uuid, Inductor's
    record of it in its caches of compiled graphs: the package's contents and the formulation
    fused_ops.autotune.force imposes (compiled calls honour it)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        fusion.fuse_graph(graph.owning_module, fusion.FuseReport(), follow_mode=False, inductor=True)

    def uuid(self) -> bytes:
        return hashlib.sha256(_package_digest() + repr(autotune._FORCED).encode()).digest()


_PASS = _FusedOpsPass()


def enable_compile_patterns() -> None:
    """From now on, ``torch.compile`` (Inductor) runs the fused chains and tails it finds by the
    fused ops (this module's docstring). Refuses to replace another custom pass."""
    current = inductor_config.pre_grad_custom_pass
    if current is not None and current is not _PASS:
        raise RuntimeError("fused_ops.enable_compile_patterns: torch._inductor.config.pre_grad_custom_pass "
                           f"is already set ({current!r}); not replacing it")
    inductor_config.pre_grad_custom_pass = _PASS


def disable_compile_patterns() -> None:
    """Undoes enable_compile_patterns (graphs compiled already keep their fused ops)."""
    if inductor_config.pre_grad_custom_pass is _PASS:
        inductor_config.pre_grad_custom_pass = None
