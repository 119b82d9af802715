"""``nonlocal_policy="gather"``: run a module the converter cannot make exact on the whole globe.

:class:`DomainGatherModule` all-gathers the rows of every B,C,H,W / B,C,T,H,W tensor argument,
runs the unchanged module on the global tensors, and keeps, of every output whose height is the
global input height, this rank's rows (a plain slice); other outputs (a pooled vector, a scalar)
are the same on every rank and are returned whole.  Exact forward and backward for ANY module:
each rank back-propagates only the gradient of the outputs it keeps, so its parameter gradient
is its share and the shares sum over ranks to the single-process gradient (which is what
``sync_domain_gradients`` sums), and the all-gather's backward sums the input gradients over
ranks before each rank keeps its rows.  Modules with state updated in the forward (BatchNorm
running statistics) update it identically on every rank, as one process would.

The price is memory and traffic: the module's activations are those of the whole globe on every
rank (d times a sharded layer's); :func:`gather_cost_note` states it in the warning.
"""

from __future__ import annotations

import torch
from torch import nn

from ..exchange.collectives import all_gather_rows
from ..manager import resolve_manager
from ..rows import shard_range
from ..wrap import DomainWrapper

__all__ = [
    "NONLOCAL_POLICIES",
    "DomainGatherModule",
    "gather_cost_note",
    "gather_nonlocal_modules",
]

NONLOCAL_POLICIES = ("raise", "gather")


class DomainGatherModule(DomainWrapper):
    """Run ``module`` on all-gathered inputs; keep this rank's output rows."""

    domain_form = "gather"

    def __init__(self, module: nn.Module, shard_dim: int = -2, *, manager=None):
        inner = [
            f"{name} ({type(m).__name__})"
            for name, m in module.named_modules()
            if name and getattr(m, "_domain_parallel", False)
        ]
        if inner:  # it runs on the whole globe: a domain layer inside would treat it as a shard
            raise ValueError(
                f"DomainGatherModule({type(module).__name__}): holds domain-parallel layers "
                f"{', '.join(inner)}; gather the original module (unconverted descendants)"
            )
        super().__init__(module)
        self.shard_dim = shard_dim
        self.manager = manager
        self.last_gathered_bytes = 0  # bytes of global input this rank held in the last forward

    # ---- geometry protocol
    def output_height(self, input_height: int) -> int:
        return input_height

    def input_windows(self, input_height: int, n: int):
        return tuple(tuple(range(input_height)) for _ in range(n))

    def communication_bytes(self, input_shape, n: int, itemsize: int) -> int:
        """Bytes received over all ranks per forward (all-gather of the input; the backward
        all-reduces a gradient of the same size)."""
        numel = 1
        for s in input_shape:
            numel *= s
        return int(numel * itemsize * (n - 1))

    def activation_factor(self, n: int) -> int:
        """Per-rank activation memory of the module relative to a sharded layer: d."""
        return n

    def activation_bytes(self, input_shape, n: int, itemsize: int) -> int:
        """The whole globe's input, on every rank."""
        numel = 1
        for s in input_shape:
            numel *= s
        return numel * itemsize

    def _is_sharded(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.dim() in (4, 5)

    def forward(self, *args, **kwargs):
        mgr = resolve_manager(self.manager, type(self.wrapped).__name__)
        n = mgr.domain_world_size
        if n == 1:
            return self.wrapped(*args, **kwargs)
        heights = set()

        def gather(t):
            if not self._is_sharded(t):
                return t
            dim = self.shard_dim % t.dim()
            height = mgr.global_length(self, t.shape[dim])
            heights.add(height)
            full = all_gather_rows(t, dim, height, mgr)
            self.last_gathered_bytes += full.numel() * full.element_size()
            return full

        self.last_gathered_bytes = 0
        args = tuple(gather(a) for a in args)
        kwargs = {k: gather(v) for k, v in kwargs.items()}
        out = self.wrapped(*args, **kwargs)

        def keep_own(t):
            if not self._is_sharded(t):
                return t
            dim = self.shard_dim % t.dim()
            if t.shape[dim] not in heights:
                return t  # not a latitude field of the input's grid: the same on every rank
            start, stop = shard_range(t.shape[dim], n, mgr.domain_rank)
            return t.narrow(dim, start, stop - start)

        if isinstance(out, tuple):
            return tuple(keep_own(o) for o in out)
        if isinstance(out, list):
            return [keep_own(o) for o in out]
        return keep_own(out)


def gather_cost_note(n: int) -> str:
    return (
        f"each runs on the whole globe on every one of the {n} domain ranks: its input is "
        f"all-gathered ((d-1)/d of it received per rank, the same volume all-reduced in backward) "
        f"and its activations take {n}x the per-rank memory of a sharded layer"
    )


def gather_nonlocal_modules(model: nn.Module, paths: list[str], manager, shard_dim: int = -2):
    """Replace, in place, the modules at ``paths`` ("<root>" for the model) by
    :class:`DomainGatherModule`; returns the (possibly replaced) model."""
    for path in paths:
        if path == "<root>":
            model = DomainGatherModule(model, shard_dim, manager=manager)
            model.configure(module_path=path)
            continue
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        wrapper = DomainGatherModule(parent._modules[name], shard_dim, manager=manager)
        wrapper.configure(module_path=path)
        parent._modules[name] = wrapper
    return model
