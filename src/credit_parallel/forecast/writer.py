"""The forecast writer: each step's rows leave the rollout's critical path.

:class:`StepWriter` takes one step of this rank's owned block (``(members, C, rows, columns)``,
float32, on the model's device) per :meth:`StepWriter.submit` and returns at once:

1. the device-to-host copy goes into one of ``in_flight`` reused host buffers (:class:`CudaCopy`:
   pinned, on a side stream that first waits for the computing stream, then records an event;
   :class:`HostCopy` on CPU: the step's own tensor, no copy).  The step's device tensor is held
   until that event has completed, so the caching allocator cannot hand its memory to the next
   step while the copy still reads it;
2. a writer thread waits for the event (outside the interpreter lock), then hands each variable's
   chunks to tensorstore (``zarr3`` driver, its own thread pool: encoding, compression and file
   writes run without the interpreter lock), asynchronously;
3. when every chunk of a step is committed, its buffer is free again.

The rollout blocks only when ``in_flight`` steps are not committed yet (``blocked_s``); host
memory: ``in_flight`` buffers of one step plus tensorstore's copy of the steps being encoded
(:func:`writer_memory_bytes`).  ``lag`` (steps not committed) and ``behind_s`` (the age of the
oldest) are the progress report's writer lag; ``busy_s`` (wall time with a step in the writer)
and ``bytes`` give its throughput.

``tests/test_forecast_writer.py`` drives :class:`CudaCopy` with a fake ``torch.cuda`` that
records the stream / event calls (the order a GPU needs: wait_stream, copy on the side stream,
record, the writer's synchronize before it reads the buffer and before the device tensor is
released).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "CudaCopy",
    "HostCopy",
    "StepWriter",
    "copy_for_device",
    "summary",
    "writer_memory_bytes",
]


def writer_memory_bytes(step_bytes: int, in_flight: int) -> int:
    """Host memory the writer may hold: ``in_flight`` step buffers (pinned on CUDA; on CPU the
    steps themselves) plus tensorstore's copy of each step until it is committed."""
    return 2 * in_flight * step_bytes


class _Done:
    """The event of a copy that already happened (CPU)."""

    def synchronize(self) -> None:
        return None


class HostCopy:
    """CPU: the step's tensor is already host memory; it is the buffer (no copy, no stream)."""

    pinned = False

    def start(self, source: torch.Tensor, slot: int):
        """``(host tensor, event)``: the host values of ``source`` once ``event`` completed."""
        return source, _Done()


class CudaCopy:
    """CUDA: reused pinned buffers, one per slot, filled on a side stream.

    ``cuda``: the ``torch.cuda`` namespace (a test passes a fake with ``Stream``, ``Event``,
    ``current_stream``, ``stream``); ``host_empty(shape, dtype)``: the host buffer allocation
    (default pinned ``torch.empty``)."""

    pinned = True

    def __init__(self, device, slots: int, cuda=None, host_empty=None):
        self.cuda = cuda if cuda is not None else torch.cuda
        self.device = device
        self.host_empty = host_empty or (
            lambda shape, dtype: torch.empty(shape, dtype=dtype, pin_memory=True)
        )
        self.side = self.cuda.Stream(device=device)
        self.buffers: list[torch.Tensor | None] = [None] * slots
        self.events = [self.cuda.Event() for _ in range(slots)]

    def start(self, source: torch.Tensor, slot: int):
        buffer = self.buffers[slot]
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = self.buffers[slot] = self.host_empty(tuple(source.shape), source.dtype)
        # the copy reads what the computing stream wrote: the side stream waits for it first
        self.side.wait_stream(self.cuda.current_stream(self.device))
        with self.cuda.stream(self.side):
            buffer.copy_(source, non_blocking=True)
            self.events[slot].record(self.side)
        return buffer, self.events[slot]


def copy_for_device(device, slots: int):
    """:class:`CudaCopy` on a CUDA device, else :class:`HostCopy`."""
    device = torch.device(device)
    return CudaCopy(device, slots) if device.type == "cuda" else HostCopy()


@dataclass
class _Step:
    seq: int
    source: torch.Tensor | None  # the device tensor, held until the copy's event completed
    host: torch.Tensor
    event: object
    writes: list  # (name, store index, channel slice or int, member position)
    nbytes: int
    submitted: float = field(default_factory=time.perf_counter)
    slot: int = 0


