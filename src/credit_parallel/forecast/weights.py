"""The weights a forecast starts from: a checkpoint ``train`` wrote under any layout, or a
miles-credit checkpoint.

- A ``step_*`` directory (DCP shards, ``manifest.json``, ``COMPLETE``) or a directory of them (the
  newest complete one): loaded through :func:`credit_parallel.train.checkpoint.load_checkpoint`,
  resharded onto this run's layout as ``train --resume`` does; a model that does not match is
  refused naming the first differing keys.
- A file (``torch.save``): miles-credit's ``{"model_state_dict": ...}`` (or a bare state dict)
  of the unconverted model.  Keys are mapped onto the model's: the ``module.`` (DDP) and
  ``_orig_mod.`` (``torch.compile``) prefixes are dropped, and a key that CREDIT's own domain
  conversion renamed (``credit.domain_parallel.convert``: a ``Conv2d`` / ``Conv3d`` / transposed
  conv / cross-embedding branch wrapped as ``<name>.conv``) is mapped back to the key without
  that ``.conv`` segment when exactly that key is the model's.  The full tensors are then
  distributed onto this rank's shards (``set_state_dict(full_state_dict=True)``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
)

from ..train.checkpoint import CheckpointError, list_checkpoints, load_checkpoint

__all__ = [
    "check_weights",
    "credit_state",
    "load_forecast_weights",
    "map_credit_keys",
    "resolve_checkpoint",
    "set_credit_weights",
]

_PREFIXES = ("module.", "_orig_mod.")


def resolve_checkpoint(path) -> Path:
    """The checkpoint ``path`` names: a file, a ``step_*`` directory, or the newest complete
    one inside a directory of them.  ``CheckpointError`` when there is none."""
    path = Path(path)
    if path.is_file():
        return path
    if path.is_dir() and path.name.startswith("step_"):
        return path
    found = list_checkpoints(path) if path.is_dir() else []
    if found:
        return found[-1]
    raise CheckpointError(
        f"--checkpoint {str(path)!r}: no checkpoint there (expected a step_* directory written "
        "by train, a directory holding them, or a miles-credit checkpoint file)"
    )


def _strip(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if key.startswith(prefix):
                key, changed = key[len(prefix) :], True
        key = key.replace("._orig_mod.", ".")
    return key


def _without_conv_segment(key: str, expected: set) -> str | None:
    """``key`` without one ``.conv`` segment that CREDIT's domain wrapper added, when exactly
    one such key is the model's."""
    parts = key.split(".")
    hits = {
        ".".join(parts[:i] + parts[i + 1 :])
        for i, part in enumerate(parts[:-1])
        if part == "conv" and i > 0
    }
    hits &= expected
    return hits.pop() if len(hits) == 1 else None


def map_credit_keys(state: dict, expected) -> dict:
    """``state``'s keys mapped onto ``expected`` (the model's keys): prefixes dropped, CREDIT's
    domain-conversion renames undone (module docstring).  Keys that map nowhere stay as they
    are (the caller reports them)."""
    expected = set(expected)
    out = {}
    for key, value in state.items():
        name = _strip(key)
        if name not in expected:
            name = _without_conv_segment(name, expected) or name
        if name in out:
            raise CheckpointError(f"checkpoint keys {key!r} and another both map to {name!r}")
        out[name] = value
    return out


def _read(path: Path, **kw):
    try:
        return torch.load(path, map_location="cpu", weights_only=True, **kw)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is reported in one line
        raise CheckpointError(
            f"checkpoint {str(path)!r} could not be read ({type(exc).__name__}: {exc})"
        ) from None


def credit_state(payload) -> tuple[dict | None, bool]:
    """The state dict a miles-credit ``torch.save`` payload holds, and whether it is the EMA
    shadow: ``payload["model_state_dict"]`` (else the payload itself), then its ``shadow`` when
    it has one (``checkpoint_ema.pt``: ``EMATracker.state_dict()``).  ``None`` when it is no
    dict."""
    state = payload.get("model_state_dict", payload) if isinstance(payload, dict) else None
    if isinstance(state, dict) and isinstance(state.get("shadow"), dict):
        return state["shadow"], True
    return (state if isinstance(state, dict) else None), False


def _credit_file_state(path: Path, ema: bool, **kw) -> tuple[Path, dict | None]:
    """The file read and its state dict; with ``ema`` the EMA shadow: the file's own, else the
    sibling ``checkpoint_ema.pt`` miles-credit writes beside ``checkpoint.pt``."""
    state, is_ema = credit_state(_read(path, **kw))
    if not ema or is_ema:
        return path, state
    sibling = path.with_name("checkpoint_ema.pt")
    if sibling != path and sibling.is_file():
        state, is_ema = credit_state(_read(sibling, **kw))
        if is_ema:
            return sibling, state
    raise CheckpointError(
        f"--ema: checkpoint {str(path)!r} holds no EMA weights (no 'shadow') and no "
        f"checkpoint_ema.pt with them lies beside it: pass checkpoint_ema.pt"
    )


