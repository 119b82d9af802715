"""The forecast writer (``forecast/writer.py``) with an injected ``torch.cuda`` that records every
stream and event call: the order a GPU needs (the side stream waits for the computing stream, the
copy into a reused pinned buffer runs on the side stream, the event is recorded after it, the
writer synchronizes on the event before it reads the buffer, the device tensor is held until
then), the bound on steps in flight, the values handed to the store, errors; and the progress
line with the writer's lag."""

from __future__ import annotations

import contextlib
import io
import re
import threading
import time
import weakref
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from credit_parallel.forecast.fields import Progress
from credit_parallel.forecast.writer import CudaCopy, HostCopy, StepWriter, writer_memory_bytes

__all__: list[str] = []

SLICES = [("T", slice(0, 2), True), ("SP", slice(2, 3), False)]  # 2 levels of T, then SP


class _Buffer(torch.Tensor):
    """A host buffer that records how it is filled."""

    def copy_(self, source, non_blocking=False):
        self.calls.append(("copy_", non_blocking, self.cuda.active))
        return super().copy_(source)


class FakeCuda:
    """``torch.cuda``'s Stream / Event / current_stream / stream, recording the calls."""

    def __init__(self):
        self.calls: list = []
        self.active = None  # the stream inside ``with stream(...)``
        self.gate = threading.Event()  # the copies "complete" when set
        self.gate.set()
        self.main = self.Stream(name="main")
        self.calls.clear()

    def Stream(self, device=None, name="side"):  # noqa: N802 - torch.cuda's name
        cuda = self

        class _Stream:
            def __init__(self):
                self.name = name

            def wait_stream(self, other):
                cuda.calls.append(("wait_stream", self.name, other.name))

        self.calls.append(("Stream", name))
        return _Stream()

    def Event(self):  # noqa: N802 - torch.cuda's name
        cuda = self

        class _Event:
            def record(self, stream):
                cuda.calls.append(("record", id(self), stream.name, cuda.active))

            def synchronize(self):
                cuda.gate.wait()
                cuda.calls.append(("synchronize", id(self)))

        return _Event()

    def current_stream(self, device=None):
        return self.main

    @contextlib.contextmanager
    def stream(self, stream):
        self.calls.append(("enter", stream.name))
        self.active = stream.name
        try:
            yield
        finally:
            self.active = None
            self.calls.append(("exit", stream.name))

    def host_empty(self, shape, dtype):
        self.calls.append(("host_empty", shape))
        buffer = torch.empty(shape, dtype=dtype).as_subclass(_Buffer)
        buffer.calls, buffer.cuda = self.calls, self
        return buffer


class FakeStore:
    """``write_async`` records the values and returns a future the test completes."""

    def __init__(self, auto=True):
        self.writes: list = []
        self.futures: list[Future] = []
        self.auto = auto
        self.calls = None
        self.written_chunks: set = set()

    def write_async(self, name, index, rows, values, columns=None):
        if self.calls is not None:
            self.calls.append(("write_async", name, index))
        self.writes.append((name, index, rows, np.array(values), columns))
        future = Future()
        self.futures.append(future)
        if self.auto:
            future.set_result(None)
        return future


def _until(condition, timeout=10.0):
    deadline = time.perf_counter() + timeout
    while not condition():
        assert time.perf_counter() < deadline, "timed out"
        time.sleep(0.01)


def _step(k, members=1):
    return torch.arange(members * 3 * 4 * 5, dtype=torch.float32).view(members, 3, 4, 5) + k


def test_cuda_copy_orders_the_stream_and_event_calls_and_reuses_pinned_buffers():
    cuda, store = FakeCuda(), FakeStore()
    store.calls = cuda.calls
    copy = CudaCopy("cuda:0", 2, cuda=cuda, host_empty=cuda.host_empty)
    writer = StepWriter(store, SLICES, in_flight=2, copy=copy)
    for k in range(5):
        writer.submit(_step(k), (0, k), [None], (4, 8), None)
    writer.close()
    calls = cuda.calls
    assert calls[0] == ("Stream", "side")
    assert [c for c in calls if c[0] == "host_empty"] == [("host_empty", (1, 3, 4, 5))] * 2
    # per step: the side stream waits for the computing one, then the copy (non-blocking) and
    # the event's record run on the side stream, then the writer synchronizes, then writes
    starts = [i for i, c in enumerate(calls) if c[0] == "wait_stream"]
    assert len(starts) == 5
    for k, i in enumerate(starts):
        assert calls[i] == ("wait_stream", "side", "main")
        assert calls[i + 1] == ("enter", "side")
        assert calls[i + 2] == ("copy_", True, "side")
        assert calls[i + 3][0] == "record" and calls[i + 3][2:] == ("side", "side")
        event = calls[i + 3][1]
        sync = calls.index(("synchronize", event), i)
        first_write = calls.index(("write_async", "T", (0, k)))
        assert sync < first_write
    # the values: T's 2 levels and SP per step, from the buffers that were reused
    assert [(n, i) for n, i, *_ in store.writes] == [
        (n, (0, k)) for k in range(5) for n in ("T", "SP")
    ]
    for name, (_, k), rows, values, columns in store.writes:
        expected = _step(k)[0, 0:2] if name == "T" else _step(k)[0, 2]
        assert np.array_equal(values, expected.numpy()) and rows == (4, 8) and columns is None
    assert writer.bytes == 5 * 3 * 4 * 5 * 4 and writer.lag == 0


