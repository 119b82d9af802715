"""What the converter does with modules not exact on lat x lon tiles (SPEC §3b): re-lays them
to latitude strips (``tiles_relayout.py``) when they are exact on 1-D strips, refuses the rest;
never silently wrong.

On a two-dimensional domain a rank holds some rows AND some columns.  A domain layer is exact
there only when it says so (class attribute ``tile_exact = True``: the convolutions of
``layers/conv.py`` through ``layers/conv_tiles.py``, the 2-D padding modules
(``DomainParallelPad._forward_tile``), GroupNorm through its statistics over the
whole P x Q group); every other replacement the converter would make (interpolation, padding,
pixel shuffle, attention, the gather policy, FuXi / Swin adapters, ...) is refused, naming the
module.  So are modules the 1-D converter leaves alone because they are ROW-local, which says
nothing about columns: padding modules other than the 2-D ones (which are converted), modules that declare
``_domain_local = True`` without also declaring ``_tile_local = True`` (each output position
computed from its own input position only), and conv subclasses with their own forward whose
kernel reaches other columns.  The refusal can be planned without a process group
(``planner.make.tile_refusals_of_model``, what ``credit-parallel plan`` reports).

All of these are exact on 1-D latitude strips: :func:`relayout_on_tiles` puts each outermost
one (with the replacements below it) in a
:class:`~credit_parallel.domain.tiles_relayout.TileStripRelayout` running the decisions of the
1-D plan of the same model (the converter's plan over ``manager.strips``), so what remains
refused is what a 1-D domain refuses too.
"""

from __future__ import annotations

import warnings

from torch import nn

from .fusion import find_fusions, find_norm_conv
from .layers.conv_geometry import conv_needs_domain_wrapper
from .plan import ConversionPlan, PlannedModule
from .tiles_relayout import TileStripRelayout
from .wrap import converted_tree

__all__ = [
    "check_tiles",
    "gathered_paths",
    "relayout_on_tiles",
    "tile_refusals",
    "tile_refusal_message",
    "tile_fusions",
]

_PADS = (
    nn.modules.padding._ConstantPadNd,
    nn.modules.padding._ReflectionPadNd,
    nn.modules.padding._ReplicationPadNd,
    nn.modules.padding._CircularPadNd,
)
_PADS_2D = (nn.ConstantPad2d, nn.ReflectionPad2d, nn.ReplicationPad2d, nn.CircularPad2d)
_CONVS = (nn.ConvTranspose3d, nn.ConvTranspose2d, nn.Conv3d, nn.Conv2d)
UNSUPPORTED = "two-dimensional (lat x lon) domains do not support it yet"


def _left_alone_reason(module: nn.Module) -> str | None:
    """Why a module the 1-D converter leaves alone is not exact on tiles, or None."""
    if getattr(module, "_domain_local", None) is True:
        if getattr(module, "_tile_local", None) is True:
            return None
        return (
            "declares _domain_local = True (row-local) but not _tile_local = True (each output "
            f"position from its own input position); {UNSUPPORTED}"
        )
    if isinstance(module, _PADS) and not isinstance(module, _PADS_2D):
        # 2-D padding modules are converted on tiles (DomainParallelPad); others are not
        return f"pads longitude on a tile; {UNSUPPORTED}"
    for base in _CONVS:
        if isinstance(module, base) and type(module).forward is not base.forward:
            w = len(module.kernel_size) - 1
            if conv_needs_domain_wrapper(module, w):
                return f"overrides {base.__name__}.forward and reaches other columns; {UNSUPPORTED}"
    return None


def tile_refusals(model: nn.Module, plan) -> list[tuple[str, str]]:
    """(path, reason) of every module of ``model`` that ``plan`` (a
    :class:`~credit_parallel.domain.plan.ConversionPlan` of it) leaves inexact on tiles."""
    found = []
    decided = {}
    on_strips = [m.path for m in plan.replacements() if m.stage == "strips"]
    for entry in plan.replacements():
        decided[entry.path] = entry.replacement
        if entry.stage == "custom" or getattr(entry.replacement, "tile_exact", False):
            continue
        if any(_under(entry.path, top) for top in on_strips):
            continue  # a 1-D decision run on latitude strips (relayout_on_tiles)
        old, new = type(entry.original).__name__, type(entry.replacement).__name__
        found.append((entry.path, f"{old} (as {new}): {UNSUPPORTED}"))
    refused = {path for path, _ in found}

    def visit(module: nn.Module, path: str) -> None:
        display = path or "<root>"
        module = decided.get(display, module)
        if display in decided:
            return  # a replacement: judged above, its inside is its own
        if getattr(module, "_domain_parallel", False) and not getattr(
            module, "_domain_convert_children", False
        ):
            return
        reason = _left_alone_reason(module)
        if reason is not None and display not in refused:
            found.append((display, f"{type(module).__name__} {reason}"))
            return
        for name, child in module._modules.items():
            if child is not None:
                visit(child, f"{path}.{name}" if path else name)

    visit(model, "")
    return found


def tile_refusal_message(refusals: list[tuple[str, str]]) -> str:
    listing = "\n  ".join(f"{path}: {reason}" for path, reason in refusals)
    return (
        "convert_to_domain_parallel: modules not exact on lat x lon tiles (a two-dimensional "
        "trainer.parallelism.domain):\n  " + listing + "\nUse an int domain (latitude only), "
        "or replace them (exact on tiles today: Conv2d/Conv3d, ConvTranspose2d/3d, "
        "PeriodicConv2d, the 2-D padding modules, GroupNorm, interpolation, pixel shuffle, "
        "point-wise / channel-wise modules, a bare nn.MultiheadAttention on the tile's tokens, "
        "and on latitude strips what a 1-D domain makes exact)."
    )


