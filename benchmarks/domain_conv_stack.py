"""Benchmark: a U-Net-level conv stack at domain size 1 and N on local CPU ranks.

A thin script over :mod:`credit_parallel.tools.bench` (the reusable code lives in the package): the
stack is ``--blocks`` x [3x3 conv (padding 1), GroupNorm(--groups), SiLU] at a fixed width, run
with one intra-op thread per rank at domain 1 and ``--domain`` (halo overlap on and off).  It
prints the benchmark table (step time, efficiency against 1 rank with as many threads, halo
bytes measured / predicted / minimum, collectives, saved-activation and peak bytes per rank) and
the per-direction halo summary.

    .venv/bin/python benchmarks/domain_conv_stack.py --channels 64 --height 192 --width 384 \\
        --blocks 4 --steps 5 --warmup 2
"""

from __future__ import annotations

import argparse
import sys

from credit_parallel.tools.bench import (
    LEGEND,
    Layout,
    ModelSpec,
    build_conv_stack,
    evaluate_targets,
    format_table,
    run_suite,
    target_status,
)

__all__ = ["build_stack", "main", "parse_args"]

build_stack = build_conv_stack


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
    parser.add_argument("--overlap", choices=("both", "on", "off"), default="both")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory step")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved repeats, pooled")
    args = parser.parse_args(argv)
    if args.channels % args.groups:
        parser.error(f"--channels {args.channels} is not divisible by --groups {args.groups}")
    if args.height < args.domain or args.steps < 1 or args.warmup < 0:
        parser.error("need --height >= --domain, --steps >= 1 and --warmup >= 0")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    spec = ModelSpec(
        "conv_stack",
        "custom",
        channels=args.channels,
        height=args.height,
        width=args.width,
        batch=args.batch,
        blocks=args.blocks,
        groups=args.groups,
    )
    modes = {"both": (True, False), "on": (True,), "off": (False,)}[args.overlap]
    rows = run_suite(
        [spec],
        [Layout(), Layout(domain=args.domain)],
        steps=args.steps,
        warmup=args.warmup,
        overlap_modes=modes,
        memory=not args.no_memory,
        rounds=args.rounds,
        log=lambda s: print(s, file=sys.stderr, flush=True),
    )
    print(f"{spec.describe()}, float32, 1 thread per rank, {args.steps} timed steps")
    print()
    print(format_table(rows))
    print()
    print(LEGEND)
    parallel = [r for r in rows if r.domain > 1]
    first = parallel[0]
    # every conv exchanges as many rows; the first conv's input (the model's) needs no gradient,
    # so the backward returns the halo gradients of the other blocks - 1 convs only
    forward_minimum = first.halo_bytes_minimum * spec.blocks // (2 * spec.blocks - 1)
    minima = {
        "forward": forward_minimum,
        "backward": first.halo_bytes_minimum - forward_minimum,
    }
    print()
    print(f"{'exchange (all ranks, per step)':<36}| {'measured':>12} | {'minimum':>12}")
    print("-" * 66)
    for direction in ("forward", "backward"):
        measured = round(getattr(first, f"halo_bytes_{direction}"))
        print(f"{f'halo bytes/step {direction}':<36}| {measured:>12} | {minima[direction]:>12}")
    print(f"{'P2P calls per exchange':<36}| {first.p2p_per_exchange:12.2f} | {1:>12}")
    print()
    for t in evaluate_targets(rows, target_model=spec.label):
        print(f"[{target_status(t['met'])}] {t['target']}: {t['figures']}")
    return {
        "rows": rows,
        "efficiency": {("on" if r.overlap else "off"): r.efficiency for r in parallel},
        "halo_bytes": {
            d: (round(getattr(first, f"halo_bytes_{d}")), minima[d])
            for d in ("forward", "backward")
        },
        "p2p_calls_per_exchange": first.p2p_per_exchange,
    }


if __name__ == "__main__":
    main()
