"""The layout planner behind ``credit-parallel plan`` (pure: no processes).

:func:`make_plan` reads a full config and a world size and works out, without starting a single
process or process group:

1. the rank layout: the parallel degrees (:class:`~credit_parallel.layout.config.ParallelDims`), the
   mesh axes ``build_device_mesh`` would keep, and every rank's (dp, tp, domain) coordinates and
   the global ranks of its dp / tp / domain groups (:func:`~credit_parallel.layout.mesh.full_rank_layout`);
2. the rows every domain rank owns at every resolution level, and for every module that
   ``convert_to_domain_parallel`` would replace the halo rows each rank receives: the model is
   traced once on the meta device (``trace.py``) and each layer call is asked for its geometry
   (``cost.layer_call_plan``);
3. an estimate of the memory per rank and of the communication per training step (``cost.py``);
4. every constraint the configuration violates, collected rather than stopping at the first.

Naming: an *axis* is a mesh axis ("dp", "tp", "domain"); a *dim* is a tensor dimension.  Heights
are GLOBAL row counts along the sharded dim (latitude: dim -2 of B,C,H,W and of B,C,Z,H,W).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..layout.config import DataMode, ParallelDims, domain_degrees, parse_parallelism_conf
from ..layout.mesh import full_rank_layout
from ..layout.run_config import TrainerConfig, trainer_option
from ..parallel.fsdp import fsdp2_layout_note
from .cost import PLAN_DEVICES, DomainLayerPlan, MemoryEstimate
from .ensemble_notes import ensemble_coords, ensemble_notes
from .layer_calls import (
    domain_levels,
    halo_bytes_per_rank,
    split_projections,
    tile_plans,
    tile_refusals_of_model,
    traced_layers,
    window_constraints,
)
from .per_rank import PARAM_BYTES, collectives_per_rank, memory_per_rank
from .tp_partial import tp_partial_gradient_findings
from .trace import build_meta_model, model_input_shapes

__all__ = [
    "MAX_RANKS_LISTED",
    "Plan",
    "RankEntry",
    "make_plan",
    "resolve_plan_device",
    "tile_refusals_of_model",  # re-exported from layer_calls (its home before the split)
]

MAX_RANKS_LISTED = 64  # every rank is listed up to this world size, else a sample
_SAMPLE_HEAD, _SAMPLE_TAIL = 32, 8


@dataclass(frozen=True)
class RankEntry:
    """One global rank: its (dp, tp, domain) coordinates and the global ranks of its groups."""

    rank: int
    dp: int
    tp: int
    domain: int
    dp_group: tuple[int, ...]
    tp_group: tuple[int, ...]
    domain_group: tuple[int, ...]
    ensemble: int = 0  # the ensemble axis (SPEC §2), when trainer.parallelism.ensemble > 1
    ensemble_group: tuple[int, ...] = ()


@dataclass
class Plan:
    """Everything ``credit-parallel plan`` reports; built by :func:`make_plan`."""

    world_size: int
    data: str
    tp: int
    domain: int
    dp: int  # world_size // (tp * domain); 0 when that is not a whole number >= 1
    dims: ParallelDims | None  # None when the world size does not fit the degrees
    mesh_axes: tuple[tuple[str, int], ...]
    ranks: list[RankEntry]
    ranks_omitted: int
    model_type: str
    model_class: str
    input_shapes: tuple[tuple[int, ...], ...]  # per sample, without the batch dim
    batch_size: int
    amp: bool
    parameter_count: int
    levels: list[
        tuple[int, tuple[int, ...]]
    ]  # (global height, rows per domain rank), largest first
    layers: list[DomainLayerPlan]
    memory: MemoryEstimate
    halo_bytes_per_rank: tuple[int, ...]  # bytes each domain rank sends per step (fwd + bwd)
    halo_bytes_per_step: int  # summed over one domain group
    collectives: dict[str, int]
    tp_targets: list[tuple[str, str]]  # (module path, "col" | "row")
    fsdp_units: list[str]
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # a lat x lon domain (SPEC §3b): (P, Q); ``domain`` above is P, ``layers`` and ``levels``
    # the latitude rows; ``tile_levels`` (H, W, rows per lat rank, columns per lon rank) and
    # ``tile_layers`` (``tiles.TileLayerPlan``) the tiles, which the halo bytes per rank
    # (P x Q of them, domain rank lat * Q + lon), the collectives and the memory count
    domain_shape: tuple[int, int] = (1, 1)
    tile_levels: list = field(default_factory=list)
    tile_layers: list = field(default_factory=list)
    # ``split.SplitProjection`` of every (P, Q) with P x Q = the domain size (plan --world-size)
    splits: list = field(default_factory=list)
    # SPEC §4: False when data is fsdp2 but its shard group has one rank (no fully_shard)
    fsdp2_applied: bool = True

    @property
    def ok(self) -> bool:
        return not self.violations


_FIRST_STEP_NOTE = (
    "first step only: one all-gather of local heights per domain layer call (cached per input "
    "shape afterwards; not counted above)"
)


def resolve_plan_device(device: str) -> str:
    """The device type a plan counts memory for: "cuda" / "cpu" as given; "auto": CUDA when
    this machine sees a CUDA GPU, else the CPU (the choice ``train --device auto`` makes for
    one local rank).  A plan made on a machine without GPUs for a GPU cluster says
    ``--device cuda``; the report shows the other device's total too."""
    from ..layout.device import visible_gpu_count

    if device == "auto":
        return "cuda" if visible_gpu_count() > 0 else "cpu"
    if device not in PLAN_DEVICES:
        raise ValueError(f"--device must be one of auto, cuda, cpu; got {device!r}")
    return device


