"""Host -> device copies of the coming batches while the current step computes, and the data wait.

:class:`DevicePrefetcher` wraps the never-ending host batch iterator of a training loader.  On a
CUDA device it copies the next ``depth`` batches to the device on a side stream (from pinned
memory, ``non_blocking``) as soon as the current one is handed out, so the copy overlaps with the
step that consumes the current batch.  Handing a batch out makes the consuming (current) stream
wait for the side stream, and records every device tensor of the batch on the consuming stream
(``Tensor.record_stream``), so the caching allocator never gives its memory to another tensor
while the step still reads it.  On any other device (the CPU) the batch is moved synchronously and
nothing else happens: same batches, same order.

``wait_s`` adds up the host time spent blocked on the loader (the time a GPU would sit idle for
want of data); the trainer reports it per step as ``data_wait_ms``.

The stream operations are one small object (:class:`CudaStreams`), so a test can inject a fake
one and check the ordering on a machine without a GPU.
"""

from __future__ import annotations

import time
import weakref
from collections import deque

import torch

from ..layout.device import batch_to_device

__all__ = ["CudaStreams", "DevicePrefetcher"]


def _stop_workers(batches) -> None:
    """Stop a multi-process DataLoader iterator's workers now (a no-op for any other iterator).

    Left to the iterator's own ``__del__``, the shutdown runs inside the garbage collector when the
    owner (a trainer) sits in a reference cycle; by then the collector may already have closed the
    worker queues, the workers never get their stop signal, and each one is joined only after its
    5 s status timeout.  Called while everything is intact, it takes milliseconds.
    """
    stop = getattr(batches, "_shutdown_workers", None)  # torch's own, idempotent
    if stop is not None:
        stop()


class CudaStreams:
    """The CUDA stream operations the prefetcher uses (a test injects an object like it)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.side = torch.cuda.Stream(device=self.device)

    def current(self):
        return torch.cuda.current_stream(self.device)

    def context(self, stream):
        return torch.cuda.stream(stream)

    def wait(self, consumer, producer) -> None:
        consumer.wait_stream(producer)

    def record(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)


class DevicePrefetcher:
    """Iterator of device batches from the host batches of ``batches``, ``depth`` copies ahead.

    ``depth`` (``data.device_prefetch``): how many batches are in flight to the device besides
    the one being consumed; 0 moves each batch when it is asked for (no side stream).  ``dtype``
    casts floating tensors after the copy (``batch_to_device``).  ``streams``: the stream
    operations, default :class:`CudaStreams` on a CUDA device and none elsewhere.
    """

    def __init__(self, batches, device, dtype=None, depth: int = 1, *, streams=None):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"data.device_prefetch must be an integer >= 0, got {depth!r}")
        self.device = torch.device(device)
        self.dtype = dtype
        self.depth = depth
        self._batches = iter(batches)
        # runs when close() is called or this prefetcher is collected (before the collector
        # clears anything the iterator needs): the workers stop at once
        self._finalizer = weakref.finalize(self, _stop_workers, self._batches)
        if streams is None and self.device.type == "cuda" and depth > 0:
            streams = CudaStreams(self.device)
        self._streams = streams if depth > 0 else None
        self._queue: deque = deque()
        self._exhausted = False
        self.wait_s = 0.0

    def __iter__(self):
        return self

    def close(self) -> None:
        """Stop the loader's worker processes now; the prefetcher yields nothing afterwards."""
        self._finalizer()
        self._queue.clear()
        self._exhausted = True
        self._batches = iter(())

    def _next_host(self) -> dict:
        start = time.perf_counter()
        try:
            return next(self._batches)
        finally:
            self.wait_s += time.perf_counter() - start

    def _issue(self) -> None:
        """Take the next host batch and start its copy on the side stream (a finite source
        that has ended issues nothing more)."""
        try:
            host = self._next_host()
        except StopIteration:
            self._exhausted = True
            return
        with self._streams.context(self._streams.side):
            batch = batch_to_device(host, self.device, self.dtype)
        # the host batch stays referenced until handed out: its pinned memory is the copy's source
        self._queue.append((batch, host))

    def __next__(self) -> dict:
        if self._streams is None:
            return batch_to_device(self._next_host(), self.device, self.dtype)
        if not self._queue and not self._exhausted:
            self._issue()
        if not self._queue:
            raise StopIteration
        batch, _host = self._queue.popleft()
        current = self._streams.current()
        self._streams.wait(current, self._streams.side)
        for value in batch.values():
            if isinstance(value, torch.Tensor):
                self._streams.record(value, current)
        while len(self._queue) < self.depth and not self._exhausted:
            self._issue()  # the coming batches' copies run while the caller computes this one
        return batch
