"""FSDP2 / DDP wrappers versus single-process training with identical initial weights: parity
of AdamW/SGD steps, bf16 mixed precision, activation checkpointing, FSDP2 + TP, gradient
accumulation with no_grad_sync, and conf validation."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch._dynamo  # noqa: F401  (see below)
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from credit_parallel import apply_ddp, apply_fsdp2, build_device_mesh
from credit_parallel.parallel.fsdp import is_activation_checkpointed, no_grad_sync
from credit_parallel.testing import fake_process_group, run_on_ranks

__all__: list[str] = []

# DTensor imports torch._dynamo lazily on first use (several seconds); importing it above, in the
# parent, means the forked workers inherit it instead of each importing it again.

F64_TOL = 1e-10


class ConvBlock(nn.Module):
    _fsdp2_shard = True

    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.forward_calls = 0

    def forward(self, x):
        self.forward_calls += 1
        return x + torch.tanh(self.conv(x))


class MLPBlock(nn.Module):
    _fsdp2_shard = True

    def __init__(self, dim):
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim + 1)  # odd sizes: uneven FSDP shards
        self.down = nn.Linear(2 * dim + 1, dim)
        self.forward_calls = 0

    def forward(self, x):
        self.forward_calls += 1
        return x + self.down(torch.tanh(self.up(x)))


class SmallNet(nn.Module):
    """Per-sample computation, so splitting the batch over dp ranks is exact."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(2, 4, 3, padding=1)
        self.conv_block = ConvBlock(4)
        self.mlp_block = MLPBlock(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.conv_block(self.stem(x)).mean(dim=(-2, -1))
        return self.head(self.mlp_block(h))


def _batch(dtype, n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 6, 5, generator=g).to(dtype), torch.randn(n, 3, generator=g).to(dtype)


def _loss(out, target):
    if out.dtype == torch.bfloat16:  # mixed precision: the loss itself in fp32
        out = out.float()
    return (out - target.to(out.dtype)).pow(2).mean()


def _max_rel(pairs):
    """max over pairs of max|a-b| / max|b|."""
    return max(
        ((a.double() - b.double()).abs().max() / b.double().abs().max()).item() for a, b in pairs
    )


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train_reference(model, x, y, steps, make_opt):
    opt = make_opt(model.parameters())
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, foreach=True)


# --------------------------------------------------------------------------------------------
# FSDP2 parity


