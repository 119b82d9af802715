"""Checkpoint saves off the step loop (``trainer.checkpoint_async``, default true).

A save has two parts.  The step loop pays for the first only:

1. **staging**: every tensor of the state (model, AdamW moments, EMA shadow, learnable loss
   weights; each rank its own shards, DTensors kept as DTensors) is copied into a host buffer
   that :class:`HostStager` allocates at the first save and reuses at every later one (pinned
   memory on CUDA: the device-to-host copies are asynchronous and the stager waits for them
   once, at the end);
2. **writing**, on one writer thread (:class:`AsyncCheckpointer`): DCP's ``dcp.save`` of the
   staged copy into ``step_N.tmp`` over a gloo process group of its own (the step loop's
   collectives go on beside it on theirs), each file fsynced and its SHA-256 computed from the
   bytes as they are written (:class:`HashingFileSystem`: no file is read back); then rank 0
   writes the manifest with every rank's checksums, renames the directory and writes
   ``COMPLETE`` (``checkpoint.write_checkpoint``), once every rank's files are durable.

At most one save is in flight: a new save first waits for the previous one, and that wait is
counted (``wait_s``); ``block_s`` is the time the last save held the step loop (wait + staging).
A failed write raises :class:`~credit_parallel.train.checkpoint.CheckpointSaveError` from
:meth:`AsyncCheckpointer.wait` (and from the next :meth:`AsyncCheckpointer.save`), on every
rank alike.
"""

from __future__ import annotations

import copy
import hashlib
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.tensor import DTensor

__all__ = [
    "AsyncCheckpointer",
    "HashingFileSystem",
    "HashingWriter",
    "HostStager",
    "staging_bytes_estimate",
]


# --------------------------------------------------------------------------- hashing writer
class _HashingStream:
    """A file opened for writing whose SHA-256 follows the bytes written (DCP writes each file
    from start to end: ``write`` and ``tell``, never ``seek``)."""

    def __init__(self, raw):
        self.raw, self.sha = raw, hashlib.sha256()

    def write(self, data) -> int:
        self.sha.update(data)  # hashlib releases the GIL on large buffers
        return self.raw.write(data)

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        self.raw.close()

    def writable(self) -> bool:
        return True


class HashingFileSystem(FileSystem):
    """DCP's local file system, recording ``{file name: sha256}`` of every file it writes
    (renames followed: DCP writes ``.metadata.tmp`` and renames it)."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, str] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)
        with path.open(mode) as raw:
            stream = _HashingStream(raw)
            yield stream
        with self._lock:  # only a file written whole gets a checksum
            self.digests[path.name] = stream.sha.hexdigest()

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        with self._lock:
            digest = self.digests.pop(Path(path).name, None)
            if digest is not None:
                self.digests[Path(new_path).name] = digest


class HashingWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` (one file per rank, every file fsynced) on a
    :class:`HashingFileSystem`: ``digests`` holds this rank's files' checksums afterwards."""

    def __init__(self, path) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self.fs = HashingFileSystem()
        self.path = self.fs.init_path(path)

    @property
    def digests(self) -> dict[str, str]:
        return dict(self.fs.digests)


