"""Reference weather models and the config registry ``build_model``.

The models know nothing of parallelism beyond class-attribute declarations the parallel layers
read: ``_fsdp2_shard`` (FSDP2 unit), ``_tp_col`` / ``_tp_row`` / ``_tp_fused`` / ``_tp_head_dim``
(tensor-parallel plan), ``_domain_local`` (a custom forward that computes each output row from
rows inside its own domain shard). Their forwards use only modules the domain-parallel converter
replaces (convs, GroupNorm, ``nn.Upsample`` with a global target size, ``PeriodicConv2d``) or
per-pixel / row-local computation, and never read a global size from a tensor shape.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from credit_parallel.models.crossformer import CrossFormer, WindowAttention
from credit_parallel.models.external import (
    CREDIT_MODEL_TYPES,
    accepts,
    build_credit_model,
    build_from_import_path,
    check_kwargs,
)
from credit_parallel.models.pangu import Pangu3D
from credit_parallel.models.periodic import PeriodicConv2d
from credit_parallel.models.swin import SwinNet
from credit_parallel.models.unet import UNet

__all__ = [
    "MODEL_TYPES",
    "CrossFormer",
    "Pangu3D",
    "PeriodicConv2d",
    "SwinNet",
    "UNet",
    "WindowAttention",
    "build_model",
]

MODEL_TYPES: dict[str, type[nn.Module]] = {
    "unet": UNet,
    "crossformer": CrossFormer,
    "pangu": Pangu3D,
    "swin": SwinNet,
}


def build_model(conf_model: dict[str, Any]) -> nn.Module:
    """Build a model from a ``model:`` config block ``{"type": "unet", **constructor_kwargs}``.

    ``type`` may also be an import path ``package.module:Name`` or a miles-credit model type with
    CREDIT's keys (built by miles-credit's loader): see :mod:`credit_parallel.models.external`.

    ``ValueError`` naming ``model.type`` for a missing/unknown type (listing the known ones), and
    naming the key for an unknown, missing or invalid argument.
    """
    if not isinstance(conf_model, dict):
        raise TypeError(f"model config must be a dict, got {type(conf_model).__name__}")
    known = ", ".join(sorted(MODEL_TYPES))
    if "type" not in conf_model:
        raise ValueError(f"model.type is missing; known types: {known}")
    model_type = conf_model["type"]
    kwargs = {k: v for k, v in conf_model.items() if k != "type"}
    if isinstance(model_type, str) and ":" in model_type:
        return build_from_import_path(model_type, kwargs)
    cls = MODEL_TYPES.get(str(model_type).lower()) if isinstance(model_type, str) else None
    credit_type = isinstance(model_type, str) and model_type in CREDIT_MODEL_TYPES
    if credit_type and cls is None:  # a CREDIT-only type: miles-credit's own loader
        return build_credit_model(model_type, kwargs)
    if credit_type and not accepts(cls.__init__, kwargs):
        # a name both have, keys not ours: CREDIT's block, or a typo in ours (say both)
        try:
            return build_credit_model(model_type, kwargs)
        except ValueError as credit_err:
            try:
                check_kwargs(cls.__init__, kwargs, model_type)
            except ValueError as ours:
                raise ValueError(f"{ours} (as a CREDIT model block: {credit_err})") from None
            raise
    if cls is None:
        raise ValueError(
            f"model.type={model_type!r} is not a known model; known types: {known}, a miles-credit "
            "type, or an import path 'package.module:Name'"
        )
    check_kwargs(cls.__init__, kwargs, model_type)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as err:
        raise ValueError(f"model ({model_type}): {err}") from err
