"""The declared compute precision of a model FSDP2 does not wrap: :func:`compute_in`.

SPEC §4: where the group FSDP2 would shard over has one rank, the library applies no
``fully_shard`` (it would shard nothing and only cost).  ``trainer.amp`` then still computes in
bf16, as FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)`` does: the model's ``forward`` runs
under ``torch.autocast(device_type, bf16)``, the parameters stay fp32 (the master weights the
optimizer updates, and the gradients are fp32).  Autocast is torch's mixed precision: matrix
products and convolutions in bf16, reductions such as norms and softmax in fp32, where FSDP2's
policy casts the parameters and so runs every operation in bf16; the two agree within bf16's
tolerance (``tests/test_fsdp_single_rank.py`` measures it).

The forward is swapped by a class swap (the technique FSDP2 and the activation checkpointing of
``fsdp.py`` use): no module is added, parameter names, ``state_dict`` keys and ``isinstance``
checks are unchanged, ``torch.compile`` traces the autocast region into its graph.  A forward
that ``compile_blocks`` replaced on the instance (a model without ``_fsdp2_shard`` blocks) enters
the same region through :func:`declared_autocast` (``compile.py``).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

__all__ = ["compute_in", "declared_autocast", "declared_compute_dtype"]

_ATTR = "_credit_compute_dtype"  # (device type, dtype) set by compute_in
_CLASSES: dict[type, type] = {}


def declared_compute_dtype(module: nn.Module) -> tuple[str, torch.dtype] | None:
    """``(device type, dtype)`` that :func:`compute_in` declared on ``module``, else None."""
    return module.__dict__.get(_ATTR)


def declared_autocast(module: nn.Module):
    """The autocast region :func:`compute_in` declared on ``module`` (a no-op context when
    none was declared)."""
    declared = declared_compute_dtype(module)
    if declared is None:
        return contextlib.nullcontext()
    device_type, dtype = declared
    return torch.autocast(device_type, dtype=dtype)


def _autocast_class(cls: type) -> type:
    if cls not in _CLASSES:

        def forward(self, *args, **kwargs):
            with declared_autocast(self):
                return super(new_cls, self).forward(*args, **kwargs)

        new_cls = type(f"Autocast{cls.__name__}", (cls,), {"forward": forward})
        new_cls.__module__ = cls.__module__
        _CLASSES[cls] = new_cls
    return _CLASSES[cls]


def compute_in(model: nn.Module, dtype: torch.dtype | None, device_type: str) -> nn.Module:
    """Make ``model``'s forward compute in ``dtype`` (bf16 or fp16) under ``torch.autocast`` on
    ``device_type``, its parameters kept in their own dtype; in place, returns ``model``.
    ``dtype`` None or float32: nothing changes."""
    if dtype is None or dtype == torch.float32:
        return model
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"compute_in: autocast computes in bf16 or fp16, not {dtype}")
    model.__dict__[_ATTR] = (device_type, dtype)
    if not isinstance(model, tuple(_CLASSES.values())):
        model.__class__ = _autocast_class(type(model))
    return model
