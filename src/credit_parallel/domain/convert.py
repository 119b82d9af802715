"""Converting a model for domain parallelism: one rule per module type, one plan, then apply.

:func:`convert_to_domain_parallel` first DECIDES (:func:`plan_conversion`, a
:class:`~credit_parallel.domain.plan.ConversionPlan`, replacing nothing and needing no process
group), then APPLIES (:func:`apply_conversion_plan`).  The plan is decided in stages, each on
the tree the earlier ones decided: whole CREDIT models whose forwards read the global grid
(FuXi: ``fuxi.credit_model_decision``; CREDIT's boundary padding: ``tensor_padding.py``;
its interpolation to the global size: ``credit_interp.py``), attention of a known structure
(``attention.recognise.known_attention_decision``), the rule walk (:func:`walk_domain_modules`:
the caller's ``custom_converters`` first, then the registered rule of each type), the refused
modules wrapped to run on the whole globe under ``nonlocal_policy="gather"``, and the exchange
fusions (``fusion.find_fusions``).  The layout planner reads the same plan (``planner/trace.py``).

The rule walk replaces every module whose result along latitude depends on rows it does not own
(convolutions that are not row-local, GroupNorm, Upsample, periodic convs, padding over H,
PixelShuffle/Unshuffle) by its domain-parallel layer, leaves point-wise and channel-wise modules
alone, and REFUSES modules that would compute something silently different on a shard
(BatchNorm, pooling, unknown attention over H, flattening over H, LayerNorm over H): a ``ValueError``
listing every offending path, unless ``allow_unsafe=True`` (then a warning lists them).
A module class may declare ``_domain_local = True`` (each output row depends only on its own
input row, e.g. window attention whose windows stay inside a shard) or ``False``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from torch import nn

from .adapters.credit_interp import credit_adapter_decision
from .adapters.fuxi import NONLOCAL_CLASSES
from .adapters.recognise import known_attention_decision, qualified_name, recognised_attention_form
from .adapters.swin import SWIN_SHARD_DIM, swin_family, swin_unshardable_reason
from .fusion import apply_fusions, apply_norm_conv, find_fusions, find_halo_chains, find_norm_conv
from .layers.conv import conv_needs_domain_wrapper
from .layers.empty_rows import guard_row_local_convs
from .layers.gather import NONLOCAL_POLICIES, DomainGatherModule, gather_cost_note
from .layers.halo_chain import HaloChainRun, install_halo_chains
from .options import OptionsMixin
from .plan import (
    ConversionPlan,
    HaloChainFusion,
    NormConvFusion,
    PadConvFusion,
    PlannedModule,
    SharedInputGroup,
    halo_chain_mode,
)
from .rules import CONV_BASES, DOMAIN_RULES, DomainRule, domain_rule_for, register_domain_rule
from .tiles_convert import check_tiles, gathered_paths, relayout_on_tiles
from .traced_heights import install_height_probe
from .wrap import converted_tree, visit_outermost

__all__ = [
    "DOMAIN_RULES",
    "DomainRule",
    "apply_conversion_plan",
    "convert_to_domain_parallel",
    "domain_rule_for",
    "find_unsafe_modules",
    "apply_domain_rule",
    "plan_conversion",
    "register_domain_rule",
    "validate_sharding_constraints",
    "walk_domain_modules",
]

_UNSAFE_TYPES = (
    nn.modules.batchnorm._BatchNorm,
    nn.modules.pooling._MaxPoolNd,
    nn.modules.pooling._AvgPoolNd,
    nn.modules.pooling._AdaptiveAvgPoolNd,
    nn.modules.pooling._AdaptiveMaxPoolNd,
    nn.modules.pooling._LPPoolNd,
    # nn.MultiheadAttention is converted (domain/attention/tokens.py), not refused.  nn.Flatten
    # stays: flattening C,H,W (its default start_dim=1) puts H inside the merged dim
    nn.Flatten,
    nn.Unflatten,
    nn.SyncBatchNorm,
    nn.LocalResponseNorm,
)


def _custom_forward_conv_reason(module: nn.Module, shard_dim: int) -> str | None:
    """A conv subclass with its own ``forward`` whose kernel reaches other rows: the built-in
    rule would replace that forward by the plain conv's, so it can be neither kept nor wrapped."""
    for base, rank in CONV_BASES:
        if isinstance(module, base):
            if type(module).forward is base.forward:
                return None
            if conv_needs_domain_wrapper(module, shard_dim % rank - 2):
                return (
                    f"{type(module).__name__} overrides {base.__name__}.forward and its kernel "
                    "reaches neighbouring rows; the converter cannot rewrite a custom forward "
                    "(pass custom_converters for it)"
                )
            return None
    return None


