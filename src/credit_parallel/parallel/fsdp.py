"""Data-parallel wrappers: FSDP2 (``fully_shard``) over "dp" or dp x domain, and DDP over "dp".

Recipe of :func:`fully_shard_model` (the order matters; it takes typed arguments, and
:func:`apply_fsdp2` is the SPEC's config-taking wrapper around it):

1. the mixed-precision policy from ``param_dtype`` / ``reduce_dtype``;
2. activation checkpointing of the opted-in blocks (before sharding, so FSDP2's hooks wrap the
   checkpointed forward and re-gather parameters for the recomputation);
3. ``fully_shard`` on every submodule that opts in with ``_fsdp2_shard = True`` (SPEC §4: every
   opted-in block is its own unit by default; :func:`fsdp2_units`), children before parents,
   then on the root, which takes every parameter left over.  ``trainer.fsdp2_min_unit_params:
   N`` (default 0) is the user's opt-in to merge opted-in blocks of fewer than N parameters of
   their own into their parent's unit; ``credit-parallel plan`` says when that would pay;
4. over the flattened dp x domain axis: the gradient divide factor dp (sum over domain ranks,
   average over dp; SPEC §4).

A shard group of ONE rank (one GPU, or dp 1 x domain 1) gets no ``fully_shard`` (SPEC §4, as
torchtitan enables FSDP only for a shard degree > 1): FSDP2 would shard nothing there and only
cost its per-unit work (1.5-2.7x the step of the CrossFormer on one H100, issue 33).  Steps 1-2
still hold: ``trainer.amp`` computes in bf16 through :func:`~.precision.compute_in` (autocast,
fp32 master weights) and the opted-in blocks are still checkpointed.  The parameters stay plain
tensors (not DTensors), which is all a user's own FSDP2-specific code sees differently;
``trainer.fsdp2_single_rank: true`` (``single_rank=True``) keeps FSDP2 there for such code.

Models declare only ``_fsdp2_shard``; they know nothing else about data parallelism.  Parameters
that tensor parallelism already turned into DTensors on the "tp" axis of the same mesh are
sharded again over the dp (or dp_domain) axis by FSDP2 (2-D FSDP2 + TP, as torchtitan does); that
1-D mesh must then come from the same root mesh as the tp one (``ParallelMesh`` guarantees it).  :func:`no_grad_sync` is the gradient-accumulation switch for both wrappers.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint, noop_context_fn

from ..layout.config import require_process_group
from ..layout.device import device_for_process_group
from ..layout.run_config import trainer_option
from .draw_recompute import recompute_context_fn
from .grad_overlap import OVERLAP_ATTR
from .inductor_options import guard_inductor_layout
from .precision import compute_in

__all__ = [
    "apply_ddp",
    "apply_fsdp2",
    "FSDP2_MIN_UNIT_PARAMS",
    "fsdp2_applies",
    "fsdp2_layout_note",
    "fsdp2_blocks",
    "fsdp2_precision",
    "fully_shard_model",
    "fsdp2_units",
    "is_activation_checkpointed",
    "no_grad_sync",
    "set_unit_prefetch",
]

_FSDP2_OPT_IN = "_fsdp2_shard"
_AC_MARKER = "_credit_activation_checkpointed"


def _trainer_flag(conf: dict, key: str) -> bool:
    """``trainer.<key>`` parsed as the run config parses it (absent -> False; not a bool ->
    ValueError); ``conf`` is the full config or None."""
    if conf is None:
        return False
    if not isinstance(conf, Mapping):
        raise ValueError(
            f"apply_fsdp2 expects the full config (a mapping), got {type(conf).__name__}"
        )
    return trainer_option(conf, key)


def _require_1d(dp_mesh: DeviceMesh, what: str) -> None:
    if dp_mesh.ndim != 1:
        names = dp_mesh.mesh_dim_names
        raise ValueError(
            f"{what} needs the 1-D data-parallel submesh (e.g. mesh['dp']), got a {dp_mesh.ndim}-D "
            f"mesh with axes {names}; FSDP2 would read a 2-D mesh as HSDP (replicate x shard)"
        )


def _world_dp_mesh(model: nn.Module) -> DeviceMesh:
    """A 1-D "dp" mesh over the whole default process group."""
    require_process_group(
        "apply_fsdp2 with dp_mesh=None (shards over the whole world; or pass mesh['dp'])"
    )
    device_type = device_for_process_group().type
    return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("dp",))


def fsdp2_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Submodules (not the root) that opt in with ``_fsdp2_shard = True``, in pre-order."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if module is not model and getattr(module, _FSDP2_OPT_IN, False) is True
    ]


# SPEC §4: a model declares with ``_fsdp2_shard = True`` which parameters are gathered together
# (its peak memory), so by default every opted-in block is its own unit.  A unit costs an
# all-gather in forward, another in backward and a reduce-scatter, each with a fixed price that
# only megabytes of parameters hide; merging small blocks into their parent's unit is the
# user's choice (``trainer.fsdp2_min_unit_params``), which ``credit-parallel plan`` prices
# (``planner/fsdp_merge.py``).
FSDP2_MIN_UNIT_PARAMS = 0


def fsdp2_units(
    model: nn.Module, min_params: int = FSDP2_MIN_UNIT_PARAMS
) -> list[tuple[str, nn.Module]]:
    """The opted-in blocks (:func:`fsdp2_blocks`) that get a ``fully_shard`` of their own, in
    pre-order: those whose parameters not managed by a selected descendant number at least
    ``min_params`` (full, unsharded sizes).  The rest stay in the nearest selected ancestor or
    the root.  ``min_params=0`` (the default) selects every opted-in block."""
    if isinstance(min_params, bool) or not isinstance(min_params, int) or min_params < 0:
        raise ValueError(
            f"trainer.fsdp2_min_unit_params must be an integer >= 0, got {min_params!r}"
        )
    claimed: set[int] = set()
    selected = []
    for name, block in reversed(fsdp2_blocks(model)):  # children before their parents
        own = [p for p in block.parameters() if id(p) not in claimed]
        if sum(p.numel() for p in own) >= min_params:
            selected.append((name, block))
            claimed.update(id(p) for p in own)
    return selected[::-1]


# Activation checkpointing swaps the block's class for a subclass whose forward runs the original
# one under torch.utils.checkpoint.  Unlike checkpoint_wrapper (which inserts a child module and
# renames every parameter "..._checkpoint_wrapped_module..." in named_parameters) no module is
# added, so parameter names and state_dict keys are unchanged, isinstance checks still hold, and
# deepcopy keeps working (FSDP2 itself uses the same class-swap technique).
_CHECKPOINTED_CLASSES: dict[type, type] = {}


def _checkpointed_class(cls: type) -> type:
    if cls not in _CHECKPOINTED_CLASSES:

        def forward(self, *args, **kwargs):
            inner = super(new_cls, self).forward
            if not torch.is_grad_enabled():
                return inner(*args, **kwargs)
            # the recompute draws its random numbers as the forward did (SPEC §0)
            context_fn = recompute_context_fn() or noop_context_fn
            return checkpoint(inner, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

        new_cls = type(
            f"Checkpointed{cls.__name__}", (cls,), {"forward": forward, _AC_MARKER: True}
        )
        new_cls.__module__ = cls.__module__
        _CHECKPOINTED_CLASSES[cls] = new_cls
    return _CHECKPOINTED_CLASSES[cls]


def is_activation_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`apply_fsdp2` made ``module`` recompute its activations in backward."""
    return getattr(type(module), _AC_MARKER, False) is True