# --------------------------------------------------------------------------- the plan
def _rank_entries(dims: ParallelDims) -> tuple[list[RankEntry], int]:
    layout = full_rank_layout(dims)
    world = dims.world_size
    if world <= MAX_RANKS_LISTED:
        chosen = list(range(world))
    else:
        chosen = list(range(_SAMPLE_HEAD)) + list(range(world - _SAMPLE_TAIL, world))
    entries = []
    for g in chosen:
        coords = layout.coords(g)  # (dp, [ensemble,] tp, domain)
        dp, tp, dom = coords[0], coords[-2], coords[-1]
        entries.append(
            RankEntry(
                g,
                dp,
                tp,
                dom,
                tuple(layout.ranks_along_dim("dp", g)),
                tuple(layout.ranks_along_dim("tp", g)),
                tuple(layout.ranks_along_dim("domain", g)),
                *ensemble_coords(dims, layout, g),
            )
        )
    return entries, world - len(chosen)


def _layout(block: Mapping, world_size: int, dims, violations: list, notes: list):
    """(dims or None, dp) of the parallel degrees on ``world_size`` ranks; every problem of the
    layout, as :meth:`ParallelDims.problems` words it, is a violation."""
    data, tp, n, ens = block["data"], block["tensor"], block["domain"], block.get("ensemble", 1)
    violations.extend(ParallelDims.problems(data, tp, n, world_size, ens))
    if dims is None:
        try:
            dims = ParallelDims(data, tp, n, world_size, ens)
        except ValueError:  # reported above
            notes.append("no rank layout: the world size does not fit the parallel degrees")
            return None, 0
    return dims, dims.dp


def _run_settings(conf: dict, trainer, violations: list) -> tuple:
    """(samples per data-parallel rank, amp, nonlocal policy, halo chains), parsed exactly as
    the trainer parses them (the typed run config): a value the trainer would reject is a
    violation here too.  ``trainer``: the already-parsed section, when the caller has it."""
    keys = ("batch_size", "amp", "domain_nonlocal_policy", "domain_halo_chains")
    if trainer is not None:
        return tuple(getattr(trainer, key) for key in keys)
    settings = []
    for key in keys:
        try:
            settings.append(trainer_option(conf, key))
        except ValueError as err:
            default = TrainerConfig.__dataclass_fields__[key].default
            violations.append(f"{err}; assuming {default!r}")
            settings.append(default)
    return tuple(settings)


