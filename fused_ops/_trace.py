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
