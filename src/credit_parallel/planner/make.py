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
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..domain.convert import validate_sharding_constraints
from ..domain.layers.gather import gather_cost_note
from ..domain.plan import sharing_step
from ..domain.rows import shard_sizes
from ..layout.config import DataMode, ParallelDims, domain_degrees, parse_parallelism_conf
from ..layout.mesh import full_rank_layout
from ..layout.run_config import TrainerConfig, trainer_option
from ..parallel.fsdp import FSDP2_MIN_UNIT_PARAMS, fsdp2_layout_note
from .cost import (
    PLAN_DEVICES,
    DomainLayerPlan,
    MemoryEstimate,
    activation_parts,
    fsdp_units,
    layer_call_plan,
    local_numel,
    predicted_collectives,
    predicted_halo_bytes,
    tp_split_dims,
)
from .fsdp_merge import merge_advice
from .halo_chains import chain_exchanges
from .split import project_splits, refusal_reason, split_note
from .tile_fusions import fuse_tile_plans
from .tiles import TileLayerPlan, tile_halo_bytes, tile_layer_plans
from .tiles import tile_levels as tile_levels_of
from .tp_partial import tp_partial_gradient_findings
from .trace import (
    build_meta_model,
    conversion_plan,
    model_input_shapes,
    plan_relayouts,
    plan_targets,
    trace_model,
)

__all__ = ["MAX_RANKS_LISTED", "Plan", "RankEntry", "make_plan", "resolve_plan_device"]

SHARD_DIM = -2  # latitude, as convert_to_domain_parallel shards it by default
MAX_RANKS_LISTED = 64  # every rank is listed up to this world size, else a sample
_SAMPLE_HEAD, _SAMPLE_TAIL = 32, 8
_PARAM_BYTES = 4  # parameters, gradients and AdamW moments stay fp32 (also under amp)


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
        dp, tp, dom = layout.coords(g)
        entries.append(
            RankEntry(
                g,
                dp,
                tp,
                dom,
                tuple(layout.ranks_along_dim("dp", g)),
                tuple(layout.ranks_along_dim("tp", g)),
                tuple(layout.ranks_along_dim("domain", g)),
            )
        )
    return entries, world - len(chosen)


def _layout(block: Mapping, world_size: int, dims, violations: list, notes: list):
    """(dims or None, dp) of the parallel degrees on ``world_size`` ranks; every problem of the
    layout, as :meth:`ParallelDims.problems` words it, is a violation."""
    data, tp, n = block["data"], block["tensor"], block["domain"]
    violations.extend(ParallelDims.problems(data, tp, n, world_size))
    if dims is None:
        try:
            dims = ParallelDims(data, tp, n, world_size)
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


def tile_refusals_of_model(model) -> list[tuple[str, str]]:
    """(path, reason) of the modules ``convert_to_domain_parallel`` refuses under a
    two-dimensional (lat x lon) manager (``domain/tiles_convert.py``), planned without a process
    group; the modules refused under any domain are reported by the 1-D checks, not here."""
    from ..domain.convert import plan_conversion
    from ..domain.tiles_convert import relayout_on_tiles, tile_refusals

    plan = plan_conversion(model, None, fuse_exchanges=False, errors="record")
    return tile_refusals(model, relayout_on_tiles(model, plan, plan, None))


def _tile_limits(model, lat: int, lon: int, violations: list, notes: list) -> list:
    """A two-dimensional domain (SPEC §3b): what the plan counts per tile; the modules not yet
    exact on lat x lon tiles are violations (as the converter refuses them)."""
    notes.append(
        f"two-dimensional domain {lat} x {lon}: the rows per level and the layer table below "
        f"are the latitude split (P = {lat}); the tiles per level, the halo bytes per rank "
        "(rows first, then columns of the row-extended tile: corners ride with the column "
        "pass, longitude wraps periodically), the collectives and the memory count the "
        f"{lat} x {lon} tiles"
    )
    refusals = tile_refusals_of_model(model)
    for path, reason in refusals:
        violations.append(f"{path}: {reason}")
    return refusals


