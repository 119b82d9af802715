"""Exact tensor parallelism for replicated tensors that meet tp-sharded activations.

miles-credit 2026.2's ``wxformer_next.Transformer`` declares ``_tp_plan`` on its Attention and
FeedForward; each Attention adds the output of a replicated ``DynamicPositionBias`` (``dpb``)
to the local heads' attention scores, so without help each tp rank holds only its heads' share
of the ``dpb.*`` gradients (CREDIT's own native TP is off by ~2e2 there).  The guard
(``tensor_parallel_guard``) finds the four ``dpb`` modules by tracing and all-reduces their
output gradient over tp.  Checked against the single-process model in float64 at tp = 2 and 4,
on two consecutive steps (the first traced, the second hooked), and composed with FSDP2 and
with domain parallelism through ``parallelize``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from credit_parallel import (
    apply_tensor_parallel,
    data_parallel_coords,
    get_domain_manager,
    parallelize,
    shard_batch,
    sync_domain_gradients,
)
from credit_parallel.parallel.tensor_parallel import collect_tensor_parallel_targets
from credit_parallel.parallel.tensor_parallel_guard import find_partial_gradient_modules
from credit_parallel.testing import run_on_ranks
from miles_credit import import_credit

DPB = ["layers.0.0.dpb", "layers.0.2.dpb", "layers.1.0.dpb", "layers.1.2.dpb"]


def _transformer() -> nn.Module:
    wx = import_credit("credit.models.wxformer.wxformer_next")
    torch.manual_seed(0)
    return wx.Transformer(
        16, local_window_size=2, global_window_size=2, depth=2, dim_head=4
    ).double()


def _batch(h=8):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, h, 4, dtype=torch.float64, generator=g)
    w = torch.randn(2, 16, h, 4, dtype=torch.float64, generator=g)
    return x, w


def _reference(h=8):
    model = _transformer()
    x, w = _batch(h)
    x = x.requires_grad_()
    (model(x) * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return grads, x.grad


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def test_trace_finds_the_position_bias_modules_in_one_process():
    model = _transformer()
    targets = collect_tensor_parallel_targets(model)
    column = {t.path for t in targets if t.role == "col"}
    row = {t.path for t in targets if t.role == "row"}
    report = find_partial_gradient_modules(model, column, row, _batch()[0])
    assert report.modules == DPB
    assert report.unfixable == []
    dpb_params = sorted(n for n, _ in model.named_parameters() if ".dpb." in n)
    assert report.parameters == dpb_params
    # nothing else is partial: norms and the residual stream reach the output whole
    assert not any("norm" in n for n in report.parameters)


def test_trace_refuses_a_parameter_used_directly_on_sharded_heads():
    class HeadBias(nn.Module):
        _tp_col = "up"
        _tp_row = "down"

        def __init__(self):
            super().__init__()
            self.up = nn.Linear(4, 8)
            self.down = nn.Linear(8, 4)
            self.bias = nn.Parameter(torch.zeros(1))

        def forward(self, x):
            return self.down(self.up(x) + self.bias)

    model = HeadBias()
    report = find_partial_gradient_modules(model, {"up"}, {"down"}, torch.randn(3, 4))
    assert [path for path, _ in report.unfixable] == ["parameter bias"]
    assert "submodule" in report.unfixable[0][1]


def _tp_worker(rank, world):
    model = _transformer()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    apply_tensor_parallel(model, mesh)
    x, w = _batch()
    errors = []
    for _ in range(2):  # the traced first forward, then the hooked later one
        model.zero_grad()
        x = x.detach().requires_grad_()
        (model(x) * w).sum().backward()
        grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        errors.append((grads, x.grad))
    return errors, model._tp_partial_gradient_report.modules


@pytest.mark.parametrize("tp", [2, 4])
def test_wxformer_next_transformer_tp_every_gradient_matches_single_process(tp):
    ref_grads, ref_input = _reference()
    for steps, modules in run_on_ranks(_tp_worker, tp, timeout=300):
        assert modules == DPB
        for grads, input_grad in steps:
            assert (input_grad - ref_input).abs().max() <= 1e-10
            assert grads.keys() == ref_grads.keys()
            for name, grad in grads.items():
                err = (grad - ref_grads[name]).abs().max().item()
                assert err <= 1e-10, (name, err)


def _composed_worker(rank, world, block, h):
    conf = {"trainer": {"parallelism": block}}
    model = parallelize(_transformer(), conf)
    mgr = get_domain_manager(model)
    dp_rank, dp_size = data_parallel_coords(conf)
    x, w = _batch(h)
    per = x.shape[0] // dp_size
    x, w = (t[dp_rank * per : (dp_rank + 1) * per] for t in (x, w))
    out = []
    for _ in range(2):
        model.zero_grad()
        local = shard_batch({"x": x, "w": w}, manager=mgr)
        # this rank's share of the global sum; FSDP2 averages over dp, hence * dp_size
        loss = (model(local["x"]) * local["w"]).sum() * dp_size
        loss.backward()
        if mgr is not None:
            sync_domain_gradients(model, mgr, op="sum")
        out.append({n: _full(p.grad).detach().clone() for n, p in model.named_parameters()})
    dist.barrier()
    return out


@pytest.mark.parametrize(
    "block, h",
    [
        ({"data": "fsdp2", "tensor": 2, "domain": 1}, 8),  # dp 2 x tp 2
        ({"data": "none", "tensor": 2, "domain": 2}, 8),  # tp 2 x domain 2
    ],
    ids=["fsdp2_dp2_tp2", "tp2_domain2"],
)
def test_wxformer_next_transformer_tp_composed_matches_single_process(block, h):
    ref_grads, _ = _reference(h)
    for steps in run_on_ranks(_composed_worker, 4, block, h, timeout=400):
        for grads in steps:
            assert grads.keys() == ref_grads.keys()
            for name, grad in grads.items():
                err = (grad - ref_grads[name]).abs().max().item()
                assert err <= 1e-10, (name, err)


def _spread_worker(rank, world, which):
    from credit_parallel.parallel.tensor_parallel import tp_replicated_parameters
    from credit_parallel.parallel.tensor_parallel_guard import replicated_gradient_spread

    model = _transformer()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    if which == "credit":  # miles-credit's own native TP: no all-reduce for dpb
        import_credit("credit.parallel.tensor_parallel").apply_native_tensor_parallel(model, mesh)
        params = [(n, p) for n, p in model.named_parameters() if not hasattr(p, "placements")]
    else:
        apply_tensor_parallel(model, mesh)
        params = tp_replicated_parameters(model)
    x, w = _batch()
    (model(x) * w).sum().backward()
    return replicated_gradient_spread(params, mesh.get_group())


def test_verify_spread_rows_flag_credit_native_tp_and_pass_ours():
    theirs = run_on_ranks(_spread_worker, 2, "credit", timeout=300)[0]
    ours = run_on_ranks(_spread_worker, 2, "ours", timeout=300)[0]
    differing = sorted(name for name, spread, _ in theirs if spread > 1e-10)
    assert differing and all(".dpb." in name for name in differing)
    assert {n for n, _, _ in ours} >= set(differing)
    assert max(spread for _, spread, _ in ours) <= 1e-10


def test_plan_notes_the_all_reduced_position_bias_and_flags_an_unfixable_parameter():
    from credit_parallel.planner.make import make_plan

    conf = {
        "model": {"type": "wxformer_next"},
        "trainer": {"parallelism": {"data": "none", "tensor": 2, "domain": 1}},
    }
    plan = make_plan(conf, 2, model=_transformer(), input_shapes=[(16, 8, 4)])
    assert any("layers.0.0.dpb" in note and "all-reduced over tp" in note for note in plan.notes)
    assert not any("tp:" in v for v in plan.violations)

    class HeadBias(nn.Module):
        _tp_col, _tp_row = "up", "down"

        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Conv2d(4, 8, 1), nn.Conv2d(8, 4, 1)
            self.bias = nn.Parameter(torch.zeros(1))

        def forward(self, x):
            return self.down(self.up(x) + self.bias)

    plan = make_plan(conf, 2, model=HeadBias(), input_shapes=[(4, 8, 4)])
    assert any("parameter bias" in v and "different gradients" in v for v in plan.violations)
