"""CRPS losses under any layout equal miles-credit's one-process K-member loss (float64 1e-10).

Members over the ensemble axis (E), rows over the domain (rows and 2x2 tiles, uneven): the
latitude-weighted mean of :func:`crps_share` summed over the ranks, and the gradient of every
member at every point, against ``KCRPSLoss`` (fair, biased), ``AlmostFairKCRPSLoss`` (alpha) and
``RingCRPSLoss`` (run as CREDIT runs it: one member per rank of a K-rank group, DDP's mean).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from credit_parallel import ParallelDims
from credit_parallel.domain.rows import shard_range
from credit_parallel.layout.config import ENSEMBLE
from credit_parallel.testing import run_on_ranks
from credit_parallel.train.crps import EnsembleLoss, crps_comm_per_step, crps_share

K, B, C, H, W = 4, 2, 3, 7, 6  # 7 rows: uneven over 2 latitude shards
LOSSES = {
    "kcrps": EnsembleLoss("KCRPS", K),
    "kcrps-biased": EnsembleLoss("KCRPS", K, biased=True),
    "almost-fair": EnsembleLoss("almost-fair-crps", K, alpha=0.9),
    "ring": EnsembleLoss("ring-crps", K),
}


def _data():
    g = torch.Generator().manual_seed(7)
    pred = torch.randn(B * K, C, H, W, generator=g, dtype=torch.float64)
    target = torch.randn(B, C, H, W, generator=g, dtype=torch.float64)
    lat = torch.cos(torch.linspace(-1.4, 1.4, H, dtype=torch.float64))
    return pred, target, lat / lat.mean()


def _weighted_mean(loss_map, lat_rows, count):
    return (loss_map * lat_rows.view(-1, 1)).sum() / count


def _credit_map(name, target, pred):
    from credit.losses.gen_1.almost_fair_crps import AlmostFairKCRPSLoss
    from credit.losses.gen_1.kcrps import KCRPSLoss

    loss = LOSSES[name]
    if loss.kind == "KCRPS":
        return KCRPSLoss("none", biased=loss.biased)(target, pred)
    return AlmostFairKCRPSLoss(alpha=loss.alpha, reduction="none")(target, pred)


def _credit_ring_rank(rank, world):
    """CREDIT's own ring-crps: member ``rank`` on rank ``rank``, the world as its dp group."""
    from credit.losses.crps import RingCRPSLoss

    pred, target, lat = _data()
    member = pred.view(B, K, C, H, W)[:, rank].clone().requires_grad_(True)
    elementwise = RingCRPSLoss("none", group=dist.group.WORLD)(target, member)
    loss = _weighted_mean(elementwise, lat, elementwise.numel())
    loss.backward()
    return loss.detach(), member.grad


@pytest.fixture(scope="module")
def reference():
    """{name: (one-process loss, d loss / d pred)}."""
    pred, target, lat = _data()
    out = {}
    for name in ("kcrps", "kcrps-biased", "almost-fair"):
        p = pred.clone().requires_grad_(True)
        loss = _weighted_mean(_credit_map(name, target, p), lat, target.numel())
        loss.backward()
        out[name] = (loss.detach(), p.grad)
    ranks = run_on_ranks(_credit_ring_rank, K)
    # DDP averages the K ranks: the loss is the mean, each member's gradient 1/K of its rank's
    grad = torch.stack([g / K for _, g in ranks], dim=1).reshape(B * K, C, H, W)
    out["ring"] = (sum(v for v, _ in ranks) / K, grad)
    return out


def _share_rank(rank, world, ens, domain):
    pred, target, lat = _data()
    dims = ParallelDims("fsdp2", 1, domain, world, ens)
    meshes = dims.build_mesh("cpu")
    group = meshes.submeshes[ENSEMBLE].get_group() if ens > 1 else None
    coords = dims.coords(rank)
    p, q = dims.domain_shape
    lat_rank, lon_rank = divmod(coords["domain"], q)
    r0, r1 = shard_range(H, p, lat_rank)
    c0, c1 = shard_range(W, q, lon_rank)
    e, local = dims.ensemble_coord(rank), K // ens
    out = {}
    for name, loss_kind in LOSSES.items():
        mine = pred.view(B, K, C, H, W)[:, e * local : (e + 1) * local, :, r0:r1, c0:c1]
        mine = mine.reshape(B * local, C, r1 - r0, c1 - c0).clone().requires_grad_(True)
        share = crps_share(mine, target[..., r0:r1, c0:c1], loss_kind, group)
        loss = _weighted_mean(share, lat[r0:r1], B * C * H * W)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        out[name] = (total, mine.grad, (e, r0, r1, c0, c1))
    return out