def _apply_activation_checkpointing(blocks: list[tuple[str, nn.Module]]) -> None:
    # Only the outermost opted-in blocks: checkpointing a block inside a checkpointed block would
    # recompute the inner one twice for nothing.
    outer: list[str] = []
    for name, module in blocks:
        if any(name.startswith(prefix + ".") for prefix in outer):
            continue
        outer.append(name)
        if not is_activation_checkpointed(module):
            module.__class__ = _checkpointed_class(type(module))


def fsdp2_applies(group_size: int, single_rank: bool = False) -> bool:
    """SPEC §4: whether ``fully_shard`` is applied over a shard group of ``group_size`` ranks:
    when it shards (more than one rank), or at one rank when the user keeps FSDP2 there
    (``trainer.fsdp2_single_rank: true``)."""
    return group_size > 1 or single_rank


def fsdp2_layout_note(group_size: int, single_rank: bool, amp: bool) -> str | None:
    """The line ``plan`` and the run's first lines print about FSDP2 at a one-rank shard group
    (None when FSDP2 is applied, or the group has several ranks)."""
    if fsdp2_applies(group_size, single_rank):
        return None
    precision = "bf16 compute under torch.autocast, fp32 weights" if amp else "fp32, as declared"
    return (
        "FSDP2 not applied: its shard group (dp x domain) has one rank, where it would shard "
        f"nothing and only cost; parameters stay plain tensors ({precision}); "
        "trainer.fsdp2_single_rank: true keeps FSDP2 there"
    )


