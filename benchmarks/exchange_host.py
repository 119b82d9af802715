"""Benchmark: the HOST time of one domain conv's halo exchange per call (issue 26 item 4).

At domain N (default 2), 1 intra-op thread per rank, a tiny input (default 1 x 4 x 16 x 32,
float32: the transfer is negligible, what remains is Python and dispatch), it measures the CPU
time of the calling thread (``time.thread_time``: time blocked in gloo's waits does not count)
per call, forward and backward separately, of:

* ``split``    — a ``DomainParallelConv2d`` (3x3, padding 1) on its default path
  (``split_conv.SplitConv``: the shard's call plus boundary strips);
* ``window``   — the same layer with ``split_halo=False`` (the exchange assembles the window,
  then the plain conv runs on it);
* ``exchange`` — the exchange alone (``exchange.halo.exchange_planned`` of the layer's plan,
  the window returned, no conv);
* ``plain``    — the plain ``nn.Conv2d`` on the shard alone (no exchange): the floor the two
  layer rows are compared with;
* ``gloo``     — the transport alone: per direction, one send and one receive of the halo's
  size posted on the process group and waited for, no library code (what no exchange path
  can go below; on this shared machine it moves with the load).

The host cost of the exchange in a layer is ``layer - plain`` (the convolution itself
subtracted).  Backward is ``torch.autograd.grad`` of the output with respect to the input,
weight and bias (of the window with respect to the input for ``exchange``).  Rounds interleave
the variants; per variant the median over rounds of each rank's microseconds per call, the
slowest rank reported.

    PYTHONPATH=src .venv/bin/python benchmarks/exchange_host.py --rounds 5 --calls 200
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn

from credit_parallel.domain.rows import shard_range

__all__ = ["VARIANTS", "main"]

VARIANTS = ("split", "window", "exchange", "plain", "gloo")


def _build(variant: str, conv: nn.Conv2d, mgr):
    """``(forward(x), backward(y, x))`` of one variant on this rank."""
    from credit_parallel.domain.exchange.halo import exchange_planned
    from credit_parallel.domain.layers.conv import DomainParallelConv2d

    params = list(conv.parameters())
    if variant == "gloo":
        return _transport(mgr)
    if variant == "plain":
        return conv, lambda y, x: torch.autograd.grad(y, [x, *params], torch.ones_like(y))
    layer = DomainParallelConv2d(conv, manager=mgr)
    layer.configure(split_halo=variant == "split")
    if variant != "exchange":
        return layer, lambda y, x: torch.autograd.grad(y, [x, *params], torch.ones_like(y))

    def exchange(x):
        length = mgr.global_length(layer, x.shape[2])
        call = layer._call_geometry(length, mgr.domain_world_size, mgr.domain_rank)
        return exchange_planned([x], [(call.plan, 2, 0.0)], mgr)[0]

    return exchange, lambda y, x: torch.autograd.grad(y, [x], torch.ones_like(y))


def _transport(mgr):
    """One raw send + receive of one halo row's size per direction, on the domain group."""
    group, rank = mgr.domain_group, mgr.domain_rank
    peer = 1 - rank if rank < 2 else rank  # ranks 0 and 1 swap; others send to themselves

    def swap(x):
        row = x.detach().narrow(2, 0, 1).contiguous()
        buf = torch.empty_like(row)
        for work in (group.send([row], peer, 0), group.recv([buf], peer, 0)):
            work.wait()
        return buf

    return swap, lambda y, x: swap(x)


def _per_call_us(forward, backward, x, calls: int, mgr, token) -> tuple[float, float]:
    """Thread CPU microseconds per forward and per backward call, over ``calls`` calls (each
    the one call of its layer in a forward: ``begin_forward`` before it, untimed)."""
    fwd = bwd = 0.0
    for _ in range(calls):
        mgr.begin_forward(token)
        t0 = time.thread_time()
        y = forward(x)
        t1 = time.thread_time()
        backward(y, x)
        t2 = time.thread_time()
        fwd += t1 - t0
        bwd += t2 - t1
    return 1e6 * fwd / calls, 1e6 * bwd / calls


def _worker(rank, world, shape, rounds: int, calls: int, warmup: int):
    import torch.distributed as dist

    from credit_parallel.domain.manager import DomainParallelManager

    torch.set_num_threads(1)
    torch.manual_seed(0)
    mgr = DomainParallelManager(world, world)
    token = ("exchange_host", shape)
    a, b = shard_range(shape[2], world, rank)
    x = torch.randn(shape)[:, :, a:b].clone().requires_grad_()
    runs = {}
    for v in VARIANTS:
        conv = nn.Conv2d(shape[1], shape[1], 3, padding=1)
        runs[v] = _build(v, conv, mgr)
        _per_call_us(*runs[v], x, warmup, mgr, token)
    times: dict = {v: ([], []) for v in VARIANTS}
    for _ in range(rounds):
        for v in VARIANTS:
            dist.barrier()
            f, bw = _per_call_us(*runs[v], x, calls, mgr, token)
            times[v][0].append(f)
            times[v][1].append(bw)
    return {v: (statistics.median(f), statistics.median(bw)) for v, (f, bw) in times.items()}


def main(argv=None) -> dict:
    from credit_parallel.testing import run_on_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--domain", type=int, default=2)
    parser.add_argument("--shape", default="1,4,16,32", help="global input B,C,H,W")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args(argv)
    shape = tuple(int(v) for v in args.shape.split(","))
    print(
        f"domain {args.domain}, input {shape}, 1 thread per rank, {args.calls} calls x "
        f"{args.rounds} rounds; load average before: {os.getloadavg()}"
    )
    per_rank = run_on_ranks(
        _worker, args.domain, shape, args.rounds, args.calls, args.warmup, timeout=1800
    )
    results = {v: tuple(max(r[v][i] for r in per_rank) for i in (0, 1)) for v in VARIANTS}
    plain = results["plain"]
    print(f"{'variant':<9}| fwd us/call | bwd us/call | fwd - plain | bwd - plain")
    for v, (f, b) in results.items():
        extra = (
            ""
            if v in ("plain", "exchange", "gloo")
            else f"{f - plain[0]:11.1f} | {b - plain[1]:11.1f}"
        )
        print(f"{v:<9}| {f:11.1f} | {b:11.1f} | {extra}")
    print(f"load average after: {os.getloadavg()}")
    return results


if __name__ == "__main__":
    main()
