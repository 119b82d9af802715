"""One-rank overhead at torch's level: plain loop vs torch FSDP2 (+ clip) vs the library's step.

    PYTHONPATH=src .venv/bin/python benchmarks/overhead.py [--model crossformer] [--size cpu]

One rank (gloo on the CPU; NCCL on a GPU when one is visible), the bundled model at the
given size (credit_parallel.tools.bench.overhead.SIZES); prints one line per variant with the
median step time and its ratio to torch's FSDP2 on the root + clip_grad_norm_.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from credit_parallel.layout.device import DEVICE_ENV, choose_device
from credit_parallel.testing import free_port
from credit_parallel.tools.bench.overhead import VARIANTS, measure_variants, model_conf


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="crossformer", choices=("crossformer", "unet"))
    ap.add_argument("--size", default=None, choices=("cpu", "gpu"), help="default: the device's")
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = choose_device(args.device, 1)
    os.environ[DEVICE_ENV] = device
    backend = "nccl" if device == "cuda" else "gloo"
    kwargs = {"device_id": torch.device("cuda", 0)} if device == "cuda" else {}
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, **kwargs
    )
    size = args.size or ("gpu" if device == "cuda" else "cpu")
    block = model_conf(args.model, size)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    figures = measure_variants(
        block,
        variants,
        device=torch.device(device),
        amp=device == "cuda",
        steps=args.steps,
        warmup=args.warmup,
        rounds=args.rounds,
        log=lambda s: print(s, file=sys.stderr, flush=True),
    )
    ref = {f.variant: f.ms for f in figures}.get("torch fsdp2 root")
    print(f"{args.model} {size} {block} on {device}, {args.threads} thread(s), 1 rank {backend}")
    for f in figures:
        ratio = f" ({f.ms / ref:.2f}x torch fsdp2 root)" if ref else ""
        peak = f", peak {f.peak_bytes / 2**30:.2f} GiB" if f.peak_bytes else ""
        print(f"  {f.variant:<20} {f.ms:9.1f} ms{ratio}{peak}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
