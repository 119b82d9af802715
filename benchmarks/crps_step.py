"""The CRPS training step's cost at ensemble E = 1 and 2 against the deterministic step.

    PYTHONPATH=src .venv/bin/python benchmarks/crps_step.py [--members 4] [--steps 6]

The demo U-Net (8 channels, 33 x 64, float32) with Gaussian noise injected on its input
(``x + 0.05 * randn_like(x)``, drawn through the layout-independent draws under E > 1), one
sample per step, AdamW, on gloo CPU ranks:

- ``deterministic``: 1 rank, the latitude-weighted MSE of one forecast per sample;
- ``crps E=1``: 1 rank, the K members in its batch, KCRPS share (``train/crps.py``);
- ``crps E=2``: 2 ranks, ``{data: fsdp2, ensemble: 2}``, K/2 members each, the pairwise term
  through one ring shift.

Per variant: median step time (s) after one warm-up step, and the peak resident memory of a
rank (``ru_maxrss``, each rank a fresh forked process) above its level before the first step.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
from torch import nn

from credit_parallel.testing import run_on_ranks

MODEL = {
    "type": "unet", "in_channels": 8, "out_channels": 8, "image_height": 33, "image_width": 64,
    "base_channels": 16, "channel_mults": [1, 2, 2], "norm_groups": 4,
}  # fmt: skip


class _Noisy(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x + 0.05 * torch.randn_like(x))


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _worker(rank, world, variant, members, steps):
    from credit_parallel import parallelize
    from credit_parallel.models import build_model
    from credit_parallel.train.crps import EnsembleLoss, crps_share

    torch.manual_seed(0)
    model = _Noisy(build_model(dict(MODEL)))
    conf = {"trainer": {"parallelism": {"data": "none"}, "ensemble_size": members}}
    group, local = None, members
    if variant == "crps E=2":
        conf["trainer"]["parallelism"] = {"data": "fsdp2", "ensemble": 2}
        model = parallelize(model, conf)
        group, local = model._device_mesh["ensemble"].get_group(), members // 2
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(1, 8, 33, 64), torch.randn(1, 8, 33, 64)
    loss_kind = EnsembleLoss("KCRPS", members)
    before, times = _rss_mib(), []
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad()
        if variant == "deterministic":
            loss = ((model(x) - y) ** 2).mean()
        else:
            out = model(x.repeat_interleave(local, 0))
            loss = crps_share(out, y, loss_kind, group).mean()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]), _rss_mib() - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    print(f"demo U-Net 8 x 33 x 64, K = {args.members} members, float32, gloo CPU ranks")
    print(f"{'variant':<14} {'ranks':>5} {'step s':>8} {'vs det.':>8} {'peak MiB/rank':>14}")
    base = None
    for variant, world in (("deterministic", 1), ("crps E=1", 1), ("crps E=2", 2)):
        out = run_on_ranks(_worker, world, variant, args.members, args.steps, timeout=600)
        step = max(t for t, _ in out)
        mem = max(m for _, m in out)
        base = base or step
        print(f"{variant:<14} {world:>5} {step:>8.3f} {step / base:>8.2f} {mem:>14.1f}")


if __name__ == "__main__":
    main()
