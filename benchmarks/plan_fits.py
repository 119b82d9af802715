"""The smallest latitude domain whose training step and forecast step fit an 80 GB GPU, for the
CREDIT CrossFormer and the bundled U-Net at 0.25 and 0.1 degrees (the planner's memory model,
``credit_parallel.planner.inference.layout_fits``; what ``credit-parallel plan`` prints for one
config).

Models: the bundled ``era5_025deg_unet.yaml`` U-Net (71 channels, base 128, mults 1/2/2/4) at
721 x 1440 and 1801 x 3600; the CrossFormer in CREDIT's 0.25-degree WXFormer layout
(``projection.CROSSFORMER_025``: dims 128/256/512/1024, depths 2/2/8/2) at 640 x 1280 and at
1600 x 3200 (the 0.1-degree grid cut to what its strides 4/2/2/2 and windows 10/10/10/5 divide).
Every run: batch 1 per rank, bf16 amp, tensor 1, no data parallelism (``--data``).  The planner
counts every activation autograd saves (it does not model ``trainer.activation_checkpoint``), so
the training figures are those without activation checkpointing, an upper bound with it.

    PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/plan_fits.py --world-size 64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["main"]

GRIDS = {
    "unet": {"0.25": (721, 1440), "0.1": (1801, 3600)},
    "crossformer": {"0.25": (640, 1280), "0.1": (1600, 3200)},
}


def _conf(name: str, grid, args) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    from projection import CROSSFORMER_025, _model_conf

    model = dict(CROSSFORMER_025) if name == "crossformer" else _model_conf("unet")["model"]
    model.update(image_height=grid[0], image_width=grid[1])
    trainer = {
        "batch_size": 1,
        "amp": True,
        "parallelism": {"data": args.data, "tensor": 1, "domain": 1},
    }
    return {"model": model, "trainer": trainer}


def main(argv=None) -> int:
    from credit_parallel.planner.inference import layout_fits

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=64)
    ap.add_argument("--data", default="none")
    ap.add_argument("--models", nargs="+", default=["unet", "crossformer"])
    args = ap.parse_args(argv)
    gib = 2**30
    print("model | grid | training: domain (GiB/rank) | forecast: domain (GiB/rank) | domain 1: "
          "training / forecast GiB")  # fmt: skip
    for name in args.models:
        for degrees, grid in GRIDS[name].items():
            fits = layout_fits(_conf(name, grid, args), args.world_size)

            def shown(found):
                return "none fits" if found is None else f"{found[0]} ({found[1] / gib:.1f})"

            first = fits["candidates"][0] if fits["candidates"] else None
            one = f"{first[1] / gib:.1f} / {first[2] / gib:.1f}" if first and first[0] == 1 else "-"
            print(
                f"{name} {degrees} | {grid[0]} x {grid[1]} | {shown(fits['training'])} | "
                f"{shown(fits['forecast'])} | {one}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
