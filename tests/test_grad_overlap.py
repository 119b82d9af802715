"""grad_overlap: the domain gradient all-reduce bucketed and overlapped with the backward.

Real domain-parallel models (``parallelize``, gloo ranks, float64): the overlapped reduction
gives the same gradient sums as ``sync_domain_gradients``' after-backward path (bitwise on 2
ranks, where a sum of two has one order), identical on every rank, and the single-process
gradients to 1e-10; with gradient accumulation and with a parameter that gets no gradient.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from credit_parallel.testing import run_on_ranks

H, W, C = 12, 8, 4


class _Net(nn.Module):
    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body
        self.unused = nn.Linear(2, 2)  # never called: no gradient

    def forward(self, x):
        return self.body(x)


def _model() -> nn.Module:
    torch.manual_seed(0)
    body = nn.Sequential(
        nn.Conv2d(C, C, 3, padding=1),
        nn.GroupNorm(2, C),
        nn.SiLU(),
        nn.Conv2d(C, C, 3, padding=1),
        nn.GroupNorm(2, C),
        nn.SiLU(),
        nn.Conv2d(C, C, 3, padding=1),
    )
    return _Net(body).double()


def _batches(count: int):
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(1, C, H, W, generator=gen, dtype=torch.float64),
         torch.randn(1, C, H, W, generator=gen, dtype=torch.float64))
        for _ in range(count)
    ]  # fmt: skip


def _reference(micro: int) -> dict:
    model = _model()
    for x, w in _batches(micro):
        ((model(x) * w).sum() / w.numel()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _worker(rank, world, overlap: bool, micro: int, use_no_sync: bool, cap_mb: float):
    from credit_parallel.domain.rows import shard_range
    from credit_parallel.parallel.collectives import sync_domain_gradients
    from credit_parallel.parallel.composition import get_domain_manager, get_raw_model, parallelize
    from credit_parallel.parallel.fsdp import no_grad_sync
    from credit_parallel.parallel.grad_overlap import enable_overlapped_domain_grad_sync

    conf = {"trainer": {"parallelism": {"data": "none", "tensor": 1, "domain": world}}}
    model = parallelize(_model(), conf)
    manager = get_domain_manager(model)
    raw = get_raw_model(model)
    reducer = None
    if overlap:
        reducer = enable_overlapped_domain_grad_sync(raw, manager=manager, bucket_cap_mb=cap_mb)
    a, b = shard_range(H, world, rank)
    launched_during_backward = 0
    for step in range(2):  # two steps: the reducer is reusable
        model.zero_grad(set_to_none=True)
        for i, (x, w) in enumerate(_batches(micro)):
            manager.begin_forward(("t", step, i))
            last = i + 1 == micro
            # the training step's gradient-accumulation context pauses the reducer
            ctx = no_grad_sync(raw) if (use_no_sync and not last) else _null()
            with ctx:
                out = model(x[:, :, a:b].contiguous())
                ((out * w[:, :, a:b]).sum() / w.numel()).backward()
        if reducer is not None:
            launched_during_backward = reducer._next
        sync_domain_gradients(raw, manager, op="sum")
    grads = {n: p.grad.clone() for n, p in raw.named_parameters() if p.grad is not None}
    buckets = reducer.bucket_count if reducer else 0
    return grads, buckets, launched_during_backward


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("world", [2, 3])
def test_overlapped_sums_match_after_backward_path_and_single_process(world):
    tiny = 1e-4  # 0.0001 MiB: several buckets on this small model
    plain = run_on_ranks(_worker, world, False, 1, False, tiny, timeout=300)
    over = run_on_ranks(_worker, world, True, 1, False, tiny, timeout=300)
    ref = _reference(1)
    grads0, buckets, launched = over[0]
    assert buckets > 2
    assert launched >= 1  # at least one bucket left during the backward, not after it
    assert set(grads0) == set(ref)
    for rank in range(world):
        g_over, g_plain = over[rank][0], plain[rank][0]
        for name, ref_grad in ref.items():
            assert torch.equal(g_over[name], grads0[name])  # identical on every rank
            assert (g_over[name] - ref_grad).abs().max().item() <= 1e-10, name
            if world == 2:
                assert torch.equal(g_over[name], g_plain[name]), name


@pytest.mark.parametrize("use_no_sync", [False, True])
def test_gradient_accumulation_reduces_the_accumulated_gradients(use_no_sync):
    """Without the pause every backward starts reductions that the next one discards; with
    ``fsdp.no_grad_sync`` (what ``TrainStep`` uses) only the last backward reduces."""
    over = run_on_ranks(_worker, 2, True, 2, use_no_sync, 1e-4, timeout=300)
    plain = run_on_ranks(_worker, 2, False, 2, False, 1e-4, timeout=300)
    ref = _reference(2)
    for rank in range(2):
        for name, ref_grad in ref.items():
            assert (over[rank][0][name] - ref_grad).abs().max().item() <= 1e-10, name
            assert torch.equal(over[rank][0][name], plain[rank][0][name]), name


def _refusal_worker(rank, world):
    from credit_parallel.parallel.composition import get_domain_manager, parallelize
    from credit_parallel.parallel.grad_overlap import enable_overlapped_domain_grad_sync

    conf = {"trainer": {"parallelism": {"data": "none", "tensor": 1, "domain": world}}}
    model = parallelize(_model(), conf)
    manager = get_domain_manager(model)
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 2).double())
    try:
        enable_overlapped_domain_grad_sync(ddp, manager=manager)
    except ValueError as err:
        return str(err)
    return "no error"


def test_refuses_a_ddp_model():
    messages = run_on_ranks(_refusal_worker, 2, timeout=300)
    assert all("wrapped in DDP" in m for m in messages)


def _count_worker(rank, world, overlap: bool):
    from credit_parallel.domain.rows import shard_range
    from credit_parallel.layout.small_collectives import record_small_collectives
    from credit_parallel.parallel.collectives import sync_domain_gradients
    from credit_parallel.parallel.composition import get_domain_manager, get_raw_model, parallelize
    from credit_parallel.parallel.grad_overlap import enable_overlapped_domain_grad_sync
    from credit_parallel.tools.bench.measure import _collective_counter

    conf = {"trainer": {"parallelism": {"data": "none", "tensor": 1, "domain": world}}}
    model = parallelize(_model(), conf)
    manager, raw = get_domain_manager(model), get_raw_model(model)
    if overlap:
        enable_overlapped_domain_grad_sync(raw, manager=manager)
    a, b = shard_range(H, world, rank)
    (x, w), counts = _batches(1)[0], []
    for step in range(2):
        manager.begin_forward(("count", step))
        model.zero_grad(set_to_none=True)
        during, after = _collective_counter(), _collective_counter()
        with during, record_small_collectives() as small:
            ((model(x[:, :, a:b].contiguous()) * w[:, :, a:b]).sum()).backward()
        with after, record_small_collectives() as small_after:
            sync_domain_gradients(raw, manager, op="sum")
        counts.append(
            (
                (during.counts + small).get("all_reduce", 0),
                (after.counts + small_after).get("all_reduce", 0),
            )
        )
    return counts[-1]


def test_planner_sync_points_match_a_real_step():
    """The planner's domain-gradient points (one bucket here): one blocking all-reduce after
    the backward without overlap; with it the all-reduce leaves during the backward and the
    step only waits for it."""
    from credit_parallel.planner.make import make_plan
    from credit_parallel.planner.sync_points import sync_points_per_step

    conf = {
        "model": {"type": "test"},
        "trainer": {"parallelism": {"data": "none", "tensor": 1, "domain": 2}},
    }
    plan = make_plan(conf, 2, model=_model(), input_shapes=[(C, H, W)])
    norms = plan.collectives["domain_all_reduce_norm"]
    buckets = plan.collectives["domain_grad_all_reduce"]
    assert buckets == 1
    assert sync_points_per_step(plan.collectives)["domain_grad"] == 1
    assert sync_points_per_step(plan.collectives, overlapped_domain_grads=True)["domain_grad"] == 1
    plain = run_on_ranks(_count_worker, 2, False, timeout=300)
    over = run_on_ranks(_count_worker, 2, True, timeout=300)
    for rank in range(2):
        assert plain[rank] == (norms, buckets)  # the bucket after the backward: blocking
        assert over[rank] == (norms + buckets, 0)  # launched in the backward, waited once


def _dp_refusal_worker(rank, world):
    from credit_parallel.parallel.composition import get_domain_manager, get_raw_model, parallelize
    from credit_parallel.parallel.grad_overlap import enable_overlapped_domain_grad_sync

    conf = {"trainer": {"parallelism": {"data": "ddp", "tensor": 1, "domain": 2}}}
    model = parallelize(_model(), conf)
    try:
        enable_overlapped_domain_grad_sync(get_raw_model(model), manager=get_domain_manager(model))
    except ValueError as err:
        return str(err)
    return "no error"


def test_refuses_a_layout_with_dp_replicas():
    """The raw model under DDP: DDP's hooks own its gradients too, so dp x domain is refused."""
    messages = run_on_ranks(_dp_refusal_worker, 4, timeout=300)
    assert all("leave it off with dp or tp replicas" in m for m in messages)
