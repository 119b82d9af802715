"""Micro-benchmark: what one synchronisation costs on this machine's process groups.

Times, per call on every rank of a --world-rank gloo group (1 intra-op thread each; the slowest
rank's mean over --calls after --warmup): gloo's ``all_reduce`` and ``all_gather_single``, one
batched send/receive with every peer, and the library's ``sum_small_`` / ``gather_small``
(small_collectives: point to point below its size threshold, the collective above).  These are
the latencies a domain-parallel step pays per exchange and per norm statistics collective
(docs/performance.md).

    .venv/bin/python benchmarks/collective_latency.py --world 2
    .venv/bin/python benchmarks/collective_latency.py --world 3 --sizes 64,24576,1048576

On a shared machine the figures are indicative only.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from credit_parallel.layout.compat import all_gather_single
from credit_parallel.layout.small_collectives import gather_small, sum_small_
from credit_parallel.testing import run_on_ranks

__all__ = ["main", "parse_args"]


def _exchange_with_peers(x: torch.Tensor, bufs: list[torch.Tensor], rank: int, world: int):
    ops = []
    for q in range(world):
        if q != rank:
            ops.append(dist.P2POp(dist.isend, x, q))
            ops.append(dist.P2POp(dist.irecv, bufs[q], q))
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _variants(nbytes: int, rank: int, world: int) -> dict:
    x = torch.randn(max(1, nbytes // 4))
    gathered = x.new_empty(world * x.numel())
    bufs = [torch.empty_like(x) for _ in range(world)]
    return {
        "gloo all_reduce": lambda: dist.all_reduce(x),
        "gloo all_gather": lambda: all_gather_single(gathered, x),
        "send/recv all peers": lambda: _exchange_with_peers(x, bufs, rank, world),
        "sum_small_": lambda: sum_small_(x, None),
        "gather_small": lambda: gather_small(x, None),
    }


def _worker(rank, world, sizes, calls, warmup):
    torch.set_num_threads(1)
    out = {}
    for nbytes in sizes:
        for name, call in _variants(nbytes, rank, world).items():
            for _ in range(warmup):
                call()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            out[(name, nbytes)] = (time.perf_counter() - t0) / calls
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--sizes", default="64,24576,262144,1048576", help="bytes per rank")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    per_rank = run_on_ranks(_worker, args.world, sizes, args.calls, args.warmup, timeout=1800)
    slowest = {key: max(r[key] for r in per_rank) for key in per_rank[0]}
    names = list(dict.fromkeys(name for name, _ in slowest))
    print(
        f"{args.world} gloo ranks, 1 thread each, ms per call (slowest rank, mean of {args.calls})"
    )
    print(f"{'bytes per rank':>14} | " + " | ".join(f"{n:>19}" for n in names))
    for nbytes in sizes:
        cells = " | ".join(f"{slowest[(n, nbytes)] * 1e3:19.3f}" for n in names)
        print(f"{nbytes:>14} | {cells}")
    return slowest


if __name__ == "__main__":
    main()