def _collectives(layers, data, dp, tp, size, tp_listed, units, local_numels) -> dict:
    """:func:`~credit_parallel.planner.cost.predicted_collectives` of the plan."""
    return predicted_collectives(
        layers,
        data=data,
        dp=max(dp, 1),
        tp=tp,
        domain=size,
        tp_row_layers=sum(1 for t in tp_listed if t.role == "row"),
        tp_col_layers=sum(1 for t in tp_listed if t.role == "col"),
        tp_fused_layers=sum(1 for t in tp_listed if t.role == "col" and t.parts > 1),
        fsdp_units=len(units),
        grad_sizes_bytes=[v * _PARAM_BYTES for v in local_numels.values()],
    )


def _tiles(model, trace, shapes, shape, double: bool, violations: list, notes: list):
    """(refused modules, ``tiles.TileLayerPlan`` of every layer call, tiles per grid size) of a
    lat x lon domain of ``shape`` (P, Q)."""
    refusals = _tile_limits(model, *shape, violations, notes)
    layers = fuse_tile_plans(model, trace, tile_layer_plans(trace, shape, double), shape, double)
    return refusals, layers, tile_levels_of(shapes, layers, shape)


def _splits(model, trace, shape, refusals, notes: list, **kw) -> list:
    """``split.SplitProjection`` of every split of the P x Q domain ranks; the note naming the
    best one goes to ``notes`` (``plan --world-size N``, issue 26 item 5)."""
    size = shape[0] * shape[1]
    if size <= 1 or not trace.calls:
        return []
    if refusals is None:
        refusals = tile_refusals_of_model(model)
    splits = project_splits(trace, size, refused=refusal_reason(refusals), **kw)
    note = split_note(splits, shape)
    if note:
        notes.append(note)
    return splits


def _traced_layers(
    model, shapes, n: int, amp: bool, violations: list, notes: list, *, policy, chains=False,
    batch: int = 1, device: str = "cpu",
):  # fmt: skip
    """(trace, one DomainLayerPlan per domain-layer call) of the meta model, converted as
    ``convert_to_domain_parallel(..., nonlocal_policy=policy, halo_chains=chains)`` would
    convert it (the chains cut for ``batch`` samples on ``device``: ``halo_chains.py``)."""
    param_dtype = next((p.dtype for p in model.parameters()), torch.get_default_dtype())
    double = param_dtype == torch.float64 and not amp  # float64 interpolation indices
    itemsize = 2 if amp else param_dtype.itemsize
    plan = conversion_plan(model, policy, chains if n > 1 else False)
    targets, unsafe = plan_targets(plan), plan.unsafe
    runnable = [t for t in targets if not isinstance(t[2], Exception)]
    trace = trace_model(model, shapes, runnable, plan_relayouts(plan))
    for path, _, err in targets:
        if isinstance(err, Exception) and n > 1:
            violations.append(f"{path}: convert_to_domain_parallel cannot convert it: {err}")
    if n > 1:
        for path, reason in unsafe:
            violations.append(
                f"{path}: {reason}; convert_to_domain_parallel refuses it under domain > 1 "
                "(replace it, declare _domain_local = True if it truly is row-local, set "
                "trainer.domain_nonlocal_policy: gather to run it on the whole globe, or use "
                "trainer.parallelism.domain: 1)"
            )
    exchanges = _fused_exchanges(plan, trace, n)
    exchanges.update(chain_exchanges(plan, trace, n, batch, itemsize, device, notes))
    linked_norms = {id(f.norm) for f in plan.norm_conv}  # statistics with the conv's exchange
    layers = []
    seen_calls: dict[str, int] = {}
    for index, (path, _, replacement, in_shape, out_shape, x) in enumerate(trace.calls):
        seen_calls[path] = seen_calls.get(path, 0) + 1
        label = path if seen_calls[path] == 1 else f"{path} (call {seen_calls[path]})"
        layer = layer_call_plan(
            label, replacement, in_shape, out_shape, n, double, exchanges.get(index), itemsize
        )
        layer = dataclasses.replace(layer, input_grad=bool(x.requires_grad))
        if id(replacement) in linked_norms:
            layer = dataclasses.replace(layer, stats_with_exchange=True)
        layers.append(layer)
    gathered = [layer.path for layer in layers if layer.form == "gather"]
    if gathered and n > 1:
        notes.append(
            f"trainer.domain_nonlocal_policy: gather: {', '.join(gathered)}: {gather_cost_note(n)}"
        )
    return trace, layers


