"""Ensemble perturbation (forecast/ensemble.py): member 0 is the control, other members add
seeded noise of the given scale to the leading (prognostic) channels only, keyed by initial time
(not batch position), and the perturbed rows at 4 domain ranks (9 rows: 3/2/2/2) are bitwise the
rows of the one-process perturbation, for 4-D and 5-D (tuple) states."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.domain.rows import shard_range
from credit_parallel.forecast.ensemble import perturb
from credit_parallel.testing import run_on_ranks

__all__: list[str] = []

H, W = 9, 16


def _states():
    g = torch.Generator().manual_seed(3)
    flat = torch.randn(2, 6, H, W, generator=g)
    five = (torch.randn(2, 3, 2, H, W, generator=g), torch.randn(2, 4, H, W, generator=g))
    return flat, five


def _perturbed(manager=None, rows=slice(None)):
    flat, five = _states()
    out = []
    for member in (1, 2):
        out.append(
            perturb(flat[..., rows, :], member, 7, manager=manager, channels=4, init_times=[10, 11])
        )
        out.append(
            perturb(
                tuple(t[..., rows, :] for t in five),
                member,
                7,
                manager=manager,
                channels=(None, 2),
                scale=(torch.tensor([0.1, 0.2, 0.3]), 0.05),
                init_times=[10, 11],
            )
        )
    return out


def test_control_member_and_perturbed_channels():
    flat, five = _states()
    assert perturb(flat, 0, 7) is flat and perturb(five, 0, 7) is five
    one = perturb(flat, 1, 7, channels=4, scale=0.5)
    assert torch.equal(one[:, 4:], flat[:, 4:])  # forcing / static channels untouched
    noise = (one - flat)[:, :4]
    assert 0.45 < float(noise.std()) < 0.55 and abs(float(noise.mean())) < 0.05
    assert not torch.equal(perturb(flat, 2, 7, channels=4, scale=0.5), one)  # members differ
    assert not torch.equal(perturb(flat, 1, 8, channels=4, scale=0.5), one)  # seeds differ
    assert torch.equal(perturb(flat, 1, 7, channels=4, scale=0.5), one)  # reproducible
    # per-channel scales of a 5-D state
    upper, surface = perturb(
        five, 1, 7, channels=(None, 2), scale=(torch.tensor([0.1, 1.0, 10.0]), 0.0)
    )
    stds = (upper - five[0]).std(dim=(0, 2, 3, 4))
    assert 0.08 < float(stds[0]) < 0.12 and 8 < float(stds[2]) < 12
    assert torch.equal(surface, five[1])


def test_noise_follows_the_initial_time_not_the_batch_position():
    flat, _ = _states()
    a = perturb(flat, 1, 7, init_times=[10, 11])
    b = perturb(flat.flip(0), 1, 7, init_times=[11, 10])
    assert torch.equal(a, b.flip(0))
    with pytest.raises(ValueError, match="1 init_times for a batch of 2"):
        perturb(flat, 1, 7, init_times=[3])
    with pytest.raises(ValueError, match="channels 9 outside 0..6"):
        perturb(flat, 1, 7, channels=9)


def _domain_worker(rank, world):
    manager = DomainParallelManager(world, world)
    a, b = shard_range(H, world, rank)
    return _perturbed(manager, slice(a, b))


def test_perturbation_at_4_domain_ranks_is_bitwise_the_one_process_rows():
    whole = _perturbed()
    for rank, parts in enumerate(run_on_ranks(_domain_worker, 4)):
        a, b = shard_range(H, 4, rank)
        for got, want in zip(parts, whole):
            got, want = (
                (got,) if torch.is_tensor(got) else got,
                (want,) if torch.is_tensor(want) else want,
            )
            for g, w in zip(got, want):
                assert torch.equal(g, w[..., a:b, :])


class _Tiles2x2:
    """The attributes SPEC §3b gives a 2-D domain manager (latitude x longitude tiles, domain
    rank ``lat * Q + lon``), over the 4 ranks of the world: what ``perturb`` reads of one."""

    def __init__(self, rank):
        self.domain_rank, self.domain_world_size, self.domain_shape = rank, 4, (2, 2)
        self.domain_group, self.device = dist.group.WORLD, torch.device("cpu")


def _tile_worker(rank, world):
    lat, lon = divmod(rank, 2)
    (a, b), (c, d) = shard_range(H, 2, lat), shard_range(W - 1, 2, lon)  # 15 columns: 8 / 7
    flat, five = _states()
    tile = flat[..., a:b, c:d]
    return perturb(tile, 1, 7, manager=_Tiles2x2(rank), init_times=[10, 11])


def test_perturbation_on_2x2_latitude_longitude_tiles_is_bitwise_the_whole_field():
    flat, _ = _states()
    whole = perturb(flat[..., : W - 1], 1, 7, init_times=[10, 11])
    for rank, got in enumerate(run_on_ranks(_tile_worker, 4)):
        lat, lon = divmod(rank, 2)
        (a, b), (c, d) = shard_range(H, 2, lat), shard_range(W - 1, 2, lon)
        assert torch.equal(got, whole[..., a:b, c:d])
