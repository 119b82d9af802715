"""``model.type`` beyond the bundled models: an import path ``package.module:Name`` and a
miles-credit model block built by miles-credit's own loader; ``plan``, ``verify`` and training
on the sample data with a real miles-credit CrossFormer (its forward takes the trainer's 4-D
batches as one frame)."""

from __future__ import annotations

import pytest
import torch

from credit_parallel.data import write_sample_dataset
from credit_parallel.models import UNet, build_model, external
from credit_parallel.testing import run_on_ranks
from miles_credit import import_credit
from sample_conf import SAMPLE_DATA, tiny_unet

H, W = 32, 64

# a miles-credit CrossFormer (4 levels, as CREDIT requires) on the sample store's 8 channels
CREDIT_CROSSFORMER = {
    "type": "crossformer",
    "image_height": H,
    "image_width": W,
    "frames": 1,
    "channels": 3,
    "surface_channels": 2,
    "input_only_channels": 0,
    "output_only_channels": 0,
    "levels": 2,
    "dim": [4, 8, 16, 32],
    "depth": [2, 2, 2, 2],
    "dim_head": 4,
    "global_window_size": [2, 2, 2, 1],
    "local_window_size": 2,
    "cross_embed_kernel_sizes": [[2, 4], [2, 4], [2, 4], [2, 4]],
    "cross_embed_strides": [2, 2, 2, 2],
    "use_spectral_norm": False,
    "interp": False,
}


def _credit_loaded():
    # miles-credit's model files import packages this venv lacks (tests/miles_credit.py); once
    # imported here its loader finds the module in sys.modules (forked ranks inherit it)
    return import_credit("credit.models.crossformer")


def test_import_path_builds_a_class_with_its_keys_checked():
    kwargs = tiny_unet(16, 32)
    kwargs["type"] = "credit_parallel.models.unet:UNet"
    assert isinstance(build_model(kwargs), UNet)
    with pytest.raises(ValueError, match=r"model\.colour is not an argument of"):
        build_model({**kwargs, "colour": 1})
    with pytest.raises(ValueError, match=r"model\.in_channels is required"):
        build_model({k: v for k, v in kwargs.items() if k != "in_channels"})


def test_import_path_builds_through_a_factory_and_refuses_what_is_not_a_module():
    model = build_model({"type": "torch.nn:Linear", "in_features": 3, "out_features": 2})
    assert isinstance(model, torch.nn.Linear) and model.out_features == 2
    with pytest.raises(ValueError, match="returned a dict, not an nn.Module"):
        build_model({"type": "sample_conf:tiny_unet", "height": 8, "width": 8})
    with pytest.raises(ValueError, match="cannot import 'no_such_package.models'"):
        build_model({"type": "no_such_package.models:Net"})
    with pytest.raises(ValueError, match="has no 'Nope'"):
        build_model({"type": "torch.nn:Nope"})


def test_credit_block_is_built_by_miles_credit_and_takes_four_d_batches():
    crossformer = _credit_loaded()
    model = build_model(dict(CREDIT_CROSSFORMER))
    assert isinstance(model, crossformer.CrossFormer)
    assert model.input_shapes == ((8, H, W),)
    # the same parameters and state_dict keys as miles-credit's own class builds
    torch.manual_seed(0)
    theirs = crossformer.CrossFormer(**{k: v for k, v in CREDIT_CROSSFORMER.items() if k != "type"})
    assert list(model.state_dict()) == list(theirs.state_dict())
    model.load_state_dict(theirs.state_dict())
    x = torch.randn(1, 8, H, W)
    assert torch.equal(model(x), theirs(x.unsqueeze(2)).squeeze(2))


def test_a_typo_in_a_bundled_block_names_both_readings():
    _credit_loaded()
    with pytest.raises(ValueError, match=r"model\.depth_typo is not an argument of 'unet'"):
        build_model({**tiny_unet(16, 32), "depth_typo": 1})


