"""Wrapping a module without renaming its parameters.

A domain-parallel layer must keep the wrapped module's ``state_dict`` keys (checkpoints move
between layouts) and must see parameter replacements made by FSDP2/TP on the wrapper.  The
wrapper therefore SHARES the wrapped module's parameter, buffer and child dictionaries (the same
dict objects) instead of registering the module as a child: ``wrapper.weight is conv.weight``
always, and ``wrapper.state_dict()`` has exactly the keys ``conv.state_dict()`` has.
"""

from __future__ import annotations

from torch import nn

__all__ = ["DomainWrapper", "run_forward_pre_hooks"]


class DomainWrapper(nn.Module):
    """Base of domain-parallel layers that wrap an existing module (``self.wrapped``)."""

    _domain_parallel = True  # converters skip modules that already are domain-parallel

    def __init__(self, module: nn.Module):
        super().__init__()
        object.__setattr__(self, "wrapped", module)  # not registered: no "wrapped." key prefix
        self._parameters = module._parameters
        self._buffers = module._buffers
        self._modules = module._modules
        self._non_persistent_buffers_set = module._non_persistent_buffers_set

    def wrapped_weights(self, *args):
        """Run the wrapped module's forward pre-hooks (e.g. spectral norm) and return it."""
        run_forward_pre_hooks(self.wrapped, args)
        return self.wrapped


def run_forward_pre_hooks(module: nn.Module, args: tuple) -> None:
    for hook in list(module._forward_pre_hooks.values()):
        hook(module, args)