def _staging_note(conf: dict, trainer, param_bytes: int) -> str:
    """Host memory a checkpoint save stages per rank (train/async_save.py): the parameters'
    shards, AdamW's two moments, and the EMA shadow under trainer.use_ema (the buffers: not
    counted here)."""

    def option(key):
        try:
            return getattr(trainer, key) if trainer is not None else trainer_option(conf, key)
        except ValueError:
            return TrainerConfig.__dataclass_fields__[key].default

    ema = option("use_ema")
    staged = param_bytes * (3 + int(ema))
    parts = "parameters + AdamW moments" + (" + EMA shadow" if ema else "")
    if not option("checkpoint_async"):
        return "checkpoints: synchronous (trainer.checkpoint_async: false), no staging memory"
    return (
        f"checkpoints: asynchronous saves stage {staged / 2**20:.1f} MiB of host memory per "
        f"rank ({parts}; pinned on CUDA), held for the run"
    )


def _meta_model(conf: dict, model: nn.Module | None, input_shapes):
    """The model on the meta device (built from ``conf["model"]`` unless given), its type name
    and the per-sample input shapes (given, or the model's input-shape rules)."""
    if model is None:
        model, model_type = build_meta_model(conf)
    else:
        model_type = str((conf.get("model") or {}).get("type", type(model).__name__))
        model = copy.deepcopy(model).to("meta")
    shapes = tuple(
        tuple(int(v) for v in s)
        for s in (input_shapes if input_shapes is not None else model_input_shapes(model))
    )
    return model, model_type, shapes


def _trainer_value(conf: dict, trainer: TrainerConfig | None, key: str):
    """``trainer.<key>``: from the parsed section when the caller has it, else parsed from
    ``conf`` as the trainer parses it."""
    return getattr(trainer, key) if trainer is not None else trainer_option(conf, key)


def _fsdp_note(conf: dict, trainer, data, dims, amp: bool, notes: list) -> str | None:
    """The note saying FSDP2 is not applied (a shard group of one rank, SPEC §4), or None where
    it is (or the data mode is not FSDP2); the note also goes to ``notes``."""
    if data != DataMode.FSDP2 or dims is None:
        return None
    single_rank = _trainer_value(conf, trainer, "fsdp2_single_rank")
    note = fsdp2_layout_note(dims.fsdp_group_size, single_rank, amp)
    if note is not None:
        notes.append(note)
    return note