def _fsdp2_worker(rank, world, dtype, activation_checkpoint):
    torch.manual_seed(0)
    reference = SmallNet().to(dtype)
    model = copy.deepcopy(reference)
    keys_before = list(model.state_dict())
    names_before = [n for n, _ in model.named_parameters()]
    # every opted-in block its own unit (min 0), however small: the per-block path is exact
    trainer = {"amp": False, "activation_checkpoint": activation_checkpoint}
    conf = {"trainer": {**trainer, "fsdp2_min_unit_params": 0}}
    apply_fsdp2(model, None, conf)  # None: a 1-D mesh over the whole world
    wrapped = {
        "root": isinstance(model, FSDPModule),
        "conv_block": isinstance(model.conv_block, FSDPModule),
        "mlp_block": isinstance(model.mlp_block, FSDPModule),
        "stem": isinstance(model.stem, FSDPModule),
        "head": isinstance(model.head, FSDPModule),
        "checkpointed": is_activation_checkpointed(model.conv_block)
        and is_activation_checkpointed(model.mlp_block),
    }
    x, y = _batch(dtype)
    opt = _adamw(model.parameters())
    losses = []
    steps = 3
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = _loss(model(x.chunk(world)[rank]), y.chunk(world)[rank])
        loss.backward()
        opt.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world)
    ref_losses = _train_reference(reference, x, y, steps, _adamw)
    params = [
        (_full(p.detach()), q.detach()) for p, q in zip(model.parameters(), reference.parameters())
    ]
    return {
        "wrapped": wrapped,
        "param_rel": _max_rel(params),
        "param_abs": max((a - b).abs().max().item() for a, b in params),
        "loss_abs": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "keys_unchanged": list(model.state_dict()) == keys_before,
        "names_unchanged": [n for n, _ in model.named_parameters()] == names_before,
        "master_dtype": {p.dtype for p in model.parameters()},
        "block_calls": (model.conv_block.forward_calls, model.mlp_block.forward_calls),
        "steps": steps,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fsdp2_4_dp_ranks_3_adamw_steps_match_single_process(dtype):
    for out in run_on_ranks(_fsdp2_worker, 4, dtype, False):
        assert out["wrapped"] == {
            "root": True,
            "conv_block": True,
            "mlp_block": True,
            "stem": False,
            "head": False,
            "checkpointed": False,
        }
        assert out["master_dtype"] == {dtype}
        assert out["keys_unchanged"] and out["names_unchanged"]
        assert out["block_calls"] == (out["steps"], out["steps"])
        if dtype == torch.float64:
            assert out["param_abs"] <= F64_TOL and out["loss_abs"] <= F64_TOL
        else:
            assert out["param_rel"] <= 1e-5 and out["loss_abs"] <= 1e-5


def test_fsdp2_activation_checkpointing_same_numbers_and_state_dict_keys():
    for out in run_on_ranks(_fsdp2_worker, 2, torch.float64, True):
        assert out["wrapped"]["checkpointed"]
        assert out["wrapped"]["root"] and out["wrapped"]["conv_block"]
        # parameter names and state_dict keys are those of the unwrapped model
        assert out["keys_unchanged"] and out["names_unchanged"]
        # recomputation really happens: one forward plus one recompute in backward per step
        assert out["block_calls"] == (2 * out["steps"], 2 * out["steps"])
        assert out["param_abs"] <= F64_TOL and out["loss_abs"] <= F64_TOL


# --------------------------------------------------------------------------------------------
# FSDP2 mixed precision


def _amp_worker(rank, world):
    torch.manual_seed(0)
    master = SmallNet()  # fp32 master weights of the reference
    model = apply_fsdp2(copy.deepcopy(master), None, {"trainer": {"amp": True}})
    seen = []
    model.mlp_block.up.register_forward_hook(
        lambda mod, inputs, output: seen.append((inputs[0].dtype, mod.weight.dtype, output.dtype))
    )
    x, y = _batch(torch.float32)
    opt = _adamw(model.parameters())
    ref_opt = _adamw(master.parameters())
    first_grads = None
    out_dtypes = set()
    for step in range(3):
        # parallel: fp32 input, FSDP2 casts inputs and parameters to bf16, reduces in fp32
        opt.zero_grad(set_to_none=True)
        out = model(x.chunk(world)[rank])
        out_dtypes.add(out.dtype)
        _loss(out, y.chunk(world)[rank]).backward()
        # reference: a bf16 copy of the fp32 master weights computes; its grads update the master
        compute = copy.deepcopy(master).to(torch.bfloat16)
        _loss(compute(x.to(torch.bfloat16)), y).backward()
        ref_opt.zero_grad(set_to_none=True)
        for q, c in zip(master.parameters(), compute.parameters()):
            q.grad = c.grad.float()
        if step == 0:
            first_grads = [
                (_full(p.grad), q.grad.clone())
                for p, q in zip(model.parameters(), master.parameters())
            ]
            grad_dtypes = {p.grad.dtype for p in model.parameters()}
        opt.step()
        ref_opt.step()
    params = [
        (_full(p.detach()), q.detach()) for p, q in zip(model.parameters(), master.parameters())
    ]
    return {
        "forward_dtypes": set(seen),
        "out_dtypes": out_dtypes,
        "master_dtypes": {p.dtype for p in model.parameters()},
        "grad_dtypes": grad_dtypes,
        "grad_rel": _max_rel(first_grads),
        "param_rel": _max_rel(params),
    }


def test_fsdp2_amp_computes_in_bf16_and_matches_bf16_reference_with_fp32_master():
    for out in run_on_ranks(_amp_worker, 2):
        # the opted-in block really computes in bf16: bf16 input, bf16 (unsharded) weight
        assert out["forward_dtypes"] == {(torch.bfloat16, torch.bfloat16, torch.bfloat16)}
        assert out["out_dtypes"] == {torch.bfloat16}
        # sharded master parameters and reduced gradients stay fp32
        assert out["master_dtypes"] == {torch.float32}
        assert out["grad_dtypes"] == {torch.float32}
        assert out["grad_rel"] <= 2e-2
        # after 3 AdamW steps: Adam's normalised update turns a bf16 rounding of a near-zero
        # gradient element into up to 2 lr per step, so the parameters differ more than the
        # gradients; 0.040 measured with the AMD EPYC CPU's bf16 kernels (0.0065 for the grads)
        assert out["param_rel"] <= 5e-2


# --------------------------------------------------------------------------------------------
# FSDP2 + TP (DTensor parameters on the tp axis of a 2-D mesh)


class TPBlock(nn.Module):
    """Column-parallel `up`, row-parallel `down` once their weights are tp DTensors."""

    _fsdp2_shard = True

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(4, 6)
        self.down = nn.Linear(6, 4)

    def forward(self, x):
        if not isinstance(self.up.weight, DTensor):
            return x + self.down(torch.tanh(self.up(x)))
        mesh = self.up.weight.device_mesh
        hidden = torch.tanh(self.up(DTensor.from_local(x, mesh, [Replicate()])))
        return x + self.down(hidden).redistribute(mesh, [Replicate()]).to_local()


class TPNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.block = TPBlock()
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.block(self.inp(x)))


