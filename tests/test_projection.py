"""planner/projection.py: the alpha-beta projection of a layout's step time (pure arithmetic)."""

from __future__ import annotations

import math

import pytest

from credit_parallel.domain.rows import shard_sizes
from credit_parallel.planner.cost import DomainLayerPlan
from credit_parallel.planner.projection import (
    Cluster,
    ComputeProfile,
    Link,
    allreduce_time,
    gather_time,
    project_step,
)

NVLINK = Link("nvlink", 5e-6, 1 / 360e9)
IB = Link("ib", 12e-6, 1 / 45e9)
CLUSTER = Cluster(8, NVLINK, IB)
FREE = Cluster(8, Link("free", 0.0, 0.0), Link("free", 0.0, 0.0))


def conv_call(path: str, height: int, n: int, row_elements: int = 1000) -> DomainLayerPlan:
    """A 3x3 conv on ``height`` rows over ``n`` ranks: one halo row from each neighbour."""
    received = tuple((r > 0) + (r < n - 1) for r in range(n)) if n > 1 else (0,)
    return DomainLayerPlan(
        path, "conv", height, height, shard_sizes(height, n),
        tuple(int(r > 0) for r in range(n)), tuple(int(r < n - 1) for r in range(n)),
        received, received, row_elements, form="halo",
    )  # fmt: skip


def norm_call(path: str, height: int, n: int) -> DomainLayerPlan:
    zeros = (0,) * n
    return DomainLayerPlan(
        path, "group_norm", height, height, shard_sizes(height, n), zeros, zeros, zeros, zeros,
        1000, form="collective",
    )  # fmt: skip


def workload(n: int, height: int = 96):
    layers = [conv_call("c1", height, n), norm_call("n1", height, n), conv_call("c2", height, n)]
    profile = ComputeProfile({"c1": 1.0, "n1": 0.1, "c2": 1.0}, rest_s=0.3)
    return layers, profile


def test_link_message_is_alpha_plus_bytes_times_beta():
    assert NVLINK.message(0) == 0.0
    assert NVLINK.message(1e6) == pytest.approx(5e-6 + 1e6 / 360e9)
    with pytest.raises(ValueError, match="alpha_s and beta_s must be >= 0"):
        Link("bad", -1.0, 0.0)


def test_cluster_uses_inter_node_link_once_the_span_leaves_a_node():
    assert CLUSTER.link(1) is NVLINK and CLUSTER.link(8) is NVLINK
    assert CLUSTER.link(9) is IB
    with pytest.raises(ValueError, match="gpus_per_node"):
        Cluster(0, NVLINK, IB)


def test_collective_limits():
    assert allreduce_time(1e6, 1, IB) == 0.0
    assert allreduce_time(0, 8, IB) == 0.0
    assert gather_time(1e6, 1, IB) == 0.0
    # two ranks: one byte each way of the ring, one latency each way
    assert allreduce_time(1e6, 2, IB) == pytest.approx(1e6 / 45e9 + 2 * 12e-6)
    # bandwidth term tends to 2 x bytes x beta for a large group
    big = allreduce_time(1e9, 4096, Link("bw", 0.0, 1e-9))
    assert big == pytest.approx(2.0, rel=1e-3)
    # more buckets cost more latency, never less
    assert allreduce_time(1e6, 8, IB, buckets=4) > allreduce_time(1e6, 8, IB, buckets=1)


def test_one_device_is_the_profile_and_has_efficiency_one():
    layers, profile = workload(1)
    p = project_step(layers, profile, domain=1, dp=1, cluster=CLUSTER)
    assert p.step_s == pytest.approx(profile.total_s)
    assert p.efficiency == pytest.approx(1.0)
    assert p.halo_s == p.norm_s == p.domain_grad_s == p.dp_grad_s == 0.0


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_free_links_give_the_row_share(n):
    """With alpha = beta = 0 the step is the busiest rank's share of each level."""
    layers, profile = workload(n)
    p = project_step(layers, profile, domain=n, dp=1, cluster=FREE, domain_grad_bytes=10**6)
    share = math.ceil(96 / n) / 96
    assert p.compute_s == pytest.approx(2.1 * share + 0.3 / n)
    assert p.halo_s == p.norm_s == p.domain_grad_s == 0.0
    assert p.efficiency <= 1.0 + 1e-12
    if 96 % n == 0:
        assert p.efficiency == pytest.approx(1.0)


def test_communication_terms_match_the_formulas():
    layers, profile = workload(2)
    p = project_step(layers, profile, domain=2, dp=1, cluster=CLUSTER, batch_size=1)
    row_bytes = 1000 * 4
    assert p.halo_s == pytest.approx(2 * 2 * (5e-6 + row_bytes / 360e9))
    assert p.norm_s == pytest.approx(gather_time(128, 2, NVLINK) + allreduce_time(64, 2, NVLINK))


def test_step_time_grows_with_alpha_and_beta_and_batch():
    layers, profile = workload(4)
    base = project_step(layers, profile, domain=4, dp=2, cluster=CLUSTER, dp_grad_bytes=10**8)
    slow_alpha = Cluster(8, Link("a", 1e-3, NVLINK.beta_s), IB)
    slow_beta = Cluster(8, Link("b", NVLINK.alpha_s, 1e-9), IB)
    for cluster in (slow_alpha, slow_beta):
        p = project_step(layers, profile, domain=4, dp=2, cluster=cluster, dp_grad_bytes=10**8)
        assert p.step_s > base.step_s
        assert p.efficiency < base.efficiency
    bigger = project_step(
        layers, profile, domain=4, dp=2, cluster=CLUSTER, dp_grad_bytes=10**8, batch_size=2
    )
    assert bigger.compute_s == pytest.approx(2 * base.compute_s)
    assert bigger.halo_s > base.halo_s


