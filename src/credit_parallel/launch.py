"""Starting N local ranks through PyTorch's elastic launcher (torchrun), and telling which failed.

``launch_local(nproc, module, args)`` runs ``python -m <module> <args>`` on ``nproc`` local ranks
with ``torch.distributed.run``.  Under SLURM or a cluster torchrun the same entry points run
unchanged: they only read the environment variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT).

Failure handling.  Every rank runs inside :func:`run_worker` (``python -m credit_parallel.launch
<module> <args>``), which

* on an exception prints the traceback and one line ``credit-parallel rank R: Type: message``,
  records the error for torchrun (its ``TORCHELASTIC_ERROR_FILE``) and for :func:`launch_local`
  (a per-rank report in ``$CREDIT_PARALLEL_STATUS_DIR``), then leaves with ``os._exit(1)``:
  after a communication failure, process-group destructors can block, and a rank that hangs on
  its way out is as bad as one that hangs in a collective;
* on SIGTERM (torchrun stopping the other ranks after a failure) dumps where each thread was
  (``faulthandler``) and dies of the signal at once, also inside a blocking C call.

Timeouts.  :func:`init_distributed_from_env` gives the default group ``trainer.dist_timeout_s``
and makes every group created later (DeviceMesh axes, domain and dp groups) inherit it
(:func:`set_subgroup_timeout`) — torch would otherwise give those groups 30 minutes.

Together: a rank that raises or dies closes its connections and its peers' collectives fail
within milliseconds ("connection closed by peer"); a rank that stops responding makes its peers'
collectives time out after ``dist_timeout_s``; torchrun stops the remaining ranks on the first
failure; and :func:`launch_local` prints ONE line naming the rank that failed first
(:func:`describe_failures`), rather than the ranks that merely lost it.
"""

from __future__ import annotations

import datetime
import faulthandler
import importlib
import json
import linecache
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_RENDEZVOUS_TIMEOUT_S",
    "STATUS_DIR_ENV",
    "describe_failures",
    "group_timeout",
    "init_distributed_from_env",
    "is_communication_error",
    "launch_local",
    "run_worker",
    "set_subgroup_timeout",
    "under_launcher",
]

STATUS_DIR_ENV = "CREDIT_PARALLEL_STATUS_DIR"
DEFAULT_RENDEZVOUS_TIMEOUT_S = 300.0

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


def under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def init_distributed_from_env(
    timeout_s: float = 600.0, *, rendezvous_timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S
) -> None:
    """Initialise the default process group from torchrun's environment (NCCL on GPUs, else gloo).

    ``timeout_s`` (``trainer.dist_timeout_s``) bounds every collective of the default group AND
    of every group created afterwards (:func:`set_subgroup_timeout`): a rank waiting for a peer
    that stopped responding raises after it instead of waiting forever.  The initial rendezvous
    alone may wait ``max(timeout_s, rendezvous_timeout_s)``: ranks start seconds or minutes
    apart (imports, containers), which is not a failure (a rank that dies before the rendezvous
    is noticed by the launcher, which then stops the others).
    """
    for key, value in (
        ("trainer.dist_timeout_s", timeout_s),
        ("rendezvous_timeout_s", rendezvous_timeout_s),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{key} must be a number of seconds > 0, got {value!r}")
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=float(timeout_s))
    rendezvous = max(timeout, datetime.timedelta(seconds=float(rendezvous_timeout_s)))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=rendezvous)
    if rendezvous != timeout:
        import torch.distributed.distributed_c10d as c10d

        c10d._set_pg_timeout(timeout)  # from now on, collectives wait at most `timeout`
    set_subgroup_timeout(timeout)


def set_subgroup_timeout(timeout: datetime.timedelta) -> None:
    """Make process groups created later without a timeout (``dist.new_group``: the DeviceMesh
    axes, the domain and dp groups) use ``timeout``.

    torch gives such groups its own default of 30 minutes, NOT the default group's timeout, so
    a peer that stops responding inside a domain exchange or a dp all-reduce would hold every
    other rank for half an hour whatever ``trainer.dist_timeout_s`` says.  torch reads that
    default from a module global of ``torch.distributed.distributed_c10d`` at each
    ``new_group`` call; this sets it (for gloo and, when built, NCCL).
    """
    import torch.distributed.distributed_c10d as c10d

    if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be a positive datetime.timedelta, got {timeout!r}")
    c10d.default_pg_timeout = timeout
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), datetime.timedelta):
        c10d.default_pg_nccl_timeout = timeout


def group_timeout(group=None) -> datetime.timedelta | None:
    """The timeout of ``group`` (default: the default group), or None when torch hides it."""
    import torch.distributed.distributed_c10d as c10d

    pg = group if group is not None else c10d._get_default_group()
    device = torch.device("cuda" if "nccl" in str(dist.get_backend(pg)) else "cpu")
    try:
        return pg._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


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


def _record_for_torchrun(exc: BaseException) -> None:
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)
    except Exception:  # noqa: BLE001 - diagnostics must never mask the real error
        pass


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
    stack_file = _arm_stack_dump()
    rank = _rank()
    name = module if isinstance(module, str) else getattr(module, "__name__", "main")
    try:
        main = importlib.import_module(module).main if isinstance(module, str) else module
        code = int(main(argv) or 0)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, then the rank leaves
        traceback.print_exc()
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


def launch_local(nproc: int, module: str, args: list[str]) -> int:
    """Run ``python -m module *args`` on ``nproc`` local ranks via torch.distributed.run.

    Returns 0 on success; otherwise prints ``credit-parallel: <who failed and how>`` on one line
    (:func:`describe_failures`) and returns 1.
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"--nproc must be an integer >= 1, got {nproc!r}")
    argv = [
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--no-python",
        sys.executable,
        "-m",
        "credit_parallel.launch",
        module,
        *args,
    ]
    # OMP threads per rank: share this machine's cores between the ranks.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    status_dir = tempfile.mkdtemp(prefix="credit-parallel-ranks-")
    previous = os.environ.get(STATUS_DIR_ENV)
    os.environ[STATUS_DIR_ENV] = status_dir
    try:
        torchrun.main(argv)
    except ChildFailedError as exc:
        codes = {int(r): f.exitcode for r, f in exc.failures.items()}
        print(f"credit-parallel: {describe_failures(status_dir, nproc, codes)}", file=sys.stderr)
        return 1
    except SystemExit as exc:  # torchrun exits through sys.exit on its own errors
        code = exc.code if isinstance(exc.code, int) else 1
        if code:
            print(
                f"credit-parallel: {describe_failures(status_dir, nproc)} (launcher exit {code})",
                file=sys.stderr,
            )
        return code
    except Exception as exc:  # noqa: BLE001 - the launcher itself failed
        print(
            f"credit-parallel: launcher failed: {type(exc).__name__}: {_one_line(exc)}",
            file=sys.stderr,
        )
        return 1
    finally:
        if previous is None:
            os.environ.pop(STATUS_DIR_ENV, None)
        else:
            os.environ[STATUS_DIR_ENV] = previous
        shutil.rmtree(status_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":  # python -m credit_parallel.launch MODULE [ARGS...]: one rank
    if len(sys.argv) < 2:
        print("usage: python -m credit_parallel.launch MODULE [ARGS...]", file=sys.stderr)
        sys.exit(2)
    sys.exit(run_worker(sys.argv[1], sys.argv[2:]))
