"""Which checkpoint a training run continues from, and the lines that say so.

Three ways to ask (SPEC §5): ``--resume PATH`` (a ``step_*`` directory, or a directory of them,
written under any layout), ``trainer.resume: true`` (the newest complete checkpoint in the run's
own ``trainer.save_dir``, default ``OUTPUT/checkpoints``) and ``auto`` (``--resume auto`` or
``trainer.resume: auto``): the same as ``true`` and never an error when there is none yet, so ONE
command line serves the first start, torchrun's restarts (``--max-restarts``) and a SLURM / PBS
requeue of the same job script.

Newest complete: a ``step_*`` directory with its ``COMPLETE`` marker whose files match the
checksums of its manifest.  A newer directory that is not (a save killed before its marker, a
truncated or altered shard) is named in one line with the reason and skipped; the one before it
is tried.  A restarted worker (torchrun's ``TORCHELASTIC_RESTART_COUNT`` > 0) always continues
from its run's own newest checkpoint when there is one, even when the first start was given
``--resume PATH``: the restart must not go back to where the job started.
"""

from __future__ import annotations

from pathlib import Path

from .checkpoint import MARKER, list_checkpoints

__all__ = ["AUTO", "resume_run", "unfinished_checkpoints"]

AUTO = "auto"  # the word of --resume and trainer.resume (layout/run_config.py parses the key)


def _step_of(path: Path) -> int | None:
    digits = path.name.removeprefix("step_").removesuffix(".tmp")
    return int(digits) if path.name.startswith("step_") and digits.isdigit() else None


def unfinished_checkpoints(directory) -> list[tuple[Path, str]]:
    """``(path, why)`` of the ``step_*`` directories under ``directory`` that are newer than its
    newest complete checkpoint but have no ``COMPLETE`` marker (a save that did not finish),
    newest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    complete = list_checkpoints(directory)
    newest = _step_of(complete[-1]) if complete else -1
    found = []
    for path in directory.iterdir():
        step = _step_of(path)
        if path.is_dir() and step is not None and step >= newest and not (path / MARKER).exists():
            found.append((step, path))
    return [
        (path, f"no {MARKER} marker: its save did not finish")
        for _, path in sorted(found, key=lambda t: (t[0], t[1].name), reverse=True)
    ]


def _one_line(text) -> str:
    return " ".join(str(text).split())


def _newest(trainer, directory: Path) -> tuple[dict | None, list[str]]:
    """Load the newest complete checkpoint under ``directory`` (the run's save_dir), skipping
    and naming the newer ones that are not; ``(manifest or None, lines)``."""
    lines = [f"resume: skipped {path} ({why})" for path, why in unfinished_checkpoints(directory)]

    def skipped(path, error) -> None:
        lines.append(f"resume: skipped {path} ({_one_line(error)})")

    manifest = trainer.resume_latest(directory, on_skip=skipped)
    if manifest is None:
        lines.append(f"resume: no complete checkpoint in {directory}; starting at step 0")
    else:
        path = directory / f"step_{int(manifest['step']):08d}"
        lines.append(f"resumed from step {manifest['step']} ({path})")
    return manifest, lines


def resume_run(trainer, save_dir, resume: str | None, *, restarts: int = 0) -> list[str]:
    """Load what the run continues from into ``trainer``; the lines rank 0 reports (none when
    the run starts afresh without being asked to resume).

    ``resume``: ``--resume`` (a path, ``"auto"`` or None); ``trainer.tc.resume`` (true, false,
    ``"auto"``) applies without it; ``restarts``: torchrun's restart count of this worker group
    (> 0: the newest checkpoint in ``save_dir`` first, whatever was asked).
    """
    save_dir = Path(save_dir)
    configured = trainer.tc.resume
    if restarts > 0 and (resume == AUTO or resume is None or list_checkpoints(save_dir)):
        manifest, lines = _newest(trainer, save_dir)
        return [f"elastic restart {restarts}: continuing from this run's checkpoints", *lines]
    if resume == AUTO or (resume is None and configured in (True, AUTO)):
        return _newest(trainer, save_dir)[1]
    if resume is None:
        return []
    manifest = trainer.resume_from(resume)
    return [f"resumed from step {manifest['step']} ({resume})"]
