"""Eager vs compiled training step, plain model vs through the library at domain 1.

One step = forward + backward + AdamW on one process (the library runs on one gloo rank:
``parallelize(model, {data: fsdp2, tensor: 1, domain: 1, compile})``).  "compiled" is
``compile_blocks`` (torch.compile per block, as ``trainer.compile: true`` does) for both the plain
model and the library; the plain model compiled as a whole is shown too.  Prints the median step
time of ``--steps`` timed steps after ``--warmup`` steps (the first step compiles).

PYTHONPATH=src .venv/bin/python benchmarks/compile_step.py --models unet,crossformer
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from credit_parallel import compile_blocks, parallelize
from credit_parallel.models.crossformer import CrossFormer
from credit_parallel.models.unet import UNet
from credit_parallel.testing import run_on_ranks


def build(name: str, h: int, w: int):
    torch.manual_seed(0)
    if name == "crossformer":
        return CrossFormer(8, 8, h, w, dims=(32, 64), depths=(2, 2), window_sizes=(4, 2))
    if name == "unet":
        return UNet(8, 8, h, w, base_channels=16, channel_mults=(1, 2, 2))
    raise ValueError(f"--models: unknown model {name!r} (unet, crossformer)")


def time_steps(model, x, steps: int, warmup: int) -> tuple[float, float]:
    """(first step seconds, median step seconds)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times[0], statistics.median(times[warmup:])


def _variant(rank, world, name, h, w, variant, steps, warmup):
    model = build(name, h, w)
    x = torch.randn(1, 8, h, w)
    if variant == "plain compiled (per block)":
        compile_blocks(model)
    elif variant == "plain compiled (whole)":
        model = torch.compile(model)
    elif variant.startswith("library"):
        conf = {"trainer": {"parallelism": {"data": "fsdp2", "tensor": 1, "domain": 1}}}
        conf["trainer"]["compile"] = variant.endswith("compiled")
        model = parallelize(copy.deepcopy(model), conf)
    return time_steps(model, x, steps, warmup)


VARIANTS = (
    "plain eager",
    "plain compiled (per block)",
    "plain compiled (whole)",
    "library eager",
    "library compiled",
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="unet,crossformer")
    p.add_argument("--height", type=int, default=32)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    args = p.parse_args()
    print(
        f"step = forward+backward+AdamW, batch 1, 8 channels, {args.height}x{args.width}, "
        f"median of {args.steps} after {args.warmup} warm-up, {torch.get_num_threads()} threads"
    )
    for name in args.models.split(","):
        for variant in args.variants.split(","):
            # each variant in a fresh process (one gloo rank): no compile cache shared in memory
            first, median = run_on_ranks(
                _variant,
                1,
                name,
                args.height,
                args.width,
                variant,
                args.steps,
                args.warmup,
                timeout=3600,
            )[0]
            print(
                f"{name:12s} {variant:28s} first step {first:7.2f} s   step {median * 1e3:8.1f} ms"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
