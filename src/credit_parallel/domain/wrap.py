"""Wrapping a module without renaming its parameters.

A domain-parallel layer must keep the wrapped module's ``state_dict`` keys (checkpoints move
between layouts) and must see parameter replacements made by FSDP2/TP on the wrapper.  The
wrapper therefore SHARES the wrapped module's parameter, buffer and child dictionaries (the same
dict objects) instead of registering the module as a child: ``wrapper.weight is conv.weight``
always, and ``wrapper.state_dict()`` has exactly the keys ``conv.state_dict()`` has.
"""

from __future__ import annotations

from torch import nn

from .options import OptionsMixin

__all__ = [
    "DomainWrapper",
    "converted_tree",
    "replace_outermost",
    "run_forward_pre_hooks",
    "visit_outermost",
]


class DomainWrapper(OptionsMixin, nn.Module):
    """Base of domain-parallel layers that wrap an existing module (``self.wrapped``); its
    options (``options.py``) are given at construction or replaced with ``configure``."""

    _domain_parallel = True  # converters skip modules that already are domain-parallel

    def __init__(self, module: nn.Module):
        super().__init__()
        self.__dict__["wrapped"] = module  # not registered: no "wrapped." key prefix
        self._parameters = module._parameters
        self._buffers = module._buffers
        self._modules = module._modules
        self._non_persistent_buffers_set = module._non_persistent_buffers_set

    def wrapped_weights(self, *args):
        """Run the wrapped module's forward pre-hooks (e.g. spectral norm) and return it.

        Without such hooks, the wrapper itself (the same parameter dict): under
        ``torch.compile`` of an FSDP2 model, FSDP's unshard replaces the parameters on the
        wrapper (the module in the tree), and Dynamo tracks that replacement on the object it
        was made on, not on the wrapped module that shares the dict."""
        if not self.wrapped._forward_pre_hooks:
            return self
        run_forward_pre_hooks(self.wrapped, args)
        return self.wrapped


def run_forward_pre_hooks(module: nn.Module, args: tuple) -> None:
    for hook in list(module._forward_pre_hooks.values()):
        hook(module, args)


def replace_outermost(model: nn.Module, replacement_for) -> nn.Module:
    """Replace modules of ``model`` in place, outermost first: ``replacement_for(module, path)``
    (path "" for the root) returns None to visit the module's children, or a module that takes
    its place, children not visited (the module itself: keep it, children not visited).
    Returns the model (the root itself may be replaced)."""

    def visit(module: nn.Module, path: str) -> nn.Module:
        new = replacement_for(module, path)
        if new is not None:
            return new
        for name, child in list(module.named_children()):
            replaced = visit(child, f"{path}.{name}" if path else name)
            if replaced is not child:
                module._modules[name] = replaced
        return module

    return visit(model, "")


def visit_outermost(model: nn.Module, decide, occupant) -> None:
    """Visit ``model``'s modules outermost first (paths "" for the root, then "a.b"):
    ``decide(module, path)`` returns None to visit the module's children, anything else stops
    there.  Nothing is replaced: ``occupant`` says which module a path holds by now."""

    def visit(module: nn.Module, path: str) -> None:
        module = occupant(path or "<root>", module)
        if decide(module, path) is not None:
            return
        for name, child in list(module.named_children()):
            visit(child, f"{path}.{name}" if path else name)

    visit(model, "")


def converted_tree(model: nn.Module, occupant):
    """``(path, module)`` of the converted tree, duplicates included (as
    ``named_modules(remove_duplicate=False)`` of the converted model would give)."""

    def visit(module: nn.Module, path: str):
        module = occupant(path or "<root>", module)
        yield path, module
        for name, child in module._modules.items():
            if child is not None:
                yield from visit(child, f"{path}.{name}" if path else name)

    return visit(model, "")
