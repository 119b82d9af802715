"""Benchmark: a U-Net-level conv stack at domain size 1 and 2 on local CPU ranks.

The stack is ``--blocks`` x [3x3 conv (padding 1), GroupNorm(--groups), SiLU] at a fixed width.
Each configuration runs under :func:`credit_parallel.testing.run_on_ranks` (one intra-op thread
per rank) and reports, per rank: the median forward+backward step time, the halo bytes sent per
step (from ``exchange_stats``) against the theoretical minimum, the P2P calls per exchange, and
the bytes of activations saved for backward (unique storages seen by
``torch.autograd.graph.saved_tensors_hooks``, parameters excluded) against half of the
single-process figure.  Gradient synchronisation over the domain group is not part of a step.

    .venv/bin/python benchmarks/domain_conv_stack.py --channels 64 --height 192 --width 384 \\
        --blocks 4 --steps 5 --warmup 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from credit_parallel.domain.convert import convert_to_domain_parallel
from credit_parallel.domain.exchange import exchange_stats
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.domain.rows import shard_range
from credit_parallel.testing import run_on_ranks

__all__ = ["build_stack", "main", "minimum_halo_bytes", "parse_args"]

HALO_ROWS = 1  # a 3x3 conv with padding 1 reads one row beyond each side of its output rows


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--height", type=int, default=192)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--domain", type=int, default=2, help="domain size compared with 1")
    args = parser.parse_args(argv)
    if args.channels % args.groups:
        parser.error(f"--channels {args.channels} is not divisible by --groups {args.groups}")
    if args.height < args.domain or args.steps < 1 or args.warmup < 0:
        parser.error("need --height >= --domain, --steps >= 1 and --warmup >= 0")
    return args


def build_stack(channels: int, blocks: int, groups: int) -> nn.Sequential:
    layers = []
    for _ in range(blocks):
        layers += [
            nn.Conv2d(channels, channels, 3, padding=1),
            nn.GroupNorm(groups, channels),
            nn.SiLU(),
        ]
    return nn.Sequential(*layers)


def minimum_halo_bytes(args, domain: int, element_size: int = 4) -> int:
    """Bytes every rank together must send per direction (forward or backward) per step: each
    interior boundary moves ``HALO_ROWS`` rows each way for each conv."""
    row = args.batch * args.channels * args.width * element_size
    return (domain - 1) * 2 * HALO_ROWS * row * args.blocks


def _saved_activation_bytes(step, parameters) -> int:
    """Bytes of the distinct storages autograd saves during ``step()`` (parameters excluded)."""
    skip = {p.untyped_storage().data_ptr() for p in parameters}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


def _worker(rank, world, args):
    torch.manual_seed(0)
    model = build_stack(args.channels, args.blocks, args.groups)
    mgr = DomainParallelManager(world, world)
    if world > 1:
        convert_to_domain_parallel(model, mgr)
    shape = (args.batch, args.channels, args.height, args.width)
    gen = torch.Generator().manual_seed(1)
    x_global = torch.randn(shape, generator=gen)
    weights_global = torch.randn(shape, generator=gen)
    a, b = shard_range(args.height, world, rank)
    # the input requires grad, as the activations inside a network do
    x = x_global[:, :, a:b].contiguous().requires_grad_()
    weights = weights_global[:, :, a:b].contiguous()
    token = ("domain_conv_stack", shape)

    def step():
        mgr.begin_forward(token)
        model.zero_grad(set_to_none=True)
        x.grad = None
        (model(x) * weights).sum().backward()

    for _ in range(args.warmup):
        step()
    saved = _saved_activation_bytes(step, list(model.parameters()))
    exchange_stats.reset()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {
        "median_s": statistics.median(times),
        "forward_bytes": exchange_stats.by_direction["forward"] / args.steps,
        "backward_bytes": exchange_stats.by_direction["backward"] / args.steps,
        "p2p_calls": exchange_stats.p2p_calls / args.steps,
        "saved_bytes": saved,
    }


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def main(argv=None) -> dict:
    args = parse_args(argv)
    n = args.domain
    single = run_on_ranks(_worker, 1, args, timeout=3600)[0]
    parallel = run_on_ranks(_worker, n, args, timeout=3600)
    t1 = single["median_s"]
    tn = max(r["median_s"] for r in parallel)
    efficiency = t1 / (n * tn)
    exchanges_per_rank = 2 * args.blocks  # one per conv, forward and backward
    p2p_per_exchange = statistics.mean(r["p2p_calls"] for r in parallel) / exchanges_per_rank
    halo = {
        d: (int(sum(r[f"{d}_bytes"] for r in parallel)), minimum_halo_bytes(args, n))
        for d in ("forward", "backward")
    }

    print(
        f"domain conv stack: B={args.batch} C={args.channels} H={args.height} W={args.width}, "
        f"{args.blocks} x [conv3x3 p1, GroupNorm({args.groups}), SiLU], float32, "
        f"1 thread per rank, {args.steps} timed steps after {args.warmup} warm-up"
    )
    print()
    print(f"{'quantity':<36}| {'domain 1':>12} | {f'domain {n}':>12}")
    print("-" * 66)
    for r in range(n):
        first = f"{t1 * 1e3:12.1f}" if r == 0 else f"{'':>12}"
        print(
            f"{f'step fwd+bwd median (ms), rank {r}':<36}| {first} | "
            f"{parallel[r]['median_s'] * 1e3:12.1f}"
        )
    print(f"{f'parallel efficiency T1/({n} x T{n})':<36}| {'':>12} | {efficiency:12.3f}")
    for r in range(n):
        first = _fmt_bytes(single["saved_bytes"]) if r == 0 else ""
        print(
            f"{f'saved activations, rank {r}':<36}| {first:>12} | "
            f"{_fmt_bytes(parallel[r]['saved_bytes']):>12}"
        )
    share = max(r["saved_bytes"] for r in parallel) / single["saved_bytes"]
    ideal = _fmt_bytes(single["saved_bytes"] / n)
    print(f"{f'1/{n} of single-process':<36}| {'':>12} | {ideal:>12}")
    print(f"{'largest rank / single-process':<36}| {'':>12} | {share:12.3f}")
    print()
    print(f"{'exchange (all ranks, per step)':<36}| {'measured':>12} | {'minimum':>12}")
    print("-" * 66)
    for d, (measured, minimum) in halo.items():
        print(f"{f'halo bytes/step {d}':<36}| {measured:>12} | {minimum:>12}")
    print(f"{'P2P calls per exchange':<36}| {p2p_per_exchange:12.2f} | {1:>12}")
    return {
        "single": single,
        "parallel": parallel,
        "efficiency": efficiency,
        "halo_bytes": halo,
        "p2p_calls_per_exchange": p2p_per_exchange,
    }


if __name__ == "__main__":
    main()
