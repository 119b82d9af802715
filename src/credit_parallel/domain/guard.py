"""Functional calls are not a blind spot: find calls that mix latitude rows on a shard.

The converter only sees modules; a forward that calls ``F.interpolate``, ``F.pad`` over H,
``torch.roll`` / ``flip`` over H, a reduction over H, a functional pooling, or a reshape that
merges H with another dim computes something different on a shard than on the globe.
:class:`FunctionalCallGuard` is a ``TorchFunctionMode`` active during one forward: tensors
marked as domain-sharded (the model's inputs, by :meth:`FunctionalCallGuard.mark`) propagate the
mark to every tensor computed from them, and each offending call on a marked tensor is recorded
with the path of the innermost module running it and the source line that made it.  Calls
made inside the library's own domain-parallel layers (which exchange rows on purpose) are not
checked.

Used by ``credit-parallel verify`` (each finding is a FAIL row) and, opt-in, during training:
``trainer.domain_guard: true`` in the config or ``CREDIT_PARALLEL_DOMAIN_GUARD=1`` in the
environment (:func:`debug_guard`; the first finding raises).
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from math import prod

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..run_config import trainer_option

__all__ = ["FunctionalCallGuard", "GuardFinding", "debug_guard", "guard_requested"]

_MARK = "_cp_domain_dim"  # attribute on a tensor: its sharded dim counted from the end (-2)
_RESAMPLE = {"interpolate", "upsample", "upsample_bilinear", "upsample_nearest", "grid_sample"}
_REDUCE = {
    "sum", "mean", "amax", "amin", "max", "min", "std", "var", "prod", "logsumexp", "softmax",
    "log_softmax", "cumsum", "cumprod", "norm", "argmax", "argmin", "median", "nansum",
    "nanmean", "std_mean", "var_mean", "sort", "argsort", "topk", "cummax", "cummin",
}  # fmt: skip
_RESHAPE = {"reshape", "view", "flatten"}
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
    return getattr(t, _MARK, None) if isinstance(t, torch.Tensor) else None


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


def _merges_h(t: torch.Tensor, shape) -> bool:
    """True when ``shape`` does not keep the rows of H apart from the other dims (a split of H
    into factors keeps them; a merge of H with a neighbour does not)."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = shape[0]
    shape = [int(s) for s in shape]
    if any(s == -1 for s in shape):
        known = prod(s for s in shape if s != -1)
        shape = [t.numel() // max(known, 1) if s == -1 else s for s in shape]
    h = _h_axis(t)
    before, rows = prod(t.shape[:h]), t.shape[h]
    for j in range(len(shape) + 1):
        if prod(shape[:j]) != before:
            continue
        for k in range(j + 1, len(shape) + 1):
            if prod(shape[j:k]) == rows:
                return False
    return True


def _flatten_merges_h(t: torch.Tensor, args, kwargs) -> bool:
    start = kwargs.get("start_dim", args[1] if len(args) > 1 else 0) % t.dim()
    end = kwargs.get("end_dim", args[2] if len(args) > 2 else -1) % t.dim()
    return start <= _h_axis(t) <= end and start != end


def _offence(name: str, t: torch.Tensor, args, kwargs) -> str | None:
    if name in _RESAMPLE:
        return "resamples a latitude-sharded tensor (use nn.Upsample / DomainParallelInterpolate)"
    if "pool" in name:
        return "pools over a latitude-sharded tensor"
    if name == "pad":
        pad = kwargs.get("pad", args[1] if len(args) > 1 else ())
        if len(pad) >= 4 and (pad[2] or pad[3]):
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
    if name in ("reshape", "view") and _merges_h(t, args[1:]):
        return "reshapes H together with another dim on a shard"
    if name == "flatten" and _flatten_merges_h(t, args, kwargs):
        return "flattens H together with another dim on a shard"
    return None


class FunctionalCallGuard(TorchFunctionMode):
    """Record functional calls that mix rows of domain-sharded tensors during a forward of
    ``model``.  ``raise_on_finding=True`` raises ``RuntimeError`` at the first one."""

    def __init__(self, model: nn.Module, *, raise_on_finding: bool = False):
        super().__init__()
        self.paths = {id(m): path or "<root>" for path, m in model.named_modules()}
        self.raise_on_finding = raise_on_finding
        self.findings: list[GuardFinding] = []
        self._stack: list[nn.Module] = []
        self._handles = []

    def mark(self, *tensors, dim: int = -2) -> None:
        """Mark 4-D / 5-D tensors as sharded along ``dim`` (counted from the end)."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.dim() in (4, 5):
                setattr(t, _MARK, dim)

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
            marked = next((a for a in args if _marked_dim(a) is not None), None)
            if marked is not None:
                self._propagate(output, _marked_dim(marked))

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
        marked = next((a for a in args if _marked_dim(a) is not None), None)
        if marked is None:
            marked = next((v for v in kwargs.values() if _marked_dim(v) is not None), None)
        if marked is not None and not self._in_domain_layer():
            name = getattr(func, "__name__", str(func))
            reason = _offence(name, marked, args, kwargs)
            if reason is not None:
                finding = GuardFinding(self._module_path(), name, reason, self._site())
                self.findings.append(finding)
                if self.raise_on_finding:
                    raise RuntimeError(f"domain guard: {finding}")
        out = func(*args, **kwargs)
        if marked is not None:
            self._propagate(out, _marked_dim(marked))
        return out

    def _propagate(self, out, dim: int) -> None:
        if isinstance(out, torch.Tensor):
            if out.dim() >= 4:  # a latitude field; pooled / flattened results are not
                try:
                    setattr(out, _MARK, dim)
                except (AttributeError, RuntimeError):
                    pass
        elif isinstance(out, (tuple, list)):
            for o in out:
                self._propagate(o, dim)


class _NoGuard:
    findings: list = []

    def mark(self, *tensors, dim: int = -2) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def guard_requested(conf: dict | None) -> bool:
    """The opt-in debug mode: ``trainer.domain_guard: true`` or CREDIT_PARALLEL_DOMAIN_GUARD=1."""
    if os.environ.get("CREDIT_PARALLEL_DOMAIN_GUARD", "").strip() not in ("", "0"):
        return True
    return trainer_option(conf or {}, "domain_guard")


def debug_guard(model: nn.Module, conf: dict | None = None):
    """A raising :class:`FunctionalCallGuard` when :func:`guard_requested`, else a no-op with
    the same ``mark`` method: ``with debug_guard(model, conf) as g: g.mark(*inputs); model(...)``."""
    if guard_requested(conf):
        return FunctionalCallGuard(model, raise_on_finding=True)
    return _NoGuard()
