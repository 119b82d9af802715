"""The rollout API (``credit_parallel.forecast.rollout``) and the state advance with dynamic
forcing: a parallelised rollout equals a one-process rollout of the unconverted model, step after
step, to float64 1e-10, with forcing and static channels, at {domain 2}, {tp 2, domain 2} and
{dp 2, domain 2}; and the dataset's forcing / static channel layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from credit_parallel.data import ERA5Dataset, write_sample_dataset
from credit_parallel.domain.rows import shard_range
from credit_parallel.forecast import rollout
from credit_parallel.layout.config import ParallelDims
from credit_parallel.models import build_model
from credit_parallel.parallel.composition import parallelize_dims
from credit_parallel.testing import run_on_ranks
from credit_parallel.train.step import advance_state, rollout_loss

__all__: list[str] = []

TOL = 1e-10
PROGNOSTIC, HISTORY, FORCING, STATIC, STEPS = 3, 2, 1, 1, 4
C_IN = HISTORY * PROGNOSTIC + FORCING + STATIC

MODELS = {
    # 17 rows: 9 / 8 over two domain ranks (uneven, both poles)
    "unet": (
        {
            "type": "unet",
            "in_channels": C_IN,
            "out_channels": PROGNOSTIC,
            "image_height": 17,
            "image_width": 16,
            "base_channels": 4,
            "channel_mults": [1, 2],
            "norm_groups": 2,
        },
        17,
    ),
    "crossformer": (
        {
            "type": "crossformer",
            "in_channels": C_IN,
            "out_channels": PROGNOSTIC,
            "image_height": 24,
            "image_width": 16,
            "dims": [8, 8],
            "depths": [2, 2],
            "dim_head": 4,
            "window_sizes": [2, 2],
            "norm_groups": 2,
        },
        24,
    ),
}


def _build(name):
    torch.manual_seed(0)
    return build_model(MODELS[name][0]).double()


def _inputs(name, batch=2):
    """Seeded global initial states (batch, C_IN, H, W) and forcing of steps 1 .. STEPS-1."""
    height = MODELS[name][1]
    g = torch.Generator().manual_seed(3)
    state = torch.randn(batch, C_IN, height, 16, generator=g, dtype=torch.float64)
    forcing = [
        torch.randn(batch, FORCING, height, 16, generator=g, dtype=torch.float64)
        for _ in range(STEPS)
    ]
    return state, forcing


def _reference(name):
    """The rollout written out on one process with the unconverted model."""
    model = _build(name).eval()
    x, forcing = _inputs(name)
    outs = []
    with torch.no_grad():
        for k in range(STEPS):
            y = model(x)
            outs.append(y)
            history = x[:, PROGNOSTIC : HISTORY * PROGNOSTIC]
            x = torch.cat([history, y, forcing[k + 1 if k + 1 < STEPS else k], x[:, -STATIC:]], 1)
    return outs


def _rollout_worker(rank, world, name, parallelism):
    dims = ParallelDims.from_conf({"trainer": {"parallelism": parallelism}})
    model = parallelize_dims(_build(name), dims)
    coords = dims.coords(rank)
    start, stop = shard_range(MODELS[name][1], dims.domain, coords["domain"])
    x, forcing = _inputs(name)
    member = slice(coords["dp"], coords["dp"] + 1) if dims.dp > 1 else slice(None)
    state = x[member, :, start:stop]
    outs = [
        out[0].clone()
        for out in rollout(
            model,
            state,
            STEPS,
            forcing=lambda k: forcing[k][member, :, start:stop],
            n_static=STATIC,
        )
    ]
    return {"rows": (start, stop), "member": member, "outs": outs, "training": model.training}


LAYOUTS = {
    "domain2": ({"data": "none", "tensor": 1, "domain": 2}, 2),
    "tp2_domain2": ({"data": "none", "tensor": 2, "domain": 2}, 4),
    "dp2_domain2": ({"data": "fsdp2", "tensor": 1, "domain": 2}, 4),
}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_rollout_equals_one_process_rollout_with_forcing(name, layout):
    parallelism, world = LAYOUTS[layout]
    reference = _reference(name)
    results = run_on_ranks(_rollout_worker, world, name, parallelism, timeout=240)
    covered = set()
    for result in results:
        start, stop = result["rows"]
        assert len(result["outs"]) == STEPS and result["training"]  # mode restored
        for k, out in enumerate(result["outs"]):
            want = reference[k][result["member"], :, start:stop]
            assert out.shape == want.shape
            err = (out - want).abs().max().item()
            assert err <= TOL, f"{layout} {name} step {k + 1} rows {start}:{stop}: {err}"
        covered.add((start, stop, str(result["member"])))
    # every row of every member was checked, and the steps really differ (the state advanced)
    assert sum(stop - start for start, stop, _ in covered) == MODELS[name][1] * (
        2 if layout.startswith("dp2") else 1
    )
    assert (reference[1] - reference[0]).abs().max() > 1e-3


def test_rollout_without_forcing_refuses_a_missing_forcing_tensor():
    model = _build("unet")
    x, _ = _inputs("unet")
    with pytest.raises(ValueError, match="no tensor for the input of step 1"):
        list(rollout(model, x, 2, forcing=lambda k: (None,), n_static=STATIC))
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        list(rollout(model, x, 0))


def test_advance_state_replaces_forcing_and_keeps_static():
    x = torch.arange(2 * 9 * 2 * 3, dtype=torch.float64).reshape(2, 9, 2, 3)  # 3x2 + 2 + 1
    pred, nxt = -torch.ones(2, 2, 2, 3), -2 * torch.ones(2, 2, 2, 3)
    (out,) = advance_state((x,), (pred,), nxt.double(), n_forcing=2, n_static=1)
    assert torch.equal(out[:, :4], x[:, 2:6]) and torch.equal(out[:, 4:6], pred.double())
    assert torch.equal(out[:, 6:8], nxt.double()) and torch.equal(out[:, 8:], x[:, 8:])
    with pytest.raises(ValueError, match="2 forcing channels expected, got none"):
        advance_state((x,), (pred,), None, n_forcing=2, n_static=1)
    # 5-D: the forcing and static channels are the surface input's (the last)
    upper, surface = torch.randn(1, 4, 3, 2, 3), torch.randn(1, 5, 2, 3)
    pu, ps, f = torch.randn(1, 2, 3, 2, 3), torch.randn(1, 2, 2, 3), torch.randn(1, 1, 2, 3)
    nu, ns = advance_state((upper, surface), (pu, ps), f, n_forcing=1, n_static=0)
    assert torch.equal(nu, torch.cat([upper[:, 2:], pu], 1))
    assert torch.equal(ns, torch.cat([surface[:, 2:4], ps, f], 1))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_sample_dataset(tmp_path_factory.mktemp("forcing") / "s.zarr", 20, 9, 16)


def test_dataset_lays_out_history_forcing_static_and_future_forcing(store):
    kw = {
        "upper_air_variables": ["T"],
        "surface_variables": ["t2m"],
        "levels": [500],
        "history_len": 2,
        "forecast_len": 3,
        "dynamic_forcing_variables": ["tsi"],
        "static_variables": ["orography"],
    }
    ds = ERA5Dataset(store, **kw)
    steps = ds.read_steps(4, 9)  # sample 4: inputs 4, 5; targets 6, 7, 8
    sample = ds[4]
    assert ds.channel_names_in == [
        "T_500@t-1",
        "t2m@t-1",
        "T_500@t",
        "t2m@t",
        "tsi@t",
        "orography",
    ]
    np.testing.assert_array_equal(sample["x"][:4].numpy(), steps[:2, :2].reshape(4, 9, 16))
    np.testing.assert_array_equal(sample["x"][4].numpy(), steps[1, 2])
    np.testing.assert_array_equal(sample["x"][5].numpy(), ds.static_fields[0])
    np.testing.assert_array_equal(sample["y"].numpy(), steps[2:, :2].reshape(6, 9, 16))
    np.testing.assert_array_equal(sample["forcing"].numpy(), steps[2:4, 2])
    # the insolation has a diurnal cycle and a night side; the static field does not vary
    assert float(sample["x"][4].std()) > 0.5 and not torch.equal(sample["x"][4], ds[5]["x"][4])
    assert torch.equal(sample["x"][5], ds[9]["x"][5])
    # rows read by a domain rank are the same rows of the globe, bitwise
    rows = ERA5Dataset(store, rows=(3, 7), **kw)[4]
    whole = ERA5Dataset(store, rows=(0, 9), **kw)[4]
    for key in ("x", "y", "forcing"):
        assert torch.equal(rows[key], whole[key][:, 3:7])
    with pytest.raises(ValueError, match="more than one kind"):
        ERA5Dataset(store, **{**kw, "static_variables": ["tsi"]})


def test_rollout_loss_with_forcing_equals_the_rollout_written_out():
    torch.manual_seed(1)
    model = torch.nn.Conv2d(C_IN, PROGNOSTIC, 3, padding=1).double()
    x, forcing = _inputs("unet")
    targets = torch.randn(2, 3 * PROGNOSTIC, 17, 16, dtype=torch.float64)
    stacked = torch.cat(forcing[1:3], 1)
    mse = lambda o, t: ((o[0] - t[0]) ** 2).mean()  # noqa: E731
    loss, _ = rollout_loss(
        model, (x,), (targets,), mse, 3, forcing=stacked, n_forcing=FORCING, n_static=STATIC
    )
    state, total = x, 0.0
    for k in range(3):
        y = model(state)
        total = total + ((y - targets[:, k * PROGNOSTIC : (k + 1) * PROGNOSTIC]) ** 2).mean()
        state = torch.cat([state[:, PROGNOSTIC:6], y, forcing[k + 1], state[:, -1:]], 1)
    assert (loss - total / 3).abs().item() <= 1e-14


def _train_conf(store, parallelism):
    return {
        "model": {
            "type": "unet",
            "in_channels": 2 * 2 + 1 + 1,  # history 2 x (T_500, t2m) + tsi + orography
            "out_channels": 2,
            "image_height": 9,
            "image_width": 16,
            "base_channels": 4,
            "channel_mults": [1, 2],
            "norm_groups": 2,
        },
        "data": {
            "path": str(store),
            "upper_air_variables": ["T"],
            "surface_variables": ["t2m"],
            "levels": [500],
            "history_len": 2,
            "forecast_len": 3,
            "dynamic_forcing_variables": ["tsi"],
            "static_variables": ["orography"],
            "time_slice": [0, 16],
            "num_workers": 0,
        },
        "trainer": {
            "parallelism": parallelism,
            "steps": 2,
            "batch_size": 2,
            "lr": 0.01,
            "seed": 5,
            "dtype": "float64",
            "dist_timeout_s": 60,
        },
    }


def _train_worker(rank, world, store):
    from credit_parallel.train.trainer import Trainer

    trainer = Trainer(_train_conf(store, {"data": "none", "tensor": 1, "domain": 2}))
    return [trainer.train_step() for _ in range(2)]


def test_training_with_forcing_at_domain2_equals_one_process(store):
    from credit_parallel.train.trainer import Trainer

    reference = Trainer(_train_conf(store, {"data": "none", "tensor": 1, "domain": 1}))
    assert reference.step_fn.n_forcing == 1 and reference.step_fn.n_static == 1
    assert reference.dataset[0]["forcing"].shape == (2, 9, 16)  # steps 2 and 3 of the rollout
    want = [reference.train_step() for _ in range(2)]
    for got in run_on_ranks(_train_worker, 2, store, timeout=240):
        for g, w in zip(got, want):
            for key in ("loss", "grad_norm"):
                assert abs(g[key] - w[key]) <= TOL, (key, g[key], w[key])


class _Tiny5D(torch.nn.Module):
    """(upper (B, 2*3, Z, H, W), surface (B, 2*2 + 1 + 1, H, W)) -> (3 upper, 2 surface)."""

    def __init__(self):
        super().__init__()
        self.upper = torch.nn.Conv3d(6, 3, 3, padding=1)
        self.surface = torch.nn.Conv2d(6, 2, 3, padding=1)
        self.couple = torch.nn.Conv2d(3, 2, 1)

    def forward(self, upper, surface):
        u = self.upper(upper)
        return u, self.surface(surface) + self.couple(u.mean(dim=2))


def _build_5d():
    torch.manual_seed(4)
    return _Tiny5D().double()


def _inputs_5d():
    g = torch.Generator().manual_seed(5)
    upper = torch.randn(1, 6, 2, 17, 16, generator=g, dtype=torch.float64)
    surface = torch.randn(1, 6, 17, 16, generator=g, dtype=torch.float64)
    forcing = [torch.randn(1, 1, 17, 16, generator=g, dtype=torch.float64) for _ in range(STEPS)]
    return upper, surface, forcing


def _rollout_5d_worker(rank, world):
    from credit_parallel.domain.convert import convert_to_domain_parallel
    from credit_parallel.domain.manager import DomainParallelManager

    manager = DomainParallelManager(world, world)
    model = convert_to_domain_parallel(_build_5d(), manager)
    start, stop = shard_range(17, world, rank)
    upper, surface, forcing = _inputs_5d()
    state = (upper[..., start:stop, :], surface[..., start:stop, :])
    outs = rollout(
        model,
        state,
        STEPS,
        forcing=lambda k: forcing[k][..., start:stop, :],
        manager=manager,
        n_static=1,
    )
    return (start, stop), [(u.clone(), s.clone()) for u, s in outs]


def test_5d_rollout_with_surface_forcing_at_domain2_equals_one_process():
    model = _build_5d().eval()
    upper, surface, forcing = _inputs_5d()
    reference = []
    with torch.no_grad():
        for k in range(STEPS):
            u, s = model(upper, surface)
            reference.append((u, s))
            nxt = forcing[k + 1] if k + 1 < STEPS else forcing[k]
            upper = torch.cat([upper[:, 3:], u], 1)
            surface = torch.cat([surface[:, 2:4], s, nxt, surface[:, 5:]], 1)
    assert (reference[1][1] - reference[0][1]).abs().max() > 1e-3
    for (start, stop), outs in run_on_ranks(_rollout_5d_worker, 2, timeout=240):
        for (u, s), (ru, rs) in zip(outs, reference):
            assert (u - ru[..., start:stop, :]).abs().max() <= TOL
            assert (s - rs[..., start:stop, :]).abs().max() <= TOL
