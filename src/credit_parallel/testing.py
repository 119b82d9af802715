"""Multi-rank test harness: run a function on N local gloo ranks, or under a fake process group.

``run_on_ranks(fn, world_size, *args)`` forks ``world_size`` workers (fork costs ~0.2 s per run,
spawn ~11 s because each rank re-imports torch), gives each a fresh TCP rendezvous port, one
intra-op thread and an initialised gloo process group, calls ``fn(rank, world_size, *args)``
and returns the per-rank results in rank order.  A worker that raises has its traceback re-raised
in the caller; a run that exceeds ``timeout`` kills every worker and raises ``TimeoutError``
naming the ranks that did not finish.

``fake_process_group(rank, world_size)`` initialises torch's "fake" backend so layout code can be
exercised at world sizes such as 512 without any process.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import socket
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

__all__ = ["RankFailure", "fake_process_group", "free_port", "run_on_ranks"]


class RankFailure(RuntimeError):
    """One or more ranks raised; the message carries each failing rank's traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _worker(fn, rank, world_size, port, pg_timeout, args, kwargs, conn):
    status, payload = "ok", None
    try:
        torch.set_num_threads(1)
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
        )
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        payload = fn(rank, world_size, *args, **kwargs)
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        status, payload = "error", traceback.format_exc()
    try:
        conn.send_bytes(_dumps((rank, status, payload)))
    except BaseException:  # noqa: BLE001
        conn.send_bytes(_dumps((rank, "error", "result not picklable:\n" + traceback.format_exc())))
    finally:
        conn.close()
    if status == "ok":
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    os._exit(0)


def run_on_ranks(
    fn: Callable,
    world_size: int,
    *args,
    timeout: float = 120.0,
    pg_timeout: float | None = None,
    **kwargs,
) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` forked gloo ranks.

    Returns the list of per-rank return values (moved through ``torch.save``, so tensors are
    fine).  Raises :class:`RankFailure` with every failing rank's traceback, or
    ``TimeoutError`` after ``timeout`` seconds (all workers are killed).
    """
    ctx = tmp.get_context("fork")
    port = free_port()
    pg_timeout = pg_timeout if pg_timeout is not None else max(10.0, timeout)
    procs, conns = [], []
    for rank in range(world_size):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, port, pg_timeout, args, kwargs, send),
            daemon=True,
        )
        p.start()
        send.close()
        procs.append(p)
        conns.append(recv)

    results: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout
    pending = dict(enumerate(conns))
    try:
        while pending and time.monotonic() < deadline:
            for rank, conn in list(pending.items()):
                if conn.poll(0.01):
                    try:
                        r, status, payload = torch.load(
                            io.BytesIO(conn.recv_bytes()), weights_only=False
                        )
                    except EOFError:
                        r, status, payload = rank, "error", "worker exited without a result"
                    results[r] = (status, payload)
                    del pending[rank]
                elif not procs[rank].is_alive() and not conn.poll(0):
                    results[rank] = (
                        "error",
                        f"worker exited with code {procs[rank].exitcode} and no result",
                    )
                    del pending[rank]
            failed = [r for r, (s, _) in results.items() if s != "ok"]
            if failed and pending:
                # Give surviving ranks a moment to fail on their own (bounded by pg_timeout),
                # but never wait for the whole test timeout once one rank is known to be dead.
                deadline = min(deadline, time.monotonic() + 5.0)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)

    failed = sorted(r for r, (s, _) in results.items() if s != "ok")
    if failed:
        parts = [f"--- rank {r} ---\n{results[r][1]}" for r in failed]
        raise RankFailure(f"rank(s) {failed} of {world_size} failed:\n" + "\n".join(parts))
    if pending:
        raise TimeoutError(
            f"rank(s) {sorted(pending)} of {world_size} did not finish within {timeout:.0f} s "
            "(killed); a rank is probably blocked in a collective"
        )
    return [results[r][1] for r in range(world_size)]


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int):
    """Initialise torch's in-process "fake" backend (no communication happens)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
