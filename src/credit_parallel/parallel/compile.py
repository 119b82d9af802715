"""``torch.compile`` per block: :func:`compile_blocks` (``trainer.compile: true``).

As torchtitan does, each block is compiled on its own after the domain conversion and tensor
parallelism and before FSDP2 (``parallelize`` calls it between the two): the blocks are the
modules that opt in to FSDP2 (``_fsdp2_shard = True``) and contain no other such block, or the
whole model when none opts in.  Every block compiles to one graph (``fullgraph=True``): the
library's communication inside a converted block (halo exchanges, GroupNorm statistics, attention
all-to-alls) is traced as the custom operators of ``domain/exchange/ops.py``.  The block's ``forward`` is
what is compiled (an instance attribute), so the hooks FSDP2 registers on the block later run
eagerly around the graph, as around torchtitan's compiled blocks; the module keeps its class,
parameter names and ``state_dict`` keys.

A compiled block of a domain-parallel model cannot ask the domain group for the global height of
a new input shape inside a graph: the first call of a block per input shape (the manager's
forward token) runs eagerly and notes the heights; later calls run the compiled graph.  (A
block's inputs are not the sharded batch, so the trace-time derivation that a whole-model
``torch.compile`` uses, ``domain/traced_heights.py``, does not reach them.)
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .fsdp import is_activation_checkpointed
from .inductor_options import BLOCK_INDUCTOR_OPTIONS
from .precision import declared_autocast

__all__ = ["compile_blocks", "compile_targets", "is_compiled"]


def compile_targets(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the blocks :func:`compile_blocks` compiles: the innermost modules
    with ``_fsdp2_shard = True``, or ``("", model)`` when there is none."""
    marked = [
        (name, m) for name, m in model.named_modules() if getattr(m, "_fsdp2_shard", False) is True
    ]
    names = [name for name, _ in marked]
    inner = [
        (name, m)
        for name, m in marked
        if not any(o != name and o.startswith(f"{name}.") for o in names)
        and not any(o == "" for o in names if name != "")
    ]
    return inner or [("", model)]


def _manager_of(block: nn.Module):
    from ..domain.manager import get_domain_parallel_manager

    for m in block.modules():
        mgr = getattr(m, "manager", None)
        if mgr is not None and hasattr(mgr, "begin_forward"):
            return mgr
    return get_domain_parallel_manager()


class _CompiledForward:
    """A block's compiled ``forward``, after one eager call per new input shape of a
    domain-parallel block (see the module docstring)."""

    def __init__(self, block, eager, compiled, manager):
        self.eager, self._compiled, self._manager = eager, compiled, manager
        self._block = block
        self._seen: set = set()

    def _run(self, fn, args, kwargs):
        # trainer.activation_checkpoint and a one-rank FSDP2 group's precision (precision.py)
        # swap the block's class later; this instance forward shadows the class's, so the
        # checkpoint and the autocast region are applied here, around the graph
        with declared_autocast(self._block):
            if is_activation_checkpointed(self._block) and torch.is_grad_enabled():
                return checkpoint(fn, *args, use_reentrant=False, **kwargs)
            return fn(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        mgr = self._manager
        if mgr is not None and mgr.domain_world_size > 1 and mgr._token not in self._seen:
            self._seen.add(mgr._token)
            return self._run(self.eager, args, kwargs)
        return self._run(self._compiled, args, kwargs)


def is_compiled(module: nn.Module) -> bool:
    """Whether :func:`compile_blocks` compiled ``module``."""
    return isinstance(module.__dict__.get("forward"), _CompiledForward)


def _compile_kwargs(backend: str, mode: str | None, options: dict | None) -> dict:
    """``torch.compile``'s ``mode``/``options`` for one block: for inductor, the mode's options
    (``torch.compile`` takes one of the two) with :data:`BLOCK_INDUCTOR_OPTIONS` and the caller's
    ``options`` on top."""
    if backend != "inductor":
        return {"mode": mode, **({"options": options} if options else {})}
    from torch._inductor import list_mode_options

    merged = {**(list_mode_options(mode) if mode else {}), **BLOCK_INDUCTOR_OPTIONS}
    return {"options": {**merged, **(options or {})}}


def compile_blocks(
    model: nn.Module,
    *,
    backend: str = "inductor",
    fullgraph: bool = True,
    mode: str | None = None,
    dynamic: bool | None = False,
    options: dict | None = None,
) -> list[str]:
    """Compile every block of ``model`` (see :func:`compile_targets`) with ``torch.compile``, in
    place; call it after domain conversion / tensor parallelism and before FSDP2.  Returns the
    names of the compiled blocks ("" for the root).  ``backend``/``mode``/``dynamic``/``options``
    are ``torch.compile``'s (inductor: :data:`BLOCK_INDUCTOR_OPTIONS` below ``options``);
    ``fullgraph=True`` makes a graph break inside a block an error."""
    kwargs = _compile_kwargs(backend, mode, options)
    names = []
    for name, block in compile_targets(model):
        if is_compiled(block):
            raise RuntimeError(
                f"compile_blocks: block {name or type(model).__name__!r} is already compiled "
                "(compile_blocks or trainer.compile applied twice)"
            )
        eager = block.forward
        compiled = torch.compile(
            eager, backend=backend, fullgraph=fullgraph, dynamic=dynamic, **kwargs
        )
        block.forward = _CompiledForward(block, eager, compiled, _manager_of(block))
        names.append(name)
    return names