def test_the_device_tensor_is_held_until_the_copy_event_completed():
    cuda, store = FakeCuda(), FakeStore()
    cuda.gate.clear()  # the copy has not completed
    writer = StepWriter(store, SLICES, in_flight=2, copy=CudaCopy(
        "cuda:0", 2, cuda=cuda, host_empty=cuda.host_empty))  # fmt: skip
    block = _step(0)
    alive = weakref.ref(block)
    writer.submit(block, (0, 0), [None], (0, 4), None)
    del block
    time.sleep(0.2)
    assert alive() is not None and not store.writes  # nothing read before the event
    cuda.gate.set()
    writer.flush()
    assert alive() is None and len(store.writes) == 2
    writer.close()


def test_the_rollout_blocks_only_when_in_flight_steps_are_not_committed():
    store = FakeStore(auto=False)
    writer = StepWriter(store, SLICES, in_flight=2, copy=HostCopy())
    writer.submit(_step(0), (0, 0), [None], (0, 4), None)
    writer.submit(_step(1), (0, 1), [None], (0, 4), None)
    done = threading.Event()

    def third():
        writer.submit(_step(2), (0, 2), [None], (0, 4), None)
        done.set()

    thread = threading.Thread(target=third)
    thread.start()
    time.sleep(0.3)
    assert not done.is_set() and writer.lag == 2 and writer.behind_s >= 0.3
    _until(lambda: len(store.futures) == 4)  # steps 0 and 1 handed to the store, T and SP each
    store.futures[0].set_result(None)  # step 0 half written: still in flight
    time.sleep(0.1)
    assert not done.is_set()
    store.futures[1].set_result(None)  # step 0 committed: its slot is free
    assert done.wait(5)
    thread.join()
    assert writer.blocked_s >= 0.3
    ticket = writer.fence()
    _until(lambda: len(store.futures) == 6)
    for future in store.futures[2:]:
        future.set_result(None)
    writer.wait(ticket)
    assert writer.lag == 0 and writer.behind_s == 0.0
    writer.close()


def test_members_and_columns_reach_the_store_and_the_host_copy_is_the_step_itself():
    store = FakeStore()
    block = _step(3, members=2)
    host, event = HostCopy().start(block, 0)
    assert host is block and event.synchronize() is None
    writer = StepWriter(store, SLICES, in_flight=1)
    writer.submit(block, (1, 2), [0, 1], (4, 8), (5, 10))
    writer.close()
    assert [(n, i) for n, i, *_ in store.writes] == [
        ("T", (1, 0, 2)), ("SP", (1, 0, 2)), ("T", (1, 1, 2)), ("SP", (1, 1, 2))
    ]  # fmt: skip
    assert np.array_equal(store.writes[3][3], block[1, 2].numpy())
    assert all(w[4] == (5, 10) for w in store.writes)
    assert writer_memory_bytes(1000, 2) == 4000


def test_a_failed_write_is_raised_in_the_caller():
    store = FakeStore(auto=False)
    writer = StepWriter(store, SLICES, in_flight=2, copy=HostCopy())
    writer.submit(_step(0), (0, 0), [None], (0, 4), None)
    _until(lambda: store.futures)
    store.futures[0].set_exception(OSError("disk full"))
    with pytest.raises(RuntimeError, match="forecast writer failed: disk full"):
        writer.wait(writer.fence())
    with pytest.raises(RuntimeError, match="disk full"):
        writer.submit(_step(1), (0, 1), [None], (0, 4), None)
    with pytest.raises(RuntimeError, match="disk full"):
        writer.close()


def test_progress_lines_show_steps_per_second_and_the_writer_lag():
    stream = io.StringIO()
    report = Progress(stream, 4, enabled=True)
    report.step("2020-01-01T00:00", 1, 4, 2.5, 2, 0.75)
    report.step("2020-01-01T00:00", 2, 4, 2.0, 0, 0.0)
    report.close()
    assert stream.getvalue().splitlines() == [
        "forecast init 2020-01-01T00:00 step 1/4 steps/s 2.5 writer_lag 2 steps 0.75 s",
        "forecast init 2020-01-01T00:00 step 2/4 steps/s 2 writer_lag 0 steps 0.00 s",
    ]

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    report = Progress(terminal, 4, enabled=True)
    report.step("2020-01-01T00:00", 1, 4, 2.5, 2, 0.75)
    report.close()
    assert re.search(r"1/4 .*writer_lag=2 steps/0\.8s", terminal.getvalue()), terminal.getvalue()
