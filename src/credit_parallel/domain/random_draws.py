"""Random draws that do not depend on the layout (SPEC §0): generate the global tensor, slice.

A model converted for domain (or ensemble) parallelism that draws random numbers on its
activations (``torch.randn_like(h)``, ``torch.randn(B, C, h, w)`` with its local sizes, dropout
masks) would draw each shard's numbers from its own stream, a different function from one
process's.  While such a model runs forward, :class:`LayoutIndependentDraws` (a
``TorchFunctionMode``) intercepts the draws and, from the generator state every rank holds
(one seed, the same calls in the same order), draws the GLOBAL tensor one process would draw,
then keeps this rank's part:

- a draw of 4 or more dims is a field ``(batch, ..., H, W)``: its local rows (and columns on
  a lat x lon tile) are cut at this rank's offsets, which one small all-gather of the local
  sizes over the domain group gives (any shard sizes, uneven included);
- a draw of 2 or 3 dims is latent ``(batch, ...)``: the same on every domain rank of a member;
- under an ensemble axis (E ranks, K/E members each, CREDIT's member order) dim 0 of every draw
  of 2 or more dims is the batch of members: the one-process batch has the K members of each
  sample, this rank keeps its K/E, so members differ as in one process and equal their
  one-process selves;
- dropout (``F.dropout``, ``dropout1d/2d/3d``, ``nn.Dropout*``): the mask comes from the same
  function applied to a global tensor of ones (the same draws as on the global activation) and
  multiplies the local activation; ``Tensor.normal_ / uniform_ / bernoulli_(p)``: global, sliced.

Draws it cannot make layout-independent (``randint``, ``randperm``, ``multinomial``,
``poisson``, ``torch.normal`` / ``bernoulli`` with tensor arguments on a field or an ensemble
batch, alpha dropout, in-place draws other than the three above, ``out=``) are refused with a
``ValueError`` naming the module that drew.  Generators passed explicitly are used as given
(the caller's state must be the same on every rank, as the default one is).

Memory: each draw holds its global tensor (K members x the global field for a field draw) for
the duration of the call; a counter-based generator drawing only the local part is a later
optimisation.  Communication: one all-gather of 2 integers per field draw over the domain group.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import re
import weakref
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = [
    "DrawLayout",
    "LayoutIndependentDraws",
    "MemberStreams",
    "member_noise",
    "draw_layout",
    "install_layout_independent_draws",
    "random_drawing_modules",
]

_FACTORIES = {torch.randn, torch.rand}
_LIKE = {torch.randn_like, torch.rand_like}
_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d}
_INPLACE = {torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.bernoulli_}
_REFUSED = {
    torch.randint,
    torch.randint_like,
    torch.randperm,
    torch.multinomial,
    torch.poisson,
    torch.Tensor.random_,
    torch.Tensor.exponential_,
    torch.Tensor.geometric_,
    torch.Tensor.cauchy_,
    torch.Tensor.log_normal_,
    F.alpha_dropout,
    F.feature_alpha_dropout,
}
_FIELD_NDIM = 4  # a draw of this many dims or more is a (batch, ..., H, W) field
_STREAMED = _FACTORIES | _LIKE | _INPLACE | _DROPOUTS | {torch.normal, torch.bernoulli}
_ACTIVE_STREAMS: list = []  # the MemberStreams of the forecast step running (member_noise)
_INSTALLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> hook handles


class MemberStreams:
    """One generator per member of the batch, seeded by ``(seed, member, key)`` and advanced
    by every draw of that member, whatever rank, batch position or domain shard it runs on."""

    def __init__(self, seed: int, members, key: int, device="cpu"):
        import numpy as np

        self.generators = []
        for member in members:
            entropy = np.random.SeedSequence((int(seed), int(member), int(key)))
            gen = torch.Generator(device=device)
            gen.manual_seed(int(entropy.generate_state(1, dtype=np.uint64)[0] >> 1))
            self.generators.append(gen)


def member_noise(steps, streams: MemberStreams, model: nn.Module, manager=None):
    """Run a rollout generator ``steps`` of ``model`` with ``streams`` active around each step,
    so that a stochastic model's members draw from their own seeded streams (``forecast
    --members``), the same whatever the layout; the draws are installed on ``model`` (at any
    layout, ``manager`` its domain manager or None) if ``parallelize`` did not."""
    install_layout_independent_draws(model, DrawLayout(manager), always=True)
    steps = iter(steps)
    while True:
        _ACTIVE_STREAMS.append(streams)
        try:
            item = next(steps)
        except StopIteration:
            return
        finally:
            _ACTIVE_STREAMS.pop()
        yield item


@dataclass(frozen=True)
class DrawLayout:
    """Where this rank's part of a draw lies: the domain ``manager`` (None: whole fields) and the
    ensemble coordinate ``ensemble_rank`` of ``ensemble_size`` ranks, each holding
    ``local_members`` consecutive members of every sample."""

    manager: object | None = None
    ensemble_rank: int = 0
    ensemble_size: int = 1
    local_members: int = 1
    samples: int | None = None  # samples per rank of this forward (its input's batch / members)
    batch: int | None = None  # this forward's input batch (samples x members)

    @property
    def splits_domain(self) -> bool:
        return self.manager is not None and self.manager.domain_world_size > 1

    @property
    def is_trivial(self) -> bool:
        return not self.splits_domain and self.ensemble_size == 1


class LayoutIndependentDraws(TorchFunctionMode):
    """The mode of the module docstring; ``where()`` names the module drawing (for errors)."""

    def __init__(
        self, layout: DrawLayout, where=lambda: "<model>", in_attention=lambda: False, streams=None
    ):
        super().__init__()
        self.layout = layout
        self.where = where
        self.in_attention = in_attention
        self.streams = streams  # MemberStreams: one generator per batch member (forecasts)
        self.replay = None  # () -> a context re-entering this mode (activation recompute)

    # ------------------------------------------------------------------ global <-> local
    def _refuse(self, func, why: str):
        name = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
        raise ValueError(
            f"{self.where()}: its random draw {name} {why}; it cannot be made the same at every "
            "layout (SPEC §0), so this model cannot run domain- or ensemble-parallel as written"
        )

    def _domain_extent(self, local: tuple[int, ...]):
        """(global H, W, first row, first column) of a field whose local (h, w) is given."""
        from ..layout.small_collectives import gather_small

        manager = self.layout.manager
        p, q = getattr(manager, "domain_shape", (manager.domain_world_size, 1))
        lat, lon = divmod(manager.domain_rank, q)
        mine = torch.tensor(local[-2:], dtype=torch.int64, device=manager.device)
        sizes = gather_small(mine, manager.domain_group).view(p, q, 2).tolist()
        height = sum(sizes[r][0][0] for r in range(p))
        width = sum(sizes[lat][c][1] for c in range(q))
        first_row = sum(sizes[r][0][0] for r in range(lat))
        first_col = sum(sizes[lat][c][1] for c in range(lon))
        return height, width, first_row, first_col

    def _window_chunks(self, func, local: tuple[int, ...]):
        """(global dim 0, cut) of a draw inside an attention module under a row split: each
        batch entry's windows are split over the domain ranks in rank order (the re-laid-out
        groups of ``domain/attention/relayout.py``); one all-gather of the local shapes."""
        from ..layout.small_collectives import gather_small

        manager, batch = self.layout.manager, self.layout.batch
        if getattr(manager, "is_tiled", False) or not batch or local[0] % batch:
            self._refuse(
                func,
                f"draws on a {len(local)}-D tensor inside an attention module whose windows "
                "are not a row split of the batch dim (lat x lon tiles, or an unknown batch)",
            )
        mine = torch.tensor(local, dtype=torch.int64, device=manager.device)
        shapes = gather_small(mine, manager.domain_group).tolist()
        if any(tuple(s[1:]) != local[1:] or s[0] % batch for s in shapes):
            self._refuse(func, "draws inside an attention module with shapes that differ by rank")
        chunks = [s[0] // batch for s in shapes]
        first, total, mine_c = sum(chunks[: manager.domain_rank]), sum(chunks), local[0] // batch

        def cut(g, first=first, count=mine_c, total=total):
            rest = g.shape[1:]
            return g.reshape(batch, total, *rest)[:, first : first + count].reshape(-1, *rest)

        return batch * total, cut

    def global_view(self, func, local: tuple[int, ...]):
        """(global shape, cut) for a draw of ``local`` shape: ``cut(global) -> local part``."""
        local = tuple(int(s) for s in local)
        shape, cuts = list(local), []
        lay = self.layout
        window_cut = None
        if lay.splits_domain and len(local) >= _FIELD_NDIM and self.in_attention():
            # windows (groups of rows) in the batch dim: (batch entry, windows...) with this
            # rank's windows a contiguous chunk of each entry's, in domain rank order
            shape[0], window_cut = self._window_chunks(func, local)
        if lay.ensemble_size > 1 and len(local) >= 2:
            # dim 0 is (sample, member, rest...) with the sample outermost, as CREDIT's
            # repeat_interleave and einops' "(b h w)" windows order it
            samples = lay.samples or local[0] // lay.local_members
            per_sample = local[0] // samples if local[0] % samples == 0 else 0
            if per_sample % lay.local_members or per_sample == 0:
                self._refuse(
                    func,
                    f"has batch {local[0]}, not {samples} sample(s) x the {lay.local_members} "
                    "members this rank holds of each",
                )
            e, ens = lay.ensemble_rank, lay.ensemble_size
            shape[0] = shape[0] * ens

            def cut_members(g, samples=samples, e=e, ens=ens):
                rest = g.shape[1:]
                return g.reshape(samples, ens, -1, *rest)[:, e].reshape(-1, *rest)

            cuts.append(cut_members)
        if window_cut is not None:
            cuts.append(window_cut)
        elif lay.splits_domain and len(local) >= _FIELD_NDIM:
            height, width, r0, c0 = self._domain_extent(local)
            shape[-2], shape[-1] = height, width
            h, w = local[-2], local[-1]
            cuts.append(lambda g: g[..., r0 : r0 + h, c0 : c0 + w])

        def cut(g):
            for step in cuts:
                g = step(g)
            return g.contiguous()

        return tuple(shape), cut

    # ------------------------------------------------------------------ the interception
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _REFUSED:
            self._refuse(func, "has no layout-independent form here")
        if self.streams is not None and func in _STREAMED:
            return self._streamed(func, args, kwargs)
        if func in _FACTORIES:
            return self._factory(func, args, kwargs)
        if func in _LIKE:
            return self._like(func, args, kwargs)
        if func in _DROPOUTS:
            return self._dropout(func, args, kwargs)
        if func in _INPLACE:
            return self._inplace(func, args, kwargs)
        if func is torch.normal:
            return self._normal(func, args, kwargs)
        if func is torch.bernoulli:
            return self._bernoulli(func, args, kwargs)
        return func(*args, **kwargs)

    def _factory(self, func, args, kwargs):
        if kwargs.get("out") is not None:
            self._refuse(func, "writes into out=")
        size = kwargs.pop("size", None)
        if size is None:
            size = args[0] if len(args) == 1 and not isinstance(args[0], int) else args
        shape, cut = self.global_view(func, tuple(size))
        requires_grad = kwargs.pop("requires_grad", False)
        out = cut(func(shape, **kwargs))
        return out.requires_grad_(requires_grad) if requires_grad else out

    def _like(self, func, args, kwargs):
        source = args[0]
        shape, cut = self.global_view(func, tuple(source.shape))
        requires_grad = kwargs.pop("requires_grad", False)
        kwargs.pop("memory_format", None)  # the global tensor is contiguous, as one process's
        dtype = kwargs.pop("dtype", None) or source.dtype
        device = kwargs.pop("device", None) or source.device
        template = _global_like(source, shape, dtype=dtype, device=device)
        out = cut(func(template, *args[1:], **kwargs))
        return out.requires_grad_(requires_grad) if requires_grad else out

    def _dropout(self, func, args, kwargs):
        params = inspect.signature(func).bind(*args, **kwargs)
        params.apply_defaults()
        x, p, training, inplace = (
            params.arguments[k] for k in ("input", "p", "training", "inplace")
        )
        if not training or p == 0:
            return func(*args, **kwargs)
        shape, cut = self.global_view(func, tuple(x.shape))
        mask = cut(func(_global_like(x, shape).fill_(1), p, True, False))
        return x.mul_(mask) if inplace else x * mask

    def _inplace(self, func, args, kwargs):
        target = args[0]
        if func is torch.Tensor.bernoulli_ and isinstance(
            args[1] if len(args) > 1 else kwargs.get("p", 0.5), torch.Tensor
        ):
            self._refuse(func, "takes a tensor of probabilities")
        shape, cut = self.global_view(func, tuple(target.shape))
        drawn = func(_global_like(target, shape), *args[1:], **kwargs)
        with torch.no_grad():
            target.copy_(cut(drawn))
        return target

    def _streamed(self, func, args, kwargs):
        """A draw under member streams: member m's part of every draw comes from its own
        generator, drawn for the global field of one member and cut to this rank's part."""
        if func in _DROPOUTS or func is torch.normal:
            params = (
                inspect.signature(func).bind(*args, **kwargs).arguments if func in _DROPOUTS else {}
            )
            if func in _DROPOUTS and (
                not params.get("training", True) or params.get("p", 0.5) == 0
            ):
                return func(*args, **kwargs)
            self._refuse(func, "is not drawn per member stream (forecast members)")
        if func in _FACTORIES:
            size = kwargs.pop("size", None)
            if size is None:
                size = args[0] if len(args) == 1 and not isinstance(args[0], int) else args
            local, dtype, device = tuple(size), kwargs.get("dtype"), kwargs.get("device")
            target = None
        else:
            target = args[0]
            local, dtype, device = tuple(target.shape), target.dtype, target.device
        shape, cut = self.global_view(func, local)
        n = len(self.streams.generators)
        if len(shape) < 2 or shape[0] % n:
            self._refuse(func, f"has batch {local[0] if local else 0}, not the {n} members")
        part = (shape[0] // n, *shape[1:])
        pieces = []
        for gen in self.streams.generators:
            if func in (torch.randn, torch.randn_like):
                pieces.append(torch.randn(part, generator=gen, dtype=dtype, device=device))
            elif func in (torch.rand, torch.rand_like):
                pieces.append(torch.rand(part, generator=gen, dtype=dtype, device=device))
            else:  # Tensor.normal_ / uniform_ / bernoulli_(p) on a global empty tensor
                empty = torch.empty(part, dtype=dtype, device=device)
                pieces.append(func(empty, *args[1:], **kwargs, generator=gen))
        out = cut(torch.cat(pieces))
        if target is not None and func in _INPLACE:
            with torch.no_grad():
                target.copy_(out)
            return target
        return out

    def _normal(self, func, args, kwargs):
        mean = args[0] if args else kwargs.get("mean")
        std = args[1] if len(args) > 1 else kwargs.get("std")
        if isinstance(mean, torch.Tensor) or isinstance(std, torch.Tensor):
            local = (mean if isinstance(mean, torch.Tensor) else std).shape
            shape, _ = self.global_view(func, tuple(local))
            if shape != tuple(local):
                self._refuse(func, "takes tensor arguments on a sharded field or member batch")
            return func(*args, **kwargs)
        size = args[2] if len(args) > 2 else kwargs.pop("size")
        rest = {k: v for k, v in kwargs.items() if k not in ("mean", "std")}
        shape, cut = self.global_view(func, tuple(size))
        return cut(func(float(mean), float(std), shape, **rest))

    def _bernoulli(self, func, args, kwargs):
        probs = args[0]
        shape, _ = self.global_view(func, tuple(probs.shape))
        if shape != tuple(probs.shape):
            self._refuse(func, "takes a tensor of probabilities on a sharded field or member batch")
        return func(*args, **kwargs)


def _global_like(local: torch.Tensor, shape: tuple, dtype=None, device=None) -> torch.Tensor:
    """An empty global tensor of ``shape`` laid out in memory as ``local`` is: ``empty_like``
    keeps a dense tensor's strides and the draws fill memory in order, so one process's draw on
    a permuted activation (a rearranged window, channels-last) follows that order."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false as dense

    dtype = dtype or local.dtype
    device = device or local.device
    if local.dim() == 0 or local.is_contiguous() or not dense(local):
        return torch.empty(shape, dtype=dtype, device=device)
    order = sorted(range(local.dim()), key=lambda d: (-local.stride(d), d))
    return torch.empty_permuted(shape, order, dtype=dtype, device=device)


_DRAW_CALL = re.compile(
    r"(?:torch|F|functional)\.(?:randn|rand|randn_like|rand_like|normal|bernoulli|dropout\w*|"
    r"alpha_dropout|feature_alpha_dropout|randint\w*|randperm|multinomial|poisson)\s*\("
    r"|\.(?:normal_|uniform_|bernoulli_|random_|exponential_|geometric_|cauchy_|log_normal_)\s*\("
)
_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)


def _forward_draws(cls: type) -> bool:
    forward = cls.__dict__.get("forward")
    if forward is None or cls.__module__.startswith("torch."):
        return False
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return False
    return bool(_DRAW_CALL.search(source))


def random_drawing_modules(model: nn.Module) -> list[str]:
    """Paths ("" the root) of the modules whose forward draws random numbers: dropout modules
    with p > 0, and modules whose class's ``forward`` source calls a torch random function."""
    found, seen = [], {}
    for path, module in model.named_modules():
        if isinstance(module, _DROPOUT_MODULES):
            if module.p > 0:
                found.append(path)
            continue
        cls = type(module)
        if cls not in seen:
            seen[cls] = any(_forward_draws(c) for c in cls.__mro__ if c is not nn.Module)
        if seen[cls]:
            found.append(path)
    return found


class _ModuleStack:
    """The path of the innermost module running forward (global forward hooks), for errors;
    ``state`` (a :meth:`snapshot`) starts it inside modules already running."""

    def __init__(self, model: nn.Module, state: tuple[list[str], int] = ([], 0)):
        self.paths = {id(m): p or "<root>" for p, m in model.named_modules()}
        self.stack: list[str] = list(state[0])
        self.handles = []
        self.attention_depth = state[1]

    def snapshot(self) -> tuple[list[str], int]:
        return list(self.stack), self.attention_depth

    def __enter__(self):
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )

        def pre(module, _args):
            path = self.paths.get(id(module))
            if path is not None:
                self.stack.append(f"{path} ({type(module).__name__})")
                self.attention_depth += _is_attention(module)

        def post(module, _args, _out):
            if id(module) in self.paths and self.stack:
                self.stack.pop()
                self.attention_depth -= _is_attention(module)

        self.handles = [
            register_module_forward_pre_hook(pre),
            register_module_forward_hook(post, always_call=True),
        ]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.stack.clear()

    def where(self) -> str:
        return self.stack[-1] if self.stack else "<model>"

    def in_attention(self) -> bool:
        return self.attention_depth > 0