def _unsafe_reason(module: nn.Module, shard_dim: int = -2) -> str | None:
    declared = getattr(module, "_domain_local", None)
    if declared is True:
        return None
    if declared is False:
        return "declares _domain_local = False"
    name = type(module).__name__
    nonlocal_reason = NONLOCAL_CLASSES.get(qualified_name(module))
    if nonlocal_reason is not None:
        return f"{name} {nonlocal_reason}"
    swin_reason = swin_unshardable_reason(module)
    if swin_reason is not None:
        return f"{name}: {swin_reason}"  # reported whole: its roll and mask span the block
    if recognised_attention_form(module) is not None:
        return None  # made exact by domain/attention, not refused
    if isinstance(module, _UNSAFE_TYPES):
        return f"{name} mixes rows across latitude"
    custom_conv = _custom_forward_conv_reason(module, shard_dim)
    if custom_conv is not None:
        return custom_conv
    if isinstance(module, nn.LayerNorm) and len(module.normalized_shape) >= 2:
        return f"LayerNorm over {tuple(module.normalized_shape)} normalises across latitude"
    for word in ("Attention", "Pool", "BatchNorm"):
        if word in name:
            if word == "Attention" and _holds_exact_attention(module):
                return None
            return f"{name} may mix rows across latitude ({word}); declare _domain_local = True if it does not"
    return None


def _holds_exact_attention(module: nn.Module) -> bool:
    """A module named *Attention* is not refused by name when its attention is a submodule the
    converter makes exact (recognised, declared, or already converted): its own forward then
    delegates the attention to it; the functional calls around it are what
    ``credit-parallel verify`` checks (domain/guard.py)."""
    return any(
        sub is not module
        and (
            getattr(sub, "domain_form", None) in ("relayout", "regroup", "sequence")
            or recognised_attention_form(sub) is not None
        )
        for sub in module.modules()
    )


def _display(path: str) -> str:
    return "<root>" if path == "root" else path.removeprefix("root.")


def _is_domain_parallel(module: nn.Module) -> bool:
    return bool(getattr(module, "_domain_parallel", False))


def apply_domain_rule(module: nn.Module, manager, shard_dim: int):
    """The replacement the registered rule gives ``module``, or None (no rule, or left alone)."""
    rule = domain_rule_for(module)
    return None if rule is None else rule(module, manager, shard_dim)


def walk_domain_modules(
    model: nn.Module,
    on_candidate: Callable[[nn.Module, str, str, nn.Module], bool],
    on_unsafe: Callable[[str, str], None] | None = None,
    custom: dict[type, Callable[[nn.Module], nn.Module | None]] | None = None,
    shard_dim: int = -2,
) -> nn.Module:
    """Walk ``model`` (the root included) exactly as the converter's rule stage does; returns the
    root, which is a custom replacement when ``model`` itself is of a ``custom`` type.

    Already domain-parallel modules and ``_domain_local = True`` modules are skipped (not
    descended into); a module of a ``custom`` type is replaced, in place, by the custom
    callable's result; an unsafe module is reported to ``on_unsafe(path, reason)``;
    every other module goes to ``on_candidate(parent, name, path, module)``, which returns True
    when it handled (replaced) the module — otherwise its children are visited.  Paths are as
    users see them ("<root>" for the model itself).
    """

    def on_custom(parent, name, path, child, replacement):
        parent._modules[name] = replacement

    return _walk(model, on_candidate, on_unsafe, custom or {}, shard_dim, on_custom)


