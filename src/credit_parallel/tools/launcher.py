"""Starting N local ranks through PyTorch's elastic launcher (torchrun).

``launch_local(nproc, module, args)`` runs ``python -m <module> <args>`` on ``nproc`` local ranks
with ``torch.distributed.run``, each inside :func:`credit_parallel.tools.forensics.run_worker`
(``python -m credit_parallel.tools.launcher <module> <args>``); on a failure it prints ONE line
naming the rank that failed first (:func:`~credit_parallel.tools.forensics.describe_failures`).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

from .forensics import STATUS_DIR_ENV, _one_line, describe_failures, run_worker

__all__ = ["launch_local"]


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
        "credit_parallel.tools.launcher",
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


if __name__ == "__main__":  # python -m credit_parallel.tools.launcher MODULE [ARGS...]: one rank
    if len(sys.argv) < 2:
        print("usage: python -m credit_parallel.tools.launcher MODULE [ARGS...]", file=sys.stderr)
        sys.exit(2)
    sys.exit(run_worker(sys.argv[1], sys.argv[2:]))
