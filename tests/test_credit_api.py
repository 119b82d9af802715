"""CREDIT 2026.2's parallel names (``credit_parallel.parallel.credit_api``) against miles-credit's own
classes: ``_tp_plan`` read as our plan, ``supports_native_tp``, ``apply_native_tensor_parallel``,
the four ``Tp*`` modules, ``shard_lat_weights``, ``gather_spatial`` and ``fsdp2_is_applied``.
Where CREDIT is inexact (the column modules' input gradient) ours is checked against one
process; where it refuses (H not divisible by the domain size) ours is checked against
``torch.tensor_split``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import credit_parallel
from credit_parallel import (
    DomainParallelManager,
    TpColConv2d,
    TpColLinear,
    TpRowConv2d,
    TpRowLinear,
    apply_native_tensor_parallel,
    fsdp2_is_applied,
    gather_spatial,
    shard_lat_weights,
    shard_tensor,
    supports_native_tp,
)
from credit_parallel.parallel.tensor_parallel import (
    build_tensor_parallel_plan,
    collect_tensor_parallel_targets,
)
from credit_parallel.testing import run_on_ranks
from miles_credit import import_credit


def _credit_tp():
    return import_credit("credit.parallel.tensor_parallel")


def _attention(dim=16, dim_head=4):
    wx = import_credit("credit.models.wxformer.wxformer_next")
    torch.manual_seed(0)
    return wx.Attention(dim, attn_type="short", window_size=2, dim_head=dim_head).double()


def test_every_credit_name_is_exported_from_the_top_level():
    for name in (
        "supports_native_tp",
        "apply_native_tensor_parallel",
        "TpColConv2d",
        "TpColLinear",
        "TpRowConv2d",
        "TpRowLinear",
        "shard_lat_weights",
        "gather_spatial",
        "fsdp2_is_applied",
    ):
        assert name in credit_parallel.__all__
        assert getattr(credit_parallel, name) is not None


def test_tp_plan_of_wxformer_next_attention_is_read_as_our_plan():
    attn = _attention()
    roles = {t.path: t.role for t in collect_tensor_parallel_targets(attn)}
    assert roles == {"to_q": "col", "to_k": "col", "to_v": "col", "to_out": "row"}
    assert set(build_tensor_parallel_plan(attn, 2)) == set(roles)
    # CREDIT's _tp_constraints is honoured: 4 heads do not split over 3 ranks
    with pytest.raises(ValueError, match="heads=4 not divisible by tp_size=3"):
        build_tensor_parallel_plan(attn, 3)


def test_a_bad_tp_plan_value_names_the_module():
    block = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    block._tp_plan = {"0": "colwise", "1": "sideways"}
    with pytest.raises(TypeError, match="_tp_plan of module <root>.*'colwise' or 'rowwise'"):
        collect_tensor_parallel_targets(block)


def test_supports_native_tp_agrees_with_credit_and_also_counts_tp_col():
    wx = import_credit("credit.models.wxformer.wxformer_next")
    model = wx.Transformer(16, local_window_size=2, global_window_size=2, depth=1, dim_head=4)
    plain = nn.Sequential(nn.Linear(4, 4))
    credit_tp = _credit_tp()
    for m in (model, plain):
        assert supports_native_tp(m) == credit_tp.supports_native_tp(m)

    class Legacy(nn.Module):
        _tp_col, _tp_row = "a", "b"

    assert supports_native_tp(Legacy()) and not credit_tp.supports_native_tp(Legacy())


def _tp_modules_worker(rank, world):
    credit_tp = _credit_tp()
    group = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)).get_group()
    torch.set_default_dtype(torch.float64)  # CREDIT builds its local layers in the default
    torch.manual_seed(0)
    pairs = [
        (nn.Linear(8, 6), TpColLinear, credit_tp.TpColLinear, (3, 8)),
        (nn.Conv2d(8, 6, 1), TpColConv2d, credit_tp.TpColConv2d, (2, 8, 3, 3)),
        (nn.Linear(6, 8), TpRowLinear, credit_tp.TpRowLinear, (3, 3)),
        (nn.Conv2d(6, 8, 1), TpRowConv2d, credit_tp.TpRowConv2d, (2, 3, 3, 3)),
    ]
    out = []
    for layer, ours_cls, theirs_cls, shape in pairs:
        layer = layer.double()
        ours, theirs = ours_cls(copy.deepcopy(layer), group), theirs_cls(layer, group)
        x = torch.randn(shape, dtype=torch.float64)
        forward_err = (ours(x) - theirs(x)).abs().max().item()
        input_err = None
        if ours_cls in (TpColLinear, TpColConv2d):
            # the single-process input gradient of sum(full output * g): ours must match it
            g = torch.randn(layer(x).shape, dtype=torch.float64)
            xr = x.clone().requires_grad_()
            (layer(xr) * g).sum().backward()
            xo = x.clone().requires_grad_()
            local_g = g.tensor_split(world, dim=1 if x.dim() == 4 else -1)[rank]
            (ours(xo) * local_g).sum().backward()
            input_err = (xo.grad - xr.grad).abs().max().item()
        out.append((ours_cls.__name__, forward_err, input_err, sorted(ours.state_dict())))
    return out


def test_tp_modules_compute_credit_forward_and_the_exact_input_gradient():
    for rank_result in run_on_ranks(_tp_modules_worker, 2):
        for name, forward_err, input_err, keys in rank_result:
            assert forward_err <= 1e-12, (name, forward_err)
            if input_err is not None:
                assert input_err <= 1e-12, (name, input_err)
            assert keys == ["bias", "weight"]  # the original layer's names (CREDIT: conv.*)


def test_tp_modules_refuse_what_they_cannot_split():
    with pytest.raises(TypeError, match="TpColLinear wraps an Linear"):
        TpColLinear(nn.Conv2d(4, 4, 1), None)
    with pytest.raises(ValueError, match="only 1x1 convolutions"):
        TpRowConv2d(nn.Conv2d(4, 4, 3), None)


def _native_worker(rank, world):
    attn = _attention()
    reference = copy.deepcopy(attn)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = apply_native_tensor_parallel(attn, mesh)
    x = torch.randn(2, 16, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (model(x) ** 2).sum().backward()
    (reference(x) ** 2).sum().backward()
    ref = dict(reference.named_parameters())
    errs = {}
    for n, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        errs[n] = (grad - ref[n].grad).abs().max().item()
    return errs, model._tp_native, model._tp_group is mesh.get_group()


def test_apply_native_tensor_parallel_on_wxformer_next_attention_is_exact():
    for errs, native, group in run_on_ranks(_native_worker, 2):
        assert native and group
        assert any(".dpb." in n or n.startswith("dpb.") for n in errs)
        for name, err in errs.items():
            assert err <= 1e-10, (name, err)


def test_apply_native_tensor_parallel_without_declarations_raises_like_credit():
    with pytest.raises(ValueError, match="no module of Sequential declares"):
        apply_native_tensor_parallel(nn.Sequential(nn.Linear(2, 2)), None)


def _domain_worker(rank, world, height):
    from torch.distributed.fsdp import fully_shard

    credit_domain = import_credit("credit.parallel.domain")
    credit_fsdp = import_credit("credit.parallel.fsdp2")
    mgr = DomainParallelManager(world, world)
    g = torch.Generator().manual_seed(0)
    weights = torch.rand(height, 1, generator=g, dtype=torch.float64)
    x = torch.randn(1, 2, height, 3, generator=g, dtype=torch.float64)
    local = shard_tensor(x, manager=mgr)
    rows = shard_lat_weights(weights, local.shape[-2], manager=mgr)
    expected_rows = weights.tensor_split(world, dim=-2)[rank]
    gathered = gather_spatial(local, mgr)
    # CREDIT's own functions on the same data (even heights only: it refuses the others)
    theirs_gather = theirs_error = None
    if height % world == 0:
        theirs_gather = (credit_domain.gather_spatial(local, mgr) - gathered).abs().max().item()
    else:
        try:
            credit_domain.shard_spatial(x, mgr)
        except ValueError as err:
            theirs_error = str(err)
    model = nn.Linear(2, 2)
    applied = (fsdp2_is_applied(model), credit_fsdp.fsdp2_is_applied(model))
    fully_shard(model)
    applied += (fsdp2_is_applied(model), credit_fsdp.fsdp2_is_applied(model))
    return (
        torch.equal(rows, expected_rows),
        torch.equal(gathered, x),
        theirs_gather,
        theirs_error,
        applied,
    )


@pytest.mark.parametrize("height", [8, 7])
def test_lat_weights_gather_spatial_and_fsdp2_is_applied_on_two_domain_ranks(height):
    for rows_ok, gather_ok, theirs_gather, theirs_error, applied in run_on_ranks(
        _domain_worker, 2, height
    ):
        assert rows_ok and gather_ok
        assert applied == (False, False, True, True)
        if height % 2 == 0:
            assert theirs_gather == 0.0
        else:  # CREDIT refuses an H the domain size does not divide; we shard it
            assert "divisible" in theirs_error


def test_shard_lat_weights_without_domain_parallelism_is_identity_or_error():
    w = torch.ones(6, 1)
    assert shard_lat_weights(w, 6) is w
    with pytest.raises(ValueError, match="no domain parallelism is active"):
        shard_lat_weights(w, 3)
