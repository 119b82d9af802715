"""The one training step and its autoregressive rollout, for 4-D and 5-D (Pangu-style) inputs.

The references are rollouts written out by hand with plain torch ops in this file (not through
the library): a 5-D model that takes ``history_len = 2`` time steps of upper-air levels and
surface fields and predicts one, rolled out over ``forecast_len = 2`` steps.  The trainer's
first-step loss and its 5-D evaluation metrics must equal the hand computation (float64,
max abs error <= 1e-10), single process and under domain 2 on 17 rows (uneven 9 / 8 shards).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here so forked workers inherit it)
from torch import nn

from credit_parallel.data import write_sample_dataset
from credit_parallel.data.dataset import dataset_from_conf
from credit_parallel.testing import run_on_ranks
from credit_parallel.train.step import TrainStep, advance_state, batch_keys, rollout_loss
from credit_parallel.train.trainer import Trainer

__all__: list[str] = []

TOL = 1e-10
H, W = 17, 16
N_UPPER, N_SURFACE, LEVELS, HISTORY, FORECAST = 3, 2, 2, 2, 2


class TinyPangu(nn.Module):
    """(upper (B, HISTORY*3, Z, H, W), surface (B, HISTORY*2, H, W)) -> one time step of each."""

    def __init__(self):
        super().__init__()
        self.upper = nn.Conv3d(HISTORY * N_UPPER, N_UPPER, 3, padding=1)
        self.surface = nn.Conv2d(HISTORY * N_SURFACE, N_SURFACE, 3, padding=1)
        self.couple = nn.Conv2d(N_UPPER, N_SURFACE, 1)

    def forward(self, upper, surface):
        u = self.upper(upper)
        return u, self.surface(surface) + self.couple(u.mean(dim=2))


def _model():
    torch.manual_seed(11)
    return TinyPangu().double()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("data5d") / "s.zarr"
    return str(write_sample_dataset(path, n_times=30, nlat=H, nlon=W))


def _conf(store, parallelism=None):
    return {
        "data": {
            "path": store,
            "upper_air_variables": ["T", "U", "V"],
            "surface_variables": ["t2m", "SP"],
            "levels": [500, 850],
            "history_len": HISTORY,
            "forecast_len": FORECAST,
            "as_5d": True,
            "time_slice": [0, 24],
        },
        "trainer": {
            "parallelism": parallelism or {"data": "none", "tensor": 1, "domain": 1},
            "steps": 3,
            "batch_size": 2,
            "lr": 0.01,
            "seed": 5,
            "dtype": "float64",
            "val_batches": 1,
        },
    }


def _hand_batch(trainer, step, split="train"):
    """The samples of the trainer's first micro-batch of ``step`` (validation: batch ``step``),
    read by hand from the dataset through the loader's sampler."""
    loader = trainer.loader if split == "train" else trainer._loader_for("valid")
    ds = loader.dataset
    indices = loader.batch_sampler.batch_indices(
        step * (trainer.tc.grad_accum if split == "train" else 1)
    )
    samples = [ds[i] for i in indices]
    return {
        k: torch.stack([s[k] for s in samples]).double() for k in samples[0] if k != "time_index"
    }


def _weighted_mse(pred, target, w):
    return ((pred - target) ** 2 * w.view(-1, 1)).sum() / pred.numel()


def _hand_rollout_loss(model, batch, w, advance=True):
    """The rollout written out: drop the oldest time step, append the prediction."""
    upper, surface = batch["x_upper"], batch["x_surface"]
    total = 0.0
    for k in range(FORECAST):
        pu, ps = model(upper, surface)
        tu = batch["y_upper"][:, k * N_UPPER : (k + 1) * N_UPPER]
        ts = batch["y_surface"][:, k * N_SURFACE : (k + 1) * N_SURFACE]
        total = total + (_weighted_mse(pu, tu, w) + _weighted_mse(ps, ts, w)) / 2
        if advance:
            upper = torch.cat([upper[:, N_UPPER:], pu], dim=1)
            surface = torch.cat([surface[:, N_SURFACE:], ps], dim=1)
    return total / FORECAST