def test_credit_block_without_miles_credit_names_the_package(monkeypatch):
    monkeypatch.setattr(external.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        ValueError, match=r"needs the miles-credit package \(pip install miles-credit"
    ):
        build_model({"type": "fuxi", "dim": 8})
    with pytest.raises(ValueError, match="needs the miles-credit package"):
        build_model(dict(CREDIT_CROSSFORMER))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return str(
        write_sample_dataset(tmp_path_factory.mktemp("data") / "s.zarr", n_times=12, nlat=H, nlon=W)
    )


def _conf(store, parallelism):
    return {
        "model": dict(CREDIT_CROSSFORMER),
        "data": {"path": store, **SAMPLE_DATA, "time_slice": [0, 10], "valid_time_slice": [10, 12]},
        "trainer": {
            "parallelism": parallelism,
            "steps": 3,
            "batch_size": 1,
            "lr": 0.01,
            "warmup_steps": 1,
            "seed": 3,
            "dtype": "float64",
            "validate_every": 0,
            "checkpoint_every": 0,
        },
    }


def _train(conf):
    from credit_parallel.train.trainer import Trainer

    trainer = Trainer(conf)
    return [trainer.train_step()["loss"] for _ in range(3)]


def _train_worker(rank, world, conf):
    return _train(conf)


def _verify_worker(rank, world, conf):
    from credit_parallel.data.dataset import dataset_from_conf
    from credit_parallel.tools.verify import judge, verify_layout

    # as `credit-parallel verify` does when data.path exists: a real batch of the sample store
    dataset = dataset_from_conf(conf, "train")
    rows = verify_layout(conf, dtype=torch.float64, batch_size=1, dataset=dataset)
    return judge(rows, torch.float64)


def test_miles_credit_crossformer_plans_verifies_and_trains_on_sample_data_domain2(store):
    from credit_parallel.planner.make import make_plan

    _credit_loaded()
    single = _conf(store, {"data": "none", "tensor": 1, "domain": 1})
    domain2 = _conf(store, {"data": "none", "tensor": 1, "domain": 2})
    plan = make_plan(domain2, 2)
    assert plan.model_class == "CrossFormer" and not plan.violations, plan.violations
    rows = run_on_ranks(_verify_worker, 2, domain2, timeout=400)[0]
    failed = [r for r in rows if r[-1] != "PASS"]
    assert rows and not failed, failed
    reference = _train(single)
    for losses in run_on_ranks(_train_worker, 2, domain2, timeout=400):
        assert all(torch.isfinite(torch.tensor(losses)))
        assert max(abs(a - b) for a, b in zip(losses, reference)) <= 1e-10, (losses, reference)


class _VariableGroupsNet(torch.nn.Module):
    """A model block as CREDIT writes it: channels per variable group, no in_channels key;
    the model declares its input shape (as ``models/external.py`` gives CREDIT's models)."""

    def __init__(
        self, image_height: int, image_width: int, channels=3, levels=2, surface_channels=2
    ):
        super().__init__()
        self.image_height, self.image_width = image_height, image_width
        c = channels * levels + surface_channels
        self.conv = torch.nn.Conv2d(c, channels * levels, 3, padding=1)
        self.norm = torch.nn.GroupNorm(2, channels * levels)

    def input_shapes(self):
        return ((self.conv.in_channels, self.image_height, self.image_width),)

    def forward(self, x):
        return self.norm(self.conv(x))


def _verify_synthetic_worker(rank, world, conf):
    from credit_parallel.tools.verify import judge, verify_layout

    return judge(verify_layout(conf, dtype=torch.float64, batch_size=1), torch.float64)


def test_verify_without_data_takes_the_shapes_the_model_declares():
    conf = {
        "model": {
            "type": f"{__name__}:_VariableGroupsNet",
            "image_height": 13,  # uneven rows over 2 ranks
            "image_width": 8,
        },
        "trainer": {"parallelism": {"data": "none", "tensor": 1, "domain": 2}, "seed": 1},
    }
    rows = run_on_ranks(_verify_synthetic_worker, 2, conf, timeout=300)[0]
    assert len(rows) > 3 and all(r[-1] == "PASS" for r in rows), rows
