"""Rank workers that several test files run through ``run_on_ranks`` (the configs they share
are in ``sample_conf.py``).

``run_on_ranks`` forks its ranks: the worker and its arguments reach each rank by fork, never
through pickle, so module-level functions here may take builders and converters (lambdas
included) as arguments; only the results travel back pickled.
"""

from __future__ import annotations

import torch

from credit_parallel.domain.convert import convert_to_domain_parallel
from credit_parallel.domain.exchange.traffic import record_exchange_stats
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.domain.rows import shard_range
from credit_parallel.testing import assert_parity, domain_parity_errors

__all__ = ["assert_parity_matrix", "exchange_stats_worker", "parity_matrix_worker", "wrap_with"]


def wrap_with(wrapper):
    """A ``convert`` for :func:`domain_parity_errors` that wraps the whole module in ``wrapper``
    (a domain layer class) instead of running the converter."""
    return lambda module, mgr: wrapper(module, manager=mgr)


def parity_matrix_worker(rank, world, cases, dtype):
    """``{name: domain_parity_errors(...)}`` on one domain group of all ``world`` ranks, in
    default dtype ``dtype``; ``cases`` are ``(name, build, global input shape, convert)`` (convert
    None: the converter), the i-th case's input drawn from seed i."""
    torch.set_default_dtype(dtype)
    mgr = DomainParallelManager(world, world)
    results = {}
    for i, (name, build, shape, convert) in enumerate(cases):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(i))
        results[name] = domain_parity_errors(build, x, mgr, convert=convert)
    return results


def assert_parity_matrix(results, dtype=torch.float64, min_cases=1):
    """:func:`parity_matrix_worker`'s per-rank results: identical on every rank, at least
    ``min_cases`` cases, every one within ``dtype``'s tolerance (all failures listed)."""
    assert len(results[0]) >= min_cases
    failures = []
    for rank, per_rank in enumerate(results):
        assert per_rank == results[0], "parity errors must be identical on every rank"
        for name, errors in per_rank.items():
            try:
                assert_parity(errors, dtype)
            except AssertionError as err:
                failures.append(f"rank {rank} {name}: {err}")
    assert not failures, "\n".join(failures)


def exchange_stats_worker(rank, world, build, shape, token):
    """(bytes sent, point-to-point calls) of one forward and backward of the converted
    ``build()`` (float64) on this rank's rows of a seeded global input of ``shape``."""
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    model = convert_to_domain_parallel(build(), mgr)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    a, b = shard_range(shape[2], world, rank)
    mgr.begin_forward((token, tuple(x.shape)))
    with record_exchange_stats() as stats:
        # a training step's input: no gradient, so no gradient exchange of it (issue 39)
        model(x[:, :, a:b].clone()).square().sum().backward()
    return stats.bytes_sent, stats.p2p_calls