def _hand_scores(model, batch, w, clim=None):
    """Per forecast step: the RMSE per channel (upper variables x levels, then surface) and,
    with a climatology ``(C, H, W)``, the uncentred ACC, the state advanced by hand."""
    upper, surface = batch["x_upper"], batch["x_surface"]
    ws = w.view(-1, 1) / (w.sum() * W)
    out = []
    for k in range(FORECAST):
        with torch.no_grad():
            pu, ps = model(upper, surface)
        tu = batch["y_upper"][:, k * N_UPPER : (k + 1) * N_UPPER]
        ts = batch["y_surface"][:, k * N_SURFACE : (k + 1) * N_SURFACE]
        pred = torch.cat([pu.flatten(1, 2), ps], dim=1)
        truth = torch.cat([tu.flatten(1, 2), ts], dim=1)
        rmse = torch.sqrt(((pred - truth) ** 2 * ws).sum(dim=(2, 3)).mean(dim=0))
        acc = None
        if clim is not None:
            a, b = pred - clim, truth - clim
            s = [(v * ws).sum(dim=(2, 3)) for v in (a * b, a * a, b * b)]
            acc = (s[0] / torch.sqrt(s[1] * s[2])).mean(dim=0)
        out.append((rmse, acc))
        upper = torch.cat([upper[:, N_UPPER:], pu], dim=1)
        surface = torch.cat([surface[:, N_SURFACE:], ps], dim=1)
    return out


def test_advance_state_drops_the_oldest_step_and_appends_the_prediction():
    x = torch.arange(2 * 6 * 3 * 2, dtype=torch.float64).reshape(2, 6, 3, 2)  # 3 steps x 2 ch
    pred = -torch.ones(2, 2, 3, 2, dtype=torch.float64)
    (out,) = advance_state((x,), (pred,))
    assert torch.equal(out[:, :4], x[:, 2:]) and torch.equal(out[:, 4:], pred)
    # 5-D: the time-major channel axis is dim 1, levels (dim 2) untouched
    u = torch.randn(1, 6, 4, 5, 3, dtype=torch.float64)
    pu = torch.randn(1, 3, 4, 5, 3, dtype=torch.float64)
    (nu,) = advance_state((u,), (pu,))
    assert nu.shape == u.shape and torch.equal(nu[:, :3], u[:, 3:]) and torch.equal(nu[:, 3:], pu)


def test_rollout_loss_4d_history2_forecast3_matches_hand_rollout():
    torch.manual_seed(0)
    model = nn.Conv2d(4, 2, 3, padding=1).double()  # 2 steps of 2 channels in, one step out
    x = torch.randn(2, 4, 7, 5, dtype=torch.float64)
    y = torch.randn(2, 6, 7, 5, dtype=torch.float64)
    with torch.no_grad():
        loss, _ = rollout_loss(model, (x,), (y,), lambda o, t: ((o[0] - t[0]) ** 2).mean(), 3)
    state, expected = x, 0.0
    for k in range(3):
        pred = model(state)
        expected = expected + ((pred - y[:, 2 * k : 2 * k + 2]) ** 2).mean()
        state = torch.cat([state[:, 2:], pred], dim=1)
    assert abs(loss.item() - (expected / 3).item()) <= TOL


def test_5d_history2_forecast2_trainer_loss_equals_hand_rollout(store):
    model = _model()
    reference = copy.deepcopy(model)
    trainer = Trainer(_conf(store), model=model)
    batch = _hand_batch(trainer, 0)
    w = trainer.dataset.lat_weights.double()
    with torch.no_grad():
        expected = float(_hand_rollout_loss(reference, batch, w))
        frozen = float(_hand_rollout_loss(reference, batch, w, advance=False))
    assert abs(expected - frozen) > 1e-4  # advancing the state changes the loss: a real test
    record = trainer.train_step()
    assert abs(record["loss"] - expected) <= TOL, (record["loss"], expected)