# --------------------------------------------------------------------------- staging
class HostStager:
    """Copies a state dict into host buffers allocated once and reused at every save.

    ``device``: where the state lives.  On CUDA the buffers are pinned (``host_empty(...,
    pin_memory=True)``), the copies ``non_blocking`` and the stager synchronises ``device``
    once after the last one; on the CPU they are plain copies.  ``host_empty`` and ``cuda``
    stand in for ``torch.empty`` and ``torch.cuda`` in tests (a fake CUDA on a CPU machine).
    """

    def __init__(self, device, *, host_empty=None, cuda=None):
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self.host_empty = host_empty if host_empty is not None else torch.empty
        self.cuda = cuda if cuda is not None else (torch.cuda if self.pinned else None)
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.allocations = 0  # buffers allocated so far (reuse keeps it constant)

    @property
    def nbytes(self) -> int:
        """Host bytes the buffers hold."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def _buffer(self, key: tuple, like: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = self.host_empty(
                tuple(like.shape), dtype=like.dtype, device="cpu", pin_memory=self.pinned
            )
            self.buffers[key] = buf
            self.allocations += 1
        return buf

    def _copy(self, key: tuple, tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, DTensor):
            local = self._copy(key, tensor._local_tensor)
            return DTensor.from_local(
                local,
                tensor.device_mesh,
                tensor.placements,
                run_check=False,
                shape=tensor.shape,
                stride=tensor.stride(),
            )
        buf = self._buffer(key, tensor)
        buf.copy_(tensor.detach(), non_blocking=self.pinned)
        return buf

    def _walk(self, obj, key: tuple):
        if isinstance(obj, torch.Tensor):
            return self._copy(key, obj)
        if isinstance(obj, dict):
            return {k: self._walk(v, (*key, k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._walk(v, (*key, i)) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    @torch.no_grad()
    def stage(self, state: dict) -> dict:
        """A copy of ``state`` in the host buffers, complete when this returns."""
        staged = self._walk(state, ())
        if self.pinned:
            self.cuda.synchronize(self.device)  # every non-blocking copy has landed
        return staged


def staging_bytes_estimate(model, *, optimizer_moments: int = 2, ema: bool = False) -> int:
    """Host bytes one rank's staged checkpoint takes: its parameters' shards (and buffers) once
    for the model, ``optimizer_moments`` times for AdamW's moments, and the EMA shadow (float32,
    parameters and buffers) when there is one."""

    def local(t):
        t = t._local_tensor if isinstance(t, DTensor) else t
        return t.numel(), t.element_size()

    params = [local(p) for p in model.parameters()]
    buffers = [local(b) for b in model.buffers()]
    model_bytes = sum(n * s for n, s in params) + sum(n * s for n, s in buffers)
    total = model_bytes + optimizer_moments * sum(n * s for n, s in params)
    if ema:
        total += 4 * (sum(n for n, _ in params) + sum(n for n, _ in buffers))
    return total


# --------------------------------------------------------------------------- the writer
class AsyncCheckpointer:
    """One rank's checkpoint writer: stage on the calling thread, write on a writer thread.

    ``device``: the state's device (pinned staging on CUDA).  Every rank calls :meth:`save`
    for the same steps (its collectives run on ``group``, a gloo group of its own, created at
    the first save when a process group exists).
    """

    def __init__(self, device, *, dist_timeout_s: float | None = None, **stager_options):
        self.stager = HostStager(device, **stager_options)
        self.timeout_s = dist_timeout_s
        self.group = None
        self._executor: ThreadPoolExecutor | None = None
        self._future: Future | None = None
        self._pid = os.getpid()
        self.wait_s = 0.0  # total time a save (or the run's end) waited for the previous one
        self.waits = 0  # waits that found a save still in flight
        self.block_s = 0.0  # the last save's time on the calling thread (wait + staging)
        self.stage_s = 0.0  # the last save's staging time

    @property
    def in_flight(self) -> bool:
        return self._future is not None and not self._future.done()

    @property
    def failed(self) -> bool:
        """Whether the save in flight has finished with an error (not waited for yet)."""
        f = self._future
        return f is not None and f.done() and f.exception() is not None

    def _ensure_group(self) -> None:
        if self.group is None and dist.is_available() and dist.is_initialized():
            from datetime import timedelta

            timeout = timedelta(seconds=self.timeout_s) if self.timeout_s else None
            self.group = dist.new_group(backend="gloo", timeout=timeout)

    def save(self, write, state_fn) -> None:
        """Wait for the save in flight (counted), stage ``state_fn()`` and hand
        ``write(staged, group)`` to the writer thread.  Raises the previous save's error."""
        start = time.perf_counter()
        self._ensure_group()
        self.wait()
        staged_at = time.perf_counter()
        staged = self.stager.stage(state_fn())
        self.stage_s = time.perf_counter() - staged_at
        if self._executor is None or self._pid != os.getpid():
            # a forked child has a copy of the executor but not its thread: a new one
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
            self._pid = os.getpid()
        self._future = self._executor.submit(write, staged, self.group)
        self.block_s = time.perf_counter() - start

    def wait(self):
        """The save in flight's result (its path), after it is complete; None when there is
        none.  Raises its error."""
        future, self._future = self._future, None
        if future is None or self._pid != os.getpid():
            return None  # nothing, or the parent's save (a forked child never sees it end)
        if not future.done():
            self.waits += 1
        start = time.perf_counter()
        try:
            return future.result()
        finally:
            self.wait_s += time.perf_counter() - start

    def close(self) -> None:
        """Stop the writer thread (after the save in flight: call :meth:`wait` first to see
        its error)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
