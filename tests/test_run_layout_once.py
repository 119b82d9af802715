"""One Trainer start parses the run config once and builds one ParallelDims; ParallelDims.problems
lists every problem of a layout at once, and the planner and preflight report that list.

The counts are taken by wrapping the parsers and the ParallelDims constructor (every
construction passes ``__post_init__``) around a real Trainer start: single-process, and on two
ranks under ``data: fsdp2, domain: 2`` (meshes, domain conversion and FSDP2 over dp x domain),
whose parallel model must still be the converted one.
"""

from __future__ import annotations

import collections
import contextlib
from unittest import mock

import pytest
import torch.distributed.tensor  # noqa: F401  (imported once here so forked workers inherit it)
from torch.distributed.fsdp import FSDPModule

from credit_parallel.data import write_sample_dataset
from credit_parallel.layout import config, run_config
from credit_parallel.layout.config import ParallelDims
from credit_parallel.planner import make_plan
from credit_parallel.testing import run_on_ranks
from credit_parallel.train import preflight
from credit_parallel.train.preflight import validate_run
from credit_parallel.train.trainer import Trainer
from sample_conf import tiny_unet, unet_run_conf

__all__: list[str] = []

H, W = 17, 32


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return str(
        write_sample_dataset(tmp_path_factory.mktemp("data") / "s.zarr", n_times=12, nlat=H, nlon=W)
    )


def _conf(store, parallelism):
    return unet_run_conf(
        store,
        H,
        W,
        time_slice=[0, 12],
        parallelism=parallelism,
        data={"num_workers": 0},
        steps=1,
        batch_size=2,
        dtype="float64",
    )


@contextlib.contextmanager
def _counting():
    """Counts of: ParallelDims constructions, parallelism-block parses, section parses and
    RunConfig constructions while the block runs."""
    counts = collections.Counter()

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    post_init = ParallelDims.__post_init__
    run_config_init = run_config.RunConfig.__init__
    with (
        mock.patch.object(ParallelDims, "__post_init__", counted("ParallelDims", post_init)),
        mock.patch.object(
            config,
            "parse_parallelism_block",
            counted("parallelism", config.parse_parallelism_block),
        ),
        mock.patch.object(
            preflight, "parse_sections", counted("sections", run_config.parse_sections)
        ),
        mock.patch.object(run_config.RunConfig, "__init__", counted("RunConfig", run_config_init)),
    ):
        yield counts


def _start_counts(conf):
    with _counting() as counts:
        trainer = Trainer(conf)
    return dict(counts), trainer


ONCE = {"ParallelDims": 1, "parallelism": 1, "sections": 1, "RunConfig": 1}


def test_a_single_process_trainer_start_parses_once_and_builds_one_layout(store):
    counts, trainer = _start_counts(_conf(store, {"data": "none"}))
    assert counts == ONCE
    assert trainer.dims == ParallelDims("none", 1, 1, 1)
    assert trainer.run_config.trainer.dtype == "float64"


def _parallel_start_worker(rank, world, store):
    counts, trainer = _start_counts(_conf(store, {"data": "fsdp2", "domain": 2}))
    names = {type(m).__name__ for m in trainer.model.modules()}
    converted = any(name.startswith("DomainParallel") for name in names)
    sharded = isinstance(trainer.model, FSDPModule)
    return counts, trainer.dims, trainer.manager.domain_world_size, converted, sharded


def test_a_parallel_trainer_start_parses_once_and_builds_one_layout(store):
    results = run_on_ranks(_parallel_start_worker, 2, store, timeout=240)
    for counts, dims, domain_size, converted, sharded in results:
        assert counts == ONCE
        assert dims == ParallelDims("fsdp2", 1, 2, 2)
        assert domain_size == 2 and converted and sharded


# --------------------------------------------------------------------------- layout problems
def test_problems_lists_every_problem_of_a_layout_at_once():
    problems = ParallelDims.problems("zero3", 0, True, 0)
    assert len(problems) == 4
    assert "trainer.parallelism.data must be one of 'fsdp2', 'ddp', 'none'" in problems[0]
    assert "trainer.parallelism.tensor must be an integer >= 1, got 0" in problems[1]
    assert "trainer.parallelism.domain must be an integer >= 1, got True" in problems[2]
    assert "world_size must be >= 1, got 0" in problems[3]

    # a layout that does not fit the world AND has no exact implementation: both reported
    problems = ParallelDims.problems("ddp", 2, 2, 6)
    assert len(problems) == 2
    assert problems[0].startswith("world size 6 is not divisible by trainer.parallelism.tensor")
    assert "'ddp' cannot be combined with tensor > 1" in problems[1]
    assert ParallelDims.problems("fsdp2", 2, 2, 8) == []


def test_the_raising_checks_raise_the_listed_problems():
    with pytest.raises(ValueError) as err:
        ParallelDims("zero3", 0, 1, 3)
    assert str(err.value) == "; ".join(ParallelDims.problems("zero3", 0, 1, 3))
    dims = ParallelDims("ddp", 2, 1, 4)  # a valid rank layout ...
    with pytest.raises(ValueError) as err:
        dims.check_supported()  # ... without an exact implementation
    assert [str(err.value)] == ParallelDims.problems("ddp", 2, 1, 4)


def test_planner_and_preflight_report_the_layout_problems_of_parallel_dims():
    conf = {"model": tiny_unet(H, W), "trainer": {"parallelism": {"data": "ddp", "tensor": 2}}}
    expected = ParallelDims.problems("ddp", 2, 1, 3)
    assert len(expected) == 2
    plan = make_plan(conf, 3)
    assert [v for v in plan.violations if v in expected] == expected
    assert all(p in validate_run(conf, 3) for p in expected)

    # the planner words no layout problem itself: it reports what ParallelDims says
    sentinel = ["layout problem from ParallelDims.problems"]
    with mock.patch.object(ParallelDims, "problems", return_value=sentinel):
        plan = make_plan(conf, 4)
        assert sentinel[0] in plan.violations
        assert sentinel[0] in validate_run({**conf, "model": None}, 4)
