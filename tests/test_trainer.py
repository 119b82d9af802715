"""The Trainer under a parallel layout follows the single-process trajectory exactly.

References run in this (test) process without a process group; the parallel runs are grouped
into one 2-rank worker call (building a Trainer per layout inside it), because forking ranks and
importing DTensor are the expensive parts on a busy machine.  Everything runs in float64
(``trainer.dtype``) and is compared at max abs error <= 1e-10: the 10-step loss trajectory,
gradient norms and final weights under domain 2; a forecast_len 2 rollout under domain 2;
validation RMSE under domain 2; gradient accumulation (2 x half batch == one batch, also under
FSDP2 with dp 2); and the non-finite policy with a NaN injected on one domain rank's rows only.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here so forked workers inherit it)
import torch.distributed.tensor  # noqa: F401

from credit_parallel.data import ERA5Dataset, write_sample_dataset
from credit_parallel.testing import run_on_ranks
from credit_parallel.train.trainer import NonFiniteError, Trainer
from sample_conf import unet_run_conf

__all__: list[str] = []

TOL = 1e-10
H, W = 17, 32  # 17 rows: uneven 9 / 8 shards under domain 2, both poles included
NAN_STEP = 3  # the (1-based) step whose batch carries a NaN under the non-finite tests


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return str(
        write_sample_dataset(tmp_path_factory.mktemp("data") / "s.zarr", n_times=40, nlat=H, nlon=W)
    )


def _conf(store, *, parallelism=None, forecast_len=1, **trainer):
    base = {
        "steps": 10,
        "batch_size": 2,
        "lr": 0.01,
        "warmup_steps": 2,
        "grad_clip": 1.0,
        "seed": 3,
        "dtype": "float64",
        "validate_every": 5,
        "val_batches": 2,
    }
    data = {"forecast_len": forecast_len, "valid_time_slice": [33, 40]}
    return unet_run_conf(
        store, H, W, time_slice=[0, 33], parallelism=parallelism, data=data, **{**base, **trainer}
    )


class NaNAtStep(torch.utils.data.Dataset):
    """Wraps a dataset; while ``trainer.step + 1 == NAN_STEP`` every sample's target gets a NaN
    in its LAST row, which only the last domain rank holds: the other ranks must learn of it
    through the gradient sync / loss reduction, not from their own data."""

    def __init__(self, inner):
        self.inner = inner
        self.trainer = None

    def __len__(self):
        return len(self.inner)

    def __getattr__(self, name):  # lat_weights, forecast_len, variable_names, ...
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __getitem__(self, i):
        sample = dict(self.inner[i])
        if self.trainer is not None and self.trainer.step + 1 == NAN_STEP:
            y = sample["y"].clone()
            y[0, -1, 5] = float("nan")
            sample["y"] = y
        return sample


def _nan_trainer(conf):
    dataset = NaNAtStep(ERA5Dataset(**_dataset_kwargs(conf)))
    trainer = Trainer(conf, dataset=dataset, val_dataset=dataset.inner)
    dataset.trainer = trainer
    return trainer


def _dataset_kwargs(conf):
    d = conf["data"]
    return {
        "path": d["path"],
        "upper_air_variables": d["upper_air_variables"],
        "surface_variables": d["surface_variables"],
        "levels": d["levels"],
        "forecast_len": d["forecast_len"],
        "time_slice": tuple(d["time_slice"]),
    }


def _params(trainer):
    """Full parameters by name (DTensors gathered: a collective, every rank calls it)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in trainer.model.named_parameters():
        t = p.detach()
        out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).clone()
    return out


def _run(trainer, steps):
    return [trainer.train_step() for _ in range(steps)]


def _skip_run(conf):
    """Steps 1..5 with a NaN at NAN_STEP under nonfinite 'skip'; the params before/after it."""
    trainer = _nan_trainer(conf)
    records = _run(trainer, NAN_STEP - 1)
    before = _params(trainer)
    records += _run(trainer, 1)
    after = _params(trainer)
    records += _run(trainer, 2)
    return records, before, after, _params(trainer)