def fsdp2_precision(amp: bool) -> dict[str, torch.dtype | None]:
    """``param_dtype`` / ``reduce_dtype`` of :func:`fully_shard_model` for ``trainer.amp``:
    bf16 parameters and compute with fp32 gradient reduction, or fp32 throughout (None, None)."""
    if amp:
        return {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    return {"param_dtype": None, "reduce_dtype": None}


def apply_fsdp2(
    model: nn.Module,
    dp_mesh: DeviceMesh | None,
    conf: dict,
    *,
    gradient_divide_factor: float | None = None,
) -> nn.Module:
    """Shard ``model`` with FSDP2 over the 1-D data-parallel mesh ``dp_mesh``; in place.

    The SPEC's config-taking entry point: it parses ``trainer.amp``,
    ``trainer.activation_checkpoint`` and ``trainer.fsdp2_min_unit_params`` of the full config as
    the run config parses them and calls :func:`fully_shard_model`, which the library itself uses.

    Args:
        model: the model (after domain conversion and tensor parallelism, if any); every
            submodule with ``_fsdp2_shard = True`` becomes an FSDP2 unit, then the root
            (``trainer.fsdp2_min_unit_params: N``, default 0, merges opted-in blocks of fewer
            than N parameters of their own into their parent's unit: :func:`fsdp2_units`).
        dp_mesh: the 1-D mesh to shard over (dp, or the flattened dp x domain axis); None: the
            whole world.
        conf: the full config; ``trainer.amp`` true -> bf16 parameters/compute with fp32
            gradient reduction (false/absent -> fp32); ``trainer.activation_checkpoint`` true ->
            the opted-in blocks recompute their activations in backward (state_dict keys
            unchanged).
        gradient_divide_factor: over dp x domain pass dp, so that the reduce-scatter sums over
            the domain ranks and averages over dp only.

    Returns:
        ``model`` itself, sharded (its class becomes an ``FSDPModule`` subclass).

    Example::

        model = apply_fsdp2(model, sub.get("dp"), {"trainer": {"amp": True}})
    """
    amp = _trainer_flag(conf, "amp")
    activation_checkpoint = _trainer_flag(conf, "activation_checkpoint")
    single_rank = _trainer_flag(conf, "fsdp2_single_rank")
    prefetch = _trainer_flag(conf, "fsdp2_prefetch")
    min_unit_params = (
        trainer_option(conf, "fsdp2_min_unit_params") if conf is not None else FSDP2_MIN_UNIT_PARAMS
    )
    return fully_shard_model(
        model,
        dp_mesh,
        **fsdp2_precision(amp),
        activation_checkpoint=activation_checkpoint,
        gradient_divide_factor=gradient_divide_factor,
        min_unit_params=min_unit_params,
        single_rank=single_rank,
        prefetch=prefetch,
    )


def fully_shard_model(
    model: nn.Module,
    dp_mesh: DeviceMesh | None,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    activation_checkpoint: bool = False,
    gradient_divide_factor: float | None = None,
    min_unit_params: int = FSDP2_MIN_UNIT_PARAMS,
    single_rank: bool = False,
    prefetch: bool = False,
) -> nn.Module:
    """Shard ``model`` with FSDP2 over the 1-D data-parallel mesh ``dp_mesh``; in place.

    A ``dp_mesh`` of one rank gets no ``fully_shard`` unless ``single_rank`` (see the module
    docstring): ``param_dtype`` is then the autocast dtype of the forward
    (:func:`~.precision.compute_in`), the parameters stay plain tensors, and the model's class
    is not an ``FSDPModule``.  ``prefetch`` (``trainer.fsdp2_prefetch``):
    :func:`set_unit_prefetch` on the units.

    ``fully_shard`` is applied to every submodule with ``_fsdp2_shard = True`` (children before
    parents; with ``min_unit_params`` = ``trainer.fsdp2_min_unit_params`` > 0 only those holding
    at least that many parameters of their own: :func:`fsdp2_units`), then to the root; ``dp_mesh=None`` shards over a 1-D mesh of the whole world.
    ``dp_mesh`` may be the flattened dp x domain axis; pass ``gradient_divide_factor=dp`` then,
    so that the reduce-scatter sums over the domain ranks and averages over dp only (the default
    divides by the whole shard group).  ``param_dtype`` / ``reduce_dtype``: FSDP2's
    mixed-precision policy (None: the parameters' own dtype; :func:`fsdp2_precision` maps
    ``trainer.amp``).  ``activation_checkpoint``: the opted-in blocks recompute their
    activations in backward.  Returns the model (its class becomes an ``FSDPModule`` subclass).
    """
    if dp_mesh is None:
        dp_mesh = _world_dp_mesh(model)
    _require_1d(dp_mesh, "apply_fsdp2")
    blocks = fsdp2_blocks(model)
    if activation_checkpoint:
        if not blocks:
            warnings.warn(
                "trainer.activation_checkpoint is true but no submodule of "
                f"{type(model).__name__} sets _fsdp2_shard = True; nothing is checkpointed",
                stacklevel=2,
            )
        _apply_activation_checkpointing(blocks)
    if not fsdp2_applies(dp_mesh.size(), single_rank):
        return compute_in(model, param_dtype, dp_mesh.device_type)
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    guard_inductor_layout(dp_mesh.device_type, param_dtype)
    # Bottom-up: a parent's fully_shard must see its children already managed so that it only
    # takes the parameters left over.
    units = [block for _, block in fsdp2_units(model, min_unit_params)]
    # Zero-element parameters (CREDIT's crossformer at a small dim: its dynamic position bias
    # MLP of dim // 4 = 0 features) hold nothing to shard or reduce, and FSDP2's reduce-scatter
    # refuses them (torch._chunk_cat: "expects non-empty tensor"): they stay plain tensors,
    # replicated, with (empty) local gradients -- exact, as there is nothing to sum.
    empty = {p for p in model.parameters() if p.numel() == 0} or None
    for block in reversed(units):
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy, ignored_params=empty)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, ignored_params=empty)
    if prefetch:
        set_unit_prefetch(units)
    if gradient_divide_factor is not None:
        _set_gradient_divide_factor(model, dp_mesh, gradient_divide_factor)
    return model


