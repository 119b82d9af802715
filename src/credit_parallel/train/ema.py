"""An exponential moving average of the weights (``trainer.use_ema``, ``trainer.ema_decay``):
miles-credit's own ``credit.trainers.base_trainer.EMATracker``, called, never copied.

CREDIT's tracker keeps a float32 CPU shadow of the model's ``state_dict`` (each rank the LOCAL
shard of every DTensor: FSDP2 and tensor-parallel parameters; plain tensors, e.g. the parameters
every domain rank replicates, whole), updates it after every optimizer step with the adaptive
decay ``min(decay, (1 + step) / (10 + step))``, and skips spectral-norm ``weight_u`` /
``weight_v`` buffers.  What this module adds around it:

* :func:`build_ema` imports it (a ``ValueError`` naming the missing dependency otherwise);
* :func:`ema_weights`: the EMA weights in the model for the duration of a block (CREDIT
  validates on them: ``ema.swap`` before and after ``validate``).  The training weights are set
  aside in their own dtype and put back bit for bit: ``EMATracker.swap`` would round them
  through its float32 shadow (a float64 run would leave validation with other weights);
* :func:`ema_checkpoint_state` / :func:`restore_ema`: the shadow in the DCP checkpoint, keyed by
  the model's fully qualified names, each shard as a DTensor with its parameter's mesh and
  placements, so a checkpoint written under one layout resumes under any (as the model does);
* :func:`load_ema_weights`: a checkpoint's EMA shadow loaded as the model's weights (the
  forecast's ``--ema``).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor

from ..layout.extras import extra_hint, require

__all__ = [
    "build_ema",
    "ema_tracker_class",
    "ema_checkpoint_state",
    "ema_weights",
    "has_ema",
    "load_ema_weights",
    "restore_ema",
]

TOP = "ema"  # the checkpoint's top-level key of the shadow (beside "model" and "optim")


def build_ema(model: torch.nn.Module, decay: float):
    """miles-credit's ``EMATracker(model, decay)``; its shadow starts at the model's weights."""
    return ema_tracker_class()(model, decay=decay)


def ema_tracker_class():
    """miles-credit's ``EMATracker`` class, or a ``ValueError`` naming what its import lacks
    (preflight asks before any rank starts)."""
    require("cftime", "trainer.use_ema (miles-credit's EMATracker)")
    try:
        from credit.trainers.base_trainer import EMATracker
    except ImportError as err:
        raise ValueError(
            "trainer.use_ema: the moving average is miles-credit's own EMATracker "
            f"(credit.trainers.base_trainer), which cannot be imported ({err}); its import "
            f"chain needs miles-credit 2026.2 with cftime ({extra_hint()}), or "
            "set trainer.use_ema: false"
        ) from err
    return EMATracker


def _live_state(model: torch.nn.Module) -> dict:
    """The state dict the tracker reads (``model.module``'s under DDP), tensors sharing storage
    with the parameters."""
    return model.module.state_dict() if hasattr(model, "module") else model.state_dict()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _fqn(key: str) -> str:
    """A state-dict key as DCP names it: without the ``torch.compile`` wrapper segments."""
    return key.replace("._orig_mod.", ".").removeprefix("_orig_mod.")


@contextmanager
def ema_weights(ema, model: torch.nn.Module):
    """The EMA weights in ``model`` inside the block (nothing when ``ema`` is None); the
    training weights restored exactly on exit, also on errors."""
    if ema is None:
        yield model
        return
    live = _live_state(model)
    saved = {}
    with torch.no_grad():
        for key, shadow in ema.shadow.items():
            local = _local(live[key])
            saved[key] = local.detach().clone()
            local.copy_(shadow.to(device=local.device, dtype=local.dtype))
    try:
        yield model
    finally:
        with torch.no_grad():
            for key, kept in saved.items():
                _local(live[key]).copy_(kept)


def _shadow_like(live: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's float32 shadow) as a tensor laid out like ``live``."""
    if not isinstance(live, DTensor):
        return local
    return DTensor.from_local(
        local.to(device=_local(live).device),
        device_mesh=live.device_mesh,
        placements=live.placements,
        run_check=False,
        shape=live.shape,
        stride=live.stride(),
    )


def ema_checkpoint_state(ema, model: torch.nn.Module) -> dict:
    """``{"ema": {"shadow": {fqn: shard}, "step": tensor}}`` for ``save_checkpoint(extra=)``."""
    live = _live_state(model)
    shadow = {_fqn(k): _shadow_like(live[k], v) for k, v in ema.shadow.items()}
    return {TOP: {"shadow": shadow, "step": torch.tensor(ema.step, dtype=torch.int64)}}


def ema_template(ema, model: torch.nn.Module) -> dict:
    """What ``load_checkpoint(extra=)`` fills in place: the shadow's layout, values to come."""
    live = _live_state(model)
    shadow = {_fqn(k): _shadow_like(live[k], torch.empty_like(v)) for k, v in ema.shadow.items()}
    return {TOP: {"shadow": shadow, "step": torch.zeros((), dtype=torch.int64)}}


def restore_ema(ema, loaded: dict) -> None:
    """Put a loaded :func:`ema_template` into the tracker (its shards, its step count)."""
    state = loaded[TOP]
    for key, kept in ema.shadow.items():
        # where and as what the tracker keeps its shadow (miles-credit: float32, on the host)
        value = _local(state["shadow"][_fqn(key)]).detach()
        ema.shadow[key] = value.to(device=kept.device, dtype=kept.dtype).clone()
    ema.step = int(state["step"])


def has_ema(path) -> bool:
    """Whether the DCP checkpoint at ``path`` holds an EMA shadow (False when unreadable:
    loading it then reports what is wrong)."""
    return has_top_level(path, TOP)


def has_top_level(path, top: str) -> bool:
    """Whether the DCP checkpoint at ``path`` holds state under the top-level key ``top``."""
    try:
        meta = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception:  # noqa: BLE001 - a missing or damaged checkpoint is reported by the load
        return False
    return any(k.startswith(top + ".") for k in meta.state_dict_metadata)


def load_ema_weights(path, model: torch.nn.Module) -> None:
    """The EMA shadow of the DCP checkpoint at ``path`` loaded as ``model``'s weights (every
    rank calls it; any layout).  Spectral-norm ``_u`` / ``_v`` buffers, which the shadow skips,
    keep the values the model holds (load the checkpoint itself first)."""
    from .checkpoint import CheckpointError

    path = Path(path)
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    own = get_state_dict(model, [])[0]
    prefix = f"{TOP}.shadow."
    stored = {k[len(prefix) :] for k in meta if k.startswith(prefix)}
    if not stored:
        raise CheckpointError(
            f"checkpoint {path} holds no EMA weights (train with trainer.use_ema: true)"
        )
    missing = sorted(k for k in stored if k not in own)
    if missing:
        raise CheckpointError(f"checkpoint {path}: EMA weights of no model key: {missing[:5]}")
    template = {
        k: _shadow_like(own[k], torch.empty_like(_local(own[k]), dtype=torch.float32))
        for k in stored
    }
    dcp.load({TOP: {"shadow": template}}, checkpoint_id=str(path))
    weights = {k: v.to(dtype=own[k].dtype) for k, v in template.items()}
    set_model_state_dict(model, weights, options=StateDictOptions(strict=False))
