"""Global heights under ``torch.compile`` of the whole model, with no eager call first.

A domain layer needs the GLOBAL height of the tensor it is handed (its exchange plan, its output
rows); eagerly it asks the domain group (``manager.global_length``).  A compiled graph cannot
ask, and should not: the heights are a function of the input shapes alone.  They are derived at
trace time, on the host, without communication:

* the batch's row layout is fixed when it is sharded: ``shard_tensor`` / ``shard_batch`` register
  the GLOBAL input shapes with the manager (its forward token, :func:`token_heights`);
* :func:`install_height_probe` (called by ``convert_to_domain_parallel``) keeps a shape-only
  twin of the converted model (every parameter and buffer on the meta device, each converted
  layer replaced by a recorder that runs the layer's original module) and puts a forward
  pre-hook on the model;
* when Dynamo traces the model's forward, that hook hands the local input shapes and the token to
  :func:`_probe_at_trace` (``assume_constant_result``: run for real at trace time, not put in the
  graph).  It gives each input its global height (the one registered height whose balanced
  shard on this rank has the input's local height), runs the twin once on meta tensors of those
  GLOBAL shapes, and notes for every converted layer the global heights it is called with;
* each traced layer then reads its height with :func:`traced_height` (again run at trace time
  only): the one noted height whose balanced shard on this rank has its local height.

On lat x lon tiles (SPEC §3b) the same is done for the WIDTH (the last dim): the twin runs at
the registered global H x W (the height from this rank's latitude shard, the width from its
longitude shard, :func:`global_inputs`), and each layer's height is noted in the latitude axis
view's table, its width in the longitude view's (``manager.py``), read back by each view.

Every rank traces the same forward on the same registered global shapes, so every rank derives
the same heights; a layer called at two global heights some rank could not tell apart by its
local height is refused on every rank alike (:meth:`HeightTable.resolve`).  Dynamo guards the
graph on the manager's token, so a new global shape retraces on every rank.  Nothing is written
on the user's modules: the heights live in the manager's :class:`HeightTable`, the twin in the
hook's :class:`HeightProbe`.
"""

from __future__ import annotations

import copy
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from .rows import shard_sizes

__all__ = [
    "HeightProbe",
    "HeightTable",
    "describe_input",
    "global_inputs",
    "global_meta",
    "install_height_probe",
    "shape_twin",
    "token_heights",
    "token_widths",
    "traced_height",
]


class HeightTable:
    """The global heights each owner (a domain layer, or any object asking ``global_length``) was
    called with, per forward token: noted by eager calls (``manager.global_length``) and by the
    trace-time probe; read back under ``torch.compile`` by :func:`traced_height`.  Keyed by
    ``id(owner)``, each entry dropped when its owner is collected; owners are never written to."""

    def __init__(self):
        self._entries: dict[int, tuple[str, dict]] = {}

    def note(self, owner, token, height: int) -> None:
        key = id(owner)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = (_name_of(owner), {})
            weakref.finalize(owner, self._entries.pop, key, None)
        entry[1].setdefault(token, set()).add(int(height))

    def heights(self, owner, token) -> set:
        entry = self._entries.get(id(owner))
        return set(entry[1].get(token, ())) if entry is not None else set()

    def resolve(self, owner_id: int, token, local: int, n: int, rank: int) -> int:
        """The global height of ``local`` rows on ``rank`` of ``n`` among the heights noted for
        the owner under ``token``; an error when none is noted, or when two noted heights give
        some rank the same local height (the same decision on every rank)."""
        name, by_token = self._entries.get(owner_id, ("a domain layer", {}))
        noted = sorted(by_token.get(token, ()))
        found = [h for h in noted if shard_sizes(h, n)[rank] == local]
        if not found:
            raise RuntimeError(
                f"{name}: no global height known for {local} local rows under torch.compile "
                f"(heights noted for this input shape: {noted or 'none'}).  Shard the inputs with "
                "credit_parallel.shard_tensor / shard_batch (they register the global shape; a "
                "hand-sliced input states it with credit_parallel.declare_global_shape) and "
                "compile the whole model (torch.compile(model)), or compile it with "
                "credit_parallel.compile_blocks"
            )
        height = found[0]
        clash = _clash(height, noted, n)
        if clash is not None:
            raise RuntimeError(
                f"{name} is called at global heights {height} and {clash[0]} in one forward, "
                f"which rank {clash[1]} of {n} cannot tell apart by its local height: under "
                "torch.compile each call's height must follow from the local one; compile this "
                "model with credit_parallel.compile_blocks instead"
            )
        return height


