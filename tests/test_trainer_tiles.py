"""The trainer on lat x lon tiles (issue 26, SPEC §3b): the demo U-Net at {lat 2, lon 2} trains
like one process, and checkpoints move between 1-D and 2-D layouts with the optimizer.

The bundled demo config (``configs/demo_unet.yaml``: 33 x 64 grid, both poles, 17 / 16 rows per
latitude band; forcing and static channels), float64, on a sample store of its grid:

* 3 AdamW steps at ``{data: none, domain: {lat: 2, lon: 2}}`` and at ``{data: fsdp2, ...}``:
  the losses, gradient norms and learning rates of every step and the final weights equal the
  single-process run's (max abs error <= 1e-10); so do ``evaluate``'s RMSE and ACC (against the
  training climatology read by tiles); a batch of another tile's width is refused;
* a checkpoint saved after 2 steps at ``{fsdp2, domain: 2}`` (dp 2 x domain 2, one sample per
  dp rank: the same global batches) resumes at ``{fsdp2, domain: {lat 2, lon 2}}``, and one
  saved at {lat 2, lon 2} resumes at domain 2: the third step's loss and the weights after it
  equal the uninterrupted run's (AdamW's moments and step count came along).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here so forked workers inherit it)
import torch.distributed.tensor  # noqa: F401

import credit_parallel
from credit_parallel.data import write_sample_dataset
from credit_parallel.layout.config import load_config
from credit_parallel.testing import run_on_ranks
from credit_parallel.train.trainer import Trainer

TOL = 1e-10
DEMO = Path(credit_parallel.__file__).parent / "configs" / "demo_unet.yaml"
TILES = {"lat": 2, "lon": 2}
STEPS, SAVE_AT = 3, 2


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    conf = load_config(DEMO)["model"]
    path = tmp_path_factory.mktemp("demo") / "demo.zarr"
    height, width = conf["image_height"], conf["image_width"]
    return str(write_sample_dataset(path, n_times=16, nlat=height, nlon=width))


def _conf(store, data="none", domain=TILES, batch_size=2, tensor=1):
    conf = copy.deepcopy(load_config(DEMO))
    conf["data"].update(path=store, time_slice=[0, 12], valid_time_slice=[12, 16], num_workers=0)
    conf["trainer"].update(
        parallelism={"data": data, "tensor": tensor, "domain": domain},
        dtype="float64",
        steps=STEPS,
        batch_size=batch_size,
        lr=0.01,
        warmup_steps=1,
        val_batches=1,
    )
    return conf


def _params(trainer):
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in trainer.model.named_parameters():
        t = p.detach()
        name = name.removeprefix("module.")  # DDP's wrapper
        out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).clone()
    return out


def _run(trainer, steps):
    return [trainer.train_step() for _ in range(steps)]


def _domain2(store):
    """The 1-D layout at 4 ranks: FSDP2 over dp 2 x domain 2 with 1 sample per dp rank, the
    same global batches as 2 samples at dp 1 (the sampler's order is a function of the
    micro-batch number)."""
    return Trainer(_conf(store, "fsdp2", 2, batch_size=1))


def _tiles_worker(rank, world, store, dirs):
    out = {}
    trainer = _domain2(store)
    _run(trainer, SAVE_AT)
    trainer.save(dirs["from_1d"])
    trainer = Trainer(_conf(store))
    out["none"] = (_run(trainer, STEPS), _params(trainer))
    trainer.use_training_climatology()
    out["evaluate"] = trainer.evaluate()
    out["wrong_tile"] = _wrong_tile_message(trainer)
    trainer = Trainer(_conf(store, "fsdp2"))
    records = _run(trainer, SAVE_AT)
    trainer.save(dirs["from_2d"])
    out["fsdp2"] = (records + _run(trainer, STEPS - SAVE_AT), _params(trainer))
    trainer = Trainer(_conf(store, "fsdp2"))
    trainer.resume_latest(dirs["from_1d"])
    out["resumed_from_1d"] = (_run(trainer, STEPS - SAVE_AT), _params(trainer))
    trainer = _domain2(store)
    trainer.resume_latest(dirs["from_2d"])
    out["resumed_from_2d"] = (_run(trainer, STEPS - SAVE_AT), _params(trainer))
    return out


def _wrong_tile_message(trainer):
    """``register_row_batch``'s refusal of a batch one column too wide for this rank's tile."""
    from credit_parallel.data.loader import register_row_batch

    rows = trainer.dataset.sample_grid_shape[0]
    x = torch.zeros(1, 2, rows, 33)  # every tile of 64 columns over 2 ranks is 32 wide
    try:
        register_row_batch({"x": x}, 33, manager=trainer.manager, global_width=64)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def runs(store, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    dirs = {"from_1d": str(root / "from_1d"), "from_2d": str(root / "from_2d")}
    return run_on_ranks(_tiles_worker, 4, store, dirs, timeout=400)


@pytest.fixture(scope="module")
def reference(store):
    trainer = Trainer(_conf(store, domain=1))
    records = _run(trainer, STEPS)
    params = _params(trainer)
    trainer.use_training_climatology()
    return records, params, trainer.evaluate()


def _assert_records(got, want):
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        for key in ("loss", "grad_norm", "lr"):
            assert abs(g[key] - w[key]) <= TOL, (g["step"], key, g[key], w[key])


def _assert_params(got, want):
    assert got.keys() == want.keys()
    err = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert err <= TOL, err


def test_three_demo_steps_at_lat2_lon2_equal_one_process(runs, reference):
    records, params, _ = reference
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0]  # it trains
    # the demo's grad_clip (1.0) acts at every step: the clipped update is what is compared
    assert all(r["grad_norm"] > 1.0 for r in records)
    for out in runs:  # every rank reports the same numbers
        for mode in ("none", "fsdp2"):
            _assert_records(out[mode][0], records)
            _assert_params(out[mode][1], params)


def test_evaluate_on_tiles_equals_one_process(runs, reference):
    expected = reference[2]
    assert any(k.startswith("acc/") for k in expected)  # the climatology was read and used
    for out in runs:
        assert out["evaluate"].keys() == expected.keys()
        for key, value in expected.items():
            assert abs(out["evaluate"][key] - value) <= TOL, key


def test_a_batch_of_another_tile_is_refused_naming_the_columns(runs):
    for rank, out in enumerate(runs):
        assert f"has 33 columns along dim 3 but domain rank {rank} of 4 owns 32 of 64" in (
            out["wrong_tile"] or ""
        )


def test_checkpoints_move_between_domain2_and_lat2_lon2_with_the_optimizer(runs, reference):
    records, params, _ = reference
    for got, weights in [out[k] for out in runs for k in ("resumed_from_1d", "resumed_from_2d")]:
        _assert_records(got, records[SAVE_AT:])  # step 3 after the resume: AdamW moments kept
        _assert_params(weights, params)


# ----------------------------------------------------------------------------- ddp, tensor, dp x tiles
# 4 ranks each; one sample per dp rank at dp 2 (the same global batches as 2 samples at dp 1)
_LAYOUTS = {
    "ddp_dp2_x_1x2": dict(data="ddp", domain={"lat": 1, "lon": 2}, batch_size=1),
    "fsdp2_dp2_x_1x2": dict(data="fsdp2", domain={"lat": 1, "lon": 2}, batch_size=1),
    "tensor2_x_1x2": dict(data="none", domain={"lat": 1, "lon": 2}, tensor=2),
    "fsdp2_tensor2_x_1x2": dict(data="fsdp2", domain={"lat": 1, "lon": 2}, tensor=2),
}
_DP2_X_2X2 = {"ddp_dp2_x_2x2": dict(data="ddp", domain=TILES, batch_size=1)}  # 8 ranks


def _layouts_worker(rank, world, store, names):
    out = {}
    for name in names:
        trainer = Trainer(_conf(store, **{**_LAYOUTS, **_DP2_X_2X2}[name]))
        out[name] = (_run(trainer, STEPS), _params(trainer))
    return out


@pytest.mark.slow  # 4 ranks x 4 layouts x 3 steps of the demo: ~1 min on 2 loaded cores
def test_ddp_tensor_and_dp_times_tiles_train_like_one_process(store, reference):
    records, params, _ = reference
    for out in run_on_ranks(_layouts_worker, 4, store, list(_LAYOUTS), timeout=600):
        for name in _LAYOUTS:
            _assert_records(out[name][0], records)
            _assert_params(out[name][1], params)


@pytest.mark.slow  # 8 ranks on 2 cores
def test_ddp_over_dp2_x_lat2_lon2_trains_like_one_process(store, reference):
    records, params, _ = reference
    for out in run_on_ranks(_layouts_worker, 8, store, ["ddp_dp2_x_2x2"], timeout=600):
        _assert_records(out["ddp_dp2_x_2x2"][0], records)
        _assert_params(out["ddp_dp2_x_2x2"][1], params)
