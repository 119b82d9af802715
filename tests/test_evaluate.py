"""Trainer.evaluate scores every forecast step exactly under {dp 2, domain 2}: a 4-D U-Net with
dynamic forcing and static fields rolled out over forecast_len = 3 on 4 ranks (each dp rank its
own validation samples, 9 rows split 5/4) gives the RMSE and ACC per channel and step of a
one-process hand computation over the union of the dp ranks' samples (float64, 1e-10)."""

from __future__ import annotations

import pytest
import torch

from credit_parallel.data.dataset import dataset_from_conf
from credit_parallel.data.sample import write_sample_dataset
from credit_parallel.forecast.scores import climatology
from credit_parallel.models import build_model
from credit_parallel.testing import run_on_ranks
from credit_parallel.train.trainer import Trainer
from sample_conf import unet_run_conf

__all__: list[str] = []

H, W, STEPS, C = 9, 16, 3, 8
TOL = 1e-10


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("evaluate") / "s.zarr"
    return str(write_sample_dataset(path, n_times=24, nlat=H, nlon=W))


def _conf(store, parallelism=None):
    conf = unet_run_conf(
        store,
        H,
        W,
        time_slice=[0, 20],
        parallelism=parallelism,
        data={
            "forecast_len": STEPS,
            "dynamic_forcing_variables": ["tsi"],
            "static_variables": ["orography", "land_sea_mask"],
        },
        steps=1,
        batch_size=2,
        seed=4,
        dtype="float64",
        val_batches=1,
    )
    conf["model"]["in_channels"] = C + 1 + 2
    return conf


def _worker(rank, world, store):
    trainer = Trainer(_conf(store, {"data": "ddp", "tensor": 1, "domain": 2}))
    indices = trainer._loader_for("valid").batch_sampler.batch_indices(0)
    trainer.use_training_climatology()
    return trainer.evaluate(), [int(i) for i in indices], trainer.dp_rank


def _hand_scores(conf, indices):
    """RMSE and ACC per (step, channel) over the samples ``indices``, rolled out by hand:
    the next input is [prediction, the next time's forcing, the static fields]."""
    torch.manual_seed(conf["trainer"]["seed"])
    model = build_model(conf["model"]).double().eval()
    ds = dataset_from_conf(conf, rows=(0, H))  # the rows read as a rank reads them
    clim = climatology(conf).double()
    clim = (clim - torch.as_tensor(ds.channel_mean).view(-1, 1, 1)) / torch.as_tensor(
        ds.channel_std
    ).view(-1, 1, 1)
    w = ds.lat_weights.double().view(-1, 1)
    w = w / (w.sum() * W)
    samples = [ds[i] for i in indices]
    x = torch.stack([s["x"] for s in samples]).double()
    y = torch.stack([s["y"] for s in samples]).double()
    forcing = torch.stack([s["forcing"] for s in samples]).double()
    mse, acc = [], []
    with torch.no_grad():
        for k in range(STEPS):
            pred, truth = model(x), y[:, k * C : (k + 1) * C]
            mse.append(((pred - truth) ** 2 * w).sum(dim=(2, 3)).mean(dim=0))
            a, b = pred - clim, truth - clim
            s = [(v * w).sum(dim=(2, 3)) for v in (a * b, a * a, b * b)]
            acc.append((s[0] / torch.sqrt(s[1] * s[2])).mean(dim=0))
            x = torch.cat([pred, forcing[:, k : k + 1], x[:, C + 1 :]], dim=1)
    return torch.sqrt(torch.stack(mse)), torch.stack(acc)


def test_evaluate_at_dp2_domain2_with_forcing_equals_hand_rollout_over_all_samples(store):
    results = run_on_ranks(_worker, 4, store, timeout=240)
    per_dp = {dp: indices for _, indices, dp in results}
    assert sorted(per_dp) == [0, 1] and set(per_dp[0]).isdisjoint(per_dp[1])
    rmse, acc = _hand_scores(_conf(store), per_dp[0] + per_dp[1])
    assert float((rmse[2] - rmse[0]).abs().max()) > 1e-3  # the later steps really differ
    names = dataset_from_conf(_conf(store)).variable_names
    for metrics, _, _ in results:
        assert len(metrics) == 2 * STEPS * C
        for k in range(STEPS):
            suffix = "" if k == 0 else f"@t+{k + 1}"
            for c, name in enumerate(names):
                assert abs(metrics[f"rmse{suffix}/{name}"] - float(rmse[k, c])) <= TOL
                assert abs(metrics[f"acc{suffix}/{name}"] - float(acc[k, c])) <= TOL