def _is_attention(module: nn.Module) -> bool:
    """An attention module, or a domain wrapper of one (``DomainWrapper.wrapped``)."""
    for candidate in (module, module.__dict__.get("wrapped")):
        name = type(candidate).__name__.lower() if candidate is not None else ""
        if "attention" in name or name.startswith("attn"):
            return True
    return False


def draw_layout(dims, manager, ensemble_size: int = 1) -> DrawLayout:
    """The :class:`DrawLayout` of this rank in the layout ``dims`` (a ``ParallelDims``):
    ``trainer.ensemble_size`` K members of each sample, K/E on each ensemble rank."""
    import torch.distributed as dist

    ens = dims.ensemble
    if ens > 1 and (ensemble_size < ens or ensemble_size % ens):
        raise ValueError(
            f"trainer.ensemble_size = {ensemble_size} is not a multiple of "
            f"trainer.parallelism.ensemble = {ens} (each ensemble rank holds K/E members)"
        )
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return DrawLayout(manager, dims.ensemble_coord(rank), ens, max(ensemble_size // ens, 1))


def refuse_spherical_harmonics(model: nn.Module) -> None:
    """A stochastic model holding a torch-harmonics transform (CREDIT's spherical-harmonic
    noise, SKEBS): its noise is correlated over the globe, drawn as coefficients that are not
    (batch, ..., H, W) fields, so a shard cannot cut its part of the draw.  Refused under domain
    parallelism, naming the module (SPEC §0), until it is generated globally and sliced."""
    for path, module in model.named_modules():
        if type(module).__module__.split(".")[0] == "torch_harmonics":
            raise ValueError(
                f"{path or '<root>'} ({type(module).__name__}): spherical-harmonic noise "
                "(torch-harmonics) in a model that draws random numbers is global; it cannot be "
                "drawn per shard and is not supported under trainer.parallelism.domain > 1 yet "
                "(run it at domain: 1, with the ensemble axis if needed)"
            )


def refuse_attention_draws_on_tiles(model: nn.Module) -> None:
    """Random draws inside an attention module hold windows in the batch dim; on lat x lon
    tiles a rank's windows are not a contiguous chunk of it: refused naming the module, before
    any forward."""
    drawing = set(random_drawing_modules(model))
    for path, module in model.named_modules():
        if not _is_attention(module):
            continue
        for sub, _ in module.named_modules():
            inner = f"{path}.{sub}" if path and sub else (path or sub)
            if inner in drawing:
                raise ValueError(
                    f"{inner or '<root>'} ({type(model.get_submodule(inner)).__name__}): draws "
                    f"random numbers inside the attention module {path or '<root>'}, whose "
                    "windows a lat x lon tile does not hold as one chunk of the batch; not "
                    "supported on tiles yet (use a latitude-only domain, or no dropout there)"
                )


def install_layout_independent_draws(
    model: nn.Module, layout: DrawLayout, *, always=False, replace_installed=False
):
    """Run ``model``'s forward under :class:`LayoutIndependentDraws` (root forward hooks; the
    handles are returned).  Nothing is installed (an empty list) for a trivial layout or a model
    that draws nothing (:func:`random_drawing_modules`).  Draws already installed (by
    ``convert_to_domain_parallel``, for its manager) are kept, unless ``replace_installed``
    (``parallelize``: the layout with the ensemble axis)."""
    installed = _INSTALLED.get(model)
    if installed and installed[0].id in model._forward_pre_hooks:
        if not replace_installed:
            return []  # already drawing layout-independently
        for handle in installed:
            handle.remove()
        del _INSTALLED[model]
    if not random_drawing_modules(model):
        return []
    if layout.is_trivial and not always:
        return []
    if layout.splits_domain:
        refuse_spherical_harmonics(model)
        if getattr(layout.manager, "is_tiled", False):
            refuse_attention_draws_on_tiles(model)
    active: list[contextlib.ExitStack] = []

    def open_mode(this: DrawLayout, streams, state=([], 0)) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        modules = stack.enter_context(_ModuleStack(model, state))
        mode = LayoutIndependentDraws(this, modules.where, modules.in_attention, streams)
        mode.replay = lambda: _deferred(open_mode, this, streams, modules.snapshot())
        stack.enter_context(mode)
        return stack

    def enter(_module, args):
        batch = args[0].shape[0] if args and isinstance(args[0], torch.Tensor) else None
        this = layout
        if batch is not None:
            this = replace(layout, samples=max(batch // layout.local_members, 1), batch=batch)
        streams = _ACTIVE_STREAMS[-1] if _ACTIVE_STREAMS else None
        active.append(open_mode(this, streams))

    def leave(_module, _args, _out):
        if active:
            active.pop().close()

    handles = [
        model.register_forward_pre_hook(enter),
        model.register_forward_hook(leave, always_call=True),
    ]
    _INSTALLED[model] = handles
    return handles


@contextlib.contextmanager
def _deferred(open_mode, *args):
    with open_mode(*args):
        yield


def draw_memory_bytes(local_numel: int, domain_size: int, ensemble_size: int, itemsize: int) -> int:
    """Upper estimate of the extra memory of one field draw: the global tensor of
    ``local_numel * domain_size * ensemble_size`` elements (uneven shards: about)."""
    return math.prod((local_numel, domain_size, ensemble_size, itemsize))