def _fused_exchanges(plan, trace, n: int) -> dict:
    """``{call index: exchange}`` (see ``cost.layer_call_plan``) for the calls whose exchange
    the converter's plan fuses (``domain/plan.py``): a pad followed by a conv exchanges once,
    for the conv; sibling convs on one input exchange the union of their windows once, at the
    calls where the run-time rule ``sharing_step`` exchanges."""
    pad_of = {id(f.conv): f for f in plan.pad_conv}
    fused_pads = {id(f.pad) for f in plan.pad_conv}
    group_of = {id(layer): g for g in plan.shared_inputs for layer in g.layers}
    out, served_by, inactive = {}, {}, set()
    for index, (_, _, layer, in_shape, _, x) in enumerate(trace.calls):
        dim = SHARD_DIM % len(in_shape)
        group = group_of.get(id(layer))
        if id(layer) in fused_pads:
            out[index] = False
        elif id(layer) in pad_of:
            fusion = pad_of[id(layer)]
            left, right, top, bottom = fusion.pad.padding
            shape = list(in_shape)
            shape[dim] -= top + bottom
            shape[-1] -= left + right
            out[index] = (fusion.windows(shape[dim], n), tuple(shape))
        elif group is not None and id(group) not in inactive:
            entry = served_by.get(id(group))  # (input, siblings served) of the last exchange
            member = group.layers.index(layer)
            same = entry is not None and entry[0] is x
            exchanges, active = sharing_step(None if entry is None else entry[1], member, same)
            if not exchanges:
                entry[1].add(member)
                out[index] = False
                if len(entry[1]) == len(group.layers):
                    served_by[id(group)] = None  # all served: the next call exchanges afresh
                continue
            if not active:
                inactive.add(id(group))  # a stack, not siblings: every later call alone
            out[index] = (group.windows(in_shape[dim], n), in_shape)
            served_by[id(group)] = (x, {member})
    return out


def _levels(shapes, layers, trace, n: int, violations: list, notes: list):
    """Every height an input, a domain layer or an output has, largest first, with its rows per
    rank; checks each level and each layer call against the domain size."""
    first_seen: dict[int, str] = {}
    for s in shapes:
        first_seen.setdefault(s[SHARD_DIM % (len(s) + 1) - 1], "model input")
    for layer in layers:
        first_seen.setdefault(layer.in_height, f"input of {layer.path}")
        first_seen.setdefault(layer.out_height, f"output of {layer.path}")
    for s in trace.model_outputs:
        if len(s) >= 3:
            first_seen.setdefault(s[SHARD_DIM % len(s)], "model output")
    heights = sorted(first_seen, reverse=True)
    levels = [(h, shard_sizes(h, n)) for h in heights]
    for index, h in enumerate(heights):
        if h < n:
            # exact (SPEC §3), but the empty ranks idle through this level
            notes.append(
                f"level {index} has {h} rows, fewer than domain ranks ({n}) ({first_seen[h]}): "
                f"domain ranks {h}..{n - 1} hold no rows there (exact; they idle at this level)"
            )
    for layer in layers:
        if layer.error is not None:
            violations.append(f"{layer.path}: cannot run over {n} domain ranks: {layer.error}")
    for layer in layers:
        for r, peers in enumerate(layer.peers):
            far = [q for q in peers if abs(q - r) > 1 and {q, r} != {0, n - 1}]
            if far:
                notes.append(
                    f"{layer.path}: domain rank {r} receives rows from rank(s) {far} beyond its "
                    "neighbours (a shard thinner than the halo it serves; multi-hop exchange, "
                    "exact but more messages)"
                )
    return levels


_EXACT_ATTENTION_FORMS = ("relayout", "regroup", "sequence")


