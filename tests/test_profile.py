"""The per-layer-kind step profiler (credit_parallel.tools.profile): layer kinds, calls per
step, parts adding up to the step, window and communication time seen in domain layers, and a
rank held back showing up as time blocked in communication on the other rank."""

import time

import pytest
import torch
from torch import nn

from credit_parallel.domain.convert import convert_to_domain_parallel
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.domain.rows import shard_range
from credit_parallel.models import PeriodicConv2d
from credit_parallel.testing import run_on_ranks
from credit_parallel.tools.profile import (
    LAYER_KINDS,
    format_profile,
    layer_kind,
    mean_profile,
    profile_step,
)

PARTS = ("compute", "window", "comm", "overhead")


def _stack():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(4, 8, 3, padding=1),
        nn.GroupNorm(2, 8),
        nn.SiLU(),
        nn.Upsample(scale_factor=2, mode="nearest"),
        nn.ConvTranspose2d(8, 4, 2, stride=2),
    )


def _step(model, x):
    def step():
        model.zero_grad(set_to_none=True)
        model(x).square().sum().backward()

    return step


def test_layer_kind_files_plain_and_periodic_modules_by_class():
    assert layer_kind(nn.Conv2d(1, 1, 3)) == "conv"
    assert layer_kind(nn.ConvTranspose2d(1, 1, 3)) == "transposed conv"
    assert layer_kind(nn.GroupNorm(1, 2)) == "group norm"
    assert layer_kind(nn.Upsample(scale_factor=2)) == "interpolation"
    assert layer_kind(nn.ZeroPad2d(1)) == "padding"
    assert layer_kind(nn.PixelShuffle(2)) == "pixel shuffle"
    assert layer_kind(nn.MultiheadAttention(4, 1)) == "attention"
    assert layer_kind(nn.SiLU()) == "other"
    assert layer_kind(PeriodicConv2d(2, 2, 3)) == "conv"


def test_profile_one_process_counts_calls_per_step_and_parts_add_up_to_the_step():
    model = _stack()
    x = torch.randn(1, 4, 8, 8, requires_grad=True)
    result = profile_step(_step(model, x), model, steps=2, warmup=1)
    kinds = result.kinds
    assert set(kinds) == set(LAYER_KINDS)
    assert kinds["conv"].calls == 1 and kinds["group norm"].calls == 1
    assert kinds["interpolation"].calls == 1 and kinds["transposed conv"].calls == 1
    assert kinds["other"].calls == 1  # the SiLU
    for kind in ("conv", "group norm", "transposed conv"):
        assert kinds[kind].compute > 0, kind
    # plain modules assemble no windows and no process group was involved
    assert all(kinds[k].window == 0 and kinds[k].comm == 0 for k in LAYER_KINDS)
    total = sum(t.total for t in kinds.values())
    assert total == pytest.approx(result.step_s, rel=1e-6)
    text = format_profile(result, "title")
    assert text.splitlines()[0] == "title" and "group norm" in text and "padding" not in text


def _domain_worker(rank, world, lag_s):
    mgr = DomainParallelManager(world, world)
    model = convert_to_domain_parallel(_stack(), mgr)
    h = 12
    x = torch.randn(1, 4, h, 8, generator=torch.Generator().manual_seed(0))
    a, b = shard_range(h, world, rank)
    x_local = x[:, :, a:b].contiguous().requires_grad_()
    inner = _step(model, x_local)
    token = ("profile-test", h)

    def step():
        mgr.begin_forward(token)
        if rank == world - 1:
            time.sleep(lag_s)  # this rank starts late: the others wait in their first exchange
        inner()

    return profile_step(step, model, steps=2, warmup=1)


def test_profile_domain2_sees_windows_collectives_and_a_late_rank_as_blocked_time():
    lag = 0.3  # long against the scheduling noise of a shared machine
    results = run_on_ranks(_domain_worker, 2, lag)
    for r in results:
        assert r.kinds["conv"].calls == 1 and r.kinds["group norm"].calls == 1
        assert r.kinds["conv"].window > 0 and r.kinds["conv"].comm > 0
        assert r.kinds["group norm"].comm > 0
    # rank 0 waits for the late rank 1 in the first layer's exchange, every step
    assert results[0].kinds["conv"].comm >= 0.8 * lag
    assert results[1].kinds["conv"].comm < 0.5 * lag
    merged = mean_profile(results)
    assert merged.step_s == pytest.approx((results[0].step_s + results[1].step_s) / 2)
    assert merged.kinds["conv"].comm == pytest.approx(
        (results[0].kinds["conv"].comm + results[1].kinds["conv"].comm) / 2
    )


def test_profile_step_script_tiny_conv_stack_domain1_and_2_prints_a_table_each():
    import importlib.util
    import io
    from contextlib import redirect_stdout
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "profile_step.py"
    spec = importlib.util.spec_from_file_location("profile_step_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    argv = ["--models", "conv_stack/tiny", "--domains", "1,2", "--steps", "1", "--warmup", "1"]
    with redirect_stdout(io.StringIO()) as out:
        results = script.main(argv)
    assert set(results) == {("conv_stack/tiny", 1), ("conv_stack/tiny", 2)}
    assert results[("conv_stack/tiny", 1)].kinds["conv"].comm == 0
    assert results[("conv_stack/tiny", 2)].kinds["conv"].comm > 0
    assert out.getvalue().count("layer kind") == 2


def _fsdp2_worker(rank, world):
    import torch.distributed as dist

    from credit_parallel.parallel.composition import parallelize

    torch.manual_seed(0)
    model = parallelize(
        nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.Conv2d(8, 4, 1)),
        {"trainer": {"parallelism": {"data": "fsdp2", "tensor": 1, "domain": 1}}},
    )
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(rank))

    def step():
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    def grads():
        return [p.grad.full_tensor().clone() for p in model.parameters()]

    step()
    plain = grads()
    originals = (dist.all_reduce, dist.distributed_c10d.Work.wait)
    result = profile_step(step, model, steps=1, warmup=0)
    profiled = grads()
    restored = (dist.all_reduce, dist.distributed_c10d.Work.wait) == originals
    same = all(torch.equal(a, b) for a, b in zip(plain, profiled))
    return same, restored, result.kinds["other"].comm > 0


def test_profile_of_an_fsdp2_step_leaves_gradients_bitwise_unchanged_and_restores_dist():
    for same, restored, comm_seen in run_on_ranks(_fsdp2_worker, 2):
        assert same and restored
        assert comm_seen  # FSDP's all-gathers / reduce-scatters run outside the leaf layers