def _walk(model, on_candidate, on_unsafe, custom, shard_dim, on_custom, occupant=None):
    """:func:`walk_domain_modules` over the tree in which ``occupant(path, module)`` gives the
    module at each path (the converter's decisions so far; default: the module itself)."""
    occupant = occupant or (lambda path, module: module)

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in list(module.named_children()):
            path = f"{prefix}.{name}" if prefix else name
            child = occupant(_display(path), child)
            if _is_domain_parallel(child):
                if getattr(child, "_domain_convert_children", False):
                    walk(child, path)  # runs the module's own forward on the local rows
                continue
            typ = next((t for t in custom if isinstance(child, t)), None)
            if typ is not None:
                replacement = custom[typ](child)
                if replacement is not None and replacement is not child:
                    on_custom(module, name, _display(path), child, replacement)
                continue
            reason = _unsafe_reason(child, shard_dim)
            if reason is not None:
                if on_unsafe is not None:
                    on_unsafe(_display(path), reason)
                continue
            if getattr(child, "_domain_local", None) is True:
                continue
            if recognised_attention_form(child) is not None:
                continue  # made exact whole (the converter's attention stage replaces it)
            if not on_candidate(module, name, _display(path), child):
                walk(child, path)

    # The root itself may be a single layer (e.g. a bare Conv2d): walk it through a holder.
    holder = nn.Module()
    holder._modules["root"] = model
    walk(holder, "")
    return holder._modules["root"]


def find_unsafe_modules(model: nn.Module) -> list[tuple[str, str]]:
    """(path, reason) of every module the converter would refuse (not descending into them)."""
    found = []
    walk_domain_modules(model, lambda *_: False, lambda path, reason: found.append((path, reason)))
    return found


def _check_arguments(shard_dim: int, custom_converters, nonlocal_policy: str) -> dict:
    if nonlocal_policy not in NONLOCAL_POLICIES:
        raise ValueError(f"nonlocal_policy must be 'raise' or 'gather', got {nonlocal_policy!r}")
    if shard_dim >= 0 or shard_dim < -3:
        raise ValueError(
            f"shard_dim must be given from the end (-2 is latitude in B,C,H,W and B,C,T,H,W), got {shard_dim}"
        )
    custom = dict(custom_converters or {})
    for key, fn in custom.items():
        if not isinstance(key, type) or not callable(fn):
            raise TypeError(
                f"custom_converters must map module types to callables, got {key!r}: {fn!r}"
            )
    return custom


