"""The Trainer on a CRPS loss under the ensemble axis follows the one-process trajectory.

``trainer.ensemble_size: 2`` members of each sample trained on ``KCRPS`` (flat), a U-Net with
noise injected on its input (drawn layout-independently): the loss and gradient-norm trajectory
and the final weights under ``{data: fsdp2, ensemble: 2, domain: 2}`` (4 ranks, 17 uneven rows)
equal the one-process run (float64 1e-10); its checkpoint resumes at one process and under
(ensemble 2, domain 1) on the same trajectory.  Bad ensemble keys are refused before any rank
starts, naming the key.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here so forked workers inherit it)
import torch.distributed.tensor  # noqa: F401
from torch import nn

from credit_parallel.data import write_sample_dataset
from credit_parallel.models import build_model
from credit_parallel.testing import run_on_ranks
from credit_parallel.train.checkpoint import latest_checkpoint
from credit_parallel.train.preflight import check_run
from credit_parallel.train.trainer import Trainer
from sample_conf import unet_run_conf

H, W, STEPS = 17, 32, 3


class _NoisyInput(nn.Module):
    """A model whose members differ: Gaussian noise on the input, reseeded per call (as a
    script that seeds before each forward)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.calls = 0

    def forward(self, x):
        torch.manual_seed(1000 + self.calls)
        self.calls += 1
        return self.model(x + 0.1 * torch.randn_like(x))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "s.zarr"
    return str(write_sample_dataset(path, n_times=24, nlat=H, nlon=W))


def _conf(store, parallelism=None, loss="KCRPS", members=2):
    conf = unet_run_conf(
        store,
        H,
        W,
        time_slice=[0, 20],
        parallelism=parallelism,
        data={"valid_time_slice": [20, 24]},
        steps=STEPS,
        batch_size=2,
        lr=0.01,
        seed=3,
        dtype="float64",
        ensemble_size=members,
    )
    conf["loss"] = {"training_loss": loss}
    return conf


def _model(conf):
    torch.manual_seed(5)
    return _NoisyInput(build_model(conf["model"])).double()


def _run(conf):
    trainer = Trainer(conf, model=_model(conf))
    records = [trainer.train_step() for _ in range(STEPS)]
    params = {}
    for name, p in trainer.model.named_parameters():
        t = p.detach()
        params[name] = t.full_tensor() if hasattr(t, "full_tensor") else t.clone()
    return records, params


def _rank(rank, world, store, parallelism, loss):
    return _run(_conf(store, parallelism, loss))


@pytest.mark.parametrize("loss", ["KCRPS", "ring-crps"])
def test_crps_training_under_ensemble_2_domain_2_equals_one_process(store, loss):
    ref_records, ref_params = _run(_conf(store, loss=loss))
    layout = {"data": "fsdp2", "ensemble": 2, "domain": 2}
    for records, params in run_on_ranks(_rank, 4, store, layout, loss, timeout=300):
        for got, want in zip(records, ref_records):
            assert abs(got["loss"] - want["loss"]) <= 1e-10
            assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-10
        for name, p in params.items():
            assert (p - ref_params[name]).abs().max() <= 1e-10, name
    assert ref_records[0]["loss"] > 0 and ref_records[-1]["loss"] != ref_records[0]["loss"]


def test_bad_ensemble_keys_are_refused_naming_the_key(store):
    cases = [
        (_conf(store, members=1), r"trainer\.ensemble_size >= 2"),
        (_conf(store, loss="ring-crps", members=1), r"ring-crps needs trainer\.ensemble_size"),
        (
            _conf(store, {"data": "fsdp2", "ensemble": 2}, members=3),
            r"trainer\.ensemble_size = 3 is not a multiple of trainer\.parallelism\.ensemble = 2",
        ),
        (_conf(store, loss="mse", members=2), r"trainer\.ensemble_size = 2 trains members"),
    ]
    for conf, words in cases:
        with pytest.raises(ValueError, match=words):
            check_run(conf, 2, model=_model(conf))
    with pytest.raises(ValueError, match=r"trainer\.ensemble_size = 2: the model \(UNet"):
        check_run(_conf(store), 1)  # the plain U-Net draws nothing: identical members


