"""Meta-device model construction: build without memory, materialise already sharded.

:func:`build_parallel_model` builds the model on the meta device while recording how each
parameter and buffer is initialised — every aten op that creates or writes it, and the CPU RNG
state before each random op, the RNG being advanced exactly as the plain CPU build advances it
(the random op runs once on a scratch CPU tensor of that one parameter's shape).  It then applies
the layout to the meta model (domain -> TP -> FSDP2), allocates only this rank's shards on
``device`` (``to_empty``, FSDP2's documented path) and replays each tensor's initialisation on
the CPU one tensor at a time, keeping this rank's shard (``distribute_tensor`` of that one full
tensor with ``src_data_rank=None``: no communication).  Initial weights therefore equal
``torch.manual_seed(seed); model_factory()`` in one process, for any layout, and no rank ever
holds more than one full parameter at a time.

torch's ``trunc_normal_``, ``orthogonal_``, ``dirac_`` and ``sparse_`` skip meta tensors in
Python (and ``trunc_normal_`` draws until all values fit, a data-dependent loop), so while
recording they are replaced, in ``torch.nn.init``, by versions that record the call as one
step.  A copy bound before the call (``from torch.nn.init import trunc_normal_`` at import time)
is not replaced; a tensor that such code would initialise on meta is left with an earlier value
or, when nothing else wrote it, refused by name (as is a buffer built from Python data, whose
values the meta device drops).
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.init as nn_init
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ..layout.config import DataMode, ParallelDims
from ..parallel.compile import compile_blocks
from ..parallel.composition import (
    RecipeOptions,
    apply_data_parallel,
    apply_model_parallel,
    layout_meshes,
    parallelize_dims,
)

__all__ = ["InitRecord", "build_parallel_model", "materialize_", "record_meta_build"]

_META_SKIPPING_INITS = ("trunc_normal_", "orthogonal_", "dirac_", "sparse_")


def _key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage: views and ``nn.Parameter`` wrappers share it."""
    return t.untyped_storage()._cdata


@dataclass(frozen=True)
class _Ref:
    """A recorded meta tensor: a view (size, stride, offset) of storage ``key``."""

    key: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @classmethod
    def of(cls, t: torch.Tensor) -> _Ref:
        return cls(_key(t), tuple(t.size()), tuple(t.stride()), t.storage_offset())


@dataclass(frozen=True)
class _Op:
    """One recorded call; ``out_index`` set when it created the storage (its n-th output)."""

    seq: int
    fn: Callable
    args: tuple
    kwargs: dict
    rng_state: torch.Tensor | None
    out_index: int | None = None


def _is_meta(v) -> bool:
    return isinstance(v, torch.Tensor) and v.is_meta


def _involves_meta(args, kwargs) -> bool:
    flat, _ = tree_flatten((args, kwargs))
    return any(_is_meta(v) or (isinstance(v, torch.device) and v.type == "meta") for v in flat)


def _on_cpu(v):
    """A scratch CPU stand-in for a meta tensor (same geometry), or the value itself."""
    if _is_meta(v):
        return torch.empty_strided(v.size(), v.stride(), dtype=v.dtype, device="cpu")
    if isinstance(v, torch.device) and v.type == "meta":
        return torch.device("cpu")
    return v


def _written_meta_tensors(func, args, kwargs) -> list[torch.Tensor]:
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if _is_meta(value):
                written.append(value)
    return written