def plan_conversion(
    model: nn.Module,
    manager,
    shard_dim: int = -2,
    custom_converters: dict[type, Callable] | None = None,
    nonlocal_policy: str = "raise",
    *,
    fuse_exchanges: bool = True,
    errors: str = "raise",
    halo_chains=False,
) -> ConversionPlan:
    """DECIDE what :func:`convert_to_domain_parallel` does to ``model``, replacing nothing:
    the :class:`~credit_parallel.domain.plan.ConversionPlan` (see ``plan.py``).  Its stages, in
    order, each on the tree the earlier ones decided: whole CREDIT models whose forwards read
    the global grid (FuXi, ``adapters/fuxi.py``), attention of a known structure (``attention/``), then
    the rule walk (``custom_converters`` first, then the registered rule of each type;
    refusing unsafe modules), under ``nonlocal_policy="gather"`` the refused modules wrapped to
    run on the whole globe, and last the exchange fusions (``fusion.py``).

    ``manager`` may be None (the layout planner: layers resolve their manager only when they
    run).  ``errors="raise"``: a module a rule cannot convert raises ``ValueError``/``TypeError``
    naming its path; ``"record"``: the plan lists it (:attr:`ConversionPlan.errors`).
    ``halo_chains``: see :func:`convert_to_domain_parallel`."""
    custom = _check_arguments(shard_dim, custom_converters, nonlocal_policy)
    chains = halo_chain_mode(halo_chains)
    if errors not in ("raise", "record"):
        raise ValueError(f"errors must be 'raise' or 'record', got {errors!r}")
    plan = ConversionPlan(shard_dim, nonlocal_policy)
    decided: dict[str, nn.Module] = {}  # display path -> the module it holds once converted
    skip = tuple(custom)
    gathering = nonlocal_policy == "gather"

    def occupant(path: str, module: nn.Module) -> nn.Module:
        return decided.get(path, module)

    def decide(path: str, stage: str, original, replacement) -> None:
        decided[path] = replacement
        plan.modules.append(PlannedModule(path, stage, original, replacement))

    def stage(name: str, decision):
        def visit(module: nn.Module, path: str):
            try:
                new = decision(module, path)
                if new is None and gathering and _unsafe_reason(module, shard_dim) is not None:
                    return module  # gathered below: runs whole, its descendants stay original
            except ValueError as err:
                if errors == "raise":
                    raise
                plan.modules.append(PlannedModule(path or "<root>", name, module, None, err))
                return module
            if new is not None and new is not module:
                decide(path or "<root>", name, module, new)
            return new

        visit_outermost(model, visit, occupant)

    stage(
        "adapter",
        lambda m, path: credit_adapter_decision(
            m, path, manager, shard_dim, skip, nonlocal_policy, _append_to(plan.gathered)
        ),
    )
    stage("attention", lambda m, path: known_attention_decision(m, path, manager, shard_dim, skip))

    def on_custom(parent, name, path, child, replacement) -> None:
        decide(path, "custom", child, replacement)

    def candidate(parent, name, path, child) -> bool:
        try:
            replacement = apply_domain_rule(child, manager, shard_dim)
        except (ValueError, TypeError) as err:
            if errors == "raise":
                # a layer that cannot be made exact: say WHICH module (SPEC §0), keep the reason
                raise type(err)(
                    f"convert_to_domain_parallel: cannot convert {path} ({type(child).__name__}): {err}"
                ) from err
            plan.modules.append(PlannedModule(path, "rule", child, None, err))
            return True
        if replacement is None:
            return False
        if isinstance(replacement, OptionsMixin):
            # layers name their module path in errors (e.g. too few output rows)
            replacement.configure(module_path=path)
        decide(path, "rule", child, replacement)
        return True

    root = occupant("<root>", model)
    _walk(root, candidate, _append_to(plan.unsafe), custom, shard_dim, on_custom, occupant)
    if plan.unsafe and nonlocal_policy == "gather":
        _gather_unsafe(plan, dict(converted_tree(model, occupant)), decided, decide, manager)
    if fuse_exchanges:
        tiles = getattr(manager, "is_tiled", False)
        _plan_fusions(plan, list(converted_tree(model, occupant)), tiles, None if tiles else chains)
    return plan


def _gather_unsafe(plan: ConversionPlan, at: dict, decided: dict, decide, manager) -> None:
    """``nonlocal_policy="gather"``: each module the walk refused (``plan.unsafe``, ``at``: the
    converted tree by path) wrapped to run on the whole globe, its descendants left original."""
    for path, _ in plan.unsafe:
        for below in plan.keep_whole(path):  # run whole: its descendants stay original
            decided.pop(below, None)
        module = at["" if path == "<root>" else path]
        # (B, H, W, C) Swin blocks shard their dim -3 whatever the model's shard_dim
        dim = SWIN_SHARD_DIM if swin_family(module) is not None else plan.shard_dim
        wrapper = DomainGatherModule(module, dim, manager=manager)
        decide(path, "gather", module, wrapper.configure(module_path=path))
    plan.unsafe = []


def _append_to(found: list):
    return lambda *item: found.append(tuple(item))


