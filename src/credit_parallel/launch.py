"""Starting N local ranks through PyTorch's own elastic launcher (torchrun).

``launch_local(nproc, module, args)`` re-runs ``python -m <module> <args>`` on ``nproc`` local
ranks with ``torch.distributed.run`` unless this process already is a torchrun worker.  Under
SLURM or a cluster torchrun the same entry points run unchanged: they only read the environment
variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

__all__ = ["init_distributed_from_env", "launch_local", "under_launcher"]


def under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def launch_local(nproc: int, module: str, args: list[str]) -> int:
    """Run ``python -m module *args`` on ``nproc`` local ranks via torch.distributed.run."""
    from torch.distributed import run as torchrun

    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    argv = [
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--no-python",
        sys.executable,
        "-m",
        module,
        *args,
    ]
    # OMP threads per rank: share this machine's cores between the ranks.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    try:
        torchrun.main(argv)
    except SystemExit as exc:  # torchrun exits through sys.exit on failures
        return int(exc.code or 0)
    except Exception as exc:  # ChildFailedError carries the failing rank
        print(f"credit-parallel: {type(exc).__name__}: {_one_line(exc)}", file=sys.stderr)
        return 1
    return 0


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return " | ".join(line.strip() for line in text if line.strip())[:2000]


def init_distributed_from_env(timeout_s: float = 600.0) -> None:
    """Initialise the default process group from torchrun's environment (NCCL on GPUs, else gloo)."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
