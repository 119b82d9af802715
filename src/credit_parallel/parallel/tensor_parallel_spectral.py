"""Spectral normalisation on a tensor-parallel projection, exact: the norm of the WHOLE weight.

torch has two forms: the hook form ``torch.nn.utils.spectral_norm`` (parameter ``weight_orig``,
buffers ``weight_u`` / ``weight_v``, a forward pre-hook that sets ``weight``; what CREDIT's
``apply_spectral_norm`` uses on every Linear and Conv2d of its CrossFormer) and the parametrize
form ``torch.nn.utils.parametrizations.spectral_norm`` (``parametrizations.weight.original``,
buffers ``parametrizations.weight.0._u`` / ``_v``).  Both divide the weight by ``sigma = u^T W
v``, ``W`` the weight as an (out, in) matrix, after (in training mode) ``n_power_iterations``
steps of the power iteration that update ``u`` and ``v`` in place.  Run as is on a tp shard
they crash inside torch (a plain tensor assigned over a DTensor parameter; a dotted parameter
name for ``distribute_tensor``), and a shard's own sigma would be the wrong norm.

Here a projection keeps the form's parameter and buffer names (``state_dict`` keys and shapes as
in one process), stores the original weight as the tp DTensor and ``u`` / ``v`` as full vectors
on every tp rank, and computes the single-process power iteration on the shards: with ``W``
split by rows (column role) ``W^T u`` is a sum over tp ranks and ``W v`` a concatenation; split
by columns (row role) the other way round.  ``sigma`` is the sum over tp of ``u_t^T W_t v_t``
with the gradient of that sum (each rank scales its own shard by it) all-reduced in backward.
The forward hook / parametrization itself no longer runs on the converted layer.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from ..layout.small_collectives import gather_small, sum_small_
from .tensor_parallel_guard import CopyToTensorParallel, ReduceFromTensorParallel

__all__ = [
    "SpectralNormSpec",
    "attach_spectral_norm",
    "sigma_from_shards",
    "spectral_norm_of",
    "spectral_sigma",
]

COLUMN = "col"  # the roles of tensor_parallel (imported from there would be a cycle)
_HOOK = importlib.import_module("torch.nn.utils.spectral_norm").SpectralNorm
_PARAM = importlib.import_module("torch.nn.utils.parametrizations")._SpectralNorm


@dataclass(frozen=True)
class SpectralNormSpec:
    """How a layer's weight is spectrally normalised: ``form`` "hook" or "parametrize", and the
    form's ``n_power_iterations``, ``eps`` and ``dim``."""

    form: str
    n_power_iterations: int
    eps: float
    dim: int

    @property
    def orig(self) -> str:
        """The name of the parameter holding the un-normalised weight (``weight_orig`` ...)."""
        return "weight_orig" if self.form == "hook" else "parametrizations.weight.original"


def spectral_norm_of(layer: nn.Module, what: str | None = None) -> SpectralNormSpec | None:
    """The spectral norm on ``layer.weight`` (either form), or None.  A weight that is neither a
    parameter nor spectrally normalised (another parametrization, or a hook such as
    ``torch.nn.utils.weight_norm``'s computing it) raises, naming ``what`` (default: the
    layer's class): only spectral norm is computed on shards."""
    for hook in layer._forward_pre_hooks.values():
        if isinstance(hook, _HOOK) and hook.name == "weight":
            return SpectralNormSpec("hook", hook.n_power_iterations, hook.eps, hook.dim)
    what = what or type(layer).__name__
    fix = "remove it or leave this layer out of _tp_col / _tp_row"
    if parametrize.is_parametrized(layer, "weight"):
        chain = layer.parametrizations["weight"]
        if len(chain) != 1 or not isinstance(chain[0], _PARAM):
            names = [type(p).__name__ for p in chain]
            raise ValueError(
                f"tensor-parallel target {what}: its weight carries the parametrizations "
                f"{names}; of those only spectral norm is supported under tp ({fix})"
            )
        sn = chain[0]
        return SpectralNormSpec("parametrize", sn.n_power_iterations, sn.eps, sn.dim)
    if "weight" not in layer._parameters:
        hooks = [type(h).__name__ for h in layer._forward_pre_hooks.values()]
        raise ValueError(
            f"tensor-parallel target {what}: its weight is not a parameter (computed by the "
            f"forward pre-hook(s) {hooks}, e.g. torch.nn.utils.weight_norm); only spectral norm "
            f"is supported under tp ({fix})"
        )
    return None


