"""Aten operators dispatched in one training step of each ``bench`` variant (CPU, one rank).

A step's operator count is what a GPU launches per step (kernels and their host dispatch): the
library's extra operators against torch's FSDP2 on the root show where a launch-bound step
spends its host time.

    PYTHONPATH=src .venv/bin/python benchmarks/op_count.py --model crossformer
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from credit_parallel.testing import run_on_ranks

VARIANTS = ("plain", "torch fsdp2 root", "torch fsdp2 blocks", "library", "library merged")


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _worker(rank, world, model, variant):
    from credit_parallel.tools.bench.overhead import build_step, model_conf

    step = build_step(variant, model_conf(model, "cpu"), torch.device("cpu"), amp=False)
    step()
    step()  # warm: FSDP2's lazy init and the optimizer state are not counted
    with _Count() as mode:
        step()
    return mode.counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="crossformer", help="crossformer or unet (CPU size)")
    ap.add_argument("--top", type=int, default=6)
    args = ap.parse_args()
    for variant in VARIANTS:
        counts = run_on_ranks(_worker, 1, args.model, variant, timeout=600)[0]
        top = ", ".join(f"{k} {v}" for k, v in counts.most_common(args.top))
        print(f"{variant:20s} {sum(counts.values()):6d} ops   {top}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
