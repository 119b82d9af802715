"""benchmarks/efficiency.py: the plain U-Net it times is exact under domain parallelism, the
four implementations run, and oversubscribed runs get no efficiency."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.testing import assert_parity, domain_parity_errors, run_on_ranks


def _load():
    name = "efficiency_benchmark"
    if name not in sys.modules:  # dataclasses look their module up in sys.modules
        path = Path(__file__).resolve().parents[1] / "benchmarks" / "efficiency.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _plain_unet_parity_worker(rank, world):
    torch.set_default_dtype(torch.float64)
    bench = _load()
    mgr = DomainParallelManager(world, world)
    x = torch.randn(1, 8, 16, 12, generator=torch.Generator().manual_seed(0))
    errs = domain_parity_errors(lambda: bench.PlainUNet(8, groups=2), x, mgr)
    assert_parity(errs)
    return sorted(errs)


@pytest.mark.parametrize("world", [2, 4])
def test_plain_unet_h16_domain2_and_4_matches_single_process(world):
    for keys in run_on_ranks(_plain_unet_parity_worker, world):
        assert "output" in keys and "input_grad" in keys
        assert any(k.startswith("param:") for k in keys)


def test_efficiencies_follow_the_definitions_and_oversubscribed_runs_get_none():
    bench = _load()
    times = {"1p1t": 1.0, "1p2t": 0.6, "floor": 0.55, "ours": 0.8, "errors": {}}
    e = bench.efficiencies(times, 2, cores=2)
    assert not e["oversubscribed"]
    assert e["E ours"] == pytest.approx(1.0 / (2 * 0.8))
    assert e["E floor"] == pytest.approx(1.0 / (2 * 0.55))
    assert e["ours/floor"] == pytest.approx(0.55 / 0.8)
    assert e["E 2t"] == pytest.approx(0.6 / 0.8)
    times4 = {"1p1t": 1.0, "1p4t": 0.3, "floor": 0.2, "ours": 0.1, "errors": {}}
    e4 = bench.efficiencies(times4, 4, cores=2)
    assert e4["oversubscribed"]
    assert all(e4[k] is None for k in ("E ours", "E floor", "ours/floor", "E 4t"))
    loaded = bench.efficiencies(times, 2, cores=2, loaded=True)
    assert loaded["E 2t"] is None and loaded["E ours"] == e["E ours"]
    failed = dict(times, ours="RankFailure: ...")
    assert bench.efficiencies(failed, 2, cores=2)["E ours"] is None


def test_time_workload_tiny_conv_stack_domain2_times_all_four_implementations():
    bench = _load()
    w = bench.Workload("tiny", "conv_stack", 8, 16, 32)
    times = bench.time_workload(w, 2, rounds=1, steps=1, warmup=1)
    assert times["errors"] == {}
    for name in ("1p1t", "1p2t", "floor", "ours"):
        assert isinstance(times[name], float) and times[name] > 0, name
