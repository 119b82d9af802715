"""Meta-device initialisation: a model built on the meta device and materialised already sharded
has exactly the initial weights of a plain ``torch.manual_seed(s); factory()`` build.

Multi-rank cases gather every parameter (``full_tensor``) and compare bit for bit with the plain
single-process build; the RNG must also end where the plain build leaves it, so the training
that follows draws the same numbers.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from credit_parallel import gather_tensor, get_domain_manager, shard_tensor
from credit_parallel.models import build_model
from credit_parallel.testing import run_on_ranks
from credit_parallel.train.model_init import build_parallel_model, record_meta_build
from sample_conf import tiny_unet

SEED = 11
UNET = tiny_unet(13, 8, 4)


def unet():
    return build_model(dict(UNET))


class CustomInit(nn.Module):
    """Inits that are not a module's reset_parameters: a randn parameter, trunc_normal_ (a
    data-dependent draw loop torch skips on meta), in-place arithmetic, an arange buffer."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 7)
        self.table = nn.Parameter(torch.randn(3, 4))
        nn.init.trunc_normal_(self.lin.weight, std=0.02)
        self.conv = nn.Conv2d(3, 4, 3)
        nn.init.orthogonal_(self.conv.weight)
        self.register_buffer("index", torch.arange(6).view(2, 3))
        with torch.no_grad():
            self.lin.bias.mul_(2).add_(1)


def _plain(factory):
    torch.manual_seed(SEED)
    model = factory()
    values = {n: t.detach().clone() for n, t in model.named_parameters()}
    values.update({n: t.clone() for n, t in model.named_buffers()})
    return values, torch.rand(4)


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


@pytest.mark.parametrize("factory", [unet, CustomInit], ids=["unet", "custom_init"])
def test_single_process_meta_build_equals_plain_build_and_leaves_the_rng_alike(factory):
    want, rng_after = _plain(factory)
    conf = {"trainer": {"parallelism": {"data": "none"}}}
    model = build_parallel_model(factory, conf, device="cpu", seed=SEED)
    assert torch.equal(torch.rand(4), rng_after)
    got = dict(model.named_parameters()) | dict(model.named_buffers())
    assert set(got) == set(want)
    for name, value in want.items():
        assert not got[name].is_meta and torch.equal(got[name].detach(), value), name


def test_meta_build_allocates_nothing():
    model, record = record_meta_build(unet)
    assert all(p.is_meta for p in model.parameters())
    assert record.chains  # every tensor's construction was recorded


def test_a_buffer_from_python_data_is_refused_by_name():
    class FromData(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.tensor([1.0, 2.0]))

    with pytest.raises(ValueError, match=r"FromData\.table"):
        build_parallel_model(FromData, {"trainer": {"parallelism": {}}}, device="cpu")


def _input():
    return torch.randn(2, 4, 13, 8, generator=torch.Generator().manual_seed(2))


def _layout_worker(rank, world, block):
    # one FSDP2 unit per opted-in block however small (the root's own unit stays unsharded
    # after a forward, as FSDP2 keeps it for the backward)
    conf = {"trainer": {"parallelism": block, "fsdp2_min_unit_params": 0}}
    model = build_parallel_model(unet, conf, device="cpu", seed=SEED)
    raw = model.module if hasattr(model, "module") else model
    # the forward runs on what FSDP2 / DDP actually hold, not only on what full_tensor() reads
    manager = get_domain_manager(model)
    with torch.no_grad():
        out = gather_tensor(model(shard_tensor(_input(), manager=manager)), manager=manager)
    local, full = 0, 0
    values = {}
    for name, p in raw.named_parameters():
        local += p.to_local().numel() if isinstance(p, DTensor) else p.numel()
        full += p.numel()
        values[name] = _full(p.detach())
    return values, local, full, torch.rand(4), out


@pytest.mark.parametrize(
    "world, block",
    [
        (2, {"data": "fsdp2", "tensor": 1, "domain": 2}),
        (4, {"data": "fsdp2", "tensor": 2, "domain": 2}),
        (2, {"data": "none", "tensor": 1, "domain": 2}),
        (2, {"data": "ddp", "tensor": 1, "domain": 2}),
    ],
)
def test_meta_init_materialised_sharded_equals_plain_single_process_build(world, block):
    want, rng_after = _plain(unet)
    torch.manual_seed(SEED)
    with torch.no_grad():
        want_out = unet()(_input())
    for values, local, full, rng, out in run_on_ranks(_layout_worker, world, block, timeout=240):
        assert torch.equal(rng, rng_after)
        assert float((out - want_out).abs().max()) <= 1e-5 * float(want_out.abs().max())
        params = {n for n, _ in unet().named_parameters()}
        assert set(values) == params
        for name in params:
            assert torch.equal(values[name], want[name]), name
        if block["data"] == "fsdp2":
            # sharded over dp x domain (tp-split parameters also over tp): never the whole model
            dp_x_domain = world // block["tensor"]
            assert local * dp_x_domain <= full * 1.2, (local, full)
        else:
            assert local == full
