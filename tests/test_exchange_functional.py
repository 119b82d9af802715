"""The exchange as one functional collective (``domain/exchange/functional.py``): selected with
``exchange_path("all_to_all")``, pads, window-path convs, transposed convs and halo chains give
the single process's forward and every gradient in float64 at 2 and 3 ranks (uneven rows, a
rank without rows), with no point-to-point call left."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from credit_parallel.domain.convert import convert_to_domain_parallel
from credit_parallel.domain.exchange.functional import exchange_path, set_exchange_path
from credit_parallel.domain.exchange.traffic import record_exchange_stats
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.testing import assert_parity, domain_parity_errors, run_on_ranks


def _build():
    return nn.Sequential(
        nn.ReflectionPad2d((1, 1, 1, 1)), nn.Conv2d(2, 4, 3), nn.SiLU(),
        nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular"), nn.GroupNorm(2, 4),
        nn.ConvTranspose2d(4, 3, 4, stride=2, padding=1), nn.Conv2d(3, 3, 5, padding=2),
        nn.Conv2d(3, 2, 3, padding=1),
    )  # fmt: skip


def _convert(model, mgr):
    model = convert_to_domain_parallel(model, mgr, fuse_exchanges=False, halo_chains=2)
    for layer in model.modules():
        if hasattr(layer, "geometry"):
            layer.configure(split_halo=False)  # the window path: exchange_planned
    return model


def _worker(rank, world, height):
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    x = torch.randn(2, 2, height, 7, generator=torch.Generator().manual_seed(height))
    out = {}
    for path in ("all_to_all", "p2p"):
        with exchange_path(path), record_exchange_stats() as stats:
            errors = domain_parity_errors(_build, x, mgr, convert=_convert)
        assert_parity(errors)
        out[path] = stats.p2p_calls
    return out


@pytest.mark.parametrize("world, height", [(2, 9), (3, 2)])
def test_all_to_all_exchange_is_exact_and_replaces_every_p2p_call(world, height):
    for per_rank in run_on_ranks(_worker, world, height):
        assert per_rank["all_to_all"] == 0
        if height > world:
            assert per_rank["p2p"] > 0


def test_exchange_path_is_checked_and_restored():
    with pytest.raises(ValueError, match="all_to_all"):
        set_exchange_path("nccl")
    with exchange_path("all_to_all"):
        assert set_exchange_path("all_to_all") == "all_to_all"
    assert set_exchange_path("p2p") == "p2p"


def _compiled_worker(rank, world):
    from torch._dynamo.utils import counters

    from credit_parallel.domain.sharding import shard_tensor

    counters.clear()  # a forked rank inherits the parent's counts of earlier tests
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.ReflectionPad2d((1, 1, 1, 1)), nn.Conv2d(2, 2, 3))
    model = convert_to_domain_parallel(model, mgr, fuse_exchanges=False)
    xs = shard_tensor(torch.randn(1, 2, 9, 6), -2, mgr).requires_grad_()
    out = []
    with exchange_path("all_to_all"):
        for run in (model, torch.compile(model, backend="aot_eager", fullgraph=True)):
            xs.grad = None
            y = run(xs)
            y.square().sum().backward()
            out.append((y.detach(), xs.grad.clone()))
    (y0, g0), (y1, g1) = out
    return (
        float((y1 - y0).abs().max()),
        float((g1 - g0).abs().max()),
        sum(counters["graph_break"].values()),
    )


def test_all_to_all_exchange_compiles_to_one_graph_as_eager():
    """The functional collective is traced (``fullgraph=True``: no graph break) and the compiled
    forward and input gradient equal the eager ones."""
    for fwd, grad, breaks in run_on_ranks(_compiled_worker, 2, timeout=600):
        assert fwd <= 1e-12 and grad <= 1e-12 and breaks == 0