def set_unit_prefetch(units: list[nn.Module]) -> None:
    """torch's knobs that cut FSDP2's per-unit waiting (``trainer.fsdp2_prefetch: true``):
    each unit's forward all-gathers the next unit's parameters (explicit forward prefetch), each
    unit's backward the previous one's (explicit backward prefetch), and the last unit keeps its
    parameters unsharded from its forward to its backward (``reshard_after_forward=False``: it
    runs first in backward, so resharding it would gather it straight back; torchtitan does the
    same).  ``units``: the ``fully_shard`` blocks in forward order (the model's module order,
    :func:`fsdp2_units`); a unit prefetched out of its real order only loses the overlap, never
    the result.  The last unit's parameters stay gathered through the forward: that memory more."""
    for unit, nxt in zip(units, units[1:]):
        unit.set_modules_to_forward_prefetch([nxt])
    for unit, prev in zip(units[1:], units):
        unit.set_modules_to_backward_prefetch([prev])
    if units:
        units[-1].set_reshard_after_forward(False)


def _set_gradient_divide_factor(model: nn.Module, dp_mesh: DeviceMesh, factor: float) -> None:
    if isinstance(factor, bool) or not factor > 0:
        raise ValueError(f"gradient_divide_factor must be a number > 0, got {factor!r}")
    # NCCL divides inside the reduce-scatter (PREMUL_SUM); gloo has no such op, so the
    # division runs as a separate scaling around a plain SUM there
    sum_only = "nccl" not in str(dist.get_backend(dp_mesh.get_group()))
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(factor))
            module.set_force_sum_reduction_for_comms(sum_only)


def apply_ddp(
    model: nn.Module, dp_mesh: DeviceMesh | None, **ddp_kwargs
) -> DistributedDataParallel:
    """Wrap ``model`` in DistributedDataParallel over the data-parallel group.

    ``device_ids`` is passed only for a model on CUDA (it must be ``None`` on CPU).

    Args:
        model: the model (after domain conversion, if any; tensor parallelism excludes DDP).
        dp_mesh: the 1-D data-parallel mesh; None: the default process group.
        **ddp_kwargs: keyword arguments for ``DistributedDataParallel``.

    Returns:
        The ``DistributedDataParallel`` wrapping ``model`` (a new module, unlike
        :func:`apply_fsdp2` and :func:`~credit_parallel.parallel.tensor_parallel.apply_tensor_parallel`,
        which convert in place; :func:`~credit_parallel.parallel.composition.get_raw_model` unwraps it).

    Example::

        model = apply_ddp(model, sub.get("dp"))
    """
    group = None
    if dp_mesh is not None:
        _require_1d(dp_mesh, "apply_ddp")
        group = dp_mesh.get_group()
    param = next(model.parameters(), None)
    device_ids = None
    if param is not None and param.device.type == "cuda":
        index = param.device.index
        device_ids = [index if index is not None else torch.cuda.current_device()]
    return DistributedDataParallel(model, device_ids=device_ids, process_group=group, **ddp_kwargs)


@contextlib.contextmanager
def no_grad_sync(model: nn.Module) -> Iterator[None]:
    """Suppress gradient synchronisation inside the block (gradient accumulation).

    DDP: ``model.no_sync()``.  FSDP2: ``set_requires_gradient_sync(False)`` on every FSDP module
    of the tree, back to True on exit (the next backward outside the block reduce-scatters the
    accumulated gradients).  A model with an overlapped domain gradient reducer
    (``grad_overlap``): no reduction starts in the block.  Any other module: no-op.  Gradients
    accumulate locally either way; the step after the block must run its backward outside it.
    """
    overlapped = getattr(model, OVERLAP_ATTR, None)
    if overlapped is not None:
        with overlapped.no_sync():
            yield
        return
    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
        return
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in fsdp_modules:
        module.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for module in fsdp_modules:
            module.set_requires_gradient_sync(True, recurse=False)
