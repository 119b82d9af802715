"""Models from outside the bundled four: an import path, or a CREDIT model block.

``model.type`` in a config is resolved by :func:`credit_parallel.models.build_model`:

* a bundled name (``unet``, ``crossformer``, ``pangu``, ``swin``) whose keys the bundled class
  accepts: the bundled model;
* an import path ``package.module:Name`` (a class or a factory function): ``Name(**rest of the
  block)``, the keys checked against its signature exactly as for the bundled models;
* a miles-credit model type (``crossformer``, ``wxformer``, ``unet``, ``fuxi``,
  ``nextgen_wxformer``, ... with CREDIT's keys): built by miles-credit's own loader
  ``credit.models.load_model({"model": block})``, the block prepared as miles-credit's gen-2
  trainer prepares it (:func:`prepare_credit_block`: its Gen 1 ``post_conf`` removed, with a
  warning).  miles-credit is optional: without it the error names the package to install.

CREDIT's models take ``(B, C, T, H, W)`` with ``T = frames``; the trainer's batches are
``(B, C, H, W)`` for one frame.  A CREDIT model built here therefore accepts both: a 4-D input
gets ``T = 1`` added and the output's ``T = 1`` removed again.  This is done by giving the model
a subclass of its own class (the state_dict keys, the submodules and ``isinstance`` stay those
of the CREDIT model, so checkpoints move between CREDIT and credit-parallel) which also
declares ``input_shapes`` for the planner.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = [
    "CREDIT_MODEL_TYPES",
    "build_credit_model",
    "build_from_import_path",
    "check_kwargs",
    "prepare_credit_block",
]

# miles-credit 2026.2's credit.models._MODEL_REGISTRY keys (plus "unet404" of load_model)
CREDIT_MODEL_TYPES = frozenset(
    {
        "camulator",
        "crossformer",
        "crossformer-diffusion",
        "crossformer-ensemble",
        "crossformer-style",
        "crossformer_downscaling",
        "debugger",
        "dscale",
        "fuxi",
        "graph",
        "nextgen_wxformer",
        "swin",
        "unet",
        "unet-diffusion",
        "unet404",
        "unet_downscaling",
        "wrf",
        "wxformer",
        "wxformer_base",
    }
)


def check_kwargs(target: Callable, kwargs: dict[str, Any], model_type: str) -> None:
    """``ValueError`` naming ``model.<key>`` for a key ``target`` does not accept or a required
    argument missing (a ``**kwargs`` target accepts any key)."""
    params = dict(inspect.signature(target).parameters)
    params.pop("self", None)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = {
        k: p
        for k, p in params.items()
        if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    }
    for key in kwargs:
        if key not in named and not takes_any:
            raise ValueError(
                f"model.{key} is not an argument of {model_type!r}; "
                f"accepted keys: {', '.join(named)}"
            )
    for key, param in named.items():
        if param.default is inspect.Parameter.empty and key not in kwargs:
            raise ValueError(f"model.{key} is required for model.type={model_type!r}")


def accepts(target: Callable, kwargs: dict[str, Any]) -> bool:
    """Whether :func:`check_kwargs` would pass."""
    try:
        check_kwargs(target, kwargs, "")
    except ValueError:
        return False
    return True


def build_from_import_path(model_type: str, kwargs: dict[str, Any]) -> nn.Module:
    """``package.module:Name(**kwargs)``; errors name ``model.type`` and what to fix."""
    module_name, _, attr = model_type.partition(":")
    if not module_name or not attr:
        raise ValueError(
            f"model.type={model_type!r}: an import path is 'package.module:Name' (a class or a "
            "factory returning an nn.Module)"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"model.type={model_type!r}: cannot import {module_name!r}: {err}"
        ) from err
    target = module
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ValueError(f"model.type={model_type!r}: {module_name!r} has no {attr!r}")
    if not callable(target):
        raise ValueError(f"model.type={model_type!r}: {attr!r} is not a class or a function")
    check_kwargs(target.__init__ if isinstance(target, type) else target, kwargs, model_type)
    try:
        model = target(**kwargs)
    except (ValueError, TypeError) as err:
        raise ValueError(f"model ({model_type}): {err}") from err
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model.type={model_type!r} returned a {type(model).__name__}, not an nn.Module"
        )
    return model


def build_credit_model(model_type: str, kwargs: dict[str, Any]) -> nn.Module:
    """A miles-credit model built by ``credit.models.load_model``, made to take 4-D batches."""
    if importlib.util.find_spec("credit") is None:
        raise ValueError(
            f"model.type={model_type!r} with keys {sorted(kwargs)} is a CREDIT model block: it "
            "needs the miles-credit package (pip install miles-credit==2026.2.0), which is not "
            "installed"
        )
    from credit.models import load_model

    try:
        model = load_model({"model": prepare_credit_block(model_type, kwargs)})
    except ImportError as err:
        raise ValueError(
            f"model.type={model_type!r}: miles-credit cannot import this model ({err}); install "
            "the package it names"
        ) from err
    except (ValueError, TypeError, KeyError, AssertionError) as err:
        # miles-credit checks some arguments with bare asserts
        raise ValueError(f"model ({model_type}, built by miles-credit): {err!r}") from err
    return _takes_one_frame(model)


def prepare_credit_block(model_type: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The model block as miles-credit 2026.2's gen-2 trainer hands it to ``load_model``.

    ``credit/applications/train_gen2.py`` (the trainer that reads ``trainer.parallelism``) calls
    ``inject_flat_var_keys(conf)``, which fills ``conf["data"]`` only (flat variable lists for
    loss and metrics; the model never reads them), then removes ``conf["model"]["post_conf"]``
    with a warning: CREDIT's Gen 1 post block (tracer / mass / water / energy fixers inside the
    model) is not part of the model it trains; its Gen 2 ``postblocks`` run in the trainer,
    outside the model.  ``credit check`` (``credit.cli._check``) validates the block the same
    way.  So does this: a ``post_conf`` is removed with the same warning, and the model is the
    one CREDIT's trainer builds.  (Building the post block inside the model would need the
    indices that only CREDIT's Gen 1 parser, ``credit.parser.credit_main_parser``, fills from the
    flat Gen 1 data schema: ``inject_postblock_info`` raises ``KeyError('levels')`` on a gen-2
    config.)"""
    block = {"type": model_type, **kwargs}
    _padding_pairs(block)
    if "post_conf" in block:
        import warnings

        post = block.pop("post_conf")
        active = isinstance(post, dict) and post.get("activate", False)
        warnings.warn(
            f"model.post_conf ({'active' if active else 'inactive'}) of the CREDIT model "
            f"{model_type!r} is ignored, as miles-credit's gen-2 trainer (train_gen2.py) ignores "
            "it: Gen 1 post blocks are not part of the model it trains (Gen 2 postblocks run in "
            "CREDIT's trainer, outside the model)",
            UserWarning,
            stacklevel=3,
        )
    return block


