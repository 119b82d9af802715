"""Functional calls are not a blind spot: find calls that mix latitude rows on a shard.

The converter only sees modules; a forward that calls ``F.interpolate``, ``F.pad`` over H,
``torch.roll`` / ``flip`` over H, a reduction over H, a functional pooling, or a reshape that
merges H with a dim before it, or a choice of rows by position (slicing or indexing over H,
``narrow``, ``index_select``, ``split`` / ``chunk``, ``cat`` along H) computes something
different on a shard than on the globe.
A merge with H OUTERMOST (``x.flatten(2)`` of B,C,H,W) keeps each shard one contiguous block of
tokens: the mark moves to the merged dim and follows transposes, permutes and the split back
to (H, W); attention (``F.scaled_dot_product_attention``, ``F.multi_head_attention_forward``),
a softmax or reduction, or a matrix product contracting over a marked token dim is then a
finding (outside the library's wrappers, e.g. ``DomainTokenAttention``).
:class:`FunctionalCallGuard` is a ``TorchFunctionMode`` active during one forward: tensors
marked as domain-sharded (the model's inputs, by :meth:`FunctionalCallGuard.mark`) propagate the
mark to every tensor computed from them, and each offending call on a marked tensor is recorded
with the path of the innermost module running it and the source line that made it.  Calls
made inside the library's own domain-parallel layers (which exchange rows on purpose) are not
checked.
On lat x lon tiles (SPEC §3b; the model's manager is tiled, or ``tiles=True``) the width, the
last dim, is split too: a second mark follows it by the same rules, so a call that reaches other
columns (a pad, roll, flip, reduction or selection over W, a cat along W, a linear layer across
W, W merged under H) is a finding too, named by module.

Used by ``credit-parallel verify`` (each finding is a FAIL row) and, opt-in, during training:
``trainer.domain_guard: true`` in the config or ``CREDIT_PARALLEL_DOMAIN_GUARD=1`` in the
environment (:func:`debug_guard`; the first finding raises).
"""

from __future__ import annotations

import os
import re
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from math import prod

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["FunctionalCallGuard", "GuardFinding", "debug_guard", "guard_requested"]

_MARK = "_cp_domain_dim"  # attribute on a tensor: its sharded dim counted from the end (-2)
# on lat x lon tiles the width (longitude, the last dim) is split too: a second mark, followed
# and judged by the same rules (``_reading`` picks the mark the rules read)
_WIDTH_MARK = "_cp_domain_wdim"
_READING = [_MARK]
_RESAMPLE = {"interpolate", "upsample", "upsample_bilinear", "upsample_nearest", "grid_sample"}
_REDUCE = {
    "sum", "mean", "amax", "amin", "max", "min", "std", "var", "prod", "logsumexp", "softmax",
    "log_softmax", "cumsum", "cumprod", "norm", "argmax", "argmin", "median", "nansum",
    "nanmean", "std_mean", "var_mean", "sort", "argsort", "topk", "cummax", "cummin",
}  # fmt: skip
# shape ops whose result's sharded dim is followed exactly (flatten with H outermost: tokens)
_SHAPE_OPS = {
    "reshape", "view", "flatten", "transpose", "swapaxes", "swapdims", "permute", "unflatten",
    "unsqueeze",
}  # fmt: skip
_DOMAIN_DIR = os.path.dirname(os.path.abspath(__file__))  # our layers: not a call site
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


@dataclass(frozen=True)
class GuardFinding:
    path: str  # module path as in named_modules() ("<root>" for the model itself)
    op: str
    reason: str
    site: str  # file:line of the call

    def __str__(self) -> str:
        return f"{self.path}: {self.op} {self.reason} (at {self.site})"


def _marked_dim(t) -> int | None:
    return getattr(t, _READING[0], None) if isinstance(t, torch.Tensor) else None


@contextmanager
def _reading(mark: str):
    """Within: the rules read (and set) the mark ``mark`` (H's or, on tiles, W's)."""
    _READING[0], before = mark, _READING[0]
    try:
        yield
    finally:
        _READING[0] = before


