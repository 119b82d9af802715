"""Checkpoints with torch.distributed.checkpoint (DCP): save under one layout, load under any.

Layout on disk: ``<dir>/step_00000040/`` holds the DCP shards of ``{"model", "optim"}`` state
dicts (fully qualified names, so dp/tp/domain sizes and the data mode may change between save
and load), ``manifest.json`` (step, layout, config hash, library version, extra state) and a
``COMPLETE`` marker.  A save goes to ``step_N.tmp`` first and is renamed, then marked complete, so
a crash mid-save leaves the previous checkpoint untouched and loadable; loading picks the newest
directory with a marker and can fall back to older ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

__all__ = [
    "CheckpointError",
    "config_hash",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
    "verify_files",
]

MARKER = "COMPLETE"
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or does not match the model."""


def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _is_dist() else 0


def _barrier() -> None:
    if _is_dist():
        dist.barrier()


def config_hash(conf: dict) -> str:
    """Hash of the config without its parallelism block (which may legitimately change)."""
    trimmed = json.loads(json.dumps(conf, default=str))
    trimmed.get("trainer", {}).pop("parallelism", None)
    return hashlib.sha256(json.dumps(trimmed, sort_keys=True).encode()).hexdigest()[:16]


def _step_dir(directory: Path, step: int) -> Path:
    return directory / f"step_{step:08d}"


def list_checkpoints(directory) -> list[Path]:
    """Complete checkpoints under ``directory``, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        if (
            p.is_dir()
            and p.name.startswith("step_")
            and not p.name.endswith(".tmp")
            and (p / MARKER).exists()
        ):
            found.append(p)
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(directory) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1] if found else None


def save_checkpoint(
    directory,
    step: int,
    model,
    optimizer=None,
    *,
    manifest: dict | None = None,
    keep: int = 3,
    extra: dict | None = None,
) -> Path:
    """Save model (and optimizer) state atomically; every rank must call it.  ``extra``: more
    top-level state dicts saved beside them (the EMA shadow: ``train/ema.py``)."""
    directory = Path(directory)
    final = _step_dir(directory, step)
    tmp = final.with_name(final.name + ".tmp")
    if _rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
    _barrier()
    if optimizer is not None:
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
    else:
        state = {"model": get_state_dict(model, [])[0]}
    state.update(extra or {})
    dcp.save(state, checkpoint_id=str(tmp))
    _barrier()
    if _rank() == 0:
        info = dict(manifest or {})
        info.update(step=step, has_optimizer=optimizer is not None)
        from .. import __version__

        info.setdefault("library_version", __version__)
        info["files"] = {f.name: _sha256(f) for f in sorted(tmp.iterdir()) if f.is_file()}
        (tmp / MANIFEST).write_text(json.dumps(info, indent=2, default=str))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        (final / MARKER).write_text("ok\n")
        for old in list_checkpoints(directory)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify_files(path) -> None:
    """Raise CheckpointError if a file listed in the manifest is missing, truncated or altered."""
    path = Path(path)
    manifest = read_manifest(path)
    bad = []
    for name, digest in manifest.get("files", {}).items():
        f = path / name
        if not f.is_file():
            bad.append(f"{name}: missing")
        elif _sha256(f) != digest:
            bad.append(f"{name}: checksum mismatch (truncated or corrupted)")
    if bad:
        raise CheckpointError(f"checkpoint {path} is corrupted: " + "; ".join(bad))


def _verify_everywhere(path: Path) -> None:
    """Rank 0 checks the files and every rank learns the verdict (no rank loads garbage)."""
    error = None
    if _rank() == 0:
        try:
            verify_files(path)
        except CheckpointError as exc:
            error = str(exc)
    if _is_dist():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise CheckpointError(error)


def read_manifest(path) -> dict:
    path = Path(path)
    if not (path / MARKER).exists():
        raise CheckpointError(f"checkpoint {path} is incomplete (no {MARKER} marker)")
    try:
        return json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: unreadable {MANIFEST}: {exc}") from None


def _check_matches(path: Path, state: dict) -> None:
    """Refuse a checkpoint whose model differs, listing every difference (never a partial load)."""
    try:
        meta = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any unreadable metadata is a corrupted checkpoint
        raise CheckpointError(
            f"checkpoint {path}: unreadable metadata ({type(exc).__name__}: {exc})"
        ) from None
    stored = {k: v for k, v in meta.state_dict_metadata.items()}
    problems = []
    for top in state:
        want = {}
        for key, value in _flatten(state[top], top).items():
            want[key] = value
        have = {k for k in stored if k == top or k.startswith(top + ".")}
        if top == "model":
            for key, value in want.items():
                if key not in stored:
                    problems.append(f"missing in checkpoint: {key}")
                elif hasattr(stored[key], "size") and isinstance(value, torch.Tensor):
                    if tuple(stored[key].size) != tuple(value.shape):
                        problems.append(
                            f"shape mismatch: {key}: checkpoint {tuple(stored[key].size)} vs model {tuple(value.shape)}"
                        )
            for key in sorted(have - set(want)):
                problems.append(f"unexpected in checkpoint: {key}")
    if problems:
        raise CheckpointError(
            f"checkpoint {path} does not match the model ({len(problems)} differences):\n  "
            + "\n  ".join(problems[:50])
        )


def _flatten(obj, prefix: str) -> dict:
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}"))
        return out
    return {prefix: obj}


def load_checkpoint(path, model, optimizer=None, *, extra: dict | None = None) -> dict:
    """Load a checkpoint saved under any layout into ``model`` (and ``optimizer``); returns its
    manifest.  Every rank must call it.  ``extra``: top-level state dicts saved with
    ``save_checkpoint(extra=)``, filled in place (their tensors' layouts say how to reshard)."""
    path = Path(path)
    manifest = read_manifest(path)
    if optimizer is not None and not manifest.get("has_optimizer", False):
        raise CheckpointError(f"checkpoint {path} has no optimizer state")
    if optimizer is not None:
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
    else:
        state = {"model": get_state_dict(model, [])[0]}
    _verify_everywhere(path)
    _check_matches(path, {"model": state["model"]})
    state.update(extra or {})
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as exc:  # noqa: BLE001 - corrupted/truncated shard files
        raise CheckpointError(
            f"checkpoint {path} could not be read ({type(exc).__name__}: {exc})"
        ) from None
    if optimizer is not None:
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
    else:
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
    return manifest