class InitRecord(TorchDispatchMode):
    """Records, per storage, the ops that create and write meta tensors (see module doc)."""

    def __init__(self):
        super().__init__()
        self.chains: dict[int, list[_Op]] = {}
        self._alive: list[torch.Tensor] = []  # storage addresses must not be reused
        self._seq = itertools.count()

    def _encode(self, v):
        return _Ref.of(v) if _is_meta(v) else v

    def _record(self, fn, args, kwargs, state, written, outputs=()) -> None:
        seq = next(self._seq)
        rec_args, rec_kwargs = tree_map(self._encode, (tuple(args), dict(kwargs)))
        op = _Op(seq, fn, rec_args, rec_kwargs, state)
        for t in written:
            self.chains.setdefault(_key(t), []).append(op)
            self._alive.append(t)
        known = {_key(t) for t in tree_flatten((args, kwargs))[0] if _is_meta(t)}
        for i, out in enumerate(outputs):
            if _key(out) not in known and _key(out) not in self.chains:
                self.chains[_key(out)] = [_Op(seq, fn, rec_args, rec_kwargs, state, i)]
                self._alive.append(out)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _involves_meta(args, kwargs):
            return func(*args, **kwargs)
        state = None
        if torch.Tag.nondeterministic_seeded in func.tags:
            if kwargs.get("generator") is not None:
                raise ValueError(
                    f"{func}: an explicit generator during meta-device construction cannot be "
                    "replayed; initialise from the global RNG (torch.manual_seed)"
                )
            state = torch.get_rng_state()
            # the meta kernel draws nothing: draw on a scratch CPU tensor, as the plain build
            func(*tree_map(_on_cpu, args), **tree_map(_on_cpu, kwargs))
        out = func(*args, **kwargs)
        outputs = [o for o in tree_flatten(out)[0] if _is_meta(o)]
        self._record(func, args, kwargs, state, _written_meta_tensors(func, args, kwargs), outputs)
        return out

    @contextlib.contextmanager
    def _whole_call_inits(self) -> Iterator[None]:
        """Replace the torch.nn.init functions that skip meta tensors by recorded calls."""
        originals = {name: getattr(nn_init, name) for name in _META_SKIPPING_INITS}

        def recorded(original):
            def init_(tensor, *args, **kwargs):
                if not _is_meta(tensor):
                    return original(tensor, *args, **kwargs)
                state = torch.get_rng_state()
                original(_on_cpu(tensor), *args, **kwargs)  # advances the RNG as the plain build
                self._record(original, (tensor, *args), kwargs, state, [tensor])
                return tensor

            return init_

        for name, original in originals.items():
            setattr(nn_init, name, recorded(original))
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(nn_init, name, original)

    # ------------------------------------------------------------------ replay
    def can_rebuild(self, ref: _Ref, replay: bool = False) -> bool:
        """Whether :meth:`full_value` can give ``ref``'s value: a chain starting with an op
        that creates its storage; ``replay`` (buffers, small): the whole replay succeeds."""
        chain = self.chains.get(ref.key, ())
        if not chain or chain[0].out_index is None:
            return False
        if replay:
            try:
                self.full_value(ref, "")
            except ValueError:
                return False
        return True

    def full_value(self, ref: _Ref, what: str) -> torch.Tensor:
        """The CPU value the plain build gives the tensor ``ref`` (``what`` names it in errors)."""
        return self._storage(ref.key, float("inf"), {}, what).as_strided(
            ref.size, ref.stride, ref.offset
        )

    def _storage(self, key: int, upto: float, memo: dict, what: str) -> torch.Tensor:
        if (key, upto) in memo:
            return memo[(key, upto)]
        chain = [op for op in self.chains.get(key, ()) if op.seq < upto]
        if not chain or chain[0].out_index is None:
            raise ValueError(
                f"{what}: its value cannot be rebuilt from the meta-device construction (it "
                "was made from Python data, or written by code that skips meta tensors); "
                "initialise it with torch ops or in reset_parameters()"
            )
        base = None
        for op in chain:
            out = self._run(op, key, base, memo, what)
            if op.out_index is not None:
                base = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
                base = base[op.out_index]
        memo[(key, upto)] = base
        return base

    def _run(self, op: _Op, key: int, base, memo: dict, what: str):
        def decode(v):
            if isinstance(v, _Ref):
                # the storage being rebuilt is the tensor itself; others as they were then
                source = base if v.key == key else self._storage(v.key, op.seq, memo, what)
                return source.as_strided(v.size, v.stride, v.offset)
            return _on_cpu(v)

        args, kwargs = tree_map(decode, (op.args, op.kwargs))
        if op.rng_state is None:
            return op.fn(*args, **kwargs)
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(op.rng_state)
            return op.fn(*args, **kwargs)


def record_meta_build(model_factory: Callable[[], nn.Module]) -> tuple[nn.Module, InitRecord]:
    """``model_factory()`` on the meta device, and the record of how it initialised itself."""
    record = InitRecord()
    with torch.device("meta"), record, record._whole_call_inits():
        model = model_factory()
    return model, record


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    return itertools.chain(model.named_parameters(), model.named_buffers())