def _plan_fusions(plan: ConversionPlan, tree: list, tiles: bool = False, chains=None) -> None:
    """The exchange fusions of ``tree`` (on lat x lon tiles: those with a tile form).  With
    ``chains`` ("auto" or a length, 1-D rows only) the halo chains are found first: under
    "auto" around the norm + conv links (a linked conv already exchanges with its norm), under
    a fixed length before them; the pad + conv pairs, sibling groups and norm links then take
    what the chains left."""
    path_of: dict[int, str] = {}
    for path, module in tree:
        path_of.setdefault(id(module), path or "<root>")
    in_chains: set[int] = set()
    if chains is not None:
        linked = set()
        if chains == "auto":
            for norm, _, conv in find_norm_conv(None, tree=tree):
                linked |= {id(norm), id(conv)}
        for container, first, members in find_halo_chains(
            None, tree=tree, taken=linked, mode=chains
        ):
            run = HaloChainRun(first, members, chains)
            paths = tuple(path_of[id(m)] for m in members)
            plan.halo_chains.append(
                HaloChainFusion(path_of.get(id(container), "<root>"), paths, run, container)
            )
            in_chains |= {id(m) for m in members}
    pairs, groups = find_fusions(None, tree=tree, tiles=tiles)
    pairs = [(p, c) for p, c in pairs if id(p) not in in_chains and id(c) not in in_chains]
    groups = [[c for c in g if id(c) not in in_chains] for g in groups]
    groups = [g for g in groups if len(g) >= 2]
    for pad, conv in pairs:
        plan.pad_conv.append(PadConvFusion(path_of[id(pad)], path_of[id(conv)], pad, conv))
    for group in groups:
        plan.shared_inputs.append(
            SharedInputGroup(tuple(path_of[id(c)] for c in group), tuple(group))
        )
    taken = {id(conv) for _, conv in pairs} | {id(c) for g in groups for c in g} | in_chains
    for norm, act, conv in find_norm_conv(None, tree=tree, taken=taken, tiles=tiles):
        paths = (path_of[id(norm)], path_of[id(conv)])
        plan.norm_conv.append(NormConvFusion(*paths, norm, act, conv))


def apply_conversion_plan(model: nn.Module, plan: ConversionPlan) -> nn.Module:
    """APPLY ``plan`` (from :func:`plan_conversion` on this ``model``): put every replacement
    in its place, in the order decided, then let the fused layers share their exchanges.
    Returns the model (the root itself may be replaced)."""
    if plan.errors:
        raise ValueError(f"apply_conversion_plan: the plan has errors:\n{plan}")
    root = model
    for entry in plan.replacements():
        if entry.path == "<root>":
            root = entry.replacement
            continue
        parent_path, _, name = entry.path.rpartition(".")
        parent = root
        for part in parent_path.split(".") if parent_path else ():
            parent = parent._modules[part]
        parent._modules[name] = entry.replacement
    apply_fusions(
        [(f.pad, f.conv) for f in plan.pad_conv], [list(g.layers) for g in plan.shared_inputs]
    )
    apply_norm_conv([(f.norm, f.activation, f.conv) for f in plan.norm_conv])
    runs: dict[int, tuple] = {}  # per Sequential, every run of it
    for fusion in plan.halo_chains:
        runs.setdefault(id(fusion.container), (fusion.container, []))[1].append(fusion.run)
    for container, found in runs.values():
        install_halo_chains(container, found)
    guard_row_local_convs(root)  # the convs left alone also run on a rank with 0 rows
    return root


