"""The trainer on lat x lon tiles with the bundled CrossFormer (issue 26 item 3): its window
attention (short and long-distance) runs on latitude strips between two all-to-alls
(``domain/tiles_relayout.py``), its convolutions, patch embeddings and GroupNorms on the tiles.

The bundled demo config (``configs/demo_crossformer.yaml``, its grid cut to 32 x 32: 16 / 16
rows per latitude band, 16 / 16 columns per longitude band), float64, on a sample store of its grid:
3 AdamW steps at ``{data: ddp, domain: {lat: 2, lon: 2}}`` (4 ranks, dp 1): the losses, gradient
norms and learning rates of every step and the final weights equal the single-process run's
(max abs error <= 1e-10).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

import credit_parallel
from credit_parallel.data import write_sample_dataset
from credit_parallel.layout.config import load_config
from credit_parallel.testing import run_on_ranks
from credit_parallel.train.trainer import Trainer

TOL = 1e-10
DEMO = Path(credit_parallel.__file__).parent / "configs" / "demo_crossformer.yaml"
STEPS = 3
WIDTH = 32  # the demo's 64 columns cut to 32 (fast): 8 / 4 columns per tile at the two levels


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    conf = load_config(DEMO)["model"]
    path = tmp_path_factory.mktemp("demo_crossformer") / "demo.zarr"
    return str(write_sample_dataset(path, n_times=12, nlat=conf["image_height"], nlon=WIDTH))


def _conf(store, data="none", domain=1):
    conf = copy.deepcopy(load_config(DEMO))
    conf["model"]["image_width"] = WIDTH
    conf["data"].update(path=store, time_slice=[0, 10], valid_time_slice=[10, 12], num_workers=0)
    conf["trainer"].update(
        parallelism={"data": data, "tensor": 1, "domain": domain},
        dtype="float64",
        steps=STEPS,
        batch_size=2,
        lr=0.01,
        warmup_steps=1,
        val_batches=1,
    )
    return conf


def _params(trainer):
    out = {}
    for name, p in trainer.model.named_parameters():
        out[name.removeprefix("module.")] = p.detach().clone()  # DDP's wrapper
    return out


def _train(conf):
    trainer = Trainer(conf)
    records = [trainer.train_step() for _ in range(STEPS)]
    kinds = {type(m).__name__ for m in trainer.model.modules()}
    kinds |= {type(getattr(m, "wrapped", None)).__name__ for m in trainer.model.modules()}
    return records, _params(trainer), kinds


def _tiles_worker(rank, world, store):
    return _train(_conf(store, "ddp", {"lat": 2, "lon": 2}))


def test_three_crossformer_steps_at_lat2_lon2_ddp_equal_one_process(store):
    records, params, _ = _train(_conf(store))
    assert records[-1]["loss"] < records[0]["loss"]  # it trains
    for got, weights, kinds in run_on_ranks(_tiles_worker, 4, store, timeout=400):
        assert {"TileStripRelayout", "DomainRowGroupAttention"} <= kinds  # attention on strips
        assert [r["step"] for r in got] == [r["step"] for r in records]
        for g, w in zip(got, records):
            for key in ("loss", "grad_norm", "lr"):
                assert abs(g[key] - w[key]) <= TOL, (g["step"], key, g[key], w[key])
        assert weights.keys() == params.keys()
        err = max(float((weights[k] - params[k]).abs().max()) for k in params)
        assert err <= TOL, err