def _fsdp2_tp_worker(rank, world):
    mesh, submeshes = build_device_mesh({"data": "fsdp2", "tensor": 2}, device="cpu")
    torch.manual_seed(0)
    reference = TPNet().double()
    model = copy.deepcopy(reference)
    keys_before = list(model.state_dict())
    tp = submeshes["tp"]
    for layer, placement in ((model.block.up, Shard(0)), (model.block.down, Shard(1))):
        layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), tp, [placement]))
    model.block.up.bias = nn.Parameter(
        distribute_tensor(model.block.up.bias.detach(), tp, [Shard(0)])
    )
    model.block.down.bias = nn.Parameter(
        distribute_tensor(model.block.down.bias.detach(), tp, [Replicate()])
    )
    apply_fsdp2(model, submeshes["dp"], {"trainer": {}})
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 3, generator=g).double(), torch.randn(8, 3, generator=g).double()
    dp_rank = mesh.get_local_rank("dp")
    opt = _sgd(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP2 warns that to_local() output is a view
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            _loss(model(x.chunk(2)[dp_rank]), y.chunk(2)[dp_rank]).backward()
            opt.step()
        _train_reference(reference, x, y, 2, _sgd)
        params = [
            (_full(p.detach()), q.detach())
            for p, q in zip(model.parameters(), reference.parameters())
        ]
    return {
        "mesh_ndims": sorted({p.device_mesh.ndim for p in model.parameters()}),
        "param_abs": max((a - b).abs().max().item() for a, b in params),
        "keys_unchanged": list(model.state_dict()) == keys_before,
    }


def test_fsdp2_on_tp_dtensor_params_2x2_mesh_matches_single_process():
    for out in run_on_ranks(_fsdp2_tp_worker, 4):
        assert out["mesh_ndims"] == [1, 2]  # dp-only params and (dp, tp) params
        assert out["param_abs"] <= F64_TOL
        assert out["keys_unchanged"]


# --------------------------------------------------------------------------------------------
# DDP


def _ddp_worker(rank, world):
    _, submeshes = build_device_mesh({"data": "ddp"}, device="cpu")
    torch.manual_seed(0)
    reference = SmallNet().double()
    model = apply_ddp(copy.deepcopy(reference), submeshes["dp"])
    x, y = _batch(torch.float64)
    opt = _sgd(model.parameters())
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        _loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
    _train_reference(reference, x, y, 2, _sgd)
    return {
        "is_ddp": isinstance(model, DistributedDataParallel),
        "param_abs": max(
            (p - q).abs().max().item()
            for p, q in zip(model.module.parameters(), reference.parameters())
        ),
    }


def test_ddp_2_ranks_2_sgd_steps_match_single_process():
    for out in run_on_ranks(_ddp_worker, 2):
        assert out["is_ddp"]
        assert out["param_abs"] <= F64_TOL


# --------------------------------------------------------------------------------------------
# gradient accumulation


def _accumulation_worker(rank, world, wrapper):
    torch.manual_seed(0)
    reference = SmallNet().double()
    model = copy.deepcopy(reference)
    if wrapper == "ddp":
        model = apply_ddp(model, None)
        params = list(model.module.parameters())
    elif wrapper == "fsdp2":
        model = apply_fsdp2(model, None, {"trainer": {"amp": False}})
        params = list(model.parameters())
    else:
        params = list(model.parameters())
    x, y = _batch(torch.float64)
    local_x, local_y = x.chunk(world)[rank], y.chunk(world)[rank]
    micro = list(zip(local_x.chunk(2), local_y.chunk(2)))
    with no_grad_sync(model):
        _loss(model(micro[0][0]), micro[0][1]).div(2).backward()
    after_first = [None if p.grad is None else _full(p.grad).clone() for p in params]
    _loss(model(micro[1][0]), micro[1][1]).div(2).backward()
    _loss(reference(x), y).backward()
    grad_abs = max(
        (_full(p.grad) - q.grad).abs().max().item() for p, q in zip(params, reference.parameters())
    )
    return {"after_first": after_first, "grad_abs": grad_abs}


def test_no_grad_sync_accumulating_two_half_batches_equals_full_batch_ddp():
    first, second = run_on_ranks(_accumulation_worker, 2, "ddp")
    for out in (first, second):
        assert out["grad_abs"] <= F64_TOL
    # inside no_grad_sync the ranks kept their own (different) local gradients
    assert all(g is not None for g in first["after_first"])
    assert any(not torch.equal(a, b) for a, b in zip(first["after_first"], second["after_first"]))


def test_no_grad_sync_accumulating_two_half_batches_equals_full_batch_fsdp2():
    for out in run_on_ranks(_accumulation_worker, 2, "fsdp2"):
        assert out["grad_abs"] <= F64_TOL
        # no reduce-scatter happened inside no_grad_sync: no sharded gradient exists yet
        assert all(g is None for g in out["after_first"])


def test_no_grad_sync_is_a_no_op_for_a_plain_module():
    def worker(rank, world):
        return _accumulation_worker(rank, world, "plain")

    # one rank: the plain module's accumulated gradients are the full-batch gradients
    (out,) = run_on_ranks(worker, 1)
    assert out["grad_abs"] <= F64_TOL
    assert all(g is not None for g in out["after_first"])


# --------------------------------------------------------------------------------------------
# configuration and mesh validation (no communication needed)


@pytest.mark.parametrize("bad", ["yes", 1, 0.0, None, "true"])
def test_apply_fsdp2_rejects_non_bool_amp_naming_the_key(bad):
    model = SmallNet()
    with pytest.raises(ValueError, match=r"trainer\.amp"):
        apply_fsdp2(model, None, {"trainer": {"amp": bad}})
    assert not isinstance(model, FSDPModule)


def test_apply_fsdp2_rejects_non_bool_activation_checkpoint_naming_the_key():
    with pytest.raises(ValueError, match=r"trainer\.activation_checkpoint"):
        apply_fsdp2(SmallNet(), None, {"trainer": {"activation_checkpoint": "on"}})


def test_apply_fsdp2_and_ddp_reject_a_2d_mesh():
    with fake_process_group(0, 4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with pytest.raises(ValueError, match="1-D"):
            apply_fsdp2(SmallNet(), mesh, {"trainer": {}})
        with pytest.raises(ValueError, match="1-D"):
            apply_ddp(SmallNet(), mesh)


# --------------------------------------------------------------------------------------------
# Granularity (SPEC §4): every opted-in block is its own unit unless the user asks to merge


def test_fsdp2_units_every_opted_in_block_by_default_merged_only_on_request():
    from credit_parallel.parallel.fsdp import FSDP2_MIN_UNIT_PARAMS, fsdp2_units

    model = SmallNet()
    conv = sum(p.numel() for p in model.conv_block.parameters())
    mlp = sum(p.numel() for p in model.mlp_block.parameters())
    assert conv != mlp
    names = lambda units: [n for n, _ in units]  # noqa: E731
    assert FSDP2_MIN_UNIT_PARAMS == 0
    assert names(fsdp2_units(model)) == ["conv_block", "mlp_block"]  # the default
    assert names(fsdp2_units(model, 0)) == ["conv_block", "mlp_block"]
    assert names(fsdp2_units(model, max(conv, mlp))) == [
        "conv_block" if conv > mlp else "mlp_block"
    ]
    assert names(fsdp2_units(model, max(conv, mlp) + 1)) == []
    with pytest.raises(ValueError, match="fsdp2_min_unit_params"):
        fsdp2_units(model, -1)


class _Nested(nn.Module):
    """An opted-in parent whose child is big enough alone: the parent counts only the rest."""

    _fsdp2_shard = True

    def __init__(self):
        super().__init__()
        self.inner = ConvBlock(4)
        self.extra = nn.Linear(4, 4)


def test_fsdp2_units_count_only_parameters_no_selected_child_holds():
    from credit_parallel.parallel.fsdp import fsdp2_units

    model = nn.Sequential(_Nested())
    inner = sum(p.numel() for p in model[0].inner.parameters())
    extra = sum(p.numel() for p in model[0].extra.parameters())
    assert [n for n, _ in fsdp2_units(model, inner)] == ["0.inner"]  # extra alone is smaller
    assert extra < inner
    assert [n for n, _ in fsdp2_units(model, inner + 1)] == ["0"]  # together they reach it


def _granularity_worker(rank, world, min_params, single_rank=False):
    torch.manual_seed(0)
    model = SmallNet()
    trainer = {} if min_params is None else {"fsdp2_min_unit_params": min_params}
    trainer["fsdp2_single_rank"] = single_rank
    apply_fsdp2(model, None, {"trainer": trainer})
    return [isinstance(m, FSDPModule) for m in (model, model.conv_block, model.mlp_block)]


@pytest.mark.parametrize("world", [1, 2])
def test_apply_fsdp2_shards_every_small_opted_in_block_by_default(world):
    # two opted-in blocks of a few hundred parameters each: both FSDP units without any option
    model = SmallNet()
    assert all(
        sum(p.numel() for p in b.parameters()) < 10_000 for b in (model.conv_block, model.mlp_block)
    )
    # SPEC §4: a one-rank group gets FSDP2 only when trainer.fsdp2_single_rank keeps it there
    assert run_on_ranks(_granularity_worker, world, None, True) == [[True, True, True]] * world
    applied = world > 1
    assert run_on_ranks(_granularity_worker, world, None) == [[applied] * 3] * world


def test_apply_fsdp2_merges_small_blocks_only_with_the_option_set():
    assert run_on_ranks(_granularity_worker, 2, 1_000_000) == [[True, False, False]] * 2
    assert run_on_ranks(_granularity_worker, 2, 0) == [[True, True, True]] * 2