def _load_credit_file(path: Path, model: torch.nn.Module, ema: bool = False) -> dict:
    path, state = _credit_file_state(path, ema)
    set_credit_weights(model, state, path)
    return {"checkpoint": str(path), "format": "miles-credit", "ema": ema}


def set_credit_weights(model: torch.nn.Module, state, path) -> None:
    """A miles-credit ``model_state_dict`` (full tensors) into the parallel ``model``: keys
    mapped (:func:`map_credit_keys`), checked against the model's, cast to its dtypes and
    distributed onto this rank's shards; ``CheckpointError`` naming what does not match."""
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds no model_state_dict (a miles-credit checkpoint) "
            "and is not a state dict"
        )
    own = get_state_dict(model, [])[0]
    mapped = map_credit_keys(state, own)
    parts = _differences(
        {k: tuple(v.shape) for k, v in own.items()}, {k: tuple(v.shape) for k, v in mapped.items()}
    )
    if parts:
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not match the model: " + "; ".join(parts)
        )
    mapped = {k: v.to(dtype=own[k].dtype) for k, v in mapped.items()}
    set_model_state_dict(model, mapped, options=StateDictOptions(full_state_dict=True, strict=True))


def load_forecast_weights(model: torch.nn.Module, path, *, ema: bool = False) -> dict:
    """Load the checkpoint ``path`` names into the parallel ``model`` (every rank calls it);
    returns its manifest (``{"checkpoint": ..., "format": ...}`` for a miles-credit file).
    ``ema``: then the moving average of the weights a ``trainer.use_ema`` run saved with it
    (``CheckpointError`` when it holds none).  A miles-credit ``checkpoint_ema.pt`` is a file
    like any other (its ``shadow`` is read as the state dict); with ``ema`` a miles-credit
    ``checkpoint.pt`` is read through the ``checkpoint_ema.pt`` beside it (refused without)."""
    resolved = resolve_checkpoint(path)
    if resolved.is_file():
        return _load_credit_file(resolved, model, ema)
    manifest = dict(load_checkpoint(resolved, model))
    if ema:
        from ..train.ema import load_ema_weights

        load_ema_weights(resolved, model)
    manifest.update(checkpoint=str(resolved), format="credit-parallel", ema=ema)
    return manifest


def _differences(own: dict, stored: dict) -> list[str]:
    missing = [k for k in own if k not in stored]
    unexpected = [k for k in stored if k not in own]
    shapes = [
        f"{k}: checkpoint {stored[k]} vs model {own[k]}"
        for k in own
        if k in stored and stored[k] != own[k]
    ]
    parts = []
    for what, keys in (
        ("missing in checkpoint", missing),
        ("unexpected in checkpoint", unexpected),
        ("shape mismatch", shapes),
    ):
        if keys:
            more = f" (+{len(keys) - 3} more)" if len(keys) > 3 else ""
            parts.append(f"{what}: {', '.join(keys[:3])}{more}")
    return parts


def check_weights(model_conf: dict, path, *, ema: bool = False) -> None:
    """Compare the checkpoint's parameter names and shapes with the model ``model_conf`` builds
    (on the meta device: no memory, no process group), without reading a tensor;
    ``CheckpointError`` naming the first differing keys.  What the CLI checks before any rank
    starts.  ``ema``: a miles-credit file is checked as :func:`load_forecast_weights` reads it."""
    import torch.distributed.checkpoint as dcp

    from ..models import build_model
    from ..train.checkpoint import read_manifest

    resolved = resolve_checkpoint(path)
    with torch.device("meta"):
        model = build_model(model_conf)
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if resolved.is_file():
        resolved, state = _credit_file_state(resolved, ema, mmap=True)
        state = state or {}
        state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        stored = {k: tuple(v.shape) for k, v in map_credit_keys(state, own).items()}
    else:
        read_manifest(resolved)  # complete?
        meta = dcp.FileSystemReader(str(resolved)).read_metadata().state_dict_metadata
        stored = {
            k[len("model.") :]: tuple(getattr(v, "size", ()))
            for k, v in meta.items()
            if k.startswith("model.")
        }
    parts = _differences(own, stored)
    if parts:
        raise CheckpointError(
            f"checkpoint {str(resolved)!r} does not match the model: " + "; ".join(parts)
        )
