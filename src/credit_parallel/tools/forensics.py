"""Failure forensics of a multi-rank run: which rank failed first, and how.

Failure handling.  Every rank runs inside :func:`run_worker` (``python -m credit_parallel.tools.launcher
<module> <args>``), which

* on an exception prints the traceback and one line ``credit-parallel rank R: Type: message``,
  records the error for torchrun (its ``TORCHELASTIC_ERROR_FILE``) and for :func:`credit_parallel.tools.launcher.launch_local`
  (a per-rank report in ``$CREDIT_PARALLEL_STATUS_DIR``), then leaves with ``os._exit(1)``:
  after a communication failure, process-group destructors can block, and a rank that hangs on
  its way out is as bad as one that hangs in a collective;
* on SIGTERM (torchrun stopping the other ranks after a failure) dumps where each thread was
  (``faulthandler``) and dies of the signal at once, also inside a blocking C call.

Together: a rank that raises or dies closes its connections and its peers' collectives fail
within milliseconds ("connection closed by peer"); a rank that stops responding makes its peers'
collectives time out after ``dist_timeout_s``; torchrun stops the remaining ranks on the first
failure; and :func:`credit_parallel.tools.launcher.launch_local` prints ONE line naming the rank that failed first
(:func:`describe_failures`), rather than the ranks that merely lost it.
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import linecache
import os
import re
import signal
import sys
import threading
import time
import traceback

import torch.distributed as dist

__all__ = ["STATUS_DIR_ENV", "describe_failures", "is_communication_error", "run_worker"]

STATUS_DIR_ENV = "CREDIT_PARALLEL_STATUS_DIR"

# Messages of gloo / NCCL / c10d errors that mean "a peer is gone or silent", not "this rank
# is wrong": such a rank is a casualty of another rank's failure.
_COMMUNICATION = re.compile(
    r"connection (closed|reset|refused)|broken pipe|timed out|timeout|read error|"
    r"write error|nccl (error|communicator)|watchdog|socket|peer|remote worker|aborted",
    re.IGNORECASE,
)
_COMMUNICATION_CALLS = re.compile(
    r"\.wait\(|all_reduce|all_gather|reduce_scatter|broadcast|barrier|isend|irecv|"
    r"batch_isend_irecv|send\(|recv\(|all_to_all"
)


def is_communication_error(exc: BaseException) -> bool:
    """Whether ``exc`` says a peer is gone or silent (gloo/NCCL/c10d), not that this rank is wrong."""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    return isinstance(exc, RuntimeError) and bool(_COMMUNICATION.search(str(exc)))


# --------------------------------------------------------------------------- the worker side
def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _one_line(text: str, limit: int = 600) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _write_report(report: dict) -> None:
    directory = os.environ.get(STATUS_DIR_ENV)
    if not directory:
        return
    path = os.path.join(directory, f"rank{report['rank']}.json")
    try:
        with open(path + ".tmp", "w") as fh:
            json.dump(report, fh)
        os.replace(path + ".tmp", path)  # the launcher never reads half a report
    except OSError:
        pass


def _clear_earlier_report(rank: int) -> None:
    """A worker restarted by torchrun (``--max-restarts``) removes its report of the earlier
    start: the launcher's one line is about the last start."""
    from ..layout.launch import elastic_restart_count

    directory = os.environ.get(STATUS_DIR_ENV)
    if directory and elastic_restart_count() > 0:
        try:
            os.remove(os.path.join(directory, f"rank{rank}.json"))
        except OSError:
            pass


