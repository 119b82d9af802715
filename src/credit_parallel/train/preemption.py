"""A clean stop on preemption: a signal on ANY rank stops EVERY rank at the same step boundary.

``trainer.stop_signals`` (default ``[SIGTERM, SIGUSR1, SIGINT]``: a scheduler's preemption,
SLURM's ``--signal=USR1@N`` walltime warning, torchrun forwarding its own SIGTERM, Ctrl-C; a
second Ctrl-C interrupts at once) are caught by
:class:`StopRequest` while a run loops (``train`` and ``forecast``).  The handler only records
the signal.  At each step boundary (a forecast: each round) every rank calls
:meth:`StopRequest.agreed`: one all-reduce (MAX) of three small integers, the signal, the rank
that got it, and whether this rank's checkpoint write has failed.  Every rank therefore sees the
same answer at the same step, saves there (``train``: a checkpoint; ``forecast``: the writer
flushed, the finished initial times marked complete), waits for any save in flight and exits with
:data:`STOPPED_EXIT_CODE` (75, ``EX_TEMPFAIL``: "try again"), distinct from a failure (1).
``--resume auto`` then continues with nothing lost.

A rank that was sent SIGTERM and does not reach the next step boundary within
``1 s + 2 x`` its last step's time (a forecast: its last round's) is taken for hung (torchrun stops the survivors of a failed
rank with SIGTERM too): it writes every thread's stack where the launcher's forensics look
for it and exits with ``128 + SIGTERM``, as if the signal had killed it.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

__all__ = ["STOPPED_EXIT_CODE", "StopRequest", "Verdict", "stopped_by_sigterm"]

STOPPED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped on request, a checkpoint written; run it again
# the launcher's per-rank status directory (tools/forensics.py's STATUS_DIR_ENV; this layer
# cannot import tools/, tests/test_preemption.py checks that the two names agree)
STATUS_DIR_ENV = "CREDIT_PARALLEL_STATUS_DIR"
HUNG_BASE_S = 1.0
HUNG_STEPS = 2.0
_SIGTERM_AT: list = [None]  # when this process received SIGTERM inside a run loop


def stopped_by_sigterm() -> bool:
    """Whether this rank was sent SIGTERM inside a run loop: an error raised after it (a peer
    gone, a DataLoader worker terminated with it) is the stop's consequence, not a failure
    (``tools/forensics.py`` reports such a rank as stopped by the launcher)."""
    return _SIGTERM_AT[0] is not None


def forget_sigterm() -> None:
    """A new rank (``tools/forensics.run_worker``) or run loop starts with no SIGTERM received
    (a forked process inherits its parent's record)."""
    _SIGTERM_AT[0] = None


def _dump_stacks() -> None:
    """Every thread's stack, appended where the launcher's forensics look for it."""
    directory = os.environ.get(STATUS_DIR_ENV)
    if not directory:
        return
    try:
        path = os.path.join(directory, f"rank{os.environ.get('RANK', '0')}.stack")
        with open(path, "a") as fh:
            faulthandler.dump_traceback(file=fh, all_threads=True)
    except OSError:
        pass


class Verdict:
    """What every rank agreed at a step boundary."""

    def __init__(self, signum: int = 0, rank: int = -1, failed: bool = False):
        self.signum, self.rank, self.failed = signum, rank, failed

    @property
    def stop(self) -> bool:
        return self.signum > 0

    @property
    def reason(self) -> str:
        name = signal.Signals(self.signum).name if self.signum else "no signal"
        return f"{name} received on rank {self.rank}"


class StopRequest:
    """The stop signals' handlers for the duration of a run (``with StopRequest(...):``).

    ``signals``: names (``trainer.stop_signals``); ``device``: where the agreement's tensor
    lives (the process group's device: CUDA under NCCL).  Outside the main thread nothing is
    installed (the signals keep their meaning) and :meth:`agreed` still agrees with the peers.
    """

    def __init__(self, signals=("SIGTERM", "SIGUSR1", "SIGINT"), *, device=None):
        self.signals = [getattr(signal, name) for name in signals]
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.signum = 0  # the first stop signal this rank received
        self.step_s = 0.0  # the last step's duration (the hung-rank bound scales with it)
        self._previous: dict = {}
        self._watchdog: threading.Timer | None = None
        self._reached = threading.Event()
        self._stopping = False  # every rank agreed to stop at this step boundary

    # ------------------------------------------------------------------ handlers
    def __enter__(self) -> StopRequest:
        forget_sigterm()
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._reached.set()
        if self._watchdog is not None:
            self._watchdog.cancel()
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.signum:
            if signum == signal.SIGINT == self.signum:  # Ctrl-C twice: interrupt now
                raise KeyboardInterrupt
            return  # already stopping
        self.signum = signum
        if signum == signal.SIGTERM:  # torchrun's way to stop a failed run's survivors too
            _SIGTERM_AT[0] = time.time()
            _dump_stacks()  # where it was when stopped: the launcher's forensics read it
            grace = HUNG_BASE_S + HUNG_STEPS * self.step_s
            self._watchdog = threading.Timer(grace, self._hung, args=(signum,))
            self._watchdog.daemon = True
            self._watchdog.start()

    def _hung(self, signum: int) -> None:
        if self._reached.is_set():
            return
        os._exit(128 + signum)

    # ------------------------------------------------------------------ the agreement
    def agreed(self, *, failed: bool = False) -> Verdict:
        """Every rank's verdict at this step boundary (one small all-reduce when a process
        group exists): stop when any rank received a stop signal; ``failed`` when any rank's
        checkpoint write failed.  Cancels this rank's hung-rank bound: it reached the boundary."""
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        flags = [self.signum, rank if self.signum else -1, int(failed)]
        if dist.is_available() and dist.is_initialized():
            t = torch.tensor(flags, dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flags = t.tolist()
        verdict = Verdict(int(flags[0]), int(flags[1]), bool(flags[2]))
        if verdict.stop:
            self._stopping = True
            self._reached.set()
            if self._watchdog is not None:
                self._watchdog.cancel()
        return verdict

    def finishing(self) -> None:
        """The loop is over (the final save, the run's end follow): a stop signal from here on
        is noted, never taken for a hung rank."""
        self._reached.set()
        if self._watchdog is not None:
            self._watchdog.cancel()

    def timed(self, started: float) -> None:
        """Record the duration of the step that began at ``started`` (``time.perf_counter``)."""
        self.step_s = time.perf_counter() - started
