"""Dropout under the ensemble axis with ``trainer.activation_checkpoint``: the recomputed
forward of a checkpointed block draws the same masks as the forward (issue 40 item 5).

``trainer.parallelism: {data: fsdp2, ensemble: 2}`` and ``{domain: 2}`` (5 uneven rows) on 2
ranks, ``ensemble_size`` 4, a model
whose opted-in block draws dropout masks (as CREDIT's crossformer ``ff_dropout`` /
``attn_dropout``), checkpointed: the CRPS value and every parameter gradient equal miles-credit's
``KCRPSLoss`` on one process holding the 4 members (float64 1e-10).  Before the fix the
recompute ran outside the layout-independent draws and drew this rank's own local mask: the
loss matched and the gradients did not.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from credit_parallel import get_domain_manager, parallelize
from credit_parallel.domain.sharding import shard_tensor
from credit_parallel.testing import run_on_ranks
from credit_parallel.train.crps import EnsembleLoss, crps_share

K, B, H, W, SEED = 4, 2, 5, 6, 1234


class _Block(nn.Module):
    _fsdp2_shard = True

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return x + self.drop(torch.tanh(self.conv(x)))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lift = nn.Conv2d(2, 4, 1)
        self.blocks = nn.Sequential(_Block(), _Block())
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.head(self.blocks(self.lift(x)))


def _data():
    torch.manual_seed(0)
    model = _Net().double().train()
    x = torch.randn(B, 2, H, W, dtype=torch.float64)
    target = torch.randn(B, 2, H, W, dtype=torch.float64)
    return model, x, target


def _reference():
    from credit.losses.gen_1.kcrps import KCRPSLoss

    model, x, target = _data()
    torch.manual_seed(SEED)
    loss = KCRPSLoss("none")(target, model(x.repeat_interleave(K, 0))).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _rank(rank, world, ensemble, domain):
    model, x, target = _data()
    conf = {
        "trainer": {
            "parallelism": {"data": "fsdp2", "ensemble": ensemble, "domain": domain},
            "ensemble_size": K,
            "activation_checkpoint": True,
        }
    }
    model = parallelize(model, conf)
    manager = get_domain_manager(model)
    ens_group = model._device_mesh["ensemble"].get_group() if ensemble > 1 else None
    x_local = x.repeat_interleave(K // ensemble, 0)
    if manager is not None:
        x_local = shard_tensor(x_local, -2, manager)
        target = shard_tensor(target, -2, manager, register=False)
    torch.manual_seed(SEED)
    share = crps_share(model(x_local), target, EnsembleLoss("KCRPS", K), ens_group)
    loss = share.sum() / (B * 2 * H * W)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return total, grads


@pytest.mark.parametrize("ensemble,domain", [(2, 1), (1, 2)])
def test_checkpointed_dropout_equals_one_process(ensemble, domain):
    ref_loss, ref_grads = _reference()
    for total, grads in run_on_ranks(_rank, 2, ensemble, domain):
        assert abs(float(total - ref_loss)) <= 1e-10
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            assert (grad - ref_grads[name]).abs().max() <= 1e-10, name


def _crossformer_data():
    from test_random_draws import _crossformer_dropout

    torch.manual_seed(0)
    model = _crossformer_dropout().train()  # attn_dropout / ff_dropout 0.1, dim (2, 4, 8, 16)
    x = torch.randn(B, 3, 32, 32)
    target = torch.randn(B, 3, 1, 32, 32)
    return model, x, target


def _crossformer_reference():
    from credit.losses.gen_1.kcrps import KCRPSLoss

    torch.set_default_dtype(torch.float64)
    try:
        model, x, target = _crossformer_data()
        torch.manual_seed(SEED)
        loss = KCRPSLoss("none")(target, model(x.repeat_interleave(K, 0))).mean()
        loss.backward()
    finally:
        torch.set_default_dtype(torch.float32)
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _crossformer_rank(rank, world):
    torch.set_default_dtype(torch.float64)
    model, x, target = _crossformer_data()
    conf = {"trainer": {"parallelism": {"data": "fsdp2", "ensemble": 2}, "ensemble_size": K}}
    model = parallelize(model, conf)
    ens_group = model._device_mesh["ensemble"].get_group()
    torch.manual_seed(SEED)
    share = crps_share(
        model(x.repeat_interleave(K // 2, 0)), target, EnsembleLoss("KCRPS", K), ens_group
    )
    loss = share.sum() / target.numel()
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads[name] = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
    return total, grads


def test_credit_crossformer_dropout_under_ensemble_2_equals_one_process():
    """CREDIT's crossformer with attn_dropout and ff_dropout (the smoke ensemble config's source
    of member diversity) at a small dim, whose dynamic position bias has zero-element parameters
    (FSDP2 refused them: torch._chunk_cat "expects non-empty tensor"; they stay unsharded)."""
    ref_loss, ref_grads = _crossformer_reference()
    empty = [n for n, g in ref_grads.items() if g.numel() == 0]
    assert empty  # the case FSDP2 failed on
    for total, grads in run_on_ranks(_crossformer_rank, 2):
        assert abs(float(total - ref_loss)) <= 1e-10
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            assert grad.shape == ref_grads[name].shape, name
            if grad.numel():
                assert (grad - ref_grads[name]).abs().max() <= 1e-10, name
