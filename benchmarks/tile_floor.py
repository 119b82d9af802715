"""Benchmark: lat x lon tiles against the no-communication floor, one interleaved run (issue 26
item 5: "on this machine, measure ours against the no-communication floor for (1,2) and (2,1)
at 2 ranks in one interleaved run").

Per workload (``efficiency.py``'s size-agnostic ``conv_stack`` / ``plain_unet``) and split
(P, Q) of the ranks, 1 intra-op thread per rank, it times a step (forward + backward + the
domain gradient sum; median of the steps, slowest rank, median over interleaved rounds) of

* ``floor`` — every rank runs the plain model on ITS OWN TILE (its rows x its columns: ordinary
  padding at the tile edges, no exchange, no collective): not the same function, the floor a
  communication-free split would reach;
* ``ours`` — the model converted on a ``TiledDomainManager`` of (P, Q) (exact: halo rows, then
  columns of the row-extended tile; GroupNorm statistics over the P x Q group).

and prints ``ours/floor = T(floor) / T(ours)`` (1.0: communication costs nothing).  The splits
run one after the other inside every round, so the machine's load hits them alike.

    PYTHONPATH=src .venv/bin/python benchmarks/tile_floor.py --splits 1x2,2x1 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from efficiency import _time_steps, default_workloads  # noqa: E402

__all__ = ["main", "parse_args", "time_splits"]


def _tile_inputs(w, shape, coords):
    """(this rank's tile of the seeded global input, of the loss weights, the global shape)."""
    from credit_parallel.domain.tiles import tile_range

    gen = torch.Generator().manual_seed(1)
    full = (w.batch, w.channels, w.height, w.width)
    x, weights = torch.randn(full, generator=gen), torch.randn(full, generator=gen)
    (a, b), (c, d) = tile_range(w.height, w.width, shape, coords)
    tile = (slice(None), slice(None), slice(a, b), slice(c, d))
    return x[tile].contiguous().requires_grad_(), weights[tile].contiguous(), full


def _floor_worker(rank, world, w, shape, steps: int, warmup: int) -> float:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = w.build(w.height)
    x, weights, full = _tile_inputs(w, shape, divmod(rank, shape[1]))

    def step():
        model.zero_grad(set_to_none=True)
        ((model(x) * weights).sum() / (full[0] * full[1] * full[2] * full[3])).backward()

    return _time_steps(step, steps, warmup, world)


def _ours_worker(rank, world, w, shape, steps: int, warmup: int) -> float:
    from credit_parallel.domain import convert_to_domain_parallel
    from credit_parallel.domain.manager import TiledDomainManager
    from credit_parallel.parallel.collectives import sync_domain_gradients

    torch.set_num_threads(1)
    torch.manual_seed(0)
    manager = TiledDomainManager(world, shape)
    model = convert_to_domain_parallel(w.build(w.height), manager)
    x, weights, full = _tile_inputs(w, shape, manager.domain_coords)
    token = ("tile_floor", w, full)

    def step():
        manager.begin_forward(token)
        model.zero_grad(set_to_none=True)
        ((model(x) * weights).sum() / (full[0] * full[1] * full[2] * full[3])).backward()
        sync_domain_gradients(model, manager, op="sum")

    return _time_steps(step, steps, warmup, world)


def time_splits(w, splits, *, rounds: int, steps: int, warmup: int) -> dict:
    """``{(P, Q): {"floor": s, "ours": s}}``: median over interleaved rounds of the slowest
    rank's median step."""
    from credit_parallel.testing import run_on_ranks

    samples = {(s, kind): [] for s in splits for kind in ("floor", "ours")}
    for _ in range(rounds):
        for shape in splits:
            world = shape[0] * shape[1]
            for kind, fn in (("floor", _floor_worker), ("ours", _ours_worker)):
                times = run_on_ranks(fn, world, w, shape, steps, warmup, timeout=1800)
                samples[(shape, kind)].append(max(times))
    return {
        s: {kind: statistics.median(samples[(s, kind)]) for kind in ("floor", "ours")}
        for s in splits
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="conv_stack/large,plain_unet")
    parser.add_argument("--splits", default="1x2,2x1", help="comma list of PxQ")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1)
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    known = {w.name: w for w in default_workloads()}
    splits = [tuple(int(v) for v in s.lower().split("x")) for s in args.splits.split(",")]
    print(f"load average {os.getloadavg()}, {os.cpu_count()} cores; 1 thread per rank")
    print(f"{'workload':<46}| split | floor ms | ours ms | ours/floor")
    rows = []
    for name in [n.strip() for n in args.workloads.split(",") if n.strip()]:
        w = known[name]
        if w.kind not in ("conv_stack", "plain_unet"):
            raise SystemExit(f"--workloads: {name} is not size-agnostic (conv_stack, plain_unet)")
        times = time_splits(w, splits, rounds=args.rounds, steps=args.steps, warmup=args.warmup)
        for (p, q), t in times.items():
            ratio = t["floor"] / t["ours"]
            print(
                f"{w.describe():<46}| {p}x{q:<3} | {t['floor'] * 1e3:8.1f} | "
                f"{t['ours'] * 1e3:7.1f} | {ratio:10.2f}"
            )
            rows.append({"workload": name, "split": (p, q), **t, "ours/floor": ratio})
    return rows


if __name__ == "__main__":
    main()