def check_tiles(model: nn.Module, plan, allow_unsafe: bool) -> None:
    """Refuse (``ValueError``; with ``allow_unsafe`` a warning) the modules of ``model`` that
    ``plan`` leaves inexact on tiles (``convert_to_domain_parallel`` under a tiled manager)."""
    refusals = tile_refusals(model, plan)
    if refusals and not allow_unsafe:
        raise ValueError(tile_refusal_message(refusals))
    if refusals:
        warnings.warn(tile_refusal_message(refusals), stacklevel=3)


def _under(path: str, top: str) -> bool:
    return top == "<root>" or path == top or path.startswith(top + ".")


def _strip_inner(model, path: str, tiled: ConversionPlan, strips: ConversionPlan):
    """The module the strips run at ``path``: the 1-D plan's replacement there, or (a module
    both plans leave alone) the module itself; None when the two plans disagree there."""
    tiled_at = {m.path: m for m in tiled.replacements()}.get(path)
    strip_at = {m.path: m for m in strips.modules}.get(path)
    if strip_at is not None:
        if strip_at.error is not None:
            return None
        if tiled_at is not None and tiled_at.stage != strip_at.stage:
            return None
        if isinstance(strip_at.original, nn.MultiheadAttention):
            return None  # its input is tokens, not a tile: the module that flattens them must
            # declare {"form": "tokens"} to run on strips
        return strip_at.replacement
    if tiled_at is not None:
        return None
    decided = {m.path: m.replacement for m in strips.replacements()}
    tree = dict(converted_tree(model, lambda p, mod: decided.get(p, mod)))
    module = tree.get("" if path == "<root>" else path)
    if isinstance(module, _PADS):
        return None  # the 1-D converter leaves non-2-D padding alone: not known exact on strips
    return module


def relayout_on_tiles(model: nn.Module, tiled: ConversionPlan, strips: ConversionPlan, manager):
    """The plan on tiles: ``tiled`` (the plan over the tile manager), where every outermost
    module :func:`tile_refusals` names runs on latitude strips in a ``TileStripRelayout`` of
    the decisions ``strips`` (the 1-D plan over ``manager.strips``, or None when planning
    without a process group) makes at and below its path.  Modules whose 1-D decision fails or
    differs stay refused."""
    tops = []

    def depth(item) -> int:  # outermost first: the root, then by nesting
        return -1 if item[0] == "<root>" else item[0].count(".")

    for path, _ in sorted(tile_refusals(model, tiled), key=depth):
        if any(_under(path, top) for top in tops):
            continue
        inner = _strip_inner(model, path, tiled, strips)
        if inner is not None:
            tops.append(path)
    if not tops:
        return tiled
    out = ConversionPlan(tiled.shard_dim, tiled.nonlocal_policy)
    out.unsafe, out.gathered = list(tiled.unsafe), list(tiled.gathered)
    out.modules = [m for m in tiled.modules if not any(_under(m.path, t) for t in tops)]
    outside = lambda *paths: not any(_under(p, t) for p in paths for t in tops)  # noqa: E731
    # the exchange fusions of the tile layers left (inside a relayout the strips' plan runs)
    out.pad_conv = [f for f in tiled.pad_conv if outside(f.pad_path, f.conv_path)]
    out.norm_conv = [f for f in tiled.norm_conv if outside(f.norm_path, f.conv_path)]
    out.shared_inputs = [g for g in tiled.shared_inputs if outside(*g.paths)]
    for top in tops:
        inner = _strip_inner(model, top, tiled, strips)
        dim = getattr(inner, "shard_dim", tiled.shard_dim)
        wrapper = TileStripRelayout(inner, dim, manager=manager).configure(module_path=top)
        original = {m.path: m.original for m in tiled.replacements()}.get(top, inner)
        out.modules.append(PlannedModule(top, "strips", original, wrapper))
        out.modules += [
            m for m in strips.modules if _under(m.path, top) and m.path != top and m.error is None
        ]
    return out


def gathered_paths(plan: ConversionPlan) -> list[str]:
    """Paths of the modules ``plan`` runs on the whole globe (the gather policy), also when a
    relayout to strips holds the gathering wrapper."""
    return [
        m.path
        for m in plan.modules
        if m.stage == "gather"
        or (m.stage == "strips" and getattr(m.replacement.wrapped, "domain_form", "") == "gather")
    ]


def tile_fusions(model: nn.Module, decided: dict) -> tuple[list, list, list]:
    """(``(pad, conv)`` pairs, sibling conv groups, ``(norm, activation, conv)`` triples) of the
    domain layers ``decided`` (path -> replacement) puts in ``model`` that share their exchanges
    on lat x lon tiles (``fusion.py``, ``tiles=True``): what the layout planner counts
    (``planner/tile_fusions.py``)."""
    tree = list(converted_tree(model, lambda path, module: decided.get(path, module)))
    pairs, groups = find_fusions(None, tree=tree, tiles=True)
    taken = {id(conv) for _, conv in pairs} | {id(c) for g in groups for c in g}
    return pairs, groups, find_norm_conv(None, tree=tree, taken=taken, tiles=True)
