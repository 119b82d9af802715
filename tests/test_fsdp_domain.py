"""FSDP2 over the flattened dp x domain axis (SPEC §4): exact training, memory 1/(dp x domain).

With ``data: fsdp2`` and domain > 1, ``parallelize`` shards parameters, gradients and AdamW
state over dp x domain (tensor-parallel parameters additionally over tp).  The reduce-scatter
sums gradients over the domain ranks and averages over dp; ``sync_domain_gradients`` only
scales the FSDP-managed ones.  Each case trains several AdamW steps in float64 on uneven rows
(H = 13 over 2 domain ranks) and is compared with the same training in one process.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from credit_parallel import (
    get_domain_manager,
    get_raw_model,
    parallelize,
    shard_batch,
    sync_domain_gradients,
)
from credit_parallel.layout.config import DP_DOMAIN
from credit_parallel.layout.mesh import data_parallel_coords
from credit_parallel.testing import run_on_ranks

H, W, B, C = 13, 6, 4, 4
TOL = 1e-10
STEPS = 4


class Mlp(nn.Module):
    _tp_col = "fc1"
    _tp_row = "fc2"

    def __init__(self, c):
        super().__init__()
        self.fc1 = nn.Conv2d(c, 4 * c, 1)
        self.fc2 = nn.Conv2d(4 * c, c, 1)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Block(nn.Module):
    _fsdp2_shard = True

    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.norm = nn.GroupNorm(2, c)
        self.mlp = Mlp(c)

    def forward(self, x):
        return self.mlp(torch.tanh(self.norm(self.conv(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(C, 8, 3, padding=1)
        self.block1 = Block(8)
        self.block2 = Block(8)
        self.head = nn.Conv2d(8, C, 3, padding=1)

    def forward(self, x):
        return self.head(self.block2(self.block1(self.stem(x))))


def _batches(h=H):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(B, C, h, W, generator=g), torch.randn(B, C, h, W, generator=g))]


def _reference_losses(h=H):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(STEPS):
            ((x, y),) = _batches(h)
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    finally:
        torch.set_default_dtype(previous)
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _local_numel(t: torch.Tensor) -> int:
    return t.to_local().numel() if isinstance(t, DTensor) else t.numel()


def _train_worker(rank, world, block, h=H, op="sum"):
    torch.set_default_dtype(torch.float64)
    conf = {"trainer": {"parallelism": block, "fsdp2_min_unit_params": 0}}  # per-block units
    torch.manual_seed(0)
    model = parallelize(copy.deepcopy(Net()), conf)
    mgr = get_domain_manager(model)
    dp_rank, dp_size = data_parallel_coords(conf)
    per = B // dp_size
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(STEPS):
        ((x, y),) = _batches(h)
        x, y = (t[dp_rank * per : (dp_rank + 1) * per] for t in (x, y))
        local = shard_batch({"x": x, "y": y}, manager=mgr)
        opt.zero_grad()
        err = (model(local["x"]) - local["y"]) ** 2
        if op == "sum":
            # this rank's share of its replica's mean (any rows); FSDP averages over dp
            loss = err.sum() / (per * C * h * W)
            share = loss
        else:
            # the mean over this rank's own rows (equal shards only)
            loss = err.mean()
            share = loss / mgr.domain_world_size
        loss.backward()
        sync_domain_gradients(model, mgr, op=op)
        opt.step()
        total = share.detach().clone()  # the replica's mean, summed below
        dist.all_reduce(total, group=mgr.domain_group)
        dist.all_reduce(total, group=mgr.data_parallel_group)
        losses.append(float(total) / dp_size)
    raw = get_raw_model(model)
    # split over tp: TP parameters other than the row biases (those are Replicate over tp)
    tp_names = {
        n
        for n, p in raw.named_parameters()
        if "tp" in p.device_mesh.mesh_dim_names
        and not p.placements[p.device_mesh.mesh_dim_names.index("tp")].is_replicate()
    }
    memory = {"non_tp": 0, "tp": 0, "state": 0, "param_local": 0}
    meshes = set()
    for name, p in raw.named_parameters():
        memory["tp" if name in tp_names else "non_tp"] += _local_numel(p)
        memory["param_local"] += _local_numel(p)
        meshes.add(tuple(p.device_mesh.mesh_dim_names))
        state = opt.state[p]
        memory["state"] += _local_numel(state["exp_avg"]) + _local_numel(state["exp_avg_sq"])
    params = {n: p.detach().full_tensor() for n, p in raw.named_parameters()}
    return {
        "losses": losses,
        "params": params,
        "memory": memory,
        "meshes": meshes,
        "tp_names": tp_names,
    }


@pytest.mark.parametrize(
    "world, block",
    [
        (4, {"data": "fsdp2", "tensor": 1, "domain": 2}),  # dp 2 x domain 2
        (2, {"data": "fsdp2", "tensor": 1, "domain": 2}),  # dp 1 x domain 2
        (4, {"data": "fsdp2", "tensor": 2, "domain": 2}),  # (dp_domain, tp) 2-D FSDP + TP
    ],
)
def test_fsdp2_over_dp_x_domain_uneven_h13_trains_like_single_process(world, block):
    ref_losses, ref_params = _reference_losses()
    results = run_on_ranks(_train_worker, world, block, timeout=300)
    tp, domain = block["tensor"], block["domain"]
    dp = world // (tp * domain)
    tp_names = results[0]["tp_names"]
    assert bool(tp_names) == (tp > 1)
    n_tp = sum(p.numel() for n, p in ref_params.items() if n in tp_names)
    n_non_tp = sum(p.numel() for n, p in ref_params.items() if n not in tp_names)
    for res in results:
        for a, b in zip(res["losses"], ref_losses):
            assert abs(a - b) <= TOL * abs(b), (res["losses"], ref_losses)
        for name, ref in ref_params.items():
            assert float((res["params"][name] - ref).abs().max()) <= TOL, name
        expected_axes = {(DP_DOMAIN,)} if tp == 1 else {(DP_DOMAIN,), (DP_DOMAIN, "tp")}
        assert res["meshes"] == expected_axes
        # AdamW state (exp_avg, exp_avg_sq) lives exactly where the parameter shard lives
        assert res["memory"]["state"] == 2 * res["memory"]["param_local"]
    # every element of the non-TP part is held once per tp rank across the dp x domain group,
    # and each rank holds 1/(dp x domain) of it up to FSDP's row rounding
    total_non_tp = sum(r["memory"]["non_tp"] for r in results)
    assert total_non_tp == n_non_tp * tp
    total_tp = sum(r["memory"]["tp"] for r in results)
    assert total_tp == n_tp
    for res in results:
        share = res["memory"]["non_tp"] / n_non_tp
        assert abs(share - 1 / (dp * domain)) <= 0.1 / (dp * domain), (share, dp, domain)
        if tp > 1:
            share = res["memory"]["tp"] / n_tp
            assert abs(share - 1 / (dp * domain * tp)) <= 0.1 / (dp * domain * tp), share


def test_fsdp2_over_dp_x_domain_sync_avg_divides_by_domain_on_equal_shards_h12():
    ref_losses, ref_params = _reference_losses(12)
    block = {"data": "fsdp2", "tensor": 1, "domain": 2}
    for res in run_on_ranks(_train_worker, 2, block, 12, "avg", timeout=300):
        for a, b in zip(res["losses"], ref_losses):
            assert abs(a - b) <= TOL * abs(b), (res["losses"], ref_losses)
        for name, ref in ref_params.items():
            assert float((res["params"][name] - ref).abs().max()) <= TOL, name