@pytest.mark.parametrize(
    "ens, domain",
    [(2, 1), (4, 1), (1, 2), (2, 2), (1, {"lat": 2, "lon": 2})],
    ids=["E2", "E4", "rows2", "E2-rows2", "tiles2x2"],
)
def test_crps_losses_equal_one_process_k_members(reference, ens, domain):
    world = ens * (domain if isinstance(domain, int) else 4)
    results = run_on_ranks(_share_rank, world, ens, domain)
    local = K // ens
    for per_rank in results:
        for name, (total, grad, (e, r0, r1, c0, c1)) in per_rank.items():
            ref_loss, ref_grad = reference[name]
            assert abs(float(total - ref_loss)) <= 1e-10, name
            expected = ref_grad.view(B, K, C, H, W)[:, e * local : (e + 1) * local]
            expected = expected[..., r0:r1, c0:c1].reshape(grad.shape)
            assert (grad - expected).abs().max() <= 1e-10, name
            assert expected.abs().max() > 1e-4  # the gradient is not trivially zero


@pytest.mark.parametrize("name", ["kcrps", "kcrps-biased", "almost-fair", "ring"])
def test_crps_one_process_all_members_local(reference, name):
    pred, target, lat = _data()
    p = pred.clone().requires_grad_(True)
    loss = _weighted_mean(crps_share(p, target, LOSSES[name]), lat, target.numel())
    loss.backward()
    ref_loss, ref_grad = reference[name]
    assert abs(float(loss.detach() - ref_loss)) <= 1e-10
    assert (p.grad - ref_grad).abs().max() <= 1e-10


def test_kcrps_at_a_tie_same_value_and_same_gradient_of_the_tied_pair():
    """CREDIT sorts, so at a tie its subgradient goes by sort position; ours is the symmetric
    one (the tied pair's mutual term contributes 0): the value and the pair's sum agree."""
    from credit.losses.gen_1.kcrps import KCRPSLoss

    pred, target, _ = _data()
    pred[1, 0, 2, 3] = pred[0, 0, 2, 3]  # members 0 and 1 of sample 0 tie at one point
    ours, theirs = pred.clone().requires_grad_(True), pred.clone().requires_grad_(True)
    a = crps_share(ours, target, LOSSES["kcrps"]).sum()
    b = KCRPSLoss("none")(target, theirs).sum()
    (a - b).backward()  # one backward: both gradients at once
    assert abs(float(a.detach() - b.detach())) <= 1e-10
    g_ours, g_theirs = ours.grad, -theirs.grad
    pair = (slice(0, 2), 0, 2, 3)
    assert abs(float(g_ours[pair].sum() - g_theirs[pair].sum())) <= 1e-12
    g_ours[pair] = g_theirs[pair] = 0
    assert (g_ours - g_theirs).abs().max() <= 1e-12


def test_bad_member_counts_are_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"trainer\.ensemble_size >= 2"):
        EnsembleLoss("KCRPS", 1)
    with pytest.raises(ValueError, match=r"trainer\.ensemble_size >= 2"):
        EnsembleLoss("ring-crps", 1)
    pred, target, _ = _data()
    with pytest.raises(ValueError, match=r"trainer\.ensemble_size 4"):
        crps_share(pred[:3], target, LOSSES["kcrps"])


def test_comm_and_memory_figures():
    sent, held = crps_comm_per_step(8, 2, 1000, 4)
    assert sent == 4 * 1000 * 4 and held == 4 * 4 * 1000 * 4
    assert crps_comm_per_step(8, 1, 1000, 4) == (0, 2 * 8 * 1000 * 4)