def _stop_run(conf):
    trainer = _nan_trainer(conf)
    try:
        _run(trainer, NAN_STEP + 1)
    except NonFiniteError as exc:
        return str(exc), trainer.step
    return None, trainer.step


def _suite_worker(rank, world, store):
    domain2 = {"data": "none", "tensor": 1, "domain": 2}
    out = {}
    fsdp_domain = {"data": "fsdp2", "tensor": 1, "domain": 2}
    trainer = Trainer(_conf(store, parallelism=fsdp_domain))
    out["init_fsdp2_domain2"] = _params(trainer)
    out["fsdp2_domain2"] = (_run(trainer, 3), _params(trainer))
    trainer = Trainer(_conf(store, parallelism=domain2))
    out["trajectory"] = _run(trainer, 10)
    out["params"] = _params(trainer)
    out["evaluate"] = trainer.evaluate()
    out["rollout"] = _run(Trainer(_conf(store, parallelism=domain2, forecast_len=2)), 3)
    fsdp = {"data": "fsdp2", "tensor": 1, "domain": 1}
    trainer = Trainer(_conf(store, parallelism=fsdp, batch_size=1, grad_accum=2))
    out["accum_fsdp2"] = (_run(trainer, 2), _params(trainer))
    out["skip"] = _skip_run(_conf(store, parallelism=domain2, nonfinite="skip"))
    out["stop"] = _stop_run(_conf(store, parallelism=domain2, nonfinite="stop"))
    return out


@pytest.fixture(scope="module")
def parallel(store):
    return run_on_ranks(_suite_worker, 2, store, timeout=240)


