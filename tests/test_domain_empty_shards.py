"""Levels with fewer rows than domain ranks (SPEC §3): the last ranks own no row, still take part
in every exchange and collective, and forward and every gradient equal the single process.

At 4 ranks: each layer family on a 3-row input (rank 3 empty) and on inputs whose OUTPUT has
fewer rows than ranks; a U-Net-like stack whose deepest level has 2 rows over 4 ranks; and the
argument checks of ``shard_tensor`` / ``gather_tensor``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from credit_parallel.domain.convert import convert_to_domain_parallel
from credit_parallel.domain.exchange.halo import HaloExchange
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.domain.rows import plan_exchange, shard_range, shard_sizes
from credit_parallel.domain.sharding import gather_tensor, shard_tensor
from credit_parallel.models import PeriodicConv2d
from credit_parallel.testing import assert_parity, domain_parity_errors, run_on_ranks

WORLD = 4


def _layer_cases():
    """(name, build, global input shape): inputs or outputs with fewer rows than 4 ranks."""
    return [
        ("conv_k3p1_h3", lambda: nn.Conv2d(2, 3, 3, padding=1), (2, 2, 3, 5)),
        ("conv_k3s2p1_h5_to_3", lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1), (2, 2, 5, 5)),
        (
            "conv_k5p2_reflect_h3",
            lambda: nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"),
            (1, 2, 3, 4),
        ),
        ("conv3d_k3p1_h3", lambda: nn.Conv3d(2, 2, 3, padding=1), (1, 2, 3, 3, 4)),
        ("periodic_k3_h3", lambda: PeriodicConv2d(2, 3, 3, padding=1), (2, 2, 3, 6)),
        (
            "convT_k4s2p1_h3_to_6",
            lambda: nn.ConvTranspose2d(2, 3, 4, stride=2, padding=1),
            (2, 2, 3, 4),
        ),
        (
            "convT_k1s3_h2_to_4",
            lambda: nn.ConvTranspose2d(2, 2, 1, stride=3, padding=1),
            (1, 2, 2, 3),
        ),
        ("groupnorm_h3", lambda: nn.GroupNorm(2, 4), (2, 4, 3, 5)),
        (
            "upsample_nearest_h3_to_6",
            lambda: nn.Upsample(scale_factor=2, mode="nearest"),
            (1, 2, 3, 4),
        ),
        (
            "upsample_bilinear_h2_to_5",
            lambda: nn.Upsample(size=(5, 4), mode="bilinear"),
            (1, 2, 2, 4),
        ),
        (
            "downsample_bilinear_h9_to_3",
            lambda: nn.Upsample(size=(3, 3), mode="bilinear"),
            (1, 2, 9, 6),
        ),
        ("pad_reflect_h3_to_5", lambda: nn.ReflectionPad2d((1, 1, 1, 1)), (1, 2, 3, 4)),
        ("pad_zero_h2_to_3", lambda: nn.ZeroPad2d((0, 0, 1, 0)), (1, 2, 2, 4)),
        ("crop_h8_to_1", lambda: nn.ZeroPad2d((0, 0, -4, -3)), (1, 2, 8, 4)),
        ("pixel_shuffle_h2_to_4", lambda: nn.PixelShuffle(2), (1, 8, 2, 3)),
        ("pixel_unshuffle_h6_to_3", lambda: nn.PixelUnshuffle(2), (1, 2, 6, 4)),
    ]


def _layers_worker(rank, world):
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    out = {}
    for i, (name, build, shape) in enumerate(_layer_cases()):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(i))
        dim = 3 if len(shape) == 5 else -2
        convert = None
        if len(shape) == 5:
            from credit_parallel.domain.layers.conv import DomainParallelConv3d

            convert = lambda m, mgr: DomainParallelConv3d(m, manager=mgr)  # noqa: E731
        out[name] = domain_parity_errors(build, x, mgr, convert=convert, shard_dim=dim)
    return out


def test_every_layer_family_with_fewer_rows_than_4_ranks_matches_single_process():
    results = run_on_ranks(_layers_worker, WORLD)
    assert len(results[0]) == len(_layer_cases())
    for rank, per_rank in enumerate(results):
        for name, errors in per_rank.items():
            assert errors == results[0][name], (rank, name)
            try:
                assert_parity(errors)
            except AssertionError as err:
                raise AssertionError(f"{name}: {err}") from None


class _TinyUNet(nn.Module):
    """13 -> 7 -> 4 -> 2 rows (the deepest level has fewer rows than 4 ranks) and back, with
    skip concatenations, GroupNorm, nearest upsampling and a transposed conv."""

    def __init__(self):
        super().__init__()
        c = 4
        self.inc = nn.Sequential(nn.Conv2d(2, c, 3, padding=1), nn.GroupNorm(2, c), nn.SiLU())
        self.down = nn.ModuleList(nn.Conv2d(c, c, 3, stride=(2, 1), padding=1) for _ in range(3))
        self.mid = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(1, c), nn.SiLU())
        self.up1 = nn.ConvTranspose2d(c, c, 3, stride=(2, 1), padding=1)  # 2 -> 3
        self.up = nn.Upsample(size=(4, 6), mode="nearest")
        self.fuse = nn.ModuleList(nn.Conv2d(2 * c, c, 3, padding=1) for _ in range(3))
        self.up2 = nn.Upsample(size=(7, 6), mode="bilinear")
        self.up3 = nn.Upsample(size=(13, 6), mode="bilinear")
        self.out = nn.Conv2d(c, 2, 1)

    def forward(self, x):
        h0 = self.inc(x)  # 13
        h1 = self.down[0](h0)  # 7
        h2 = self.down[1](h1)  # 4
        h3 = self.mid(self.down[2](h2))  # 2
        u = self.up(self.up1(h3))  # 3 -> 4
        u = self.fuse[0](torch.cat([u, h2], 1))
        u = self.fuse[1](torch.cat([self.up2(u), h1], 1))
        u = self.fuse[2](torch.cat([self.up3(u), h0], 1))
        return self.out(u)


def _unet_worker(rank, world):
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    x = torch.randn(2, 2, 13, 6, generator=torch.Generator().manual_seed(0))
    return domain_parity_errors(_TinyUNet, x, mgr)


def test_unet_like_stack_whose_deep_level_has_2_rows_over_4_ranks_matches_single_process():
    results = run_on_ranks(_unet_worker, WORLD)
    for errors in results:
        assert errors == results[0]
        assert_parity(errors)
    assert any(k.startswith("param:down.2") for k in results[0])


def _halo_worker(rank, world):
    mgr = DomainParallelManager(world, world)
    x = torch.arange(2 * 3 * 2, dtype=torch.float64).view(2, 3, 2)
    a, b = shard_range(3, world, rank)
    xl = x[:, a:b].clone().requires_grad_()
    mgr.begin_forward(("halo-empty", 3))
    y = HaloExchange(1, dim=1, manager=mgr)(xl)
    y.sum().backward()
    return y.detach(), xl.grad


def test_halo_exchange_on_3_rows_over_4_ranks_serves_the_empty_rank_its_neighbours_rows():
    results = run_on_ranks(_halo_worker, WORLD)
    x = torch.arange(2 * 3 * 2, dtype=torch.float64).view(2, 3, 2)
    padded = torch.cat([torch.zeros(2, 1, 2), x, torch.zeros(2, 1, 2)], 1)
    for rank, (y, _) in enumerate(results):
        a, b = shard_range(3, WORLD, rank)
        assert torch.equal(y, padded[:, a : b + 2])
    # rank 3 (empty) reads row 2 of rank 2 as its halo: row 2's gradient counts it
    grads = torch.cat([g for _, g in results], 1)
    assert grads[0, :, 0].tolist() == [2.0, 3.0, 3.0]


def test_exchange_plan_of_3_rows_over_4_ranks_has_an_empty_last_shard():
    assert shard_sizes(3, 4) == (1, 1, 1, 0)
    windows = ((0, 1), (0, 1, 2), (1, 2), (2,))
    plans = plan_exchange(3, 4, windows)
    assert plans[3].recvs == ((2, 1),) and plans[3].sends == ()
    assert plans[2].sends == ((1, ((0, 1),)), (3, ((0, 1),)))


def _dims_worker(rank, world):
    mgr = DomainParallelManager(world, world)
    x = torch.zeros(2, 3, 4)
    messages = []
    for fn in (shard_tensor, gather_tensor):
        for dim in (3, -4, 7):
            try:
                fn(x, dim, mgr)
                messages.append(None)
            except ValueError as err:
                messages.append(str(err))
    return messages


@pytest.mark.parametrize("world", [1, 2])
def test_shard_and_gather_reject_a_dim_outside_the_tensor(world):
    for messages in run_on_ranks(_dims_worker, world):
        assert all(m is not None and "is not a dimension of a 3-D tensor" in m for m in messages)


def test_shard_tensor_without_manager_still_checks_the_dim():
    with pytest.raises(ValueError, match="dim 2 is not a dimension of a 2-D tensor"):
        shard_tensor(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="dim -3"):
        gather_tensor(torch.zeros(2, 2), -3)


class _PointwiseAtTheDeepLevel(nn.Module):
    """4 -> 2 rows, then what the converter leaves alone (row-local: miles-credit's CrossFormer
    FeedForward, a LayerNorm over channels and two 1x1 convs; a (1, 3) conv along W with
    circular padding), then back to 4 rows: at 3 ranks rank 2 owns 0 of the 2 deep rows."""

    def __init__(self):
        super().__init__()
        from miles_credit import import_credit

        credit = import_credit("credit.models.crossformer")
        c = 4
        self.down = nn.Conv2d(2, c, 3, stride=2, padding=1)
        self.ff = credit.FeedForward(c, mult=2)
        self.along_w = nn.Conv2d(c, c, (1, 3), padding=(0, 1), padding_mode="circular")
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.out = nn.Conv2d(c, 2, 1)

    def forward(self, x):
        h = self.down(x)
        h = self.ff(h) + h
        return self.out(self.up(self.along_w(h)))


def _pointwise_worker(rank, world):
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    x = torch.randn(2, 2, 4, 6, generator=torch.Generator().manual_seed(0))
    errors = domain_parity_errors(_PointwiseAtTheDeepLevel, x, mgr)
    model = convert_to_domain_parallel(_PointwiseAtTheDeepLevel(), mgr)
    left_alone = [type(m) is nn.Conv2d for m in (model.ff.layers[1], model.ff.layers[4])]
    x5 = torch.randn(1, 2, 2, 3, 4, generator=torch.Generator().manual_seed(1))
    errors3d = domain_parity_errors(lambda: nn.Conv3d(2, 3, 1), x5, mgr, shard_dim=-2)
    return errors, errors3d, left_alone, shard_range(2, world, rank)


def test_pointwise_convs_on_a_rank_with_0_rows_of_a_level_match_single_process():
    """The gen-2 CrossFormer example at H=32 and domain 3: its deepest stage has 2 rows, and
    the FeedForward's 1x1 convs (left alone: row-local) crashed inside torch on rank 2's
    (B, C, 0, W) input while ranks 0 and 1 waited in the next collective."""
    results = run_on_ranks(_pointwise_worker, 3)
    assert [r[3] for r in results] == [(0, 1), (1, 2), (2, 2)]  # rank 2: no deep row
    for errors, errors3d, left_alone, _ in results:
        assert errors == results[0][0] and errors3d == results[0][1]
        assert left_alone == [True, True]
        assert_parity(errors)
        assert_parity(errors3d)
    assert {"param:ff.layers.0.g", "param:ff.layers.1.weight", "param:along_w.weight"} <= set(
        results[0][0]
    )
