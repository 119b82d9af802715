"""The misuse catalog: every way a user can get a run wrong ends in an exception that says where.

Each entry runs one misuse and states the exception type and the strings its message must
contain: the offending config key, module path or value (and, where the library gives one, the
fix).  Areas: config, rank layout / mesh, tensor-parallel targets, domain conversion, sharding,
data, the up-front run validation (``validate_run`` / ``check_run``) and the command line.  All
of it is pure or runs under torch's in-process "fake" backend; nothing here starts a process.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import yaml
from torch import nn

from credit_parallel.data import ERA5Dataset, write_sample_dataset
from credit_parallel.domain.convert import convert_to_domain_parallel, validate_sharding_constraints
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.domain.sharding import gather_tensor, shard_tensor, unpad_shard_interp
from credit_parallel.layout.config import ParallelDims, load_config, parse_parallelism_conf
from credit_parallel.layout.launch import init_distributed_from_env
from credit_parallel.layout.mesh import build_device_mesh, dp_world_size
from credit_parallel.layout.ranks import RankLayout
from credit_parallel.layout.run_config import TrainerConfig
from credit_parallel.models import build_model
from credit_parallel.parallel.tensor_parallel import build_tensor_parallel_plan
from credit_parallel.planner import make_plan
from credit_parallel.testing import fake_process_group
from credit_parallel.tools.launcher import launch_local
from credit_parallel.train.preflight import check_run, dist_timeout_s, validate_run
from sample_conf import tiny_unet

__all__: list[str] = []

H, W = 9, 8
UNET = tiny_unet(H, W, 2, mlp_ratio=2)


class CommandFailed(Exception):
    """``credit-parallel`` exited non-zero; the message is its one-line reason."""


@dataclass
class Ctx:
    store: str
    tmp: Any

    def data(self, **over) -> dict:
        d = {
            "path": self.store,
            "upper_air_variables": ["T"],
            "surface_variables": ["t2m"],
            "levels": [500],
        }
        d.update(over)
        return d

    def conf(self, *, model=None, data=None, parallelism=None, **trainer) -> dict:
        conf = {
            "model": dict(UNET, **(model or {})),
            "data": self.data(**(data or {})),
            "trainer": {
                "parallelism": parallelism or {"data": "none", "tensor": 1, "domain": 1},
                "batch_size": 1,
                "steps": 1,
            },
        }
        conf["trainer"].update(trainer)
        return conf

    def yaml(self, conf, name="c.yaml") -> str:
        path = self.tmp / name
        path.write_text(yaml.safe_dump(conf) if not isinstance(conf, str) else conf)
        return str(path)

    def cli(self, *argv: str) -> None:
        from credit_parallel.cli import main

        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(list(argv))
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        if code != 0:
            assert len(lines) == 1, f"expected a one-line reason, got {lines}"
            raise CommandFailed(f"exit {code}: {lines[0]}")


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("misuse")
    store = write_sample_dataset(tmp / "s.zarr", n_times=6, nlat=H, nlon=W, levels=(500, 850))
    return Ctx(str(store), tmp)


def _domain_manager(n=2):
    return DomainParallelManager(n, n)


@contextlib.contextmanager
def _fake(world=2):
    with fake_process_group(0, world):
        yield


# --------------------------------------------------------------------------- models for TP / domain
class _MissingPath(nn.Module):
    _tp_col = "proj"

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 8)


class _Kernel3(nn.Module):
    _tp_col = "conv"

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3)


class _NotDivisible(nn.Module):
    _tp_row = "fc"

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)


class _FusedUndeclared(nn.Module):
    _tp_col = "to_qkv"

    def __init__(self):
        super().__init__()
        self.to_qkv = nn.Linear(8, 24)


class _WrongType(nn.Module):
    _tp_col = "norm"

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(4)


class _BadDeclaration(nn.Module):
    _tp_col = 5


class _FusedNotColumn(nn.Module):
    _tp_row = "to_kv"
    _tp_fused = {"to_kv": 2}

    def __init__(self):
        super().__init__()
        self.to_kv = nn.Linear(8, 16)


class SwinAttention(nn.Module):  # "Attention" in the class name: non-local unless declared
    def forward(self, x):
        return x


def _unsafe_model():
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.Sequential(nn.BatchNorm2d(4)),
        nn.AdaptiveAvgPool2d(1),
        SwinAttention(),
    )


def _run(fn):
    with _fake():
        fn()


# --------------------------------------------------------------------------- the catalog
# (id, misuse(ctx), exception type, strings the message must contain)
CATALOG: list[tuple[str, Any, type, tuple[str, ...]]] = [
    # ---- config
    ("config/no-trainer", lambda c: parse_parallelism_conf({}), ValueError, ("'trainer'",)),
    (
        "config/no-parallelism",
        lambda c: parse_parallelism_conf({"trainer": {}}),
        ValueError,
        ("trainer.parallelism",),
    ),
    (
        "config/unknown-key",
        lambda c: parse_parallelism_conf({"trainer": {"parallelism": {"pipeline": 2}}}),
        ValueError,
        ("trainer.parallelism", "'pipeline'"),
    ),
    (
        "config/bad-data-mode",
        lambda c: parse_parallelism_conf({"trainer": {"parallelism": {"data": "zero3"}}}),
        ValueError,
        ("trainer.parallelism.data", "'zero3'", "fsdp2"),
    ),
    (
        "config/float-tensor",
        lambda c: parse_parallelism_conf({"trainer": {"parallelism": {"tensor": 2.0}}}),
        ValueError,
        ("trainer.parallelism.tensor", "2.0"),
    ),
    (
        "config/bool-domain",
        lambda c: parse_parallelism_conf({"trainer": {"parallelism": {"domain": True}}}),
        ValueError,
        ("trainer.parallelism.domain", "True"),
    ),
    (
        "config/zero-domain",
        lambda c: parse_parallelism_conf({"trainer": {"parallelism": {"domain": "0"}}}),
        ValueError,
        ("trainer.parallelism.domain", "'0'"),
    ),
    (
        "config/missing-file",
        lambda c: load_config(c.tmp / "nope.yaml"),
        FileNotFoundError,
        ("nope.yaml",),
    ),
    (
        "config/bad-yaml",
        lambda c: load_config(c.yaml("trainer: [1, 2\nmodel: {", "bad.yaml")),
        ValueError,
        ("bad.yaml", "line"),
    ),
    (
        "config/trainer-typo",
        lambda c: TrainerConfig.from_conf({"trainer": {"stpes": 10}}),
        ValueError,
        ("'stpes'", "trainer"),
    ),
    (
        "config/nonfinite-policy",
        lambda c: TrainerConfig.from_conf({"trainer": {"nonfinite": "ignore"}}),
        ValueError,
        ("trainer.nonfinite", "'ignore'", "skip"),
    ),
    (
        "config/dist-timeout",
        lambda c: dist_timeout_s({"trainer": {"dist_timeout_s": "10m"}}),
        ValueError,
        ("trainer.dist_timeout_s", "'10m'"),
    ),
    (
        "config/dist-timeout-at-init",
        lambda c: init_distributed_from_env(0),
        ValueError,
        ("trainer.dist_timeout_s", "0"),
    ),
    # ---- rank layout and mesh
    (
        "mesh/world-not-divisible",
        lambda c: dp_world_size({"tensor": 2, "domain": 3}, 8),
        ValueError,
        ("8", "tensor", "domain", "6"),
    ),
    (
        "mesh/world-size-bool",
        lambda c: ParallelDims.from_block({"tensor": 1}, True),
        ValueError,
        ("world_size", "True"),
    ),
    (
        "layout/shape-vs-world",
        lambda c: RankLayout((2, 2), 5),
        ValueError,
        ("(2, 2)", "world_size", "5"),
    ),
    (
        "layout/dim-names",
        lambda c: RankLayout((2, 2), 4, ("dp",)),
        ValueError,
        ("('dp',)", "2 dims"),
    ),
    ("layout/rank-range", lambda c: RankLayout((2, 2), 4).coords(4), ValueError, ("rank", "4")),
    (
        "layout/dim-name",
        lambda c: RankLayout((2, 2), 4, ("dp", "tp")).ranks_along_dim("pp", 0),
        ValueError,
        ("'pp'",),
    ),
    (
        "mesh/no-process-group",
        lambda c: build_device_mesh({"data": "fsdp2", "tensor": 2}, device="cpu"),
        RuntimeError,
        ("build_device_mesh", "process group"),
    ),
    # ---- tensor-parallel targets
    (
        "tp/missing-path",
        lambda c: build_tensor_parallel_plan(_MissingPath(), 2),
        ValueError,
        ("'proj'", "_tp_col"),
    ),
    (
        "tp/kernel-3",
        lambda c: build_tensor_parallel_plan(_Kernel3(), 2),
        ValueError,
        ("'conv'", "kernel_size=(3, 3)"),
    ),
    (
        "tp/not-divisible",
        lambda c: build_tensor_parallel_plan(_NotDivisible(), 4),
        ValueError,
        ("'fc'", "in_features = 6", "tp size 4"),
    ),
    (
        "tp/fused-undeclared",
        lambda c: build_tensor_parallel_plan(_FusedUndeclared(), 2),
        ValueError,
        ("'to_qkv'", "_tp_fused"),
    ),
    (
        "tp/wrong-layer-type",
        lambda c: build_tensor_parallel_plan(_WrongType(), 2),
        TypeError,
        ("'norm'", "LayerNorm"),
    ),
    (
        "tp/bad-declaration",
        lambda c: build_tensor_parallel_plan(_BadDeclaration(), 2),
        TypeError,
        ("_tp_col", "5"),
    ),
    (
        "tp/fused-row-layer",
        lambda c: build_tensor_parallel_plan(_FusedNotColumn(), 2),
        ValueError,
        ("_tp_fused", "'to_kv'"),
    ),
    (
        "tp/plan-names-config-key",
        lambda c: check_run(
            {
                "model": dict(
                    UNET, base_channels=6, channel_mults=[1, 1], mlp_ratio=1, norm_groups=3
                ),
                "trainer": {"parallelism": {"data": "fsdp2", "tensor": 4, "domain": 1}},
            },
            4,
        ),
        ValueError,
        ("trainer.parallelism.tensor=4", "mid_mlp.ff.net.0", "not divisible by the tp size 4"),
    ),
    # ---- domain conversion
    (
        "domain/unsafe-modules",
        lambda c: _run(lambda: convert_to_domain_parallel(_unsafe_model(), _domain_manager())),
        ValueError,
        ("1.0: BatchNorm2d", "2: AdaptiveAvgPool2d", "3: SwinAttention", "_domain_local"),
    ),
    (
        "domain/shard-dim",
        lambda c: _run(
            lambda: convert_to_domain_parallel(nn.Conv2d(1, 1, 3), _domain_manager(), shard_dim=1)
        ),
        ValueError,
        ("shard_dim", "1"),
    ),
    (
        "domain/no-manager",
        lambda c: convert_to_domain_parallel(nn.Conv2d(1, 1, 3), None),
        ValueError,
        ("DomainParallelManager",),
    ),
    (
        "domain/gather-dim-outside-the-tensor",
        lambda c: _run(lambda: gather_tensor(torch.zeros(1, 1, 1, 4), -5, _domain_manager())),
        ValueError,
        ("gather_tensor", "dim -5", "4-D tensor"),
    ),
    (
        "domain/window-constraint",
        lambda c: validate_sharding_constraints(nn.Linear(1, 1), 0, window_sizes=[4]),
        ValueError,
        ("local_h", "0"),
    ),
    # ---- sharding
    (
        "sharding/dim-outside-the-tensor",
        lambda c: _run(lambda: shard_tensor(torch.zeros(1, 1, 1, 4), 4, _domain_manager())),
        ValueError,
        ("shard_tensor", "dim 4", "4-D tensor"),
    ),
    (
        "sharding/padding-opt",
        lambda c: unpad_shard_interp(torch.zeros(1, 1, 4, 4), {"pad_lat": "x"}, None, 4, 4),
        ValueError,
        ("padding_opt.pad_lat", "'x'"),
    ),
    # ---- models
    (
        "model/unknown-type",
        lambda c: build_model({"type": "graphcast"}),
        ValueError,
        ("model.type", "'graphcast'", "unet"),
    ),
    (
        "model/unknown-argument",
        lambda c: build_model(dict(UNET, n_levels=3)),
        ValueError,
        ("model.n_levels",),
    ),
    # ---- data
    (
        "data/missing-variable",
        lambda c: ERA5Dataset(c.store, upper_air_variables=["Q"]),
        ValueError,
        ("'Q'", "available variables"),
    ),
    (
        "data/missing-level",
        lambda c: ERA5Dataset(c.store, upper_air_variables=["T"], levels=[300]),
        ValueError,
        ("level 300",),
    ),
    (
        "data/history-len",
        lambda c: ERA5Dataset(c.store, surface_variables=["t2m"], history_len=0),
        ValueError,
        ("history_len", "0"),
    ),
    # ---- the run: data against model, layout against world size
    (
        "run/in-channels",
        lambda c: check_run(c.conf(model={"in_channels": 3}), 1),
        ValueError,
        ("model.in_channels = 3", "2 input channels", "set model.in_channels: 2"),
    ),
    (
        "run/out-channels",
        lambda c: check_run(c.conf(model={"out_channels": 5}), 1),
        ValueError,
        ("set model.out_channels: 2",),
    ),
    (
        "run/image-height",
        lambda c: check_run(c.conf(model={"image_height": 12}), 1),
        ValueError,
        ("model.image_height = 12", "9 latitude", "set model.image_height: 9"),
    ),
    (
        "run/history-changes-channels",
        lambda c: check_run(c.conf(data={"history_len": 2}), 1),
        ValueError,
        ("model.in_channels = 2", "4 input channels", "history_len 2"),
    ),
    (
        "run/as-5d-with-2d-model",
        lambda c: check_run(c.conf(data={"as_5d": True}), 1),
        ValueError,
        ("data.as_5d",),
    ),
    (
        "run/data-missing-level",
        lambda c: check_run(c.conf(data={"levels": [500, 300]}), 1),
        ValueError,
        ("level 300",),
    ),
    (
        "run/batch-too-large",
        lambda c: check_run(c.conf(batch_size=4, parallelism={"data": "ddp"}), 2),
        ValueError,
        ("trainer.batch_size = 4", "2 data-parallel ranks"),
    ),
    (
        "run/world-size",
        lambda c: check_run(c.conf(parallelism={"tensor": 2, "domain": 2}), 6),
        ValueError,
        ("world size 6", "tensor*domain", "4"),
    ),
    (
        "run/ddp-with-tp",
        lambda c: check_run(c.conf(parallelism={"data": "ddp", "tensor": 2}), 2),
        ValueError,
        ("trainer.parallelism", "'ddp'", "fsdp2"),
    ),
    # ---- command line and launcher
    (
        "cli/world-size",
        lambda c: c.cli("plan", "--config", c.yaml(c.conf()), "--world-size", "0"),
        CommandFailed,
        ("exit 2", "--world-size", "0"),
    ),
    (
        "cli/missing-config",
        lambda c: c.cli("plan", "--config", str(c.tmp / "absent.yaml"), "--world-size", "2"),
        CommandFailed,
        ("exit 2", "absent.yaml"),
    ),
    (
        "cli/missing-data",
        lambda c: c.cli(
            "train", "--config", c.yaml(c.conf(data={"path": str(c.tmp / "none.zarr")}))
        ),
        CommandFailed,
        ("exit 2", "data.path", "none.zarr", "sample-data"),
    ),
    (
        "cli/nproc-vs-layout",
        lambda c: c.cli(
            "train",
            "--config",
            c.yaml(c.conf(parallelism={"domain": 2})),
            "--nproc",
            "3",
        ),
        CommandFailed,
        ("exit 2", "world size 3", "tensor*domain"),
    ),
    (
        "cli/bad-layout-verify",
        lambda c: c.cli("verify", "--config", c.yaml(c.conf(parallelism={"data": "zero"}))),
        CommandFailed,
        ("exit 2", "trainer.parallelism.data", "'zero'"),
    ),
    (
        "cli/train-lists-every-problem",
        lambda c: c.cli(
            "train",
            "--config",
            c.yaml(
                c.conf(
                    model={"in_channels": 3, "image_width": 10},
                    data={"levels": [500]},
                    nonfinite="ignore",
                )
            ),
            "--output",
            str(c.tmp / "out"),
        ),
        CommandFailed,
        ("exit 2", "trainer.nonfinite", "model.in_channels = 3", "model.image_width = 10"),
    ),
    ("launch/nproc", lambda c: launch_local(0, "x", []), ValueError, ("--nproc", "0")),
]


@pytest.mark.parametrize(
    "misuse, exc_type, fragments", [c[1:] for c in CATALOG], ids=[c[0] for c in CATALOG]
)
def test_misuse_raises_a_clear_error(ctx, misuse, exc_type, fragments):
    with pytest.raises(Exception) as info:  # noqa: B017 - the exact type is asserted below
        misuse(ctx)
    assert type(info.value) is exc_type or isinstance(info.value, exc_type), (
        f"expected {exc_type.__name__}, got {type(info.value).__name__}: {info.value}"
    )
    message = str(info.value)
    missing = [f for f in fragments if f not in message]
    assert not missing, f"message does not name {missing}:\n{message}"


def test_catalog_covers_at_least_30_misuses_in_every_area():
    areas = {case_id.split("/")[0] for case_id, *_ in CATALOG}
    assert len(CATALOG) >= 30
    assert {"config", "mesh", "tp", "domain", "sharding", "data", "run", "cli"} <= areas


def test_check_run_reports_every_violation_at_once(ctx):
    conf = ctx.conf(
        model={"in_channels": 3, "image_height": 12},
        parallelism={"data": "ddp", "tensor": 2, "domain": 2},
        nonfinite="halt",
        dist_timeout_s=-5,
    )
    problems = validate_run(conf, 6)
    text = "\n".join(problems)
    for key in (
        "trainer.nonfinite",
        "trainer.dist_timeout_s",
        "world size 6",
        "'ddp' cannot be combined with tensor > 1",
        "model.in_channels = 3",
        "model.image_height = 12",
    ):
        assert key in text, f"{key!r} not reported:\n{text}"
    with pytest.raises(ValueError) as info:
        check_run(conf, 6)
    assert f"{len(problems)} problem(s)" in str(info.value)
    assert all(p in str(info.value) for p in problems)


_CROSSFORMER_CUT_WINDOWS = {
    "model": {
        "type": "crossformer",
        "in_channels": 2,
        "out_channels": 2,
        "image_height": 32,
        "image_width": 32,
        "dims": [8, 16],
        "depths": [1, 1],
        "dim_head": 4,
        "window_sizes": [4, 4],
    },
    "trainer": {"parallelism": {"domain": 3}},
}


def test_crossformer_windows_cut_by_shards_pass_preflight_with_a_note():
    # formerly a misuse: shards of 11/11/10 rows cut the 4-row windows.  The converter now
    # re-lays the windows out (exactness at domain 3: tests/test_verify_models.py), so preflight
    # accepts the run and the plan says what it costs instead of refusing it
    assert validate_run(_CROSSFORMER_CUT_WINDOWS, 3) == []
    check_run(_CROSSFORMER_CUT_WINDOWS, 3)
    notes = [n for n in make_plan(_CROSSFORMER_CUT_WINDOWS, 3).notes if "local_h=" in n]
    assert any("local_h=11" in n for n in notes) and any("window size 4" in n for n in notes)
    assert all("exact anyway" in n and "levels.0.0.attn" in n for n in notes)


def test_validate_run_accepts_a_good_run_and_a_custom_model(ctx):
    assert validate_run(ctx.conf(parallelism={"data": "ddp", "domain": 2}), 4) == []

    class Custom(nn.Module):  # outside the registry, no shape attributes: the data defines them
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 3, padding=1)

        def forward(self, x):
            return self.conv(x)

    conf = ctx.conf(parallelism={"domain": 3})
    dataset = ERA5Dataset(
        ctx.store, upper_air_variables=["T"], surface_variables=["t2m"], levels=[500]
    )
    assert validate_run(conf, 3, dataset, model=Custom()) == []
    wrong = nn.Sequential(nn.Conv2d(2, 5, 3, padding=1))
    problems = validate_run(conf, 3, dataset, model=wrong)
    assert any("(5, 9, 8)" in p and "(2, 9, 8)" in p for p in problems), problems
