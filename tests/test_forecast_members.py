"""Forecast members of a stochastic model: each member's noise stream seeded by (seed, member,
initial time) and the same at every layout (forecast/stochastic.py).

A net drawing ``randn_like`` noise and a latent style in its forward rolled out 2 steps for 4
members: in one process (the 4 members in one batch), at domain 2 (uneven rows) and with the
members split over 2 ranks (2 each, as ``forecast`` spreads them over dp): every member's every
step is the same (float64, 1e-12); the members differ.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from credit_parallel.domain.convert import convert_to_domain_parallel
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.domain.random_draws import DrawLayout, install_layout_independent_draws
from credit_parallel.domain.sharding import gather_tensor, shard_tensor
from credit_parallel.forecast.rollout import rollout
from credit_parallel.forecast.stochastic import member_noise_steps
from credit_parallel.testing import run_on_ranks
from test_random_draws import _NoisyNet

MEMBERS, SEED, POSITION = 4, 7, 123


def _setup():
    torch.manual_seed(0)
    model = _NoisyNet().double()
    x = torch.randn(1, 2, 7, 6, dtype=torch.float64)
    return model, x


def _forecast(model, state, members, manager=None):
    steps = rollout(model, state, 2, manager=manager)
    steps = member_noise_steps(steps, model, SEED, members, POSITION, "cpu")
    return [out[0] for out in steps]


def _one_process():
    model, x = _setup()
    outs = _forecast(model, x.expand(MEMBERS, -1, -1, -1).contiguous(), range(MEMBERS))
    return torch.stack(outs)  # (step, member, C, H, W)


def _domain_rank(rank, world):
    model, x = _setup()
    manager = DomainParallelManager(world, world)
    model = convert_to_domain_parallel(model, manager)
    install_layout_independent_draws(model, DrawLayout(manager))
    state = shard_tensor(x.expand(MEMBERS, -1, -1, -1).contiguous(), -2, manager)
    outs = _forecast(model, state, range(MEMBERS), manager)
    return torch.stack([gather_tensor(o, -2, manager) for o in outs])


def _members_rank(rank, world):
    model, x = _setup()
    mine = range(2 * rank, 2 * rank + 2)
    torch.manual_seed(rank)  # the global generator differs per rank: the streams do not care
    out = torch.stack(_forecast(model, x.expand(2, -1, -1, -1).contiguous(), mine))
    parts = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(parts, out)
    return torch.cat(parts, dim=1)


def test_stochastic_members_are_the_same_at_every_layout():
    one = _one_process()
    assert (one[:, 0] - one[:, 1]).abs().max() > 1e-2  # the members differ
    for layout in (_domain_rank, _members_rank):
        for out in run_on_ranks(layout, 2):
            assert (out - one).abs().max() <= 1e-12, layout.__name__


def test_a_member_is_its_own_stream_whatever_batch_it_is_in():
    model, x = _setup()
    alone = torch.stack(_forecast(model, x.clone(), [2]))
    together = _one_process()[:, 2:3]
    assert (alone - together).abs().max() <= 1e-12