def test_5d_evaluate_scores_every_forecast_step_per_variable_and_level(store):
    trainer = Trainer(_conf(store), model=_model())
    metrics = trainer.evaluate()
    names = trainer.dataset.variable_names
    assert len(names) == 8
    assert list(metrics) == [f"rmse/{n}" for n in names] + [f"rmse@t+2/{n}" for n in names]
    batch = _hand_batch(trainer, 0, split="valid")
    w = trainer.dataset.lat_weights.double()
    clim = trainer.use_training_climatology()
    assert clim.shape == (8, H, W)
    expected = _hand_scores(_model(), batch, w, clim.double())
    # the second step really differs from the first: the state advanced
    assert float((expected[1][0] - expected[0][0]).abs().max()) > 1e-3
    for k, suffix in enumerate(("", "@t+2")):
        for n, want in zip(names, expected[k][0]):
            assert abs(metrics[f"rmse{suffix}/{n}"] - float(want)) <= TOL
    scored = trainer.evaluate()
    assert [k for k in scored if k.startswith("acc")] == [f"acc/{n}" for n in names] + [
        f"acc@t+2/{n}" for n in names
    ]
    for k, suffix in enumerate(("", "@t+2")):
        for n, want in zip(names, expected[k][1]):
            assert abs(scored[f"acc{suffix}/{n}"] - float(want)) <= TOL
        assert all(-1 <= scored[f"acc{suffix}/{n}"] <= 1 for n in names)


def _domain2_worker(rank, world, store):
    trainer = Trainer(_conf(store, {"data": "none", "tensor": 1, "domain": 2}), model=_model())
    records = [trainer.train_step() for _ in range(3)]
    trainer.use_training_climatology()  # this rank's rows
    return records, trainer.evaluate()


def test_5d_rollout_domain2_uneven_rows_matches_single_process(store):
    ref = Trainer(_conf(store), model=_model())
    ref_records = [ref.train_step() for _ in range(3)]
    ref.use_training_climatology()
    ref_metrics = ref.evaluate()
    assert len(ref_metrics) == 4 * 8  # rmse and acc, two forecast steps, 8 channels
    for records, metrics in run_on_ranks(_domain2_worker, 2, store, timeout=240):
        for got, want in zip(records, ref_records):
            for key in ("loss", "grad_norm", "lr"):
                assert abs(got[key] - want[key]) <= TOL, (got["step"], key)
        assert metrics.keys() == ref_metrics.keys()
        assert all(abs(metrics[k] - ref_metrics[k]) <= TOL for k in metrics)


def test_train_step_accumulates_micro_batches_like_one_batch():
    torch.manual_seed(0)
    model = nn.Conv2d(2, 2, 3, padding=1).double()
    twin = copy.deepcopy(model)
    x = torch.randn(4, 2, 6, 5, dtype=torch.float64)
    y = torch.randn(4, 2, 6, 5, dtype=torch.float64)

    def mse(o, t):
        return ((o[0] - t[0]) ** 2).mean()

    whole = TrainStep(model, mse, max_norm=float("inf"))([{"x": x, "y": y}])
    halves = [{"x": x[:2], "y": y[:2]}, {"x": x[2:], "y": y[2:]}]
    accumulated = TrainStep(twin, mse, max_norm=float("inf"))(halves, grad_accum=2)
    assert abs(float(whole.loss_share) - float(accumulated.loss_share)) <= TOL
    assert abs(float(whole.grad_norm) - float(accumulated.grad_norm)) <= TOL
    for p, q in zip(model.parameters(), twin.parameters()):
        assert float((p.grad - q.grad).abs().max()) <= TOL


def test_batch_keys_names_the_expected_keys_when_missing():
    assert batch_keys({"x": 1, "y": 2}) == (("x",), ("y",))
    assert batch_keys({"x_upper": 1, "x_surface": 2, "y_upper": 3, "y_surface": 4})[1] == (
        "y_upper",
        "y_surface",
    )
    with pytest.raises(ValueError, match="x_upper"):
        batch_keys({"inputs": 1})


def test_dataset_5d_layout_is_history_major_as_the_rollout_assumes(store):
    """x_upper channel c*N_UPPER + v is time step c, variable v: dropping N_UPPER channels
    drops exactly the oldest time step."""
    ds = dataset_from_conf(_conf(store), "train")
    s0, s1 = ds[0], ds[1]
    # sample 1's first history step is sample 0's second one
    assert torch.equal(s1["x_upper"][:N_UPPER], s0["x_upper"][N_UPPER:])
    assert torch.equal(s1["x_surface"][:N_SURFACE], s0["x_surface"][N_SURFACE:])
    # and sample 0's first target step is sample 1's newest input step
    assert torch.equal(s0["y_upper"][:N_UPPER], s1["x_upper"][N_UPPER:])