def _save_rank(rank, world, store, parallelism, directory):
    trainer = Trainer(_conf(store, parallelism), model=_model(_conf(store)))
    for _ in range(2):
        trainer.train_step()
    trainer.save(directory)


def _resume(conf, directory):
    """Load the checkpoint into ``conf``'s layout, take the third step."""
    trainer = Trainer(conf, model=_model(conf))
    trainer.load(latest_checkpoint(directory))
    trainer.model.calls = 2  # the noise stream of step 3, as the uninterrupted run draws it
    record = trainer.train_step()
    params = {}
    for name, p in trainer.model.named_parameters():
        t = p.detach()
        params[name] = t.full_tensor() if hasattr(t, "full_tensor") else t.clone()
    return record, params


def _resume_rank(rank, world, store, parallelism, directory):
    return _resume(_conf(store, parallelism), directory)


@pytest.mark.slow
def test_checkpoint_of_ensemble_2_domain_2_resumes_at_one_process_and_at_ensemble_2(
    store, tmp_path
):
    """DCP reshards across E: saved under (E 2, domain 2), resumed at one process and under
    (E 2, domain 1), the third step equals the uninterrupted one-process run."""
    ref_records, ref_params = _run(_conf(store))
    run_on_ranks(_save_rank, 4, store, {"data": "fsdp2", "ensemble": 2, "domain": 2}, str(tmp_path))
    results = [_resume(_conf(store), str(tmp_path))]
    results += run_on_ranks(_resume_rank, 2, store, {"data": "fsdp2", "ensemble": 2}, str(tmp_path))
    for record, params in results:
        assert record["step"] == 3
        assert abs(record["loss"] - ref_records[2]["loss"]) <= 1e-10
        for name, p in params.items():
            assert (p - ref_params[name]).abs().max() <= 1e-10, name


def test_plan_states_the_crps_communication_and_memory(store):
    from credit_parallel.planner import make_plan
    from credit_parallel.planner.report import format_plan

    conf = _conf(store, {"data": "fsdp2", "ensemble": 2, "domain": 2})
    shape = (conf["model"]["in_channels"], H, W)
    plan = make_plan(conf, 4, model=_model(conf).to("meta"), input_shapes=[shape])
    lines = [n for n in plan.notes if n.startswith("ensemble: KCRPS")]
    assert len(lines) == 1, plan.notes
    # output (C, 17, 32): 9 rows of the larger shard, 2 samples, 1 member sent per ring shift
    channels = conf["model"]["out_channels"]
    bytes_per = plan.memory.activation_dtype_bytes
    sent = channels * 9 * 32 * 2 * bytes_per / 2**20
    assert f"sends {sent:.2f} MiB (1 ring shift(s)" in lines[0]
    assert f"holds {4 * sent:.2f} MiB" in lines[0]
    assert any(n.startswith("random draws:") for n in plan.notes)
    assert plan.dims.ensemble == 2 and plan.dp == 1
    # the rank table: rank 2 is member group 1 of dp 0, domain rank 0; its ensemble group [0, 2]
    assert [(r.rank, r.ensemble, r.domain, r.ensemble_group) for r in plan.ranks][2] == (
        2,
        1,
        0,
        (0, 2),
    )
    text = format_plan(plan)
    assert "ensemble group" in text and "x ensemble=2" in text


def _verify_rank(rank, world, parallelism):
    from credit_parallel.tools.verify import judge, verify_layout
    from test_verify_models import UNET

    conf = {
        "model": dict(UNET),
        "trainer": {"parallelism": parallelism, "seed": 1, "ensemble_size": 4},
        "loss": {"training_loss": "almost-fair-crps", "training_loss_parameters": {"alpha": 0.9}},
    }
    return judge(verify_layout(conf, dtype=torch.float64, batch_size=2), torch.float64)


def test_verify_checks_the_crps_step_under_ensemble_2_domain_2():
    """``credit-parallel verify`` on an ensemble config: the one-process 4-member CRPS step
    against (E 2, domain 2): outputs of every member, input gradients, every parameter."""
    for rows in run_on_ranks(_verify_rank, 4, {"data": "fsdp2", "ensemble": 2, "domain": 2}):
        assert rows and all(r[-1] == "PASS" for r in rows), rows
        assert any(r[0].startswith("output") for r in rows)
        assert any(r[0].startswith("grad ") and r[2] > 0 for r in rows)
