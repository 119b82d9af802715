"""Benchmark: the domain conv's halo paths against each other, same run, interleaved rounds.

Per workload (those of ``efficiency.py``) at domain N, 1 intra-op thread per rank, it times a
step (forward + backward + domain gradient sync; median of the steps, slowest rank, median over
rounds) and measures the bytes autograd saves and the peak bytes allocated during a step (largest
rank) for three forms of every domain convolution:

* ``window``   — the reference path: assemble the whole window (shard + halo rows) per conv, in
  forward and backward (``split_halo = False``);
* ``split``    — convolve the shard and only the boundary strips from small
  halo-extended buffers, no window (``overlap.SplitConv``), waiting for the halo rows first;
* ``split+late`` — the same, waiting for the halo rows after the shard's own work (overlap on);
* ``default`` — what a converted model does when nothing is set (``split_halo = None``,
  ``overlap = None``: the rules of ``domain/layers/conv.py`` and ``overlap.overlap_enabled``).

    .venv/bin/python benchmarks/halo_paths.py --workloads conv_stack/large,conv_stack/small \\
        --rounds 3 --steps 3 --warmup 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from efficiency import _inputs, _time_steps, default_workloads  # noqa: E402

from credit_parallel.domain.rows import shard_range  # noqa: E402
from credit_parallel.tools.bench.measure import _peak_bytes, _saved_bytes  # noqa: E402

__all__ = ["VARIANTS", "main", "set_halo_path"]

# variant -> (split_halo, overlap)
VARIANTS = {
    "window": (False, False),
    "split": (True, False),
    "split+late": (True, True),
    "default": (None, None),
}


def set_halo_path(model, split: bool | None, late: bool | None) -> int:
    """Set ``split_halo`` and ``overlap`` (None: the default rule) on every domain conv of
    ``model``; returns how many."""
    count = 0
    for m in model.modules():
        if hasattr(m, "split_halo"):
            m.configure(split_halo=split, overlap=late)
            count += 1
    return count


def _worker(rank, world, w, variant: str, steps: int, warmup: int, memory: bool):
    from credit_parallel.parallel.collectives import sync_domain_gradients
    from credit_parallel.parallel.composition import get_domain_manager, get_raw_model, parallelize
    from credit_parallel.tools.bench import Layout

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = parallelize(w.build(w.height), Layout(domain=world).conf(w.batch))
    manager = get_domain_manager(model)
    set_halo_path(get_raw_model(model), *VARIANTS[variant])
    x, weights, shape = _inputs(w, shard_range(w.height, world, rank))
    token = ("halo_paths", w, shape)

    def step():
        manager.begin_forward(token)
        model.zero_grad(set_to_none=True)
        ((model(x) * weights).sum() / x.numel()).backward()
        sync_domain_gradients(get_raw_model(model), manager, op="sum")

    seconds = _time_steps(step, steps, warmup, world)
    if not memory:
        return seconds, None, None
    saved = _saved_bytes(step, model.parameters())
    return seconds, saved, _peak_bytes(step)


def main(argv=None) -> dict:
    from credit_parallel.testing import run_on_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="conv_stack/large,conv_stack/small")
    parser.add_argument("--domain", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args(argv)
    known = {w.name: w for w in default_workloads()}
    print(f"domain {args.domain}, 1 thread per rank; load average before: {os.getloadavg()}")
    print(f"{'workload':<20}| {'variant':<11}| step ms | saved MiB | peak MiB")
    results = {}
    for name in args.workloads.split(","):
        w = known[name.strip()]
        times: dict = {v: [] for v in VARIANTS}
        memory: dict = {}
        for r in range(args.rounds):
            for v in VARIANTS:
                per_rank = run_on_ranks(
                    _worker, args.domain, w, v, args.steps, args.warmup, r == 0, timeout=1800
                )
                times[v].append(max(t for t, _, _ in per_rank))
                if r == 0:
                    memory[v] = (max(s for _, s, _ in per_rank), max(p for _, _, p in per_rank))
        for v in VARIANTS:
            ms = 1e3 * statistics.median(times[v])
            saved, peak = (b / 2**20 for b in memory[v])
            results[name, v] = (ms, saved, peak)
            print(f"{name:<20}| {v:<11}| {ms:7.1f} | {saved:9.2f} | {peak:8.2f}")
    print(f"load average after: {os.getloadavg()}")
    return results


if __name__ == "__main__":
    main()