def _clash(height: int, noted, n: int):
    mine = shard_sizes(height, n)
    for other in noted:
        if other != height:
            theirs = shard_sizes(other, n)
            for r in range(n):
                if theirs[r] == mine[r]:
                    return other, r
    return None


def _name_of(owner) -> str:
    path = getattr(owner, "module_path", None)
    return f"{type(owner).__name__} ({path})" if path else type(owner).__name__


@torch._dynamo.assume_constant_result
def traced_height(manager, owner_id: int, token, local: int) -> int:
    """At trace time (a constant of the graph): the global height of ``local`` rows of the
    owner with ``id(owner) == owner_id`` under the forward ``token``; see :class:`HeightTable`."""
    return manager.height_table.resolve(
        owner_id, token, local, manager.domain_world_size, manager.domain_rank
    )


def token_heights(token, shard_dim: int) -> dict[int, set]:
    """The global heights a forward token registers, by sharded dim counted from the end:
    ``shard_tensor``'s ``("shard_tensor", shape, dim)``, ``shard_batch``'s ``("shard_batch",
    ((key, shape, dim), ...))``, or ``(name, (shape, ...))`` sharded along ``shard_dim``."""
    out: dict[int, set] = {}

    def add(shape, dim):
        shape = tuple(shape)
        d = dim % len(shape) - len(shape)
        out.setdefault(d, set()).add(int(shape[d]))

    if not isinstance(token, tuple) or len(token) < 2:
        return out
    if token[0] == "shard_tensor" and len(token) == 3:
        add(token[1], token[2])
    elif token[0] == "shard_batch":
        for _, shape, dim in token[1]:
            add(shape, dim)
    elif isinstance(token[1], tuple):
        for shape in token[1]:
            if isinstance(shape, tuple) and len(shape) >= 2:
                add(shape, shard_dim)
    return out


# ----------------------------------------------------------------------------- the shape twin
class _Recorder(nn.Module):
    """In the twin, in place of a converted layer: notes the global height of its input(s)
    along the layer's shard dim for the REAL layer, then runs the layer's original module."""

    def __init__(self, layer: nn.Module, owner: nn.Module, probe: HeightProbe):
        super().__init__()
        self.__dict__.update(layer=layer, owner=owner, probe=probe)

    def forward(self, *args, **kwargs):
        layer = self.layer
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if type(layer).__name__ != "DomainGatherModule":
            tensors = tensors[:1]
        dim = getattr(layer, "shard_dim", getattr(layer, "dim", -2))
        wdim = (dim + 1) % tensors[0].dim() if tensors and dim != -2 else -1
        for t in tensors:
            if t.dim() >= 2:  # the width: the dim after the rows (split on tiles only)
                self.probe.sink(self.owner, t.shape[dim % t.dim()], t.shape[wdim])
        if getattr(self.owner, "domain_form", None) != "strips":
            return _global_call(layer, args, kwargs)
        # a tile -> strips relayout (tiles_relayout.py): its module (a 1-D domain layer is
        # recorded too: it is held unregistered, so the twin's slots do not reach it), then the
        # height of the module's output, learned over the strips under the wrapper's own key
        inner = layer.__dict__["wrapped"]
        if _is_domain_layer(inner):
            inner = _Recorder(inner, self.owner.__dict__["wrapped"], self.probe)
        out = inner(*args, **kwargs)
        self.probe.sink_strips(self.owner._out_key, out.shape[dim % out.dim()])
        return out