def _as_width(reason: str) -> str:
    """A finding's reason for the split width of a tile (the rules speak of H)."""
    reason = re.sub(r"\bH\b", "W", reason.replace("latitude", "longitude"))
    return reason.replace("rows", "columns") + " (the width is split on lat x lon tiles)"


def _h_axis(t: torch.Tensor) -> int:
    return t.dim() + _marked_dim(t)


def _dims_arg(args, kwargs, position: int, names=("dim", "dims")):
    for name in names:
        if name in kwargs:
            return kwargs[name], True
    if len(args) > position:
        return args[position], True
    return None, False


def _covers(dims, t: torch.Tensor) -> bool:
    h = _h_axis(t)
    dims = dims if isinstance(dims, (tuple, list)) else (dims,)
    return any(isinstance(d, int) and d % t.dim() == h for d in dims)


def _shape_arg(t: torch.Tensor, shape) -> list[int]:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = shape[0]
    shape = [int(s) for s in shape]
    if any(s == -1 for s in shape):
        known = prod(s for s in shape if s != -1)
        shape = [t.numel() // max(known, 1) if s == -1 else s for s in shape]
    return shape


def _reshape_target(t: torch.Tensor, shape) -> int | None:
    """Index in the new ``shape`` of the dim holding ``t``'s sharded dim after a reshape: where
    it stays, is split (its first factor), or is merged as the OUTERMOST of the merged dims
    (``x.flatten(2)`` of B,C,H,W: each shard is then one contiguous block of the H*W tokens);
    None when it merges with a dim before it (rows of a shard interleave with others)."""
    h, old = _h_axis(t), list(t.shape)
    try:
        shape = _shape_arg(t, shape)
    except (TypeError, ValueError):  # view(dtype): no shape change to follow
        return h
    before = prod(old[:h])
    for j in range(len(shape)):
        if prod(shape[:j]) != before or (shape[j] == 1 and old[h] != 1):
            continue
        if any(prod(shape[j:k]) == old[h] for k in range(j + 1, len(shape) + 1)):
            return j  # kept or split into factors
        if any(prod(old[h:m]) == shape[j] for m in range(h + 2, len(old) + 1)):
            return j  # merged with the dims after it, H outermost
    return None


def _flatten_target(t: torch.Tensor, args, kwargs) -> int | None:
    start = kwargs.get("start_dim", args[1] if len(args) > 1 else 0) % t.dim()
    end = kwargs.get("end_dim", args[2] if len(args) > 2 else -1) % t.dim()
    h = _h_axis(t)
    if h < start:
        return h
    if h > end:
        return h - (end - start)
    return start if h == start else None


def _int_args(args, kwargs, names) -> list:
    out = list(args[1:])
    out += [kwargs[n] for n in names if n in kwargs]
    if len(out) == 1 and isinstance(out[0], (tuple, list, torch.Size)):
        out = list(out[0])
    return out


def _moved_axis(name: str, t: torch.Tensor, args, kwargs, out: torch.Tensor) -> int | None:
    """Where the sharded dim of ``t`` is in ``out`` after a shape op (index from the front), or
    None when this is not a shape op it can follow."""
    h = _h_axis(t)
    if name in ("reshape", "view"):
        return _reshape_target(t, args[1:] if len(args) > 1 else (kwargs.get("shape"),))
    if name == "flatten":
        return _flatten_target(t, args, kwargs)
    if name in ("transpose", "swapaxes", "swapdims"):
        d0, d1 = (d % t.dim() for d in _int_args(args, kwargs, ("dim0", "dim1"))[:2])
        return d1 if h == d0 else d0 if h == d1 else h
    if name == "permute":
        dims = [d % t.dim() for d in _int_args(args, kwargs, ("dims",))]
        return dims.index(h) if h in dims else None
    if name == "unflatten":
        dim, sizes = _int_args(args, kwargs, ("dim", "sizes"))[:2]
        return h + len(sizes) - 1 if dim % t.dim() < h else h
    if name == "unsqueeze":
        dim = _int_args(args, kwargs, ("dim",))[0] % out.dim()
        return h + 1 if dim <= h else h
    return None


def _token_attention_offence(name: str, args, kwargs) -> str | None:
    """SDPA or nn.MultiheadAttention's function called on latitude-sharded tokens outside the
    library's wrappers: the softmax would see only this shard's keys."""
    if name == "scaled_dot_product_attention":
        token_dim = -2
    elif name == "multi_head_attention_forward":
        token_dim = 0
    else:
        return None
    qkv = list(args[:3]) + [kwargs.get(k) for k in ("query", "key", "value")]
    for t in qkv:
        if _marked_dim(t) is not None and _h_axis(t) == token_dim % t.dim():
            return (
                "attends over latitude-sharded tokens on a shard (use nn.MultiheadAttention in "
                "a converted model, or declare _domain_attention = {'form': 'tokens'} on the "
                "module)"
            )
    return None


def _contraction_offence(name: str, args) -> str | None:
    """A matrix product or linear layer contracting over a sharded dim sums only this shard."""
    if name in ("matmul", "__matmul__", "bmm", "baddbmm") and len(args) >= 2:
        a, b = args[-2], args[-1]
        a_hit = _marked_dim(a) is not None and _h_axis(a) == a.dim() - 1
        b_hit = _marked_dim(b) is not None and b.dim() >= 2 and _h_axis(b) == b.dim() - 2
        if a_hit or b_hit:
            return "contracts a latitude-sharded dim (a matrix product over the tokens of a shard)"
    if name == "linear" and args and _marked_dim(args[0]) is not None:
        if _h_axis(args[0]) == args[0].dim() - 1:
            return "applies a linear layer across a latitude-sharded dim"
    return None


def _index_on_h(t: torch.Tensor, index):
    """The element of a ``t[index]`` subscript that applies to the sharded dim (``slice(None)``
    when none does).  None adds a dim, Ellipsis stands for the dims not named, a boolean mask
    takes as many dims as it has."""
    items = list(index) if isinstance(index, tuple) else [index]

    def width(item) -> int:
        if item is None or item is Ellipsis:
            return 0
        if isinstance(item, torch.Tensor) and item.dtype == torch.bool:
            return max(item.dim(), 1)
        return 1

    named = sum(width(i) for i in items)
    h, axis = _h_axis(t), 0
    for item in items:
        if item is Ellipsis:
            axis += t.dim() - named
            continue
        w = width(item)
        if axis <= h < axis + w:
            return item
        axis += w
    return slice(None)


def _whole(item, size: int) -> bool:
    """Whether a subscript element keeps every row, in order."""
    if not isinstance(item, slice):
        return False
    start, stop, step = item.start, item.stop, item.step
    return (
        start in (None, 0)
        and (stop is None or (isinstance(stop, int) and stop >= size))
        and step in (None, 1)
    )


def _selection_offence(name: str, t: torch.Tensor, args, kwargs) -> str | None:
    """Rows chosen by position (slicing, narrow, index_select, split, cat over H): a position
    on a shard is not the same row of the globe."""
    reason = "selects latitude rows by position on a shard (slicing / indexing over H)"
    if name == "__getitem__" and len(args) > 1:
        if not _whole(_index_on_h(t, args[1]), t.shape[_h_axis(t)]):
            return reason
    if name in ("narrow", "select", "index_select", "gather", "take_along_dim", "index_add"):
        dims, given = _dims_arg(args, kwargs, 1, ("dim",))
        if not given or _covers(dims, t):
            whole = name == "narrow" and len(args) > 3 and args[2] == 0
            if not (whole and args[3] >= t.shape[_h_axis(t)]):
                return reason
    if name in ("split", "chunk", "tensor_split", "unbind", "split_with_sizes"):
        dims, given = _dims_arg(args, kwargs, 1 if name == "unbind" else 2, ("dim",))
        if _covers(dims if given else 0, t):
            return "splits a latitude-sharded tensor over H by position on a shard"
    return None


def _concat_offence(name: str, args, kwargs) -> str | None:
    """``torch.cat`` of sharded tensors along H stacks each shard's rows, not the globe's."""
    if name not in ("cat", "concat", "concatenate") or not args:
        return None
    tensors = args[0] if isinstance(args[0], (list, tuple)) else ()
    marked = next((x for x in tensors if _marked_dim(x) is not None), None)
    dim = kwargs.get("dim", kwargs.get("axis", args[1] if len(args) > 1 else 0))
    if marked is not None and _covers(dim, marked):
        return "concatenates latitude-sharded tensors along H on a shard"
    return None


def _offence(name: str, t: torch.Tensor, args, kwargs) -> str | None:
    if name in _RESAMPLE:
        return "resamples a latitude-sharded tensor (use nn.Upsample / DomainParallelInterpolate)"
    if "pool" in name:
        return "pools over a latitude-sharded tensor"
    if name == "pad":
        pad = kwargs.get("pad", args[1] if len(args) > 1 else ())
        k = 2 * (-_marked_dim(t) - 1)  # F.pad's pairs run from the last dim backwards
        if len(pad) >= k + 2 and (pad[k] or pad[k + 1]):
            return "pads over H on a shard (use a padding module the converter replaces)"
    if name in ("roll", "flip"):
        dims, given = _dims_arg(args, kwargs, 2 if name == "roll" else 1)
        if name == "roll" and not given:
            return "rolls the flattened tensor (mixes rows)"
        if given and _covers(dims, t):
            return f"{name}s over H on a shard"
    if name in _REDUCE:
        dims, given = _dims_arg(args, kwargs, 1)
        if not given or dims is None:
            return "reduces over every dim, H included, on a shard"
        if _covers(dims, t):
            return "reduces over H on a shard"
    if name in ("reshape", "view") and _reshape_target(t, args[1:]) is None:
        return "reshapes H together with a dim outside it on a shard"
    if name == "flatten" and _flatten_target(t, args, kwargs) is None:
        return "flattens H together with a dim outside it on a shard"
    return (
        _selection_offence(name, t, args, kwargs)
        or _concat_offence(name, args, kwargs)
        or _token_attention_offence(name, args, kwargs)
        or _contraction_offence(name, args)
    )


def _first_marked(args, kwargs) -> torch.Tensor | None:
    """The first marked tensor among the arguments, also inside a list of tensors (cat, stack:
    their results stay marked)."""
    for a in (*args, *kwargs.values()):
        if _marked_dim(a) is not None:
            return a
        if isinstance(a, (list, tuple)):
            inner = next((x for x in a if _marked_dim(x) is not None), None)
            if inner is not None:
                return inner
    return None


class FunctionalCallGuard(TorchFunctionMode):
    """Record functional calls that mix rows of domain-sharded tensors during a forward of
    ``model``.  ``raise_on_finding=True`` raises ``RuntimeError`` at the first one."""

    def __init__(
        self, model: nn.Module, *, raise_on_finding: bool = False, tiles: bool | None = None
    ):
        super().__init__()
        if tiles is None:  # the model's manager (convert_to_domain_parallel) splits W too?
            tiles = bool(getattr(vars(model).get("_domain_manager"), "is_tiled", False))
        # the marks followed: H's, and on lat x lon tiles W's (the last dim) too
        self.marks = (_MARK, _WIDTH_MARK) if tiles else (_MARK,)
        self.paths = {id(m): path or "<root>" for path, m in model.named_modules()}
        self.raise_on_finding = raise_on_finding
        self.findings: list[GuardFinding] = []
        self._stack: list[nn.Module] = []
        self._handles = []

    def mark(self, *tensors, shard_dim: int = -2) -> None:
        """Mark 4-D / 5-D tensors as sharded along ``shard_dim`` (counted from the end), and
        on tiles along the last dim too."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.dim() in (4, 5):
                setattr(t, _MARK, shard_dim)
                if _WIDTH_MARK in self.marks:
                    setattr(t, _WIDTH_MARK, -1)

    def __enter__(self):
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )

        def enter(module, args):
            self._stack.append(module)

        def leave(module, args, output):  # must return None: a value would replace the output
            if self._stack:
                self._stack.pop()
            # custom autograd functions (the library's exchanges) are not seen by the mode:
            # carry the mark across every module boundary instead
            for mark in self.marks:
                with _reading(mark):
                    marked = next((a for a in args if _marked_dim(a) is not None), None)
                    if marked is not None:
                        self._propagate(output, marked)

        self._handles = [
            register_module_forward_pre_hook(enter),
            register_module_forward_hook(leave),
        ]
        return super().__enter__()

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles, self._stack = [], []
        return super().__exit__(*exc)

    def _in_domain_layer(self) -> bool:
        return any(getattr(m, "_domain_parallel", False) for m in self._stack)

    def _module_path(self) -> str:
        for m in reversed(self._stack):
            if id(m) in self.paths:
                return self.paths[id(m)]
        return "<outside the model>"

    @staticmethod
    def _site() -> str:
        for frame in reversed(traceback.extract_stack()):
            f = os.path.abspath(frame.filename)
            if not f.startswith((_TORCH_DIR, _DOMAIN_DIR)):
                return f"{frame.filename}:{frame.lineno}"
        return "<unknown>"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        marked = {}
        for mark in self.marks:
            with _reading(mark):
                marked[mark] = _first_marked(args, kwargs)
        if not self._in_domain_layer():
            for mark, t in marked.items():
                if t is not None and self._judge(mark, name, t, args, kwargs):
                    break  # one finding per call
        out = func(*args, **kwargs)
        for mark, t in marked.items():
            if t is not None:
                with _reading(mark):
                    self._follow(name, t, args, kwargs, out)
        return out

    def _judge(self, mark: str, name: str, t, args, kwargs) -> bool:
        """Record (or raise) the finding of ``name`` on ``t`` under ``mark``, if any."""
        with _reading(mark):
            reason = _offence(name, t, args, kwargs)
        if reason is None:
            return False
        if mark == _WIDTH_MARK:
            reason = _as_width(reason)
        finding = GuardFinding(self._module_path(), name, reason, self._site())
        self.findings.append(finding)
        if self.raise_on_finding:
            raise RuntimeError(f"domain guard: {finding}")
        return True

    def _follow(self, name: str, marked, args, kwargs, out) -> None:
        """Carry the mark being read from ``marked`` to ``out``."""
        moved = (
            _moved_axis(name, marked, args, kwargs, out)
            if isinstance(out, torch.Tensor) and name in _SHAPE_OPS
            else None
        )
        if moved is not None:
            self._set_mark(out, moved - out.dim())
        elif name not in _SHAPE_OPS:
            self._propagate(out, marked)

    @staticmethod
    def _set_mark(t: torch.Tensor, dim: int) -> None:
        try:
            setattr(t, _READING[0], dim)
        except (AttributeError, RuntimeError):
            pass

    def _propagate(self, out, source: torch.Tensor) -> None:
        """Results of an op on a marked tensor keep its mark (counted from the end) when they
        keep its rank, or are latitude fields (>= 4 dims); pooled or reduced results do not."""
        dim = _marked_dim(source)
        if isinstance(out, torch.Tensor):
            if out.dim() == source.dim() or out.dim() >= 4:
                self._set_mark(out, dim)
        elif isinstance(out, (tuple, list)):
            for o in out:
                self._propagate(o, source)


class _NoGuard:
    findings: list = []

    def mark(self, *tensors, dim: int = -2) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def guard_requested(enabled: bool = False) -> bool:
    """The opt-in debug mode: ``enabled`` (the run config's parsed ``trainer.domain_guard``)
    or CREDIT_PARALLEL_DOMAIN_GUARD=1 in the environment."""
    if not isinstance(enabled, bool):
        raise TypeError(
            "guard_requested takes the parsed trainer.domain_guard flag (a bool, e.g. "
            f"RunConfig.trainer.domain_guard), got {type(enabled).__name__}"
        )
    if os.environ.get("CREDIT_PARALLEL_DOMAIN_GUARD", "").strip() not in ("", "0"):
        return True
    return enabled


def debug_guard(model: nn.Module, enabled: bool = False):
    """A raising :class:`FunctionalCallGuard` when :func:`guard_requested`, else a no-op with
    the same ``mark`` method: ``with debug_guard(model, enabled) as g: g.mark(*inputs); model(...)``."""
    if guard_requested(enabled):
        return FunctionalCallGuard(model, raise_on_finding=True)
    return _NoGuard()