def _max_param_err(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _assert_same_records(par, ref, keys=("loss", "grad_norm", "lr")):
    assert [r["step"] for r in par] == [r["step"] for r in ref]
    for p, r in zip(par, ref):
        for key in keys:
            assert abs(p[key] - r[key]) <= TOL, (p["step"], key, p[key], r[key])


def test_domain2_ten_step_loss_trajectory_and_weights_match_single_process(store, parallel):
    ref = Trainer(_conf(store))
    ref_records = _run(ref, 10)
    losses = [r["loss"] for r in ref_records]
    assert losses[-1] < losses[0]  # it trains (the comparison is not between two flat lines)
    for out in parallel:  # every rank reports the same numbers
        _assert_same_records(out["trajectory"], ref_records)
        assert _max_param_err(out["params"], _params(ref)) <= TOL


def test_fsdp2_over_domain2_initial_weights_equal_the_plain_single_process_build(store, parallel):
    from credit_parallel.models import build_model

    conf = _conf(store)
    ref = _params(Trainer(conf))
    torch.manual_seed(conf["trainer"]["seed"])
    plain = dict(build_model(conf["model"]).to(torch.float64).named_parameters())
    assert ref.keys() == plain.keys()
    assert all(torch.equal(ref[k], plain[k].detach()) for k in ref)  # the trainer's meta build
    for out in parallel:  # FSDP2 over dp x domain, materialised shard by shard on each rank
        got = out["init_fsdp2_domain2"]
        assert got.keys() == ref.keys()
        assert all(torch.equal(got[k], ref[k]) for k in ref), "initial weights differ"


def test_fsdp2_over_domain2_three_adamw_steps_match_single_process(store, parallel):
    ref = Trainer(_conf(store))
    ref_records = _run(ref, 3)
    for records, params in (out["fsdp2_domain2"] for out in parallel):
        _assert_same_records(records, ref_records)
        assert _max_param_err(params, _params(ref)) <= TOL


def test_domain2_evaluate_rmse_matches_single_process(store, parallel):
    ref = Trainer(_conf(store))
    _run(ref, 10)
    expected = ref.evaluate()
    assert len(expected) == 8 and all(k.startswith("rmse/") for k in expected)
    for out in parallel:
        assert out["evaluate"].keys() == expected.keys()
        for key, value in expected.items():
            assert abs(out["evaluate"][key] - value) <= TOL, key


def test_domain2_forecast_len2_rollout_matches_single_process(store, parallel):
    ref_records = _run(Trainer(_conf(store, forecast_len=2)), 3)
    one_step = _run(Trainer(_conf(store)), 3)
    # the rollout loss differs from the one-step loss: the second step really ran
    assert abs(ref_records[0]["loss"] - one_step[0]["loss"]) > 1e-3
    for out in parallel:
        _assert_same_records(out["rollout"], ref_records)


def test_grad_accumulation_two_half_batches_equal_one_full_batch(store, parallel):
    full = Trainer(_conf(store, batch_size=4))
    full_records = _run(full, 2)
    halves = Trainer(_conf(store, batch_size=2, grad_accum=2))
    half_records = _run(halves, 2)
    _assert_same_records(half_records, full_records)
    assert _max_param_err(_params(halves), _params(full)) <= TOL
    # FSDP2 over 2 dp ranks, 1 sample per micro-batch x 2: the same global batches and update
    for records, params in (out["accum_fsdp2"] for out in parallel):
        _assert_same_records(records, full_records)
        assert _max_param_err(params, _params(full)) <= TOL


def test_nonfinite_stop_raises_naming_the_step_on_every_rank(store, parallel):
    message, step = _stop_run(_conf(store, nonfinite="stop"))
    assert message is not None and f"step {NAN_STEP}" in message and "nonfinite" in message
    assert step == NAN_STEP - 1
    for rank, out in enumerate(parallel):
        message, step = out["stop"]
        assert message is not None, f"rank {rank} did not raise NonFiniteError"
        assert f"step {NAN_STEP}" in message, message
        assert step == NAN_STEP - 1


def test_nonfinite_skip_leaves_params_unchanged_and_continues_identically(store, parallel):
    ref_records, ref_before, ref_after, ref_final = _skip_run(_conf(store, nonfinite="skip"))
    assert [bool(r.get("nonfinite")) for r in ref_records] == [False, False, True, False, False]
    assert all(torch.equal(ref_before[k], ref_after[k]) for k in ref_before)
    for out in parallel:
        records, before, after, final = out["skip"]
        assert [bool(r.get("nonfinite")) for r in records] == [False, False, True, False, False]
        assert all(torch.equal(before[k], after[k]) for k in before), "params changed on skip"
        finite = [r for r in records if not r.get("nonfinite")]
        _assert_same_records(finite, [r for r in ref_records if not r.get("nonfinite")])
        assert _max_param_err(final, ref_final) <= TOL
    # both domain ranks hold bit-identical weights after the skipped step
    finals = [out["skip"][3] for out in parallel]
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])


# --------------------------------------------------------------------------- loader workers
def _workers(trainer):
    return list(trainer._batches._batches._workers)  # the DataLoader iterator's processes


def test_close_stops_the_training_loader_workers_and_a_collected_trainer_stops_them_too(store):
    import gc

    trainer = Trainer(_conf(store))
    workers = _workers(trainer)
    assert len(workers) == 2 and all(w.is_alive() for w in workers)
    first = trainer.train_step()["loss"]
    trainer.close()
    assert not any(w.is_alive() for w in workers)
    with pytest.raises(StopIteration):
        next(trainer._batches)

    # collected without close(): the finalizer stops the workers while the queues are intact
    # (left to the iterator's own __del__ inside the collector, each worker waited out its 5 s
    # status timeout and was then killed)
    trainer = Trainer(_conf(store))
    assert trainer.train_step()["loss"] == first  # same data, same step
    workers, finalizer = _workers(trainer), trainer._batches._finalizer
    del trainer
    gc.collect()
    assert not finalizer.alive
    for w in workers:
        w.join(timeout=0)
        assert w.exitcode == 0, w.exitcode  # stopped by the signal, not terminated