def test_efficiency_falls_with_domain_when_compute_is_fixed():
    """Monotone in the domain size on a fixed grid: more ranks, more messages per sample."""
    effs = []
    for n in (1, 2, 4, 8, 16, 32):
        layers, profile = workload(n, height=96)
        effs.append(project_step(layers, profile, domain=n, dp=1, cluster=CLUSTER).efficiency)
    assert all(a >= b for a, b in zip(effs, effs[1:]))
    assert effs[0] == pytest.approx(1.0)


def test_dp_group_crosses_nodes_and_overlap_hides_it():
    layers, profile = workload(8)
    grads = 4 * 20_000_000
    inside = project_step(layers, profile, domain=8, dp=1, cluster=CLUSTER, dp_grad_bytes=grads)
    across = project_step(layers, profile, domain=8, dp=8, cluster=CLUSTER, dp_grad_bytes=grads)
    assert inside.dp_grad_s == 0.0
    assert across.dp_grad_s == pytest.approx(allreduce_time(grads, 8, IB))
    assert across.exposed_grad_s == pytest.approx(across.dp_grad_s)
    hidden = project_step(
        layers, profile, domain=8, dp=8, cluster=CLUSTER, dp_grad_bytes=grads, overlap=1.0
    )
    expected = max(0.0, across.dp_grad_s - 2 / 3 * hidden.compute_s)
    assert hidden.exposed_grad_s == pytest.approx(expected)
    assert hidden.step_s <= across.step_s
    # the domain group's reduction overlaps on its own switch
    both = dict(cluster=CLUSTER, dp_grad_bytes=grads, domain_grad_bytes=grads)
    blocking = project_step(
        layers, profile, domain=8, dp=8, overlap=1.0, domain_overlap=0.0, **both
    )
    assert blocking.exposed_grad_s == pytest.approx(
        blocking.domain_grad_s + max(0.0, blocking.dp_grad_s - 2 / 3 * blocking.compute_s)
    )
    # the domain group leaves the node past 8 ranks: its halo messages pay InfiniBand
    l16, p16 = workload(16)
    l8, p8 = workload(8)
    assert (
        project_step(l16, p16, domain=16, dp=1, cluster=CLUSTER).halo_s
        > project_step(l8, p8, domain=8, dp=1, cluster=CLUSTER).halo_s
    )


def test_unplanned_profile_paths_count_as_row_local_rest():
    layers, profile = workload(2)
    extra = ComputeProfile({**profile.layers, "act": 0.4}, rest_s=profile.rest_s)
    a = project_step(layers, profile, domain=2, dp=1, cluster=FREE)
    b = project_step(layers, extra, domain=2, dp=1, cluster=FREE)
    assert b.compute_s - a.compute_s == pytest.approx(0.2)
    assert b.single_device_s - a.single_device_s == pytest.approx(0.4)


def test_attention_bytes_travel_both_ways():
    layer = DomainLayerPlan(
        "attn", "attention", 64, 64, shard_sizes(64, 4), (0,) * 4, (0,) * 4, (), (), 10,
        form="regroup", communication_bytes=4_000_000,
    )  # fmt: skip
    p = project_step([layer], ComputeProfile({"attn": 1.0}), domain=4, dp=1, cluster=CLUSTER)
    assert p.attention_s == pytest.approx(2 * (1_000_000 / 360e9 + 2 * 5e-6))


def test_bad_arguments_name_the_parameter():
    layers, profile = workload(2)
    with pytest.raises(ValueError, match="domain and dp must be >= 1"):
        project_step(layers, profile, domain=0, dp=1, cluster=CLUSTER)
    with pytest.raises(ValueError, match="overlap must be in"):
        project_step(layers, profile, domain=2, dp=1, cluster=CLUSTER, overlap=1.5)
    with pytest.raises(ValueError, match="domain_overlap must be in"):
        project_step(layers, profile, domain=2, dp=1, cluster=CLUSTER, domain_overlap=-1.0)
    with pytest.raises(ValueError, match="backward_fraction"):
        project_step(layers, profile, domain=2, dp=1, cluster=CLUSTER, backward_fraction=-0.1)


# --------------------------------------------------------------------------- sync points
def _counts(**overrides):
    from credit_parallel.planner.cost import predicted_collectives

    base = predicted_collectives([], data="none", dp=1, tp=1, domain=1)
    return {**base, **overrides}


def test_sync_points_count_blocking_calls_and_overlap_waits_once():
    from credit_parallel.planner.sync_points import sync_points_per_step

    c = _counts(
        domain_p2p=8, domain_all_gather=4, domain_all_reduce_norm=4, domain_grad_all_reduce=3
    )
    before = sync_points_per_step(c)
    after = sync_points_per_step(c, overlapped_domain_grads=True)
    assert before == {"halo": 8, "norm": 8, "domain_grad": 3, "tp": 0, "data": 0, "total": 19}
    assert after["domain_grad"] == 1 and after["total"] == 17
    assert sync_points_per_step(_counts(), overlapped_domain_grads=True)["total"] == 0
    assert sync_points_per_step(_counts(ddp_all_reduce=5))["data"] == 1