def _global_call(layer: nn.Module, args, kwargs):
    """What ``layer`` computes on the whole globe: its original module, or ``F.interpolate``;
    a pad fused into the conv after it (``fusion.py``) passes its input on, and that conv pads
    it first."""
    options = getattr(layer, "_options", None)
    if getattr(options, "fused_into", None) is not None:
        return args[0]
    pad = getattr(options, "fused_pad", None)
    if pad is not None:
        args = (pad.wrapped(args[0]), *args[1:])
    # the module the layer was made from (a periodic conv's whole module, not its inner conv)
    wrapped = layer.__dict__.get("periodic", layer.__dict__.get("wrapped"))
    if wrapped is not None:
        return wrapped(*args, **kwargs)
    if hasattr(layer, "scale_factor") and hasattr(layer, "mode"):  # DomainParallelInterpolate
        return F.interpolate(
            args[0],
            size=layer.size,
            scale_factor=layer.scale_factor,
            mode=layer.mode,
            align_corners=layer.align_corners,
            recompute_scale_factor=layer.recompute_scale_factor,
        )
    raise NotImplementedError(
        f"{type(layer).__name__}: its global-height probe under torch.compile is not known; "
        "compile the model with credit_parallel.compile_blocks"
    )


def _is_domain_layer(module) -> bool:
    return getattr(type(module), "_domain_parallel", False) is True