def _record_for_torchrun(exc: BaseException) -> None:
    """Write torchrun's error file whole or not at all: written beside it, then renamed.  The
    agent stops a failing rank's peers with SIGTERM, which may land in the middle of this write,
    and the agent cannot parse a half-written file (it fails instead of restarting the ranks)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    partial = f"{path}.{os.getpid()}.tmp"
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        os.environ["TORCHELASTIC_ERROR_FILE"] = partial
        ErrorHandler().record_exception(exc)
        os.replace(partial, path)
    except Exception:  # noqa: BLE001 - diagnostics must never mask the real error
        pass
    finally:
        os.environ["TORCHELASTIC_ERROR_FILE"] = path


def _arm_stack_dump():
    """On SIGTERM, write every thread's Python stack to the status dir, then die of the signal."""
    directory = os.environ.get(STATUS_DIR_ENV)
    if not directory:
        return None
    rank = _rank()
    try:
        fh = open(os.path.join(directory, f"rank{rank}.stack"), "w")  # noqa: SIM115
        fh.write(f"main thread 0x{threading.main_thread().ident:016x}\n")
        fh.flush()
        faulthandler.register(signal.SIGTERM, file=fh, all_threads=True, chain=True)
    except (OSError, ValueError, RuntimeError):
        return None
    return fh


def run_worker(module, argv: list[str]) -> int:
    """Run ``module.main(argv)`` as one rank; on any failure report it and leave at once.

    ``module``: a module name (its ``main(argv)`` is called) or the ``main`` callable itself.
    Returns ``main``'s exit status (a non-zero one, or a non-zero ``SystemExit``, is reported
    first); on an exception the process ends here (``os._exit(1)``) after the reports described
    in the module docstring.
    """
    rank = _rank()
    _clear_earlier_report(rank)
    from ..train.preemption import forget_sigterm

    forget_sigterm()  # a forked rank inherits its parent's record
    stack_file = _arm_stack_dump()
    name = module if isinstance(module, str) else getattr(module, "__name__", "main")
    try:
        main = importlib.import_module(module).main if isinstance(module, str) else module
        code = int(main(argv) or 0)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, then the rank leaves
        traceback.print_exc()
        from ..train.preemption import stopped_by_sigterm

        if stopped_by_sigterm():  # raised after the launcher stopped it: stopped, not failed
            print(f"credit-parallel rank {rank}: stopped by SIGTERM", file=sys.stderr)
            _leave(128 + signal.SIGTERM, stack_file)
        message = _one_line(str(exc)) or type(exc).__name__
        print(f"credit-parallel rank {rank}: {type(exc).__name__}: {message}", file=sys.stderr)
        _record_for_torchrun(exc)
        _write_report(
            {
                "rank": rank,
                "time": time.time(),
                "type": type(exc).__name__,
                "message": message,
                "communication": is_communication_error(exc),
            }
        )
        _leave(1, stack_file)
    if code != 0:
        _write_report(
            {
                "rank": rank,
                "time": time.time(),
                "type": "ExitStatus",
                "message": f"{name} exited with status {code}",
                "communication": False,
            }
        )
    _disarm(stack_file)
    return code


def _disarm(stack_file) -> None:
    if stack_file is not None:
        faulthandler.unregister(signal.SIGTERM)
        stack_file.close()


def _leave(code: int, stack_file) -> None:
    _disarm(stack_file)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


# --------------------------------------------------------------------------- the launcher side
def _read_stack(path: str) -> list[tuple[str, int, str]] | None:
    """Innermost-first (file, line, function) of the main thread in a faulthandler dump."""
    try:
        with open(path) as fh:
            text = fh.read()
    except OSError:
        return None
    lines = text.splitlines()
    if len(lines) < 2 or not lines[0].startswith("main thread "):
        return None
    main_id = lines[0].split()[-1]
    frames, current = [], None
    for line in lines[1:]:
        if "thread 0x" in line.lower() and line.rstrip().endswith("(most recent call first):"):
            current = main_id in line
            continue
        match = re.match(r'\s+File "(.*)", line (\d+) in (.*)', line)
        if match and current:
            frames.append((match.group(1), int(match.group(2)), match.group(3)))
    return frames or None


