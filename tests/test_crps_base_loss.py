"""ring-crps inside CREDIT's ``loss.type: base`` (per-variable weights) under any layout.

miles-credit's own ``BaseLoss`` with ``training_loss: ring-crps`` run as CREDIT runs it (one
member per rank of a 4-rank group, DDP's mean) against credit-parallel's ``CreditBaseLoss``
scoring each variable with ``train/crps.py``'s share at ensemble 2 x domain 2 (2 members per
rank, 7 uneven rows): the loss and the gradient of every member at every point.  CREDIT's
BaseLoss scores in float32, so the float32 tolerances of SPEC §0 apply (relative 1e-5).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from credit_parallel import ParallelDims
from credit_parallel.data.bridgescaler_blocks import VarSlot
from credit_parallel.domain.rows import shard_range
from credit_parallel.layout.config import ENSEMBLE
from credit_parallel.testing import run_on_ranks
from credit_parallel.train.credit_loss import CreditBaseLoss, _credit_base_loss
from credit_parallel.train.crps import EnsembleLoss

K, B, H, W = 4, 1, 7, 6
SLOTS = [VarSlot("T", 0, 2), VarSlot("SP", 2, 1)]  # a 2-level variable and a surface one
ARGS = {
    "training_loss": "ring-crps",
    "var_weighting": "manual",
    "variable_weights": {"T": 2.0, "SP": 0.5},
    "normalize_weights": True,
}


def _data():
    g = torch.Generator().manual_seed(3)
    pred = torch.randn(B * K, 3, H, W, generator=g, dtype=torch.float64)
    target = torch.randn(B, 3, H, W, generator=g, dtype=torch.float64)
    return pred, target


def _credit_state(x):
    return {"ERA5": {s.key: x[:, s.start : s.start + s.width].unsqueeze(2) for s in SLOTS}}


def _credit_rank(rank, world):
    """CREDIT: member ``rank`` on rank ``rank``, its BaseLoss's ring over the world."""
    pred, target = _data()
    member = pred.view(B, K, 3, H, W)[:, rank].clone().requires_grad_(True)
    loss_fn = _credit_base_loss(dict(ARGS), [s.key for s in SLOTS], False)
    loss_fn.base_loss._group, loss_fn.base_loss._group_resolved = dist.group.WORLD, True
    loss = loss_fn(
        {"y_processed": _credit_state(member), "y_target_processed": _credit_state(target)}
    )
    loss.backward()
    return loss.detach().double(), member.grad


def _ours_rank(rank, world):
    pred, target = _data()
    dims = ParallelDims("fsdp2", 1, 2, world, 2)
    meshes = dims.build_mesh("cpu")
    group = meshes.submeshes[ENSEMBLE].get_group()
    e, dom = dims.ensemble_coord(rank), dims.coords(rank)["domain"]
    r0, r1 = shard_range(H, 2, dom)
    mine = pred.view(B, K, 3, H, W)[:, 2 * e : 2 * e + 2, :, r0:r1].reshape(B * 2, 3, r1 - r0, W)
    mine = mine.clone().requires_grad_(True)
    layout = SimpleNamespace(output_slots=SLOTS)
    loss_fn = CreditBaseLoss(ARGS, None, layout, None, H, W, 2, False)
    loss_fn.ensemble = (EnsembleLoss("ring-crps", K), group)
    loss = loss_fn((mine,), (target[..., r0:r1, :],))
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total, mine.grad, (e, r0, r1)


def test_ring_crps_inside_base_loss_equals_credits_ring_at_ensemble_2_domain_2():
    ranks = run_on_ranks(_credit_rank, K)
    ref_loss = sum(v for v, _ in ranks) / K  # DDP's mean over CREDIT's K member ranks
    ref_grad = torch.stack([g / K for _, g in ranks], dim=1)  # (B, K, 3, H, W)
    for total, grad, (e, r0, r1) in run_on_ranks(_ours_rank, 4):
        assert abs(float(total - ref_loss)) <= 1e-5 * abs(float(ref_loss))
        expected = ref_grad[:, 2 * e : 2 * e + 2, :, r0:r1].reshape(grad.shape)
        assert (grad - expected).abs().max() <= 1e-5 * ref_grad.abs().max()
        assert expected.abs().max() > 1e-4