def materialize_(
    model: nn.Module, record: InitRecord, refs: dict[str, _Ref], *, device
) -> nn.Module:
    """Allocate ``model``'s (possibly sharded) tensors on ``device`` and fill each with the
    plain build's value of its own shard; ``refs`` maps names to the recorded meta tensors."""
    model.to_empty(device=device)
    with torch.no_grad():
        for name, tensor in _named_tensors(model):
            full = record.full_value(refs[name], f"{type(model).__name__}.{name}")
            if isinstance(tensor, DTensor):
                # this one full tensor, cut locally (src_data_rank=None: no communication)
                mine = distribute_tensor(
                    full, tensor.device_mesh, tensor.placements, src_data_rank=None
                )
                tensor.to_local().copy_(mine.to_local())
            else:
                tensor.copy_(full)
            del full
    return model


def build_parallel_model(
    model_factory: Callable[[], nn.Module],
    conf: dict | None = None,
    *,
    device,
    seed: int | None = None,
    dims: ParallelDims | None = None,
    options: RecipeOptions | None = None,
) -> nn.Module:
    """Build ``model_factory()`` on the meta device, parallelise it, and materialise it sharded.

    The recipe of ``parallelize(model, conf)`` (domain -> TP -> FSDP2/DDP) on a model that never
    exists whole: FSDP2 wraps the meta model, the shards are allocated on ``device`` (the
    trainer passes ``cuda:LOCAL_RANK`` or cpu), then filled; DDP wraps after filling.  With
    ``seed`` the global RNG is seeded first; initial weights equal ``torch.manual_seed(seed);
    model_factory()`` built in one process, and the RNG ends where that build leaves it.
    ``dims`` / ``options``: the already-parsed layout and recipe settings (the trainer's);
    otherwise they are parsed from ``conf``.
    """
    if dims is None:
        dims = ParallelDims.from_conf(conf)
    if options is None:
        options = RecipeOptions.from_conf(conf) if conf is not None else RecipeOptions()
    if seed is not None:
        torch.manual_seed(seed)
    model, record = record_meta_build(model_factory)
    refs = {name: _Ref.of(t) for name, t in _named_tensors(model)}
    buffers = {name for name, _ in model.named_buffers()}
    lost = [name for name, ref in refs.items() if not record.can_rebuild(ref, name in buffers)]
    if lost and getattr(model, "_whole_build_fallback", False):
        # a model that declares it (miles-credit's, models/external.py: attention index buffers
        # made from Python data): build it whole on the CPU (same seed, same values) and
        # parallelise it, as for a passed model; any other model is refused by name below
        warnings.warn(
            f"{len(lost)} tensor(s) of {type(model).__name__} cannot be rebuilt from a "
            f"meta-device build ({', '.join(lost[:3])}{', ...' if len(lost) > 3 else ''}); "
            "building the whole model on every rank instead",
            stacklevel=2,
        )
        if seed is not None:
            torch.manual_seed(seed)
        return parallelize_dims(model_factory().to(device=torch.device(device)), dims, options)
    meshes = layout_meshes(dims)
    data_options = {
        "amp": options.amp,
        "activation_checkpoint": options.activation_checkpoint,
        "min_unit_params": options.fsdp2_min_unit_params,
        "single_rank": options.fsdp2_single_rank,
        "prefetch": options.fsdp2_prefetch,
    }
    if meshes is not None:
        model = apply_model_parallel(
            model,
            dims,
            meshes,
            src_data_rank=None,
            nonlocal_policy=options.nonlocal_policy,
            halo_chains=options.halo_chains,
        )
    if options.compile:  # per block, before FSDP2 (as parallelize does)
        compile_blocks(model)
    if meshes is not None:
        if dims.data == DataMode.FSDP2:
            model = apply_data_parallel(model, dims, meshes, **data_options)
    materialize_(model, record, refs, device=torch.device(device))
    if meshes is not None and dims.data == DataMode.DDP:
        model = apply_data_parallel(model, dims, meshes, **data_options)
    return model
