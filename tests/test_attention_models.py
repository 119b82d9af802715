"""The bundled attention models under domain parallelism: the CrossFormer's long-distance
(pole-to-pole) windows and the Swin model's shifted windows are exact at any shard layout,
the bundled configs train them exactly (verify), and ``trainer.domain_nonlocal_policy`` reaches
the converter through ``parallelize``."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from credit_parallel import parallelize
from credit_parallel.cli import resolve_config
from credit_parallel.domain.layers.gather import DomainGatherModule
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.layout.config import load_config
from credit_parallel.layout.run_config import TrainerConfig
from credit_parallel.models import CrossFormer, SwinNet
from credit_parallel.models.swin import ShiftedWindowAttention, row_segments
from credit_parallel.parallel.composition import RecipeOptions
from credit_parallel.testing import run_on_ranks
from credit_parallel.tools.verify import judge, verify_layout
from test_domain_attention import TOL, exactness_errors


def _bundled(rank, world_size, kind, h):
    torch.manual_seed(0)
    if kind == "crossformer":
        net = CrossFormer(3, 2, h, 16, dims=(8, 8), depths=(2, 2), dim_head=4, window_sizes=(2, 2))
    else:
        net = SwinNet(
            3, 2, h, 8, dim=8, depth=2, dim_head=4, window_size=4, mlp_ratio=2, norm_groups=2
        )
    x = torch.randn(2, 3, h, net.image_width, dtype=torch.float64)
    return exactness_errors(net.double(), x, (), DomainParallelManager(world_size, world_size))


@pytest.mark.parametrize(
    "kind,domain,h",
    [
        ("crossformer", 2, 24),  # level 0: 12 rows, 6 + 6, long groups stride 6 span both
        ("crossformer", 3, 24),  # 12 rows over 3 ranks: windows of 2 rows on 4-row shards...
        ("crossformer", 3, 40),  # ... and 20 rows: 7/7/6, windows cut by shard boundaries
        ("swin", 2, 24),  # 12 rows: windows of 4 cut at row 6; the shifted seam at the poles
        ("swin", 3, 40),  # 20 rows: 7/7/6, 5 windows over 3 ranks
    ],
)
def test_bundled_attention_model_exact_long_and_shifted_windows(kind, domain, h):
    for errors in run_on_ranks(_bundled, domain, kind, h):
        assert errors["keys_equal"]
        assert errors["out"] <= TOL and errors["input_grad"] <= TOL, errors
        assert errors["param_grad"] <= TOL, errors
        assert "DomainRowGroupAttention" in errors["forms"]


def test_shifted_window_mask_separates_the_poles():
    # rows of the globe rolled by 2 over 8 rows: the last window holds rows 6, 7 | 0, 1
    assert row_segments(torch.tensor([6, 7, 0, 1])).tolist() == [0, 0, 1, 1]
    torch.manual_seed(0)
    attn = ShiftedWindowAttention(4, 4, 4, 2).double()
    x = torch.randn(1, 4, 8, 4, dtype=torch.float64)
    y = attn(x)
    # perturbing the north-pole rows does not change the south-pole rows of the seam window
    x2 = x.clone()
    x2[..., 0:2, :] += 1.0
    assert torch.equal(attn(x2)[..., 6:8, :], y[..., 6:8, :])


def _verify_bundled(rank, world_size, name):
    conf = load_config(resolve_config(name))
    conf["data"] = {}  # a random batch of the model's grid: no dataset needed
    return judge(verify_layout(conf, batch_size=1), torch.float64)


@pytest.mark.parametrize("name,world", [("demo_crossformer", 2), ("demo_swin", 3)])
def test_bundled_attention_configs_verify_exact(name, world):
    conf = load_config(resolve_config(name))
    assert conf["trainer"]["parallelism"]["domain"] == world
    TrainerConfig.from_conf(conf)  # the trainer accepts its keys
    for rows in run_on_ranks(_verify_bundled, world, name, timeout=240):
        failed = [r for r in rows if r[-1] != "PASS"]
        assert not failed, failed


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.norm = nn.BatchNorm2d(2)

    def forward(self, x):
        return self.norm(self.conv(x))


def _parallelize_with_policy(rank, world_size, policy):
    conf = {"trainer": {"parallelism": {"domain": world_size}, "domain_nonlocal_policy": policy}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = parallelize(_Head(), conf)
        except ValueError as err:
            return str(err)
    return [type(m).__name__ for m in model.modules() if isinstance(m, DomainGatherModule)]


def test_trainer_domain_nonlocal_policy_reaches_the_converter():
    assert run_on_ranks(_parallelize_with_policy, 2, "gather") == [["DomainGatherModule"]] * 2
    refused = run_on_ranks(_parallelize_with_policy, 2, "raise")
    assert all("norm: BatchNorm2d" in m for m in refused)


def test_nonlocal_policy_key_validated():
    assert RecipeOptions.from_conf({"trainer": {}}).nonlocal_policy == "raise"
    with pytest.raises(ValueError, match="trainer.domain_nonlocal_policy"):
        RecipeOptions.from_conf({"trainer": {"domain_nonlocal_policy": "ignore"}})