def make_plan(
    conf: dict,
    world_size: int,
    *,
    model: nn.Module | None = None,
    input_shapes: Sequence[Sequence[int]] | None = None,
    parallelism: Mapping | None = None,
    dims: ParallelDims | None = None,
    trainer: TrainerConfig | None = None,
    device: str = "auto",
) -> Plan:
    """Plan a run of ``conf`` on ``world_size`` ranks, without starting any process.

    ``conf`` is the FULL config (``model:``, ``trainer: {parallelism: ..., batch_size, amp}``).
    ``model``/``input_shapes`` override building ``conf["model"]`` and the input-shape rules
    (for models outside the registry; per-sample shapes without the batch dim).  A caller that
    parsed the run config passes ``parallelism`` (the block), ``dims`` and ``trainer``.
    ``device`` ("cuda", "cpu", "auto": :func:`resolve_plan_device`): the device type whose
    convolution workspace the memory counts (``cost.conv_workspace_bytes``).  Raises
    ``ValueError`` only for an unusable config: a bad ``trainer.parallelism`` block, a world
    size that is not an integer >= 1, a missing/unknown ``model.type`` or bad model arguments,
    or a model that cannot be traced on the meta device; every other problem is a violation.
    """
    block = parallelism if parallelism is not None else parse_parallelism_conf(conf)
    device = resolve_plan_device(device)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"--world-size must be an integer >= 1, got {world_size!r}")
    violations: list[str] = []
    notes: list[str] = []
    data, tp = block["data"], block["tensor"]
    n, lon = domain_degrees(block["domain"])
    dims, dp = _layout(block, world_size, dims, violations, notes)
    batch_size, amp, policy, chains = _run_settings(conf, trainer, violations)
    fsdp_note = _fsdp_note(conf, trainer, data, dims, amp, notes)
    # what step 4 of the recipe applies: nothing for FSDP2 at a one-rank group
    applied = DataMode.NONE if fsdp_note is not None else data

    # ---- the model, on meta, traced once
    model, model_type, shapes = _meta_model(conf, model, input_shapes)
    tp_partial_gradient_findings(model, shapes, tp, notes, violations)  # before the domain trace
    trace, layers = traced_layers(
        model, shapes, n, amp, violations, notes, policy=policy, chains=chains if lon == 1 else False,
        batch=batch_size, device=device,
    )  # fmt: skip
    double = not amp and next((p.dtype for p in model.parameters()), None) == torch.float64
    tile_layers, tile_levels, refusals = [], [], None
    if lon > 1:
        refusals, tile_layers, tile_levels = tile_plans(
            model, trace, shapes, (n, lon), double, violations, notes
        )
    levels = domain_levels(shapes, layers, trace, n, violations, notes)
    window_constraints(model, shapes, layers, n, violations, notes)

    # ---- memory and communication
    memory, tp_listed, units, local_numels = memory_per_rank(
        model, trace, layers, shapes, levels, data=applied, dp=dp, tp=tp, n=n, batch_size=batch_size, amp=amp,
        violations=violations, notes=notes, device=device, q=lon, tile_layers=tile_layers or None,
        min_unit_params=_trainer_value(conf, trainer, "fsdp2_min_unit_params"),
    )  # fmt: skip
    act_bytes = memory.activation_dtype_bytes
    halo_per_rank = halo_bytes_per_rank(tile_layers or layers, batch_size, act_bytes, n * lon)
    collectives = collectives_per_rank(
        tile_layers or layers, applied, dp, tp, n * lon, tp_listed, units, local_numels
    )
    if n > 1 and layers:
        notes.append(_FIRST_STEP_NOTE)
    notes.append(_staging_note(conf, trainer, memory.param_bytes))
    notes.extend(ensemble_notes(conf, dims, model, shapes, batch_size, act_bytes))
    splits = split_projections(
        model, trace, (n, lon), refusals, notes, batch_size=batch_size, dtype_bytes=act_bytes,
        double=double, dp=max(dp, 1),
    )  # fmt: skip
    ranks, omitted = _rank_entries(dims) if dims is not None else ([], 0)
    return Plan(
        world_size=world_size, data=data, tp=tp, domain=n, dp=dp, dims=dims,
        mesh_axes=dims.mesh_axes if dims is not None else (), ranks=ranks, ranks_omitted=omitted,
        model_type=model_type, model_class=type(model).__name__, input_shapes=shapes,
        batch_size=batch_size, amp=amp, parameter_count=memory.param_bytes_unsharded // PARAM_BYTES,
        levels=levels, layers=layers, memory=memory, halo_bytes_per_rank=halo_per_rank,
        halo_bytes_per_step=sum(halo_per_rank), collectives=collectives,
        tp_targets=[(t.path, t.role) for t in tp_listed],
        fsdp_units=[name or "<root>" for name, _ in units], violations=violations, notes=notes,
        domain_shape=(n, lon), tile_levels=tile_levels, tile_layers=tile_layers, splits=splits,
        fsdp2_applied=fsdp_note is None,
    )  # fmt: skip