def convert_to_domain_parallel(
    model: nn.Module,
    manager,
    shard_dim: int = -2,
    custom_converters: dict[type, Callable] | None = None,
    allow_unsafe: bool = False,
    nonlocal_policy: str = "raise",
    *,
    fuse_exchanges: bool = True,
    halo_chains=False,
) -> nn.Module:
    """Replace, in place, the modules of ``model`` that need neighbouring rows by their
    domain-parallel layers; returns the model (also attached as ``model._domain_manager``).

    ``custom_converters`` maps a module type to ``callable(module) -> replacement``; it is
    checked before the built-in rules and the children of a replaced module are not visited.
    Modules that would be silently wrong under H-sharding raise ``ValueError`` listing their
    paths, unless ``allow_unsafe=True`` (then a warning lists them).  Attention of a known
    structure is made exact first (``domain/attention``; before it, whole CREDIT models whose
    forwards read the global grid, FuXi: ``domain/adapters/fuxi.py``); ``nonlocal_policy="gather"``
    runs every module that would be reported on the whole globe instead (``domain/layers/gather.py``).
    ``fuse_exchanges``: let a padding layer and the conv after it, and sibling convs on one
    input, share exchanges (``fusion.py``; the results are the same).  ``halo_chains``
    (opt-in; 1-D rows): False (default), True / ``"auto"`` (the cost model cuts each run of
    stencil layers into chains per call geometry) or an int k >= 2 (chains of at most k
    stencils): a chain exchanges once for all its stencils (``layers/halo_chain.py``).

    Two steps: :func:`plan_conversion` decides everything (the plan the layout planner reads
    too), then, once no refused module is left, :func:`apply_conversion_plan` applies it.
    """
    custom = _check_arguments(shard_dim, custom_converters, nonlocal_policy)
    if manager is None:
        raise ValueError("convert_to_domain_parallel needs a DomainParallelManager (got None)")
    tiled = getattr(manager, "is_tiled", False)  # lat x lon tiles (tiles_convert.py)
    plan = plan_conversion(
        model,
        manager,
        shard_dim,
        custom,
        nonlocal_policy,
        fuse_exchanges=fuse_exchanges,
        halo_chains=halo_chains if fuse_exchanges else False,
    )
    if tiled:  # what is not exact on tiles runs on latitude strips (tiles_relayout.py)
        strips = plan_conversion(
            model, manager.strips, shard_dim, custom, nonlocal_policy, fuse_exchanges=False
        )
        plan = relayout_on_tiles(model, plan, strips, manager)
        check_tiles(model, plan, allow_unsafe)
    for where, why in plan.gathered:
        warnings.warn(
            f"nonlocal_policy='gather': {where} ({why}): "
            + gather_cost_note(manager.domain_world_size),
            stacklevel=2,
        )
    gathered = gathered_paths(plan)
    if gathered:
        warnings.warn(
            "nonlocal_policy='gather': "
            + ", ".join(gathered)
            + ": "
            + gather_cost_note(manager.domain_world_size),
            stacklevel=2,
        )
    if plan.unsafe:
        listing = "\n  ".join(f"{p}: {r}" for p, r in plan.unsafe)
        message = (
            "modules that would be silently wrong under latitude (H) sharding:\n  "
            + listing
            + "\nReplace them, declare `_domain_local = True` on a class that truly is row-local, "
            "pass custom_converters, or pass allow_unsafe=True to keep them anyway "
            "(then verify with `credit-parallel verify`)."
        )
        if not allow_unsafe:
            raise ValueError(message)
        warnings.warn(message, stacklevel=2)
    model = apply_conversion_plan(model, plan)
    try:
        vars(model)["_domain_manager"] = manager  # read by composition.get_domain_manager
    except TypeError:
        pass
    if hasattr(manager, "height_table") and manager.domain_world_size > 1:
        # torch.compile(model) then derives every layer's global height at trace time
        install_height_probe(model, manager)
    if getattr(manager, "domain_world_size", 1) > 1:  # random draws: one process's (SPEC §0)
        from .random_draws import DrawLayout, install_layout_independent_draws

        install_layout_independent_draws(model, DrawLayout(manager))
    return model


def validate_sharding_constraints(model: nn.Module, local_h: int, window_sizes=None) -> list[str]:
    """Warnings (empty when fine): ``local_h`` not divisible by the window size at each encoder
    level after downsampling.

    Window sizes come from ``window_sizes`` or the model's ``window_sizes`` attribute; the
    cumulative downsampling factor of each level from the model's ``level_strides`` attribute
    (default ``2**level``).  Both may also be found on a submodule.
    """
    if isinstance(local_h, bool) or not isinstance(local_h, int) or local_h < 1:
        raise ValueError(f"local_h must be an integer >= 1, got {local_h!r}")

    def find(attr):
        for m in model.modules():
            v = getattr(m, attr, None)
            if v is not None:
                return v
        return None

    if window_sizes is None:
        window_sizes = find("window_sizes")
        if window_sizes is None:
            return []
    if isinstance(window_sizes, int):
        window_sizes = [window_sizes]
    strides = find("level_strides")
    if strides is None:
        strides = [2**i for i in range(len(window_sizes))]
    if len(strides) < len(window_sizes):
        raise ValueError(
            f"model.level_strides {list(strides)} has fewer levels than window_sizes {list(window_sizes)}"
        )
    warnings_out = []
    for level, (w, s) in enumerate(zip(window_sizes, strides)):
        w = w[0] if isinstance(w, (tuple, list)) else w
        if local_h % s:
            warnings_out.append(
                f"level {level}: local height {local_h} is not divisible by the downsampling factor {s}"
            )
            continue
        h = local_h // s
        if h % w:
            warnings_out.append(
                f"level {level}: local height {h} (= {local_h} / {s}) is not divisible by the window size {w}; "
                "windows would cross shard boundaries"
            )
    return warnings_out