def _window_constraints(model, shapes, layers, n: int, violations: list, notes: list) -> None:
    """``validate_sharding_constraints`` at every local height.  Its warnings are violations,
    except when the converter makes the model's attention exact for any shard layout (the
    attention modules it converts: windows re-laid out, strided groups regrouped, sequence
    parallel); then they are notes (``verify`` proves the bundled CrossFormer exact at domain 3
    with windows cut by shard boundaries: tests/test_verify_models.py)."""
    if n <= 1 or not shapes:
        return
    exact = sorted({lay.path for lay in layers if lay.form in _EXACT_ATTENTION_FORMS})
    h0 = shapes[0][SHARD_DIM % (len(shapes[0]) + 1) - 1]
    sizes = shard_sizes(h0, n)
    for local_h in sorted(set(s for s in sizes if s >= 1)):
        ranks = [r for r, s in enumerate(sizes) if s == local_h]
        for warning in validate_sharding_constraints(model, local_h):
            where = f"validate_sharding_constraints(local_h={local_h}, domain ranks {ranks})"
            if exact:
                notes.append(
                    f"{where}: {warning}; exact anyway: the converter re-lays out / regroups the "
                    f"rows of {', '.join(exact)} around the cut windows (see comm/call)"
                )
                continue
            violations.append(
                f"{where}: {warning}; choose model.image_height and trainer.parallelism.domain so "
                "every shard is a multiple of window size x level stride"
            )


def _memory(
    model, trace, layers, shapes, levels, *, data, dp, tp, n, batch_size, amp, violations, notes,
    min_unit_params=FSDP2_MIN_UNIT_PARAMS, device="cpu", q=1, tile_layers=None,
):  # fmt: skip
    """(MemoryEstimate, tp targets, FSDP units, local parameter numels) of one rank."""
    split, tp_listed = tp_split_dims(model, tp, violations)
    if tp > 1 and not tp_listed:
        notes.append(
            "tensor > 1 but the model declares no _tp_col/_tp_row layers: every tp rank "
            "repeats the same work"
        )
    # FSDP2 shards over the flattened dp x domain axis (composition.apply_data_parallel)
    fsdp_dp = dp * n * q if data == DataMode.FSDP2 and dp * n * q > 1 else 1
    local_numels, full_numel = {}, 0
    for pname, p in model.named_parameters():
        full_numel += p.numel()
        local_numels[pname] = local_numel(p.shape, split.get(pname), tp, fsdp_dp)
    param_bytes = sum(local_numels.values()) * _PARAM_BYTES
    units = fsdp_units(model, min_unit_params) if data == DataMode.FSDP2 else []
    if units:
        item = 2 if amp else _PARAM_BYTES
        advice = merge_advice(model, min_unit_params, split=split, tp=tp, item_bytes=item)
        if advice is not None:
            notes.append(advice)
    params = dict(model.named_parameters())
    largest_unit = max(
        (
            sum(local_numel(params[p].shape, split.get(p), tp, 1) for p in names)
            for _, names in units
        ),
        default=0,
    )
    param_dtype = next((p.dtype for p in model.parameters()), torch.get_default_dtype())
    act_bytes = 2 if amp else param_dtype.itemsize
    parts = activation_parts(
        trace, layers, shapes, {h for h, _ in levels}, n,
        batch_size=batch_size, act_bytes=act_bytes, data_bytes=param_dtype.itemsize, device=device,
        q=q, tile_layers=tile_layers,
    )  # fmt: skip
    memory = MemoryEstimate(
        param_bytes=param_bytes,
        grad_bytes=param_bytes,
        optimizer_bytes=2 * param_bytes,
        param_bytes_unsharded=full_numel * _PARAM_BYTES,
        fsdp_largest_unit_bytes=largest_unit * (2 if amp else _PARAM_BYTES),
        activation_dtype_bytes=act_bytes,
        **parts,
    )
    return memory, tp_listed, units, local_numels


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