def shape_twin(model: nn.Module, probe: HeightProbe) -> nn.Module:
    """A copy of ``model`` with every parameter and buffer on the meta device (no storage) and
    each converted layer replaced by a :class:`_Recorder` for the matching layer of ``model``."""
    memo = {}
    tensors = list(model.parameters()) + list(model.buffers())
    for m in model.modules():  # tensors held as plain attributes: no copy of their data either
        tensors += [v for v in vars(m).values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        memo[id(t)] = (
            nn.Parameter(torch.empty_like(t, device="meta"), t.requires_grad)
            if isinstance(t, nn.Parameter)
            else torch.empty_like(t, device="meta")
        )
    twin = copy.deepcopy(model, memo)
    real = list(model.named_modules(remove_duplicate=False))
    copied = list(twin.named_modules(remove_duplicate=False))
    owner_of = {id(c): r for (_, r), (_, c) in zip(real, copied)}
    slots = []
    for _, parent in copied:
        for name, child in parent._modules.items():
            if child is not None and _is_domain_layer(child):
                slots.append((parent, name, child))
    for parent, name, child in slots:
        parent._modules[name] = _Recorder(child, owner_of[id(child)], probe)
    for _, copy_ in copied:  # whole-model adapters (CREDIT's padding / interpolation) record
        if hasattr(copy_, "twin_forward"):  # their own heights: their twin runs globally
            copy_.__dict__["_twin_of"] = (owner_of[id(copy_)], probe)
    if _is_domain_layer(twin):
        twin = _Recorder(twin, model, probe)
    return twin


class HeightProbe:
    """The converted model's shape twin and the (token, input shapes) it has been run for."""

    def __init__(self, model: nn.Module, manager):
        self.manager = manager
        self._done: set = set()
        self._token = None
        self.twin, self.why = None, None
        try:
            self.twin = shape_twin(model, self)
        except Exception as e:  # an un-copyable model: compile_blocks still works
            self.why = f"{type(e).__name__}: {e}"

    def sink(self, owner, height: int, width: int) -> None:
        mgr = self.manager
        strips = mgr.__dict__.get("_strips") if getattr(mgr, "is_tiled", False) else None
        if strips is not None and getattr(owner, "manager", None) is strips:
            # a 1-D layer run on the latitude strips of a relayout (full width)
            strips.height_table.note(owner, self._token, height)
        elif getattr(mgr, "is_tiled", False):  # a lat x lon tile: each axis view's own table
            mgr.lat.height_table.note(owner, self._token, height)
            mgr.lon.height_table.note(owner, self._token, width)
        else:
            mgr.height_table.note(owner, self._token, height)

    def sink_strips(self, key, height: int) -> None:
        """Note ``height`` over the tiled manager's latitude strips under ``key``."""
        self.manager.strips.height_table.note(key, self._token, height)

    def run(self, token, args, kwargs) -> None:
        """Note the global heights of every converted layer for a forward on inputs described by
        ``args`` / ``kwargs`` (see :func:`describe_input`) under ``token``."""
        key = (token, args, kwargs)
        if key in self._done:
            return
        mgr = self.manager
        if self.twin is None:
            raise RuntimeError(
                f"torch.compile of a domain-parallel model: no shape twin ({self.why}); compile "
                "it with credit_parallel.compile_blocks"
            )
        if not token_heights(token, mgr.shard_dim):
            raise RuntimeError(
                "torch.compile of a domain-parallel model needs the global input shape: shard the "
                "inputs with credit_parallel.shard_tensor / shard_batch (they register it; a "
                "hand-sliced input states it with credit_parallel.declare_global_shape), or "
                "compile the model with credit_parallel.compile_blocks"
            )
        meta_args, meta_kwargs = global_inputs(mgr, token, args, kwargs)
        self._token = token
        try:
            with torch.no_grad():
                self.twin(*meta_args, **meta_kwargs)
        finally:
            self._token = None
        self._done.add(key)


def token_widths(token) -> set:
    """The global widths (last dims) of the shapes a forward token registers: on lat x lon
    tiles every registered tensor is split along its last dim too (``tiles.shard_tile``)."""
    out: set = set()
    if not isinstance(token, tuple) or len(token) < 2:
        return out
    if token[0] == "shard_tensor" and len(token) == 3:
        out.add(int(token[1][-1]))
    elif token[0] == "shard_batch":
        out.update(int(shape[-1]) for _, shape, _ in token[1])
    elif isinstance(token[1], tuple):
        out.update(int(s[-1]) for s in token[1] if isinstance(s, tuple) and len(s) >= 2)
    return out


def global_inputs(manager, token, args, kwargs) -> tuple[list, dict]:
    """Meta tensors of the GLOBAL shapes of the inputs described by ``args`` / ``kwargs``
    (:func:`describe_input`) under ``manager`` (None: the local shapes) and ``token``: the
    height from the rows of this rank's domain shard, and on lat x lon tiles the height from
    its latitude shard and the width (the last dim) from its longitude shard."""
    axes = [({}, 1, 0)]
    if manager is not None:
        heights = token_heights(token, manager.shard_dim)
        if getattr(manager, "is_tiled", False):
            (p, q), (lat, lon) = manager.domain_shape, manager.domain_coords
            axes = [(heights, p, lat), ({-1: token_widths(token)}, q, lon)]
        else:
            axes = [(heights, manager.domain_world_size, manager.domain_rank)]
    meta_args = [_global_meta_axes(d, axes) for d in args]
    return meta_args, {k: _global_meta_axes(d, axes) for k, d in kwargs}


def _global_meta_axes(desc, axes):
    for heights, n, rank in axes:
        desc = global_meta(desc, heights, n, rank, meta=False)
    return global_meta(desc, {}, 1, 0)


def global_meta(desc, heights: dict, n: int, rank: int, *, meta: bool = True):
    """A meta tensor of the GLOBAL shape of an input described as ``("tensor", shape, dtype)``;
    any other description is the value itself.  ``meta=False``: the description with the
    global shape (for a second axis)."""
    if not (isinstance(desc, tuple) and len(desc) == 3 and desc[0] == "tensor"):
        return desc
    shape = list(desc[1])
    for d, registered in heights.items():
        if len(shape) < 3 or -d > len(shape):
            continue
        found = [h for h in sorted(registered) if shard_sizes(h, n)[rank] == shape[d]]
        if len(found) > 1 or (found and _clash(found[0], registered, n) is not None):
            raise RuntimeError(
                f"torch.compile of a domain-parallel model: an input of local shape {desc[1]} "
                f"matches several registered global heights {sorted(registered)}; shard one "
                "global height per forward"
            )
        if found:
            shape[d] = found[0]
    if not meta:
        return ("tensor", tuple(shape), desc[2])
    return torch.empty(shape, dtype=desc[2], device="meta")


def describe_input(value):
    """An input as a constant Dynamo can hand to :func:`_probe_at_trace`."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(int(s) for s in value.shape), value.dtype)
    return value


@torch._dynamo.assume_constant_result
def _probe_at_trace(probe: HeightProbe, token, args, kwargs) -> bool:
    probe.run(token, args, kwargs)
    return True


def install_height_probe(model: nn.Module, manager) -> HeightProbe:
    """Keep ``model``'s shape twin and register the forward pre-hook that runs it when Dynamo
    traces the model (see the module docstring).  Eagerly the hook does nothing."""
    probe = HeightProbe(model, manager)

    def hook(module, args, kwargs):
        if torch.compiler.is_compiling():
            described = tuple(describe_input(a) for a in args)
            named = tuple((k, describe_input(v)) for k, v in kwargs.items())
            _probe_at_trace(probe, probe.manager._token, described, named)

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return probe