class StepWriter:
    """Writes steps of this rank's owned block into the store (module docstring).

    ``store``: a :class:`.store.ForecastStore`; ``slices``: ``(name, channels, upper)`` per
    variable (``Fields.slices``); ``in_flight``: steps in flight before :meth:`submit` blocks;
    ``copy``: :class:`CudaCopy` / :class:`HostCopy` (default: by the device of the first step).
    """

    def __init__(self, store, slices: Sequence, in_flight: int = 2, copy=None):
        if isinstance(in_flight, bool) or int(in_flight) < 1:
            raise ValueError(f"StepWriter: in_flight must be >= 1, got {in_flight!r}")
        self.store, self.slices, self.in_flight = store, list(slices), int(in_flight)
        self.copy = copy
        self.blocked_s = 0.0
        self.busy_s = 0.0
        self.bytes = 0
        self.error: BaseException | None = None
        self._free: queue.Queue = queue.Queue()
        for slot in range(self.in_flight):
            self._free.put(slot)
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Condition()
        self._pending: dict[int, _Step] = {}  # seq -> step not committed yet
        self._submitted = 0
        self._active_since: float | None = None
        self._thread = threading.Thread(target=self._run, name="forecast-writer", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- the caller's side
    def submit(
        self,
        block: torch.Tensor,
        index: tuple,
        members: Sequence[int | None],
        rows: tuple[int, int],
        columns: tuple[int, int] | None,
    ) -> None:
        """Hand over one step: ``block`` ``(len(members), C, rows, columns)`` (float32, any
        device) at ``index`` (init position, lead position) of ``members`` (None: no member
        axis), into global ``rows`` and ``columns`` (None: all)."""
        self._raise()
        started = time.perf_counter()
        slot = self._free.get()  # blocks while `in_flight` steps are not committed
        self.blocked_s += time.perf_counter() - started
        self._raise()
        if self.copy is None:
            self.copy = copy_for_device(block.device, self.in_flight)
        host, event = self.copy.start(block, slot)
        writes = []
        i, lead = index
        for n, member in enumerate(members):
            head = (i, lead) if member is None else (i, member, lead)
            for name, channels, upper in self.slices:
                writes.append((name, head, channels if upper else channels.start, n))
        with self._lock:
            seq = self._submitted
            self._submitted += 1
            step = _Step(seq, block, host, event, writes, block.numel() * block.element_size())
            step.slot = slot
            self._pending[seq] = step
            if self._active_since is None:
                self._active_since = step.submitted
        self._queue.put((step, rows, columns))

    def fence(self) -> int:
        """A ticket :meth:`wait` returns on once every step submitted before it is committed."""
        self._raise()
        return self._submitted

    def wait(self, ticket: int) -> None:
        started = time.perf_counter()
        with self._lock:
            self._lock.wait_for(
                lambda: self.error is not None or all(s >= ticket for s in self._pending)
            )
        self.blocked_s += time.perf_counter() - started
        self._raise()

    def flush(self) -> None:
        self.wait(self._submitted)

    def close(self) -> None:
        """Wait for every step, stop the thread; the first error is raised."""
        if self._thread.is_alive():
            with contextlib.suppress(RuntimeError):
                self.flush()
            self._queue.put(None)
            self._thread.join()
        self._raise()

    @property
    def lag(self) -> int:
        """Steps handed over and not committed yet."""
        return len(self._pending)

    @property
    def behind_s(self) -> float:
        """Seconds since the oldest step not committed yet was handed over (0: none)."""
        with self._lock:
            oldest = min((s.submitted for s in self._pending.values()), default=None)
        return 0.0 if oldest is None else time.perf_counter() - oldest

    @property
    def written_chunks(self) -> set:
        return self.store.written_chunks

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"forecast writer failed: {self.error}") from self.error

    # ---------------------------------------------------------------- the writer thread
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            step, rows, columns = item
            try:
                if self.error is not None:
                    raise RuntimeError("an earlier step failed")
                step.event.synchronize()  # the host buffer holds the step now
                step.source = None  # the device tensor may be reused
                values = step.host.numpy()
                futures = []
                for name, index, channels, n in step.writes:
                    part = values[n, channels]
                    futures.append(self.store.write_async(name, index, rows, part, columns))
                self._watch(step, futures)
            except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
                self._finish(step, err)

    def _watch(self, step: _Step, futures: list) -> None:
        """Finish ``step`` once every write future is done (in tensorstore's threads)."""
        left = [len(futures)]
        lock = threading.Lock()

        def done(future) -> None:
            try:
                error = future.exception()
            except BaseException as err:  # noqa: BLE001 - a cancelled future
                error = err
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if error is not None or last:
                self._finish(step, error)

        if not futures:
            self._finish(step, None)
        for future in futures:
            future.add_done_callback(done)

    def _finish(self, step: _Step, error: BaseException | None) -> None:
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            if self._pending.pop(step.seq, None) is None:
                return  # already finished (an error, then the last future)
            self.bytes += step.nbytes if error is None else 0
            if not self._pending and self._active_since is not None:
                self.busy_s += time.perf_counter() - self._active_since
                self._active_since = None
            self._lock.notify_all()
        self._free.put(step.slot)


def summary(writer: StepWriter) -> dict:
    """The writer's figures for the forecast's last line and the benchmark."""
    busy = max(writer.busy_s, 1e-9)
    return {
        "write_blocked_s": writer.blocked_s,
        "write_s": writer.busy_s,
        "write_bytes": writer.bytes,
        "write_mb_s": writer.bytes / 1e6 / busy if writer.bytes else 0.0,
    }
