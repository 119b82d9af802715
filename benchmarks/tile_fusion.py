"""Exchange fusion on lat x lon tiles: one forward + backward per rank, fused (the converter's
default) against ``fuse_exchanges=False``, on gloo ranks (CPU): the batched P2P calls and the
small collectives (GroupNorm statistics) of the busiest rank, their sum (the synchronisation
points), the P2P messages of the busiest rank and the halo bytes of all ranks.

    PYTHONPATH=src .venv/bin/python benchmarks/tile_fusion.py --shapes 1x2,2x2,3x2,2x3

Models: a stack of 3x3 convs with pads and norms (3 pad + conv pairs, 3 norm + conv links),
the bundled U-Net (base 4 channels), CREDIT-style CrossEmbed (3 sibling convs) then a linked
norm.  A linked norm's statistics go as P2P messages to every other rank of the P x Q group
(counted here) instead of a forward all-gather and a backward all-reduce (collectives: not
counted as messages).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from credit_parallel.domain.convert import convert_to_domain_parallel
from credit_parallel.domain.exchange.traffic import record_exchange_stats
from credit_parallel.domain.manager import TiledDomainManager
from credit_parallel.domain.sharding import shard_tensor
from credit_parallel.layout.small_collectives import record_small_collectives
from credit_parallel.models import PeriodicConv2d, UNet
from credit_parallel.models.crossformer import CrossScaleEmbedding
from credit_parallel.testing import run_on_ranks


def _stack() -> nn.Module:
    return nn.Sequential(
        nn.ZeroPad2d((1, 2, 2, 1)), nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.SiLU(),
        nn.Conv2d(4, 4, 3, padding=1), nn.CircularPad2d(1),
        nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular"), nn.GroupNorm(2, 4),
        nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular"), nn.GroupNorm(1, 4), nn.ReLU(),
        PeriodicConv2d(4, 4, 3, padding=1), nn.ReflectionPad2d(1), nn.Conv2d(4, 3, 3),
        nn.Softmax(dim=1), PeriodicConv2d(3, 2, 3, padding=1),
    )  # fmt: skip


def _cross() -> nn.Module:
    return nn.Sequential(
        CrossScaleEmbedding(2, 8, kernel_sizes=(2, 4, 8), stride=2),
        nn.GroupNorm(2, 8), nn.SiLU(), nn.Conv2d(8, 2, 3, padding=1),
    )  # fmt: skip


def _models(hw) -> dict:
    out = {"stack": _stack, "unet": lambda: UNet(2, 2, *hw, base_channels=4)}
    if hw[0] % 2 == 0 and hw[1] % 2 == 0:
        out["cross"] = _cross
    return out


def _worker(rank, world, shape, hw):
    torch.set_default_dtype(torch.float64)
    m = TiledDomainManager(world, shape)
    x = shard_tensor(torch.randn(1, 2, *hw, generator=torch.Generator().manual_seed(0)), 2, m)
    out = {}
    for name, build in _models(hw).items():
        for fuse in (True, False):
            torch.manual_seed(0)
            model = convert_to_domain_parallel(build(), m, fuse_exchanges=fuse)
            model(x)  # learns the global sizes
            with record_exchange_stats() as stats, record_small_collectives() as small:
                model(x.clone().requires_grad_()).square().sum().backward()
            out[name, fuse] = (
                stats.p2p_calls,
                sum(small.values()),
                stats.messages,
                stats.bytes_sent,
            )
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="1x2,2x2,3x2,2x3")
    parser.add_argument("--hw", default="18x22", help="global H x W (even: CrossEmbed too)")
    args = parser.parse_args(argv)
    hw = tuple(int(v) for v in args.hw.split("x"))
    for text in args.shapes.split(","):
        shape = tuple(int(v) for v in text.split("x"))
        results = run_on_ranks(_worker, shape[0] * shape[1], shape, hw, timeout=600)
        for name in _models(hw):
            cells = []
            for fuse in (False, True):
                per = [r[name, fuse] for r in results]
                calls, small = max(p[0] for p in per), max(p[1] for p in per)
                messages, halo = max(p[2] for p in per), sum(p[3] for p in per)
                cells.append(
                    f"p2p {calls:3d} + coll {small:2d} = {calls + small:3d} syncs, "
                    f"{messages:3d} msgs, halo {halo} B"
                )
            print(f"{text} {args.hw} {name:5s} unfused: {cells[0]} | fused: {cells[1]}")


if __name__ == "__main__":
    main()
