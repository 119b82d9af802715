"""GroupNorm statistics with the next conv's halo exchange (``domain/layers/norm_halo.py``): the
converter links [GroupNorm, activation, conv] in a Sequential (or declared by a block, the
bundled U-Net's residual block); results (forward, input and
every parameter gradient) equal the single process in float64 at domains 2 and 3 with uneven
rows, and the step issues one batched P2P call per direction for norm + conv where the unfused
layers issue two (and no statistics collective at all)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from credit_parallel.domain.convert import convert_to_domain_parallel, plan_conversion
from credit_parallel.domain.exchange.traffic import record_exchange_stats
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.layout.small_collectives import record_small_collectives
from credit_parallel.models.unet import UNetResBlock
from credit_parallel.testing import assert_parity, domain_parity_errors, run_on_ranks


def _cases():
    return [
        # (name, build, height, linked pairs expected)
        ("conv_gn_silu_conv", lambda: nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.SiLU(), nn.Conv2d(8, 4, 3, padding=1),
        ), 11, 1),
        ("gn_conv_k5_no_act", lambda: nn.Sequential(
            nn.GroupNorm(2, 4), nn.Conv2d(4, 4, 5, padding=2), nn.GroupNorm(2, 4, affine=False),
            nn.GELU(), nn.Conv2d(4, 2, 3, stride=2, padding=1),
        ), 13, 2),
        ("circular_conv_after_gn", lambda: nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(),
            nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular"),
        ), 10, 1),
        # 2 rows over 3 ranks: a rank without rows still takes part (count 0)
        ("rank_without_rows", lambda: nn.Sequential(
            nn.GroupNorm(2, 4), nn.SiLU(), nn.Conv2d(4, 4, 3, padding=1),
        ), 2, 1),
        # declared by the block (_domain_norm_act_conv): both norms linked, periodic convs
        ("unet_res_block", lambda: UNetResBlock(4, 8, 2), 11, 2),
        # the activation is not elementwise-known: not linked
        ("softmax_between", lambda: nn.Sequential(
            nn.GroupNorm(2, 4), nn.Softmax(dim=1), nn.Conv2d(4, 4, 3, padding=1),
        ), 9, 0),
    ]  # fmt: skip


def _fused(model, mgr):
    return convert_to_domain_parallel(model, mgr)


def _unfused(model, mgr):
    return convert_to_domain_parallel(model, mgr, fuse_exchanges=False)


def _worker(rank, world):
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    out = {}
    for i, (name, build, h, _) in enumerate(_cases()):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(2, _in_channels(build), h, 6, generator=g)
        calls = {}
        for label, convert in (("fused", _fused), ("unfused", _unfused)):
            with record_exchange_stats() as stats, record_small_collectives() as small:
                errors = domain_parity_errors(build, x, mgr, convert=convert)
                errors_again = domain_parity_errors(build, x, mgr, convert=convert)
            assert_parity(errors)
            assert_parity(errors_again)
            calls[label] = (stats.p2p_calls, sum(small.values()))
        out[name] = calls
    return out


def _in_channels(build) -> int:
    model = build()
    if isinstance(model, UNetResBlock):
        return model.norm1.num_channels
    first = model[0]
    return first.num_channels if isinstance(first, nn.GroupNorm) else first.in_channels


@pytest.mark.parametrize("world", [2, 3])
def test_norm_statistics_travel_with_the_conv_exchange_exactly(world):
    results = run_on_ranks(_worker, world)
    for name, _, _, linked in _cases():
        for rank, per_rank in enumerate(results):
            (fused_p2p, fused_small), (unfused_p2p, unfused_small) = (
                per_rank[name]["fused"],
                per_rank[name]["unfused"],
            )
            # each linked norm: its forward all-gather and backward all-reduce (two parity runs,
            # each a forward + backward) are gone; the conv's P2P calls are the norm's now
            assert unfused_small - fused_small == 2 * 2 * linked, (name, rank)
            # (a rank without rows moves no halo row but still sends its statistics)
            assert fused_p2p == (unfused_p2p or 2 * 2 * linked), (name, rank)


def test_plan_names_the_linked_norm_and_conv():
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.GroupNorm(4, 8),
        nn.SiLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.GroupNorm(4, 8),
        nn.Softmax(dim=1),
        nn.Conv2d(8, 8, 3, padding=1),
    )
    plan = plan_conversion(model, None)  # decisions only
    assert [(f.norm_path, f.conv_path) for f in plan.norm_conv] == [("1", "3")]
    assert "norm 1 statistics with the exchange of conv 3" in str(plan)