def _padding_pairs(block: dict) -> None:
    """A ``padding_conf.pad_lat`` / ``pad_lon`` given as one int (``wxformer_npj_era5_028deg.yml``:
    ``pad_lat: 80``) read as ``[80, 80]``, as CREDIT's config parser (``credit_main_parser``)
    reads it; miles-credit's gen-2 trainer skips that parser and hands the int to
    ``TensorPadding``, whose forward then fails (``'int' object is not iterable``)."""
    padding = block.get("padding_conf")
    if not isinstance(padding, dict) or not padding.get("activate"):
        return
    for key in ("pad_lat", "pad_lon"):
        value = padding.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            block["padding_conf"] = padding = {**padding, key: [value, value]}


_ONE_FRAME_CLASSES: dict[type, type] = {}


def _input_shapes(self):
    channels = (
        getattr(self, "channels", 0) * getattr(self, "levels", 0)
        + getattr(self, "surface_channels", 0)
        + getattr(self, "input_only_channels", 0)
    )
    return ((channels, self.image_height, self.image_width),)


def _one_frame_class(base: type) -> type:
    """``base`` whose forward also takes a 4-D ``(B, C, H, W)`` batch (one frame)."""

    def forward(self, x, *args, **kwargs):
        if x.dim() != 4:
            return base.forward(self, x, *args, **kwargs)
        y = base.forward(self, x.unsqueeze(2), *args, **kwargs)
        return y.squeeze(2) if isinstance(y, torch.Tensor) and y.dim() == 5 else y

    namespace = {
        "forward": forward,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "input_shapes": property(_input_shapes),
        # miles-credit builds some buffers from Python data, which a meta-device build drops:
        # model_init.build_parallel_model then builds the model whole on each rank instead
        "_whole_build_fallback": True,
        # domain/adapters/nextgen.py keeps this forward's 4-D input / output
        "_credit_one_frame": True,
    }
    return type(base.__name__, (base,), namespace)


def _takes_one_frame(model: nn.Module) -> nn.Module:
    base = type(model)
    if base not in _ONE_FRAME_CLASSES:
        _ONE_FRAME_CLASSES[base] = _one_frame_class(base)
    model.__class__ = _ONE_FRAME_CLASSES[base]
    return model