def attach_spectral_norm(
    module: nn.Module, layer: nn.Module, spec: SpectralNormSpec, weight: nn.Parameter, what: str
) -> None:
    """Give ``module`` (``layer`` itself when converted in place) the split ``weight`` under the
    form's parameter name and the full ``u`` / ``v`` under its buffer names; stop the form's own
    hook on an in-place layer.  ``what`` names the layer in errors."""
    if spec.dim != 0:
        raise ValueError(
            f"{what}: spectral norm over dim {spec.dim} under tensor parallelism is not "
            "supported (only dim 0, the default for Linear and Conv2d)"
        )
    if spec.form == "hook":
        u, v = layer.weight_u, layer.weight_v
        if module is layer:
            for key, hook in list(layer._forward_pre_hooks.items()):
                if isinstance(hook, _HOOK) and hook.name == "weight":
                    del layer._forward_pre_hooks[key]
            layer.__dict__.pop("weight", None)  # the hook's last normalised copy
        else:
            module.register_buffer("weight_u", u.detach().clone())
            module.register_buffer("weight_v", v.detach().clone())
        module.weight_orig = weight
    else:
        if module is not layer:
            module.parametrizations = _copy_parametrizations(layer)
        else:  # the parametrized class's ``weight`` would run the norm on the DTensor
            layer.__class__ = _without_weight(type(layer))
        module.parametrizations["weight"].original = weight
    module._spectral = spec


_WITHOUT_WEIGHT: dict[type, type] = {}


def _no_weight(self):
    raise AttributeError(
        "the weight of a tensor-parallel spectral-normed layer is computed in its forward; its "
        "parameter is parametrizations.weight.original"
    )


def _without_weight(cls: type) -> type:
    """``cls`` whose ``weight`` is absent (as the hook form leaves it after conversion)."""
    if cls not in _WITHOUT_WEIGHT:
        names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        _WITHOUT_WEIGHT[cls] = type(cls.__name__, (cls,), {"weight": property(_no_weight), **names})
    return _WITHOUT_WEIGHT[cls]


def _copy_parametrizations(layer: nn.Module) -> nn.ModuleDict:
    import copy

    return copy.deepcopy(layer.parametrizations)


def _summed(x, group):
    """Every rank's ``x`` summed (a vector of the power iteration, no gradient)."""
    return sum_small_(x.clone(memory_format=torch.contiguous_format), group)


def _gathered(x, group):
    """Every rank's ``x`` concatenated in tp order (a vector of the power iteration)."""
    return gather_small(x, group).flatten()


def _sum_over_tp(partial, group):
    """The sum of a per-rank partial over tp: each rank scales its own shard by it, so its
    gradient is the sum of the per-rank gradients ("g" forward, then "f" for the backward)."""
    return CopyToTensorParallel.apply(ReduceFromTensorParallel.apply(partial, group), group)


def spectral_sigma(module: nn.Module, param, group) -> torch.Tensor:
    """``sigma`` of the tp projection ``module`` (its spectral norm's whole weight ``param``, a
    DTensor on the tp mesh of ``group``), after the power iteration in training mode."""
    spec = module._spectral
    if spec.form == "hook":
        u, v = module.weight_u, module.weight_v
    else:
        sn = module.parametrizations["weight"][0]
        u, v = sn._u, sn._v
    local = param.to_local()
    return sigma_from_shards(local, u, v, module.role, group, spec, module.training)


def sigma_from_shards(
    w_local: torch.Tensor,
    u: torch.Tensor,
    v: torch.Tensor,
    role: str,
    group,
    spec: SpectralNormSpec,
    training: bool,
) -> torch.Tensor:
    """``sigma = u^T W v`` of the whole weight from this rank's ``w_local`` (rows of ``W`` for
    the column role, columns for the row role; the plain Shard(0)/Shard(1) block), after the
    form's power iteration in training mode (``u``, ``v``: full vectors, updated in place, in the
    form's order).  Differentiable in ``w_local``; the same on every tp rank."""
    mat = w_local.flatten(1)
    rank = dist.get_rank(group)
    if role == COLUMN:
        rows = slice(rank * mat.shape[0], (rank + 1) * mat.shape[0])
        cols = slice(None)
        w_v = lambda vec: _gathered(torch.mv(mat, vec), group)  # noqa: E731
        wt_u = lambda vec: _summed(torch.mv(mat.t(), vec[rows]), group)  # noqa: E731
    else:
        rows = slice(None)
        cols = slice(rank * mat.shape[1], (rank + 1) * mat.shape[1])
        w_v = lambda vec: _summed(torch.mv(mat, vec[cols]), group)  # noqa: E731
        wt_u = lambda vec: _gathered(torch.mv(mat.t(), vec), group)  # noqa: E731
    if training and spec.n_power_iterations > 0:
        with torch.no_grad():
            for _ in range(spec.n_power_iterations):
                if spec.form == "hook":  # v first, then u (torch.nn.utils.spectral_norm)
                    v.copy_(F.normalize(wt_u(u), dim=0, eps=spec.eps))
                    u.copy_(F.normalize(w_v(v), dim=0, eps=spec.eps))
                else:  # u first, then v (parametrizations.spectral_norm)
                    u.copy_(F.normalize(w_v(v), dim=0, eps=spec.eps))
                    v.copy_(F.normalize(wt_u(u), dim=0, eps=spec.eps))
    u = u.clone(memory_format=torch.contiguous_format)
    v = v.clone(memory_format=torch.contiguous_format)
    partial = torch.dot(u[rows], torch.mv(mat, v[cols]))
    return _sum_over_tp(partial, group)
