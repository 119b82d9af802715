"""One CRPS training step under ``parallelize`` with the ensemble axis equals one process.

``trainer.parallelism: {data: fsdp2, ensemble: 2, domain: 2}`` on 4 ranks, ``ensemble_size``
4 (2 members per rank, 7 uneven rows over 2 domain ranks), a model that draws dropout masks
and noise on its activations: the CRPS value and every parameter gradient (FSDP2 over
dp x ensemble x domain) equal miles-credit's ``KCRPSLoss`` on one process holding the 4 members
(float64 1e-10).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from credit_parallel import get_domain_manager, parallelize
from credit_parallel.domain.sharding import shard_tensor
from credit_parallel.testing import run_on_ranks
from credit_parallel.train.crps import EnsembleLoss, crps_share
from test_random_draws import SEED, _NoisyNet

K, B, H, W = 4, 2, 7, 6


def _data():
    torch.manual_seed(0)
    model = _NoisyNet().double().train()
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


def _rank(rank, world):
    model, x, target = _data()
    conf = {
        "trainer": {
            "parallelism": {"data": "fsdp2", "ensemble": 2, "domain": 2},
            "ensemble_size": K,
        }
    }
    model = parallelize(model, conf)
    manager = get_domain_manager(model)
    ens_group = model._device_mesh["ensemble"].get_group()
    local = K // 2
    x_local = shard_tensor(x.repeat_interleave(local, 0), -2, manager)
    t_local = shard_tensor(target, -2, manager, register=False)
    torch.manual_seed(SEED)
    share = crps_share(model(x_local), t_local, EnsembleLoss("KCRPS", K), ens_group)
    loss = share.sum() / (B * 2 * H * W)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return total, grads


def test_kcrps_step_under_ensemble_2_domain_2_equals_one_process():
    ref_loss, ref_grads = _reference()
    for total, grads in run_on_ranks(_rank, 4):
        assert abs(float(total - ref_loss)) <= 1e-10
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            assert (grad - ref_grads[name]).abs().max() <= 1e-10, name