def _halo_bytes_per_rank(layers, batch_size: int, dtype_bytes: int, n: int) -> tuple:
    """Bytes each of the ``n`` domain ranks sends per step: from the 1-D layer plans, or from
    the tile plans (``tiles.TileLayerPlan``) of a lat x lon domain."""
    tiles = bool(layers) and isinstance(layers[0], TileLayerPlan)
    count = tile_halo_bytes if tiles else predicted_halo_bytes
    return tuple(
        count(layers, batch_size=batch_size, dtype_bytes=dtype_bytes, domain_rank=r)
        for r in range(n)
    )


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
    single_rank = (
        trainer.fsdp2_single_rank if trainer is not None
        else trainer_option(conf, "fsdp2_single_rank")
    )  # fmt: skip
    fsdp_note = None
    if data == DataMode.FSDP2 and dims is not None:
        fsdp_note = fsdp2_layout_note(dims.fsdp_group_size, single_rank, amp)
    if fsdp_note is not None:
        notes.append(fsdp_note)
    # what step 4 of the recipe applies: nothing for FSDP2 at a one-rank group
    applied = DataMode.NONE if fsdp_note is not None else data

    # ---- the model, on meta, traced once
    model, model_type, shapes = _meta_model(conf, model, input_shapes)
    tp_partial_gradient_findings(model, shapes, tp, notes, violations)  # before the domain trace
    trace, layers = _traced_layers(
        model, shapes, n, amp, violations, notes, policy=policy, chains=chains if lon == 1 else False,
        batch=batch_size, device=device,
    )  # fmt: skip
    double = not amp and next((p.dtype for p in model.parameters()), None) == torch.float64
    tile_layers, tile_levels, refusals = [], [], None
    if lon > 1:
        refusals, tile_layers, tile_levels = _tiles(
            model, trace, shapes, (n, lon), double, violations, notes
        )
    levels = _levels(shapes, layers, trace, n, violations, notes)
    _window_constraints(model, shapes, layers, n, violations, notes)

    # ---- memory and communication
    memory, tp_listed, units, local_numels = _memory(
        model, trace, layers, shapes, levels, data=applied, dp=dp, tp=tp, n=n, batch_size=batch_size, amp=amp,
        violations=violations, notes=notes, device=device, q=lon,
        tile_layers=tile_layers or None,
        min_unit_params=(
            trainer.fsdp2_min_unit_params if trainer is not None
            else trainer_option(conf, "fsdp2_min_unit_params")
        ),
    )  # fmt: skip
    act_bytes = memory.activation_dtype_bytes
    halo_per_rank = _halo_bytes_per_rank(tile_layers or layers, batch_size, act_bytes, n * lon)
    collectives = _collectives(
        tile_layers or layers, applied, dp, tp, n * lon, tp_listed, units, local_numels
    )
    if n > 1 and layers:
        notes.append(_FIRST_STEP_NOTE)
    splits = _splits(
        model, trace, (n, lon), refusals, notes, batch_size=batch_size, dtype_bytes=act_bytes,
        double=double, dp=max(dp, 1),
    )  # fmt: skip
    ranks, omitted = _rank_entries(dims) if dims is not None else ([], 0)
    return Plan(
        world_size=world_size,
        data=data,
        tp=tp,
        domain=n,
        dp=dp,
        dims=dims,
        mesh_axes=dims.mesh_axes if dims is not None else (),
        ranks=ranks,
        ranks_omitted=omitted,
        model_type=model_type,
        model_class=type(model).__name__,
        input_shapes=shapes,
        batch_size=batch_size,
        amp=amp,
        parameter_count=memory.param_bytes_unsharded // _PARAM_BYTES,
        levels=levels,
        layers=layers,
        memory=memory,
        halo_bytes_per_rank=halo_per_rank,
        halo_bytes_per_step=sum(halo_per_rank),
        collectives=collectives,
        tp_targets=[(t.path, t.role) for t in tp_listed],
        fsdp_units=[name or "<root>" for name, _ in units],
        violations=violations,
        notes=notes,
        domain_shape=(n, lon),
        tile_levels=tile_levels,
        tile_layers=tile_layers,
        splits=splits,
        fsdp2_applied=fsdp_note is None,
    )
