"""Exact forecast metrics (forecast/metrics.py) against NumPy on the whole fields, and under
sharding: rows over 4 domain ranks (uneven: 9 rows as 3/2/2/2), initial times over dp ranks,
ensemble members over 1, 2 or 4 ranks (1, 2, 4 members per rank and an uneven 3 + 1 split).
Every value at 4 ranks equals the one-process value to 1e-12 and the NumPy value to 1e-12."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from credit_parallel.data.dataset import latitude_weights
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.domain.rows import shard_range
from credit_parallel.forecast import metrics as fm
from credit_parallel.testing import run_on_ranks

__all__: list[str] = []

H, W = 9, 8
TOL = 1e-12


def _fields(shape=(3, 2, H, W), members=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    truth = torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 10
    pred = truth + torch.randn(shape, generator=g, dtype=torch.float64)
    clim = torch.randn(shape[1:], generator=g, dtype=torch.float64) * 2 + 10
    ens = truth + torch.randn((members, *shape), generator=g, dtype=torch.float64) * 1.5
    lat = np.linspace(90, -90, H)
    return pred, truth, clim, ens, latitude_weights(lat, torch.float64)


# ------------------------------------------------------------------ NumPy reference
def _np_w(weights, like):
    w = np.broadcast_to(weights[:, None], like.shape[-2:])
    return w / w.sum()


def _np_spatial(field, weights):
    return (field * _np_w(weights, field)).sum(axis=(-2, -1))


def np_rmse(pred, truth, weights, axis=None):
    return np.sqrt(_np_spatial((pred - truth) ** 2, weights).mean(axis=axis))


def np_acc(pred, truth, clim, weights, axis=None, centered=False):
    a, b = pred - clim, truth - clim
    if centered:
        a = a - _np_spatial(a, weights)[..., None, None]
        b = b - _np_spatial(b, weights)[..., None, None]
    s = _np_spatial
    acc = s(a * b, weights) / np.sqrt(s(a * a, weights) * s(b * b, weights))
    return acc.mean(axis=axis)


def np_crps(ens, truth, weights, axis=None):
    m = ens.shape[0]
    skill = np.abs(ens - truth).mean(axis=0)
    pairs = np.abs(ens[:, None] - ens[None, :]).sum(axis=(0, 1))
    field = skill - pairs / (2 * m * (m - 1)) if m > 1 else skill
    return _np_spatial(field, weights).mean(axis=axis)


def np_spread(ens, weights, axis=None):
    return np.sqrt(_np_spatial(ens.var(axis=0, ddof=1), weights).mean(axis=axis))


def _all_metrics(pred, truth, clim, ens, w, **kw):
    """Every aggregate, scalar and per channel, as a list of float64 arrays."""
    members = {k: kw.pop(k) for k in ("member_group",) if k in kw}
    out = []
    for per_channel in (False, True):
        out += [
            fm.weighted_rmse(pred, truth, w, per_channel=per_channel, **kw),
            fm.anomaly_correlation(pred, truth, clim, w, per_channel=per_channel, **kw),
            fm.anomaly_correlation(
                pred, truth, clim, w, per_channel=per_channel, centered=True, **kw
            ),
            fm.crps(ens, truth, w, per_channel=per_channel, **kw, **members),
            fm.spread(ens, w, per_channel=per_channel, **kw, **members),
        ]
    return [np.asarray(v.double()) for v in out]


def _numpy_metrics(pred, truth, clim, ens, w):
    p, t, c, e, wn = (np.asarray(v) for v in (pred, truth, clim, ens, w))
    out = []
    for axis in (None, 0):
        out += [
            np_rmse(p, t, wn, axis),
            np_acc(p, t, c, wn, axis),
            np_acc(p, t, c, wn, axis, centered=True),
            np_crps(e, t, wn, axis),
            np_spread(e, wn, axis),
        ]
    return out


def _assert_close(got, want, tol=TOL):
    assert len(got) == len(want)
    for i, (g, r) in enumerate(zip(got, want)):
        assert np.shape(g) == np.shape(r), (i, np.shape(g), np.shape(r))
        err = float(np.max(np.abs(np.asarray(g) - np.asarray(r))))
        assert err <= tol, f"metric {i}: max abs err {err:.3e} > {tol}"


@pytest.mark.parametrize("shape", [(3, 2, H, W), (2, 2, 3, H, W)])
def test_metrics_equal_numpy_on_whole_fields(shape):
    pred, truth, clim, ens, w = _fields(shape)
    _assert_close(
        _all_metrics(pred, truth, clim, ens, w), _numpy_metrics(pred, truth, clim, ens, w)
    )


def test_rmse_and_acc_of_known_fields():
    truth = torch.zeros(1, 1, H, W, dtype=torch.float64)
    w = latitude_weights(np.linspace(90, -90, H), torch.float64)
    assert float(fm.weighted_rmse(truth + 2.0, truth, w)) == pytest.approx(2.0, abs=1e-15)
    clim = torch.full((1, H, W), -1.0, dtype=torch.float64)
    assert float(fm.anomaly_correlation(truth, truth, clim, w)) == pytest.approx(1.0, abs=1e-15)
    # the truth's anomaly is +1 everywhere, the prediction's -1
    assert float(fm.anomaly_correlation(truth - 2.0, truth, clim, w)) == pytest.approx(-1.0)
    # a one-member ensemble: the fair CRPS is the mean absolute error
    ens = (truth + 3.0)[None]
    assert float(fm.crps(ens, truth, w)) == pytest.approx(3.0, abs=1e-15)
    with pytest.raises(ValueError, match="at least 2 members"):
        fm.spread(ens, w)


def test_bad_shapes_name_the_function():
    pred, truth, clim, ens, w = _fields()
    with pytest.raises(ValueError, match="spatial_mse: prediction shape"):
        fm.weighted_rmse(pred, truth[:, :1], w)
    with pytest.raises(ValueError, match=r"lat_weights_local must be \(H_local,\)"):
        fm.weighted_rmse(pred, truth, w[:-1])


# ------------------------------------------------------------------ sharded
def _rows(t, manager):
    a, b = shard_range(H, manager.domain_world_size, manager.domain_rank)
    return t[a:b] if t.dim() == 1 else t[..., a:b, :]


def _sharded_worker(rank, world, domain, shape):
    """Rows over ``domain`` ranks; initial times split over the dp ranks (batch_group)."""
    torch.set_default_dtype(torch.float64)
    pred, truth, clim, ens, w = _fields(shape)
    manager = DomainParallelManager(world, domain)
    dp, dp_size = manager.dp_rank, manager.data_parallel_size
    times = torch.arange(shape[0]).tensor_split(dp_size)[dp]  # uneven: 3 times over 2 ranks
    local = [_rows(t[times], manager) for t in (pred, truth)]
    ens_local = _rows(ens[:, times], manager)
    return _all_metrics(
        *local,
        _rows(clim, manager),
        ens_local,
        _rows(w, manager),
        manager=manager,
        batch_group=manager.data_parallel_group,
    )


@pytest.mark.parametrize("world,domain", [(4, 4), (4, 2)])
@pytest.mark.parametrize("shape", [(3, 2, H, W), (3, 2, 3, H, W)])
def test_metrics_at_4_ranks_equal_one_process_and_numpy(world, domain, shape):
    pred, truth, clim, ens, w = _fields(shape)
    single = _all_metrics(pred, truth, clim, ens, w)
    reference = _numpy_metrics(pred, truth, clim, ens, w)
    for per_rank in run_on_ranks(_sharded_worker, world, domain, shape):
        _assert_close(per_rank, single)
        _assert_close(per_rank, reference)


def _members_worker(rank, world, domain, counts):
    """Members split over the dp ranks (``counts[dp]`` each), rows over ``domain`` ranks."""
    torch.set_default_dtype(torch.float64)
    pred, truth, clim, ens, w = _fields(members=sum(counts))
    manager = DomainParallelManager(world, domain)
    start = sum(counts[: manager.dp_rank])
    mine = ens[start : start + counts[manager.dp_rank]]
    kw = dict(manager=manager, member_group=manager.data_parallel_group)
    tw = _rows(w, manager)
    values = [
        fm.crps(_rows(mine, manager), _rows(truth, manager), tw, per_channel=True, **kw),
        fm.spread(_rows(mine, manager), tw, per_channel=True, **kw),
    ]
    return [np.asarray(v) for v in values]


@pytest.mark.parametrize(
    "world,domain,counts",
    [
        (1, 1, (4,)),
        (2, 1, (2, 2)),
        (4, 1, (1, 1, 1, 1)),
        (4, 2, (2, 2)),
        (2, 1, (3, 1)),
        (2, 1, (4, 0)),
    ],
)
def test_crps_and_spread_do_not_depend_on_the_member_split(world, domain, counts):
    _, truth, _, ens, w = _fields(members=4)
    want = [np_crps(np.asarray(ens), np.asarray(truth), np.asarray(w), 0)]
    want.append(np_spread(np.asarray(ens), np.asarray(w), 0))
    single = [
        np.asarray(fm.crps(ens, truth, w, per_channel=True)),
        np.asarray(fm.spread(ens, w, per_channel=True)),
    ]
    _assert_close(single, want)
    for per_rank in run_on_ranks(_members_worker, world, domain, counts):
        if domain == 1:  # the same members in the same order: bitwise
            assert all(np.array_equal(a, b) for a, b in zip(per_rank, single))
        _assert_close(per_rank, single)


def _gather_worker(rank, world):
    mine = torch.full((rank, 2), float(rank))  # rank r holds r members (rank 0: none)
    return fm.gather_members(mine, dist.group.WORLD)


def test_gather_members_with_uneven_and_empty_parts():
    want = torch.cat([torch.full((r, 2), float(r)) for r in range(3)])
    for got in run_on_ranks(_gather_worker, 3):
        assert torch.equal(got, want)


class _Tiles2x2:
    """What the metrics read of a 2-D domain manager (SPEC §3b: its flattened domain group)."""

    def __init__(self):
        self.domain_group = dist.group.WORLD  # the 4 ranks: 2 x 2 tiles


def _tile_worker(rank, world):
    torch.set_default_dtype(torch.float64)
    pred, truth, clim, ens, w = _fields()
    lat, lon = divmod(rank, 2)
    (a, b), (c, d) = shard_range(H, 2, lat), shard_range(W - 1, 2, lon)  # 8 / 7 columns

    def tile(t):
        return t[..., a:b, c:d]

    return _all_metrics(
        tile(pred[..., : W - 1]),
        tile(truth[..., : W - 1]),
        tile(clim[..., : W - 1]),
        tile(ens[..., : W - 1]),
        w[a:b],
        manager=_Tiles2x2(),
    )


def test_metrics_on_2x2_latitude_longitude_tiles_equal_one_process():
    pred, truth, clim, ens, w = (t[..., : W - 1] if t.dim() > 1 else t for t in _fields())
    single = _all_metrics(pred, truth, clim, ens, w)
    _assert_close(single, _numpy_metrics(pred, truth, clim, ens, w))
    for per_rank in run_on_ranks(_tile_worker, 4):
        _assert_close(per_rank, single)
