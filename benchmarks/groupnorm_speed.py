"""Micro-benchmark: DomainParallelGroupNorm against the native nn.GroupNorm layer.

One GroupNorm(--groups, --channels) on a (--batch, C, H, W) float32 activation, 1 intra-op
thread per process, forward and backward timed separately (median of --steps after --warmup,
--rounds interleaved rounds pooled; for several ranks the slowest rank's median):

* native nn.GroupNorm, 1 process, all H rows (the single-process layer);
* native nn.GroupNorm, 1 process, H / domain rows (the per-rank floor: same rows, no statistics
  exchange — not the same function);
* ours with the collective path forced, 1 rank (the cost of the per-element passes alone);
* ours at --domain ranks on their shards (gloo; includes the statistics collectives).

    .venv/bin/python benchmarks/groupnorm_speed.py --channels 64 --height 192 --width 384

On a shared machine the figures are indicative only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from credit_parallel.domain.layers.norm import DomainParallelGroupNorm
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.domain.rows import shard_range
from credit_parallel.testing import run_on_ranks

__all__ = ["main", "parse_args"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--height", type=int, default=192)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--domain", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    if args.channels % args.groups or args.height < args.domain or args.steps < 1:
        parser.error("need channels divisible by groups, height >= domain and steps >= 1")
    return args


def _layer(kind: str, args, world: int, rank: int):
    """(module, input rows) for one of the measured variants."""
    torch.manual_seed(0)
    norm = nn.GroupNorm(args.groups, args.channels)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    if kind == "native_full":
        return norm, (0, args.height)
    if kind == "native_shard":
        return norm, shard_range(args.height, args.domain, 0)
    layer = DomainParallelGroupNorm(norm, manager=DomainParallelManager(world, world))
    if kind == "ours_1rank":
        # a 1-rank group normally takes the F.group_norm shortcut; force the collective path
        layer.manager = _ForcedManager(layer.manager)
        return layer, (0, args.height)
    return layer, shard_range(args.height, world, rank)


class _ForcedManager:
    """A 1-rank manager that reports a domain size of 2 to the layer's shortcut test only."""

    def __init__(self, manager):
        self._manager = manager
        self.domain_world_size = 2

    def __getattr__(self, name):
        return getattr(self._manager, name)


def _worker(rank, world, kind, args):
    """Per timed step: forward and backward wall seconds, and the CPU seconds of this thread
    (the work itself: on a loaded machine wall time also counts waiting for a core)."""
    layer, (a, b) = _layer(kind, args, world, rank)
    gen = torch.Generator().manual_seed(1)
    shape = (args.batch, args.channels, args.height, args.width)
    x = torch.randn(shape, generator=gen)[:, :, a:b].contiguous().requires_grad_()
    grad_y = torch.randn(shape, generator=gen)[:, :, a:b].contiguous()
    forward, backward, cpu = [], [], []
    for step in range(args.warmup + args.steps):
        if world > 1:
            dist.barrier()
        c0, t0 = time.thread_time(), time.perf_counter()
        y = layer(x)
        t1 = time.perf_counter()
        y.backward(grad_y)
        t2, c2 = time.perf_counter(), time.thread_time()
        if step >= args.warmup:
            forward.append(t1 - t0)
            backward.append(t2 - t1)
            cpu.append(c2 - c0)
        x.grad = None
        layer.zero_grad(set_to_none=True)
    return forward, backward, cpu


VARIANTS = (
    ("native_full", 1, "nn.GroupNorm, 1 process, all rows"),
    ("native_shard", 1, "nn.GroupNorm, 1 process, one shard of rows (floor)"),
    ("ours_1rank", 1, "DomainParallelGroupNorm, 1 rank, collective path"),
    ("ours_domain", None, "DomainParallelGroupNorm, domain ranks"),
)


def main(argv=None) -> dict:
    args = parse_args(argv)
    times = {kind: ([], [], []) for kind, _, _ in VARIANTS}
    for _ in range(args.rounds):  # interleaved: every variant once per round
        for kind, world, _ in VARIANTS:
            per_rank = run_on_ranks(_worker, world or args.domain, kind, args, timeout=600)
            slowest = max(per_rank, key=lambda r: statistics.median(r[0]) + statistics.median(r[1]))
            for pooled, sample in zip(times[kind], slowest):
                pooled.extend(sample)
    print(
        f"GroupNorm({args.groups}, {args.channels}) on {args.batch}x{args.channels}x"
        f"{args.height}x{args.width} float32, 1 thread per process, domain {args.domain}, "
        f"median of {args.steps} steps x {args.rounds} rounds (shared machine: indicative)"
    )
    head = f"{'variant':<52}| {'fwd ms':>7} | {'bwd ms':>7} | {'sum ms':>7} | {'cpu ms':>7}"
    head += " | x native wall | x native cpu"
    print(head)
    print("-" * len(head))
    result = {}
    for kind, _, _ in VARIANTS:
        fwd, bwd, cpu = (statistics.median(t) * 1e3 for t in times[kind])
        result[kind] = {"forward_ms": fwd, "backward_ms": bwd, "cpu_ms": cpu}
    for kind, _, label in VARIANTS:
        r = result[kind]
        shard = kind in ("native_shard", "ours_domain")
        ref = result["native_shard" if shard else "native_full"]
        total = r["forward_ms"] + r["backward_ms"]
        r["ratio"] = total / (ref["forward_ms"] + ref["backward_ms"])
        r["cpu_ratio"] = r["cpu_ms"] / ref["cpu_ms"]
        print(
            f"{label:<52}| {r['forward_ms']:7.2f} | {r['backward_ms']:7.2f} | {total:7.2f} "
            f"| {r['cpu_ms']:7.2f} | {r['ratio']:13.2f} | {r['cpu_ratio']:12.2f}"
        )
    print(
        "x native: against nn.GroupNorm on the same rows (all rows for the 1-process variants, "
        "one shard for the domain ranks); cpu: CPU time of the computing thread per step "
        "(forward + backward), which waiting for a core or for the other rank does not count"
    )
    return result


if __name__ == "__main__":
    main()