def _in_communication(frames: list[tuple[str, int, str]]) -> bool:
    """Whether the innermost frames are waiting in a collective / P2P call."""
    for filename, lineno, _ in frames[:3]:
        if f"torch{os.sep}distributed{os.sep}" in filename:
            return True
        if _COMMUNICATION_CALLS.search(linecache.getline(filename, lineno)):
            return True
    return False


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def describe_failures(status_dir: str, world_size: int, exit_codes: dict | None = None) -> str:
    """One line naming the rank that failed first and what the others did.

    ``status_dir``: the per-rank reports of :func:`run_worker`; ``exit_codes``: ``{rank: code}``
    of the ranks the launcher saw failing (torchrun's ``ChildFailedError.failures``).  Priority:
    a rank that raised something other than a communication error; else a rank that died without
    a Python error (``os._exit``, a signal, the OOM killer); else a rank that was stopped while NOT
    waiting in communication (it stopped responding); else the earliest communication error.
    """
    exit_codes = dict(exit_codes or {})
    reports = {}
    for r in range(world_size):
        try:
            with open(os.path.join(status_dir, f"rank{r}.json")) as fh:
                reports[r] = json.load(fh)
        except (OSError, ValueError):
            pass
    stacks = {r: _read_stack(os.path.join(status_dir, f"rank{r}.stack")) for r in range(world_size)}
    stopped = {r: f for r, f in stacks.items() if f and r not in reports}
    casualties = sorted(r for r, rep in reports.items() if rep.get("communication"))
    timeouts = [r for r in casualties if "time" in reports[r]["message"].lower()]

    def others(primary: set[int]) -> str:
        parts = []
        waited = [r for r in timeouts if r not in primary]
        lost = [r for r in casualties if r not in primary and r not in timeouts]
        if waited:
            parts.append(f"{_ranks(waited)} then timed out waiting in a collective")
        if lost:
            parts.append(f"{_ranks(lost)} then lost the connection in a collective")
        quiet = [r for r in stopped if r not in primary]
        if quiet:
            parts.append(f"{_ranks(quiet)} stopped by the launcher")
        return f" ({'; '.join(parts)})" if parts else ""

    errors = sorted((rep["time"], r) for r, rep in reports.items() if not rep.get("communication"))
    if errors:
        first = errors[0][1]
        message = f"{reports[first]['type']}: {reports[first]['message']}"
        same = {r for _, r in errors if reports[r]["message"] == reports[first]["message"]}
        if len(same) == world_size and world_size > 1:
            return f"all {world_size} ranks failed with {message}"
        who = _ranks(same) if len(same) > 1 else f"rank {first}"
        return f"{who} of {world_size} failed first: {message}{others(same)}"
    # a rank with a stack dump was stopped by the launcher (SIGTERM), it did not die by itself
    died = sorted(
        r for r, code in exit_codes.items() if r not in reports and r not in stopped and code != 0
    )
    if died:
        codes = ", ".join(f"rank {r}: exit code {exit_codes[r]}" for r in died)
        return (
            f"{_ranks(died)} of {world_size} died without a Python error ({codes}; os._exit, a "
            f"signal or the out-of-memory killer){others(set(died))}"
        )
    stuck = {r: f for r, f in stopped.items() if not _in_communication(f)}
    if stuck and casualties:
        where = "; ".join(
            f"rank {r} was at {os.path.basename(f[0][0])}:{f[0][1]} in {f[0][2]}"
            for r, f in sorted(stuck.items())
        )
        return (
            f"{_ranks(stuck)} of {world_size} stopped responding ({where} when stopped)"
            f"{others(set(stuck))}"
        )
    if casualties:
        first = min(casualties, key=lambda r: reports[r]["time"])
        return (
            f"rank {first} of {world_size} failed first: {reports[first]['type']}: "
            f"{reports[first]['message']}{others({first})}"
        )
    if exit_codes:
        codes = ", ".join(f"rank {r}: exit code {c}" for r, c in sorted(exit_codes.items()))
        return f"{_ranks(exit_codes)} of {world_size} failed ({codes})"
    return "a rank failed (no report; see the output above)"
