"""Members of modules read on every call, at a host cost that counts at a batch of one.

nn.Module.__getattr__ serves a registered parameter, buffer or submodule only after Python's own
lookup has failed: about 0.5 us a lookup, where a whole call at a batch of one takes some tens of
microseconds of host time (D's eval made 18 such lookups a call). ``member`` reads the registries
directly for the classes known to define no attribute of a member's name."""
from torch import nn

# torch's layers that the drop-ins hold; fused_ops.nn adds the drop-ins themselves
REGISTRY_CLASSES = {nn.Conv2d, nn.Conv3d, nn.ConvTranspose3d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.MaxPool3d,
                    nn.AvgPool2d, nn.AdaptiveAvgPool3d}


def member(module: nn.Module, name: str):
    """module.<name>: what nn.Module.__getattr__ returns for a registered parameter, buffer or submodule,
    read from its registry where module's class is one of REGISTRY_CLASSES; getattr otherwise (a
    parametrization's property, a subclass's own attribute) and for a name not registered."""
    if type(module) in REGISTRY_CLASSES:
        for registry in (module._parameters, module._buffers, module._modules):
            if name in registry:
                return registry[name]
    return getattr(module, name)
