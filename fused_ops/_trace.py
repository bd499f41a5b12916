"""Whether a call is traced rather than run on memory (torch.compile, torch.export, fake tensors):
then nothing is timed, captured or asked of a device."""
import torch
from torch import Tensor

_PLAIN = (Tensor, torch.nn.Parameter)  # (types that are never a trace's: detect_fake_mode takes ~4 us)


def traced(t: Tensor) -> bool:
    """Whether a call with t is a trace's rather than one on memory: while Dynamo compiles, under
    a fake mode (what the call builds is fake, a real t too), or t a fake (or functional) tensor
    of AOT autograd's, export's or an Inductor pass's tracing: nothing to time or capture."""
    return (torch.compiler.is_compiling()
            or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
            or (type(t) not in _PLAIN and torch._guards.detect_fake_mode(t) is not None))


_functorch_interpreter = torch._C._functorch.peek_interpreter_stack
_FunctorchInterpreter = torch._C._functorch.CInterpreter


def transformed() -> bool:
    """Whether a torch.func transform (grad, vjp, jacrev, vmap, ...; compiled too) runs the call: then
    only ops functorch transforms may run (the fused ops' C++ autograd functions it cannot)."""
    transform = _functorch_interpreter()
    # (dynamo reads the query's None as true; the type as it is)
    return transform is not None and isinstance(transform, _FunctorchInterpreter)
