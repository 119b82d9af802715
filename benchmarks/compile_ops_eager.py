"""The traced row exchange (``domain/exchange/ops.py``) called eagerly vs the eager exchange path.

Why the eager path stays the default: this times forward + backward of one halo exchange
(halo 1 each side) at domain 2 on gloo, through ``exchange_planned`` (autograd Function) and
through the ``credit_parallel::exchange_rows`` operator (what compiled code calls).

PYTHONPATH=src .venv/bin/python benchmarks/compile_ops_eager.py
"""

from __future__ import annotations

import statistics
import time

import torch

from credit_parallel.domain.exchange.halo import exchange_planned, halo_window
from credit_parallel.domain.exchange.ops import exchange_traced
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.domain.rows import plan_exchange, shard_range
from credit_parallel.testing import run_on_ranks


def _worker(rank, world, shape, reps):
    mgr = DomainParallelManager(world, world)
    h = shape[2]
    windows = tuple(halo_window(h, world, r, 1, 1) for r in range(world))
    specs = [(plan_exchange(h, world, windows)[rank], 2, 0.0)]
    a, b = shard_range(h, world, rank)
    x = torch.randn(shape)[:, :, a:b].contiguous().requires_grad_()
    paths = {
        "eager (autograd Function)": lambda: exchange_planned([x], specs, mgr)[0],
        "operator (ops.py)": lambda: exchange_traced([x], specs, mgr.domain_group)[0],
    }
    out = {}
    for name, fn in paths.items():
        times = []
        for _ in range(reps):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            fn().sum().backward()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times[5:])
    return out


def main() -> int:
    for shape in ((1, 32, 64, 128), (4, 64, 128, 256)):
        res = run_on_ranks(_worker, 2, shape, 60, timeout=600)[0]
        for name, t in res.items():
            print(f"domain 2, shard of {shape}: {name:28s} {t * 1e3:7.3f} ms (fwd+bwd)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
