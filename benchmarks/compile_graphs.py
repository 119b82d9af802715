"""Graphs, graph breaks and first-step CPU time of each compile variant under ``{data: fsdp2}``.

On ``--world`` gloo ranks (1: the one-rank shard group, where the library applies no
``fully_shard`` unless ``--single-rank`` keeps FSDP2 there, SPEC §4), a U-Net with three
resolution levels, bf16 (``trainer.amp``), three forward + backward steps per variant; rank 0
prints after each step dynamo's counters (``unique_graphs``, graph breaks) and the step's CPU
time (``time.process_time``: the compile itself with ``--backend aot_eager``; not inflated by a
loaded machine).  ``TORCH_LOGS=recompiles`` shows why a frame recompiles.

    PYTHONPATH=src .venv/bin/python benchmarks/compile_graphs.py --world 1
    PYTHONPATH=src .venv/bin/python benchmarks/compile_graphs.py --world 1 --single-rank
"""

from __future__ import annotations

import argparse
import time

import torch

from credit_parallel import parallelize
from credit_parallel.models.unet import UNet
from credit_parallel.testing import run_on_ranks

VARIANTS = ("compile(parallelize)", "parallelize(compile)", "trainer.compile")


def _run(rank, world, variant, single_rank, backend):
    from torch._dynamo.utils import counters

    from credit_parallel.parallel import compile as compile_mod

    compile_mod.compile_blocks.__kwdefaults__["backend"] = backend  # trainer.compile's
    torch.manual_seed(0)
    model = UNet(8, 8, 33, 64, base_channels=8, channel_mults=(1, 2, 2), norm_groups=4)
    trainer = {"parallelism": {"data": "fsdp2", "tensor": 1, "domain": 1}, "amp": True}
    trainer.update(fsdp2_single_rank=single_rank, compile=variant == "trainer.compile")
    conf = {"trainer": trainer}
    if variant == "compile(parallelize)":
        model = torch.compile(parallelize(model, conf), backend=backend)
    elif variant == "parallelize(compile)":
        model = parallelize(torch.compile(model, backend=backend), conf)
    else:
        model = parallelize(model, conf)
    x = torch.randn(1, 8, 33, 64)
    rows = []
    for step in range(3):
        c0 = time.process_time()
        model(x).float().square().mean().backward()
        rows.append(
            (step + 1, counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()),
             time.process_time() - c0)
        )  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--single-rank", action="store_true", help="trainer.fsdp2_single_rank: true")
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    for variant in args.variants.split(","):
        rows = run_on_ranks(
            _run, args.world, variant, args.single_rank, args.backend, timeout=3000
        )[0]
        for step, graphs, breaks, cpu in rows:
            print(f"{variant:22s} world {args.world} single_rank {args.single_rank!s:5s} step "
                  f"{step}: graphs {graphs:3d}  breaks {breaks:3d}  CPU {cpu:6.1f} s", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
