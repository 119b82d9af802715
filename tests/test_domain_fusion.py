"""Exchange fusion by the converter (``domain/fusion.py``): a padding layer and the conv after it
exchange once (composed windows), sibling convolutions on one input (CrossEmbed) exchange once;
results equal the single process, with fewer P2P calls than the unfused layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from credit_parallel.domain.convert import convert_to_domain_parallel
from credit_parallel.domain.exchange.traffic import record_exchange_stats
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.models.crossformer import CrossScaleEmbedding
from credit_parallel.testing import assert_parity, domain_parity_errors, run_on_ranks
from helpers import exchange_stats_worker


def _pad_conv_cases():
    return [
        ("zero_pad_t2b1_then_valid_k3", lambda: nn.Sequential(nn.ZeroPad2d((1, 1, 2, 1)), nn.Conv2d(2, 3, 3)), True),
        ("reflect_pad1_then_valid_k3", lambda: nn.Sequential(nn.ReflectionPad2d(1), nn.Conv2d(2, 3, 3)), True),
        ("replicate_pad2_then_k3s2", lambda: nn.Sequential(nn.ReplicationPad2d(2), nn.Conv2d(2, 2, 3, stride=2)), True),
        ("circular_pad1_then_k3p1", lambda: nn.Sequential(nn.CircularPad2d(1), nn.Conv2d(2, 2, 3, padding=1)), True),
        ("constant_half_then_valid_k3", lambda: nn.Sequential(nn.ConstantPad2d((0, 0, 1, 1), 0.5), nn.Conv2d(2, 2, 3)), True),
        # a non-zero pad value and the conv's own zero rows: two fill values, not fused
        ("constant_half_then_k3p1", lambda: nn.Sequential(nn.ConstantPad2d((0, 0, 1, 1), 0.5), nn.Conv2d(2, 2, 3, padding=1)), False),
    ]  # fmt: skip


def _unfused(model, mgr):
    return convert_to_domain_parallel(model, mgr, fuse_exchanges=False)


def _fused(model, mgr):
    return convert_to_domain_parallel(model, mgr)


def _pad_conv_worker(rank, world):
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    out = {}
    for i, (name, build, _) in enumerate(_pad_conv_cases()):
        x = torch.randn(2, 2, 11, 7, generator=torch.Generator().manual_seed(i))
        calls = {}
        for label, convert in (("fused", _fused), ("unfused", _unfused)):
            with record_exchange_stats() as stats:
                errors = domain_parity_errors(build, x, mgr, convert=convert)
            assert_parity(errors)
            calls[label] = stats.p2p_calls
        fused_flag = _fused(build(), mgr)[1].fused_pad is not None
        out[name] = (calls["fused"], calls["unfused"], fused_flag)
    return out


@pytest.mark.parametrize("world", [1, 3])
def test_pad_then_conv_is_one_exchange_and_matches_single_process(world):
    results = run_on_ranks(_pad_conv_worker, world)
    saved = 0
    for name, _, expect_fused in _pad_conv_cases():
        per_rank = [r[name] for r in results]
        assert all(flag == expect_fused for _, _, flag in per_rank), name
        fused_calls = sum(f for f, _, _ in per_rank)
        unfused_calls = sum(u for _, u, _ in per_rank)
        if expect_fused:
            # at most one exchange each way per rank (two when the pad itself moves rows)
            assert all(f <= 2 for f, _, _ in per_rank) and fused_calls <= unfused_calls, name
            saved += unfused_calls - fused_calls
        else:
            assert fused_calls == unfused_calls, name
    assert saved >= (6 if world > 1 else 0)


class _Stack(nn.Module):
    """Same-shaped convs in a ModuleList applied one after the other (not siblings)."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(3, 3, k, padding=k // 2) for k in (3, 5, 3))

    def forward(self, x):
        for conv in self.convs:
            x = torch.tanh(conv(x))
        return x


def _sibling_worker(rank, world):
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    out = {}
    cases = (
        ("cross_embed_k2_4_6_s2", lambda: CrossScaleEmbedding(3, 8, (2, 4, 6), 2), 16),
        ("stack_in_a_modulelist", _Stack, 13),
    )
    for name, build, h in cases:
        x = torch.randn(2, 3, h, 8, generator=torch.Generator().manual_seed(h))
        calls = {}
        for label, convert in (("fused", _fused), ("unfused", _unfused)):
            with record_exchange_stats() as stats:
                errors = domain_parity_errors(build, x, mgr, convert=convert)
                errors_again = domain_parity_errors(build, x, mgr, convert=convert)
            assert_parity(errors)
            assert_parity(errors_again)
            calls[label] = stats.p2p_calls
        out[name] = calls
    return out


def test_sibling_convs_share_one_exchange_and_a_stack_stops_sharing():
    for per_rank in run_on_ranks(_sibling_worker, 3):
        embed = per_rank["cross_embed_k2_4_6_s2"]
        assert embed["fused"] == 4 and embed["unfused"] > embed["fused"], embed
        stack = per_rank["stack_in_a_modulelist"]
        # the first call of a fresh model finds out it is a stack; then exchanges as unfused
        assert stack["fused"] == stack["unfused"], stack


# --------------------------------------------------------------------------- the planner
def _plan_model():
    return nn.Sequential(
        nn.ReflectionPad2d((1, 1, 2, 1)),
        nn.Conv2d(3, 3, 3),
        CrossScaleEmbedding(3, 8, (2, 4, 6), 2),
        nn.ZeroPad2d((0, 0, 1, 1)),
        nn.Conv2d(8, 2, 3, padding=(0, 1)),
    ).double()


def test_planner_predicts_the_fused_exchanges_of_a_real_step():
    from credit_parallel.planner import make_plan, predicted_collectives, predicted_halo_bytes

    world = 3
    conf = {"trainer": {"parallelism": {"data": "none", "tensor": 1, "domain": world}}}
    plan = make_plan(conf, world, model=_plan_model(), input_shapes=[(3, 19, 8)])
    assert plan.violations == []
    # the fused pads and two of the three sibling convs move no rows of their own
    silent = [layer.path for layer in plan.layers if not layer.exchanges]
    assert {"0", "3", "2.convs.1", "2.convs.2"} <= set(silent)
    for r, (bytes_sent, calls) in enumerate(
        run_on_ranks(exchange_stats_worker, world, _plan_model, (2, 3, 19, 8), "plan-fusion")
    ):
        assert predicted_halo_bytes(plan.layers, batch_size=2, dtype_bytes=8, domain_rank=r) == (
            bytes_sent
        )
        counts = predicted_collectives(
            plan.layers, data="none", dp=1, tp=1, domain=world, domain_rank=r
        )
        assert counts["domain_p2p"] == calls
