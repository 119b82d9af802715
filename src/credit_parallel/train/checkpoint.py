"""Checkpoints with torch.distributed.checkpoint (DCP): save under one layout, load under any.

Layout on disk: ``<dir>/step_00000040/`` holds the DCP shards of ``{"model", "optim"}`` state
dicts (fully qualified names, so dp/tp/domain sizes and the data mode may change between save
and load), ``manifest.json`` (step, layout, config hash, library version, extra state, the
SHA-256 of every file, computed as it was written) and a ``COMPLETE`` marker.  A save goes to
``step_N.tmp`` first (every file fsynced), is renamed, then marked complete, so a crash mid-save
leaves the previous checkpoint untouched and loadable; a save that fails (a full disk, a
permission) raises :class:`CheckpointSaveError` on every rank and removes its partial directory;
retention (``keep``) removes old checkpoints only after the new one is complete.  Loading picks
the newest directory with a marker and can fall back to older ones.  ``train/async_save.py``
writes the same checkpoints behind the step loop.
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
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

__all__ = [
    "CheckpointError",
    "CheckpointSaveError",
    "checkpoint_state",
    "config_hash",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
    "verify_files",
    "write_checkpoint",
]

MARKER = "COMPLETE"
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or does not match the model."""


class CheckpointSaveError(CheckpointError):
    """A save failed (a full disk, a permission, a killed writer); the previous checkpoints are
    intact.  ``path``: the directory it was writing; ``cause``: ``Type: message``."""

    def __init__(self, message: str, *, path=None, cause: str = ""):
        super().__init__(message)
        self.path, self.cause = path, cause


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


def checkpoint_state(model, optimizer=None, extra: dict | None = None) -> dict:
    """What a checkpoint holds: ``{"model", "optim"}`` state dicts (fully qualified names) and
    the ``extra`` top-level state dicts beside them (the EMA shadow: ``train/ema.py``)."""
    if optimizer is not None:
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
    else:
        state = {"model": get_state_dict(model, [])[0]}
    state.update(extra or {})
    return state


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
    top-level state dicts saved beside them (the EMA shadow: ``train/ema.py``).  Synchronous:
    the checkpoint is complete when this returns (``train/async_save.py`` writes it behind
    the step loop).  Raises :class:`CheckpointSaveError` (previous checkpoints intact)."""
    state = checkpoint_state(model, optimizer, extra)
    return write_checkpoint(
        state, directory, step, manifest=manifest, has_optimizer=optimizer is not None, keep=keep
    )


def _one_line(exc: BaseException) -> str:
    """``Type: message`` of the first failure (DCP's CheckpointException wraps each rank's)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        exc = first[0] if isinstance(first, tuple) else first
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text[:400]}"


def _everyone(error: str | None, group) -> str | None:
    """Rank 0's error, known to every rank (``group`` spans the world: its rank 0 is rank 0)."""
    if not _is_dist():
        return error
    box = [error]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _failed(step: int, tmp: Path, directory: Path, cause: str) -> CheckpointSaveError:
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # frees the space a full disk needs back
    latest = latest_checkpoint(directory)
    kept = f"newest complete checkpoint {latest} intact" if latest else "no complete checkpoint yet"
    return CheckpointSaveError(
        f"checkpoint save of step {step} to {tmp} failed: {cause}; {kept}", path=tmp, cause=cause
    )


def write_checkpoint(
    state: dict,
    directory,
    step: int,
    *,
    manifest: dict | None = None,
    has_optimizer: bool = True,
    keep: int = 3,
    group=None,
) -> Path:
    """Write ``state`` (live or staged) as the checkpoint of ``step``; every rank calls it.

    ``step_N.tmp`` first: DCP's files, each fsynced, their SHA-256 computed as they are written;
    then rank 0 writes the manifest (every rank's checksums), renames the directory and writes
    ``COMPLETE`` once every rank's files are durable, and only then removes checkpoints beyond
    the newest ``keep``.  ``group``: the process group of the collectives (default: the world).
    A failure on any rank raises the same :class:`CheckpointSaveError` on every rank (its path
    and cause in one line); the partial directory is removed and older checkpoints are intact.
    """
    from .async_save import HashingWriter

    directory = Path(directory)
    final = _step_dir(directory, step)
    tmp = final.with_name(final.name + ".tmp")
    error = None
    if _rank() == 0:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
        except OSError as exc:
            error = _one_line(exc)
    error = _everyone(error, group)
    if error is not None:
        raise _failed(step, tmp, directory, error)
    writer = HashingWriter(tmp)
    try:
        dcp.save(state, checkpoint_id=str(tmp), storage_writer=writer, process_group=group)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - named, on every rank
        error = _one_line(exc)
    digests = writer.digests if error is None else {}
    if _is_dist():
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (error, digests), group=group)
    else:
        gathered = [(error, digests)]
    error = next((e for e, _ in gathered if e is not None), None)
    if error is not None:
        raise _failed(step, tmp, directory, error)
    if _rank() == 0:
        files = {}
        for _, part in gathered:
            files.update(part)
        try:
            _finish(directory, tmp, final, step, manifest, has_optimizer, files, keep)
        except OSError as exc:
            error = _one_line(exc)
    error = _everyone(error, group)
    if error is not None:
        raise _failed(step, tmp, directory, error)
    return final


def _finish(directory, tmp, final, step, manifest, has_optimizer, files, keep) -> None:
    """Rank 0: manifest, rename, marker (each durable), then retention."""
    info = dict(manifest or {})
    info.update(step=step, has_optimizer=has_optimizer)
    from .. import __version__

    info.setdefault("library_version", __version__)
    info["files"] = dict(sorted(files.items()))
    with open(tmp / MANIFEST, "w") as fh:
        fh.write(json.dumps(info, indent=2, default=str))
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(directory)
    (final / MARKER).write_text("ok\n")
    _fsync_dir(final)
    # retention only now: the newest complete checkpoint is the new one
    for old in list_checkpoints(directory)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


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
    state = checkpoint_state(model, optimizer)
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
