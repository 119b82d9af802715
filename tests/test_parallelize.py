"""The composed recipe: domain -> TP -> FSDP2/DDP trains exactly like one process."""

import copy

import pytest
import torch
from torch import nn

from credit_parallel import ParallelDims, get_domain_manager, get_raw_model, parallelize
from credit_parallel.layout.mesh import data_parallel_coords
from credit_parallel.testing import run_on_ranks
from credit_parallel.train.step import TrainStep, replica_mean_loss

H, W, B = 13, 8, 4


class ConvMlp(nn.Module):
    _tp_col = "net.0"
    _tp_row = "net.2"

    def __init__(self, c):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(c, 4 * c, 1), nn.GELU(), nn.Conv2d(4 * c, c, 1))

    def forward(self, x):
        return x + self.net(x)


class Block(nn.Module):
    _fsdp2_shard = True

    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.norm = nn.GroupNorm(2, c)
        self.act = nn.SiLU()
        self.mlp = ConvMlp(c)

    def forward(self, x):
        return self.mlp(self.act(self.norm(self.conv(x))))


class SmallNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(4, 8, 3, padding=1)
        self.block1 = Block(8)
        self.down = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.block2 = Block(8)
        self.up = nn.Upsample(size=(H, W), mode="bilinear")
        self.head = nn.Conv2d(16, 4, 1)

    def forward(self, x):
        skip = self.block1(self.stem(x))
        y = self.up(self.block2(self.down(skip)))
        return self.head(torch.cat([y, skip], dim=1))


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(model, params, batches, step_fn, steps):
    opt = torch.optim.AdamW(params, lr=1e-2, eps=1e-6)
    losses, norms = [], []
    for s in range(steps):
        opt.zero_grad()
        loss, norm = step_fn(model, batches[s % len(batches)])
        opt.step()
        losses.append(loss)
        norms.append(norm)
    return losses, norms


def _worker(rank, world, block, steps, dtype):
    torch.set_default_dtype(dtype)
    conf = {"trainer": {"parallelism": block, "fsdp2_min_unit_params": 0}}  # per-block units
    g = torch.Generator().manual_seed(7)
    batches = [
        (torch.randn(B, 4, H, W, generator=g), torch.randn(B, 4, H, W, generator=g))
        for _ in range(2)
    ]
    torch.manual_seed(0)
    ref = SmallNet()
    par_model = copy.deepcopy(ref)

    def ref_step(model, batch):
        x, y = batch
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        return float(loss), float(norm)

    ref_losses, ref_norms = _train(ref, ref.parameters(), batches, ref_step, steps)

    par = parallelize(par_model, conf)
    mgr = get_domain_manager(par)
    dp_rank, dp_size = data_parallel_coords(conf)
    per = B // dp_size

    def share(outputs, targets):
        # share of the replica's mean: local sum / global count of the replica
        return ((outputs[0] - targets[0]) ** 2).sum() / (per * 4 * H * W)

    def par_step(model, batch):
        x, y = (t[dp_rank * per : (dp_rank + 1) * per] for t in batch)
        step = TrainStep(model, share, manager=mgr, max_norm=0.5)
        result = step([{"x": x, "y": y}])
        tp_size = ParallelDims.from_conf(conf, world).tp
        loss = replica_mean_loss(result.loss_share, tp_size=tp_size, dp_size=dp_size)
        return float(loss), float(result.grad_norm)

    par_losses, par_norms = _train(par, par.parameters(), batches, par_step, steps)
    ref_params = dict(ref.named_parameters())
    errs = {}
    for name, p in get_raw_model(par).named_parameters():
        full = _full(p.detach())
        r = ref_params[name].detach()
        errs[name] = float((full - r).abs().max() / r.abs().max())
    return {
        "loss": max(abs(a - b) / abs(b) for a, b in zip(par_losses, ref_losses)),
        "norm": max(abs(a - b) / abs(b) for a, b in zip(par_norms, ref_norms)),
        "params": max(errs.values()),
        "worst": max(errs, key=errs.get),
        "clipped": any(n > 0.5 for n in ref_norms),
    }


@pytest.mark.parametrize(
    "world, block",
    [
        (4, {"data": "ddp", "tensor": 1, "domain": 2}),
        (4, {"data": "none", "tensor": 2, "domain": 2}),
        (4, {"data": "fsdp2", "tensor": 2, "domain": 1}),
        (3, {"data": "none", "tensor": 1, "domain": 3}),
    ],
)
def test_composed_layout_trains_like_single_process(world, block):
    results = run_on_ranks(_worker, world, block, 5, torch.float32, timeout=240)
    for r in results:
        assert r["clipped"], "the test must exercise clipping"
        assert r["loss"] <= 1e-5, r
        assert r["norm"] <= 1e-5, r
        assert r["params"] <= 1e-5, r


@pytest.mark.slow
def test_full_composition_fsdp2_tp2_domain2_on_8_ranks():
    results = run_on_ranks(
        _worker, 8, {"data": "fsdp2", "tensor": 2, "domain": 2}, 5, torch.float32, timeout=400
    )
    for r in results:
        assert r["loss"] <= 1e-5 and r["norm"] <= 1e-5 and r["params"] <= 1e-5, r


def test_everything_at_one_returns_model_untouched():
    model = SmallNet()
    assert parallelize(model, {"trainer": {"parallelism": {"data": "none"}}}) is model
    assert get_domain_manager(model) is None


def test_parallelize_without_process_group_is_a_clear_error():
    with pytest.raises(RuntimeError, match="process group"):
        parallelize(SmallNet(), {"trainer": {"parallelism": {"data": "ddp", "domain": 2}}})


def test_ddp_with_tensor_parallel_is_refused():
    def worker(rank, world):
        parallelize(SmallNet(), {"trainer": {"parallelism": {"data": "ddp", "tensor": 2}}})

    with pytest.raises(Exception, match="fsdp2"):
        run_on_ranks(worker, 2)
