"""Starting N local ranks through PyTorch's elastic launcher (torchrun).

``launch_local(nproc, module, args)`` runs ``python -m <module> <args>`` on ``nproc`` local ranks
with ``torch.distributed.run``, each inside :func:`credit_parallel.tools.forensics.run_worker`
(``python -m credit_parallel.tools.launcher <module> <args>``); on a failure it prints ONE line
naming the rank that failed first (:func:`~credit_parallel.tools.forensics.describe_failures`),
or, when every rank stopped on request (SIGTERM / SIGUSR1: :mod:`credit_parallel.train.preemption`),
one line saying so, and returns their exit status 75.  The agent forwards SIGUSR1 to the ranks
as it does SIGTERM and SIGINT (``TORCHELASTIC_SIGNALS_TO_HANDLE``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile

from ..train.preemption import STOPPED_EXIT_CODE
from .forensics import STATUS_DIR_ENV, _one_line, describe_failures, run_worker

__all__ = ["SIGNALS_ENV", "UNSHARED_STORE_ENV", "launch_local", "stopped_line"]

UNSHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# the signals torchrun's agent catches and forwards to the ranks (its default, plus SIGUSR1: a
# scheduler's walltime warning must reach the ranks, not kill the agent)
SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
AGENT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def stopped_line(status_dir: str, nproc: int, exit_codes: dict | None = None) -> str | None:
    """The one line of a run whose every rank stopped on request (exit status 75, a checkpoint
    written: train/preemption.py), else None.  A rank counts as stopped when its report says it
    exited with 75 (torchrun may then still stop it with SIGTERM on its way out: the first rank
    to exit looks like a failure to the agent) or when its exit code is 75."""
    codes = dict(exit_codes or {})
    stopped, terminated = 0, 0
    for rank in range(nproc):
        try:
            with open(os.path.join(status_dir, f"rank{rank}.json")) as fh:
                message = json.load(fh).get("message", "")
        except (OSError, ValueError):
            message = None  # no report: it raised nothing and exited non-zero by no choice
        if (message or "").endswith(f"status {STOPPED_EXIT_CODE}") or codes.get(rank) == (
            STOPPED_EXIT_CODE
        ):
            stopped += 1
        elif message is None and codes.get(rank) in (-signal.SIGTERM, 128 + signal.SIGTERM):
            terminated += 1  # torchrun's SIGTERM after the first rank exited 75, before its report
        else:
            return None
    if not stopped:
        return None
    return (
        f"credit-parallel: stopped on request: all {nproc} ranks saved at the same step and "
        f"exited with status {STOPPED_EXIT_CODE}; run the same command with --resume auto "
        "(forecast: --resume) to continue"
    )


def launch_local(nproc: int, module: str, args: list[str], *, max_restarts: int = 0) -> int:
    """Run ``python -m module *args`` on ``nproc`` local ranks via torch.distributed.run.

    ``max_restarts``: torchrun's ``--max-restarts``: when a rank fails, its elastic agent stops
    every rank and starts them all again, up to this many times (the workers see
    ``TORCHELASTIC_RESTART_COUNT`` and continue from their newest checkpoint).
    Returns 0 on success; 75 when every rank stopped on request (:func:`stopped_line`);
    otherwise prints ``credit-parallel: <who failed and how>`` on one line
    (:func:`describe_failures`, about the last start) and returns 1.
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"--nproc must be an integer >= 1, got {nproc!r}")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"--max-restarts must be an integer >= 0, got {max_restarts!r}")
    argv = [
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--no-python",
        sys.executable,
        "-m",
        "credit_parallel.tools.launcher",
        module,
        *args,
    ]
    # OMP threads per rank: share this machine's cores between the ranks.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ.setdefault(SIGNALS_ENV, AGENT_SIGNALS)
    if max_restarts:
        # restarted ranks must not share the agent's rendezvous store: there they read the
        # addresses of the ranks they replace and gloo waits on a closed port (torch #135712)
        os.environ.setdefault(UNSHARED_STORE_ENV, "1")
    status_dir = tempfile.mkdtemp(prefix="credit-parallel-ranks-")
    previous = os.environ.get(STATUS_DIR_ENV)
    os.environ[STATUS_DIR_ENV] = status_dir
    try:
        torchrun.main(argv)
    except ChildFailedError as exc:
        codes = {int(r): f.exitcode for r, f in exc.failures.items()}
        stopped = stopped_line(status_dir, nproc, codes)
        if stopped:
            print(stopped, file=sys.stderr)
            return STOPPED_EXIT_CODE
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
    except SignalException as exc:  # the agent was signalled and forwarded it to the ranks
        stopped = stopped_line(status_dir, nproc)
        if stopped:
            print(stopped, file=sys.stderr)
            return STOPPED_EXIT_CODE
        print(
            f"credit-parallel: the launcher received {exc.sigval.name}: "
            f"{describe_failures(status_dir, nproc)}",
            file=sys.stderr,
        )
        return 1
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


if __name__ == "__main__":  # python -m credit_parallel.tools.launcher MODULE [ARGS...]: one rank
    if len(sys.argv) < 2:
        print("usage: python -m credit_parallel.tools.launcher MODULE [ARGS...]", file=sys.stderr)
        sys.exit(2)
    sys.exit(run_worker(sys.argv[1], sys.argv[2:]))
