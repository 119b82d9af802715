"""The domain-layer calls of a plan: what :func:`~credit_parallel.planner.make.make_plan` learns
from the model traced once on the meta device (pure: no processes).

Per layer call its :class:`~credit_parallel.planner.cost.DomainLayerPlan` (converted as
``convert_to_domain_parallel`` would convert it, with the exchanges the converter fuses and the
halo chains it cuts), every height level with its rows per domain rank, the window constraints
of attention, and for a lat x lon domain the tile plans, the refused modules and the projection
of every P x Q split.  Each function appends what it finds to the plan's ``violations`` /
``notes`` lists instead of stopping at the first problem.
"""

from __future__ import annotations

import dataclasses

import torch

from ..domain.convert import validate_sharding_constraints
from ..domain.layers.gather import gather_cost_note
from ..domain.plan import sharing_step
from ..domain.rows import shard_sizes
from .cost import layer_call_plan, predicted_halo_bytes
from .halo_chains import chain_exchanges
from .split import project_splits, refusal_reason, split_note
from .tile_fusions import fuse_tile_plans
from .tiles import TileLayerPlan, tile_halo_bytes, tile_layer_plans
from .tiles import tile_levels as tile_levels_of
from .trace import conversion_plan, plan_relayouts, plan_targets, trace_model

__all__ = [
    "domain_levels",
    "fused_exchanges",
    "halo_bytes_per_rank",
    "split_projections",
    "tile_limits",
    "tile_plans",
    "tile_refusals_of_model",
    "traced_layers",
    "window_constraints",
]

SHARD_DIM = -2  # latitude, as convert_to_domain_parallel shards it by default


def tile_refusals_of_model(model) -> list[tuple[str, str]]:
    """(path, reason) of the modules ``convert_to_domain_parallel`` refuses under a
    two-dimensional (lat x lon) manager (``domain/tiles_convert.py``), planned without a process
    group; the modules refused under any domain are reported by the 1-D checks, not here."""
    from ..domain.convert import plan_conversion
    from ..domain.tiles_convert import relayout_on_tiles, tile_refusals

    plan = plan_conversion(model, None, fuse_exchanges=False, errors="record")
    return tile_refusals(model, relayout_on_tiles(model, plan, plan, None))


def tile_limits(model, lat: int, lon: int, violations: list, notes: list) -> list:
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


def tile_plans(model, trace, shapes, shape, double: bool, violations: list, notes: list):
    """(refused modules, ``tiles.TileLayerPlan`` of every layer call, tiles per grid size) of a
    lat x lon domain of ``shape`` (P, Q)."""
    refusals = tile_limits(model, *shape, violations, notes)
    layers = fuse_tile_plans(model, trace, tile_layer_plans(trace, shape, double), shape, double)
    return refusals, layers, tile_levels_of(shapes, layers, shape)


def split_projections(model, trace, shape, refusals, notes: list, **kw) -> list:
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


def traced_layers(
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
    exchanges = fused_exchanges(plan, trace, n)
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


def fused_exchanges(plan, trace, n: int) -> dict:
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


def domain_levels(shapes, layers, trace, n: int, violations: list, notes: list):
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


def window_constraints(model, shapes, layers, n: int, violations: list, notes: list) -> None:
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


def halo_bytes_per_rank(layers, batch_size: int, dtype_bytes: int, n: int) -> tuple:
    """Bytes each of the ``n`` domain ranks sends per step: from the 1-D layer plans, or from
    the tile plans (``tiles.TileLayerPlan``) of a lat x lon domain."""
    tiles = bool(layers) and isinstance(layers[0], TileLayerPlan)
    count = tile_halo_bytes if tiles else predicted_halo_bytes
    return tuple(
        count(layers, batch_size=batch_size, dtype_bytes=dtype_bytes, domain_rank=r)
        for r in range(n)
    )
