"""Attention under latitude sharding, tested against miles-credit's own model classes (a test
dependency installed by scripts/setup.sh, imported through tests/miles_credit.py): every model
converted by the default ``convert_to_domain_parallel`` computes the single-process function —
output, input gradient and every parameter gradient summed over the domain ranks (float64,
max abs error <= 1e-10) — with its state_dict keys unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from credit_parallel import convert_to_domain_parallel, gather_tensor, shard_tensor
from credit_parallel.domain.attention import (
    DomainRowGroupAttention,
    DomainSequenceAttention,
    head_split,
    shifted_window_layout,
    strided_group_layout,
    window_layout,
)
from credit_parallel.domain.convert import find_unsafe_modules
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.testing import run_on_ranks
from miles_credit import import_credit

TOL = 1e-10


def _crossformer(module: str, local_windows, global_windows, **extra):
    m = import_credit(module)
    return m.CrossFormer(
        image_height=48,
        image_width=16,
        frames=1,
        channels=1,
        surface_channels=1,
        input_only_channels=0,
        levels=2,
        dim=(2, 4, 8, 16),
        depth=(1, 1, 1, 1),
        dim_head=2,
        global_window_size=global_windows,
        local_window_size=local_windows,
        cross_embed_kernel_sizes=((2, 4), (2, 4), (2, 4), (2, 4)),
        cross_embed_strides=(2, 2, 2, 2),
        use_spectral_norm=False,
        interp=False,
        **extra,
    )


def build_credit_model(kind: str):
    """(model, input, extra forward args), float64, deterministic."""
    torch.manual_seed(0)
    args = ()
    if kind == "crossformer_long":
        # default CrossFormer structure: short AND long-distance attention at every level;
        # H per level 24, 12, 6, 3: short windows of 4 rows are not on shard boundaries at 2
        # ranks x level 2 etc., long groups span the whole latitude range
        net = _crossformer("credit.models.crossformer", (4, 2, 2, 1), (2, 2, 2, 1))
        x = torch.randn(1, 3, 1, 48, 16)
    elif kind == "crossformer_aligned_short":
        # short windows of 2 rows at levels 24 / 12 rows: on shard boundaries at 2 and 3 ranks
        net = _crossformer("credit.models.crossformer", (2, 2, 1, 1), (1, 1, 1, 1))
        x = torch.randn(1, 3, 1, 48, 16)
    elif kind == "wxformer":
        net = _crossformer("credit.models.wxformer.crossformer", (4, 2, 2, 1), (2, 2, 2, 1))
        x = torch.randn(1, 3, 1, 48, 16)
    elif kind == "unet_diffusion":
        m = import_credit("credit.models.unet_diffusion")
        net = m.UnetDiffusion(
            image_height=24,
            image_width=8,
            frames=1,
            channels=1,
            surface_channels=1,
            input_only_channels=0,
            levels=2,
            dim=(4,),
            dim_mults=(1, 2, 2),
            attn_heads=2,
            attn_dim_head=4,
            padding_conf={"activate": False},
        )
        x = torch.randn(2, 3, 1, 24, 8)
        args = (torch.tensor([3.0, 7.0], dtype=torch.float64),)
    else:
        raise ValueError(kind)
    return net.double(), x.double(), args


def exactness_errors(net, x, args, manager, *, convert=None):
    """Max abs errors of the converted model against a deep copy run on one process."""
    ref = copy.deepcopy(net)
    xr = x.clone().requires_grad_()
    yr = ref(xr, *args)
    w = torch.randn(yr.shape, generator=torch.Generator().manual_seed(1), dtype=yr.dtype)
    (yr * w).sum().backward()
    keys = list(net.state_dict())
    net = (convert or convert_to_domain_parallel)(net, manager)
    xl = shard_tensor(x, -2, manager).detach().requires_grad_()
    yl = net(xl, *args)
    (yl * shard_tensor(w, -2, manager)).sum().backward()
    errors = {
        "keys_equal": list(net.state_dict()) == keys,
        "out": (gather_tensor(yl.detach(), -2, manager) - yr).abs().max().item(),
        "input_grad": (gather_tensor(xl.grad, -2, manager) - xr.grad).abs().max().item(),
        "param_grad": 0.0,
        "out_ref": yr.abs().max().item(),
        "input_grad_ref": xr.grad.abs().max().item(),
        "param_grad_ref": max(
            (
                p.grad.abs().max().item()
                for p in ref.parameters()
                if p.grad is not None and p.grad.numel()
            ),
            default=0.0,
        ),
    }
    for p, pr in zip(net.parameters(), ref.parameters()):
        g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(g, group=manager.domain_group)
        gr = torch.zeros_like(pr) if pr.grad is None else pr.grad
        if g.numel():
            errors["param_grad"] = max(errors["param_grad"], (g - gr).abs().max().item())
    errors["forms"] = sorted(
        {type(m).__name__ for m in net.modules() if getattr(m, "domain_form", None)}
    )
    return errors


def _credit_model_on_ranks(rank, world_size, kind):
    net, x, args = build_credit_model(kind)
    manager = DomainParallelManager(world_size, world_size)
    return exactness_errors(net, x, args, manager)


def _assert_exact(results, forms):
    for errors in results:
        assert errors["keys_equal"]
        assert errors["out"] <= TOL, errors
        assert errors["input_grad"] <= TOL, errors
        assert errors["param_grad"] <= TOL, errors
        assert set(forms) <= set(errors["forms"]), errors["forms"]


@pytest.mark.parametrize("domain", [2, 3])
def test_credit_crossformer_long_and_short_attention_default_converter_exact(domain):
    _assert_exact(
        run_on_ranks(_credit_model_on_ranks, domain, "crossformer_long"),
        ["DomainRowGroupAttention"],
    )


@pytest.mark.parametrize("domain", [2, 3])
def test_credit_crossformer_aligned_short_windows_exact(domain):
    _assert_exact(
        run_on_ranks(_credit_model_on_ranks, domain, "crossformer_aligned_short"),
        ["DomainRowGroupAttention"],
    )


@pytest.mark.parametrize("domain", [2, 3])
def test_credit_wxformer_default_converter_exact(domain):
    _assert_exact(
        run_on_ranks(_credit_model_on_ranks, domain, "wxformer"), ["DomainRowGroupAttention"]
    )


@pytest.mark.parametrize("domain", [2, 3])
def test_credit_unet_diffusion_linear_and_full_attention_sequence_parallel_exact(domain):
    _assert_exact(
        run_on_ranks(_credit_model_on_ranks, domain, "unet_diffusion"),
        ["DomainSequenceAttention"],
    )


def test_credit_attention_classes_are_not_reported_unsafe():
    for kind in ("crossformer_long", "unet_diffusion"):
        net, _, _ = build_credit_model(kind)
        assert [p for p, _ in find_unsafe_modules(net)] == []


def test_credit_attention_forms_by_qualified_name():
    net, _, _ = build_credit_model("crossformer_long")
    att = net.layers[0][1].layers[0]
    short, long_ = att[0], att[2]
    assert DomainRowGroupAttention(short, "windows", 4).domain_form == "relayout"
    assert DomainRowGroupAttention(long_, "strided", 2).domain_form == "regroup"
    unet, _, _ = build_credit_model("unet_diffusion")
    assert DomainSequenceAttention(unet.mid_attn).domain_form == "sequence"


# ------------------------------------------------------------------ pure layouts
def test_window_layout_h12_w4_over_2_ranks_moves_whole_windows():
    assert window_layout(12, 2, 4) == ((0, 1, 2, 3, 4, 5, 6, 7), (8, 9, 10, 11))


def test_window_layout_aligned_equals_balanced_shards():
    assert window_layout(12, 3, 2) == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11))


def test_strided_layout_h12_groups_of_3_over_2_ranks():
    # stride H/k = 4: group j = rows j, j+4, j+8; rank 0 holds groups 0,1 laid out "(l1 h)"
    assert strided_group_layout(12, 2, 3) == ((0, 1, 4, 5, 8, 9), (2, 3, 6, 7, 10, 11))


def test_shifted_window_layout_wraps_around_the_globe():
    assert shifted_window_layout(8, 2, 4, 2) == ((2, 3, 4, 5), (6, 7, 0, 1))


def test_layout_rejects_height_not_multiple_of_window():
    with pytest.raises(ValueError, match="not a multiple of 5"):
        window_layout(12, 2, 5)


def test_head_split_uneven_and_fewer_heads_than_ranks():
    assert head_split(4, 3) == ((0, 2), (2, 3), (3, 4))
    assert head_split(1, 2) == ((0, 1), (1, 1))


# ------------------------------------------------------------------ memory per rank
def saved_activation_bytes(module, x) -> int:
    """Bytes of the tensors autograd saves during ``module(x)`` (parameters excluded, each
    storage counted once)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values())


def _attention_layer(kind: str):
    torch.manual_seed(0)
    if kind == "long":
        m = import_credit("credit.models.crossformer")
        layer = m.Attention(12, attn_type="long", window_size=2, dim_head=2)  # 6 heads
        x = torch.randn(1, 12, 24, 8)
    else:
        m = import_credit("credit.models.unet_diffusion")
        layer = m.Attention(12, heads=6, dim_head=4)
        x = torch.randn(1, 12, 24, 8)
    return layer.double(), x.double().requires_grad_()


def _memory_on_ranks(rank, world_size, kind):
    layer, x = _attention_layer(kind)
    single = saved_activation_bytes(layer, x)
    manager = DomainParallelManager(world_size, world_size)
    wrapped = convert_to_domain_parallel(layer, manager)
    xl = shard_tensor(x.detach(), -2, manager).requires_grad_()
    return single, saved_activation_bytes(wrapped, xl), type(wrapped).__name__


@pytest.mark.parametrize("domain", [2, 3])
@pytest.mark.parametrize("kind", ["long", "global"])
def test_attention_layer_memory_per_rank_at_most_1_2_over_d(kind, domain):
    for single, per_rank, form in run_on_ranks(_memory_on_ranks, domain, kind):
        assert form in ("DomainRowGroupAttention", "DomainSequenceAttention")
        assert per_rank <= 1.2 * single / domain, (kind, domain, single, per_rank)


# ------------------------------------------------------------------ what the planner reports
def test_form_cost_relayout_regroup_sequence_and_gather():
    from credit_parallel.domain.attention import form_cost
    from credit_parallel.domain.layers.gather import DomainGatherModule

    net, _, _ = build_credit_model("crossformer_long")
    short, long_ = net.layers[0][1].layers[0][0], net.layers[0][1].layers[0][2]
    shape, row = (1, 2, 12, 8), 2 * 8 * 8  # B, C, H, W; bytes of one row at itemsize 8
    aligned = form_cost(DomainRowGroupAttention(short, "windows", 3), shape, 2, 8)
    assert aligned == {"form": "relayout", "communication_bytes": 0, "activation_bytes": 6 * row}
    # windows of 4 rows over 6 + 6 rows: rank 0 runs rows 0-7, borrowing rows 6 and 7
    cut = form_cost(DomainRowGroupAttention(short, "windows", 4), shape, 2, 8)
    assert cut == {
        "form": "relayout",
        "communication_bytes": 2 * 2 * row,
        "activation_bytes": 8 * row,
    }
    # groups of 3 rows at stride 4: rank 0 holds groups 0, 1 = rows 0,1,4,5,8,9 (borrows 8, 9)
    strided = form_cost(DomainRowGroupAttention(long_, "strided", 3), shape, 2, 8)
    assert strided == {
        "form": "regroup",
        "communication_bytes": 2 * 4 * row,
        "activation_bytes": 6 * row,
    }
    unet, _, _ = build_credit_model("unet_diffusion")
    seq = form_cost(DomainSequenceAttention(unet.mid_attn), (1, 8, 6, 2), 2, 8)
    hidden = unet.mid_attn.to_qkv.out_channels // 3  # 2 heads of 4 channels
    assert seq == {
        "form": "sequence",
        "communication_bytes": 4 * hidden * 12 * 8 // 2,
        "activation_bytes": 3 * 12 * (hidden // 2) * 8,
    }
    gathered = form_cost(DomainGatherModule(torch.nn.BatchNorm2d(2)), shape, 3, 8)
    assert gathered == {
        "form": "gather",
        "communication_bytes": 2 * 12 * row,
        "activation_bytes": 12 * row,
    }


def _credit_layer_on_ranks(rank, world_size, module_name, attn_type, window, dtype):
    torch.manual_seed(0)
    layer = import_credit(module_name).Attention(8, attn_type, window, dim_head=4).to(dtype)
    x = torch.randn(2, 8, 12, 6, dtype=dtype)
    return exactness_errors(layer, x, (), DomainParallelManager(world_size, world_size))


def test_credit_wxformer_next_attention_short_and_long_exact_domain3():
    # 12 rows over 3 ranks: 4 + 4 + 4; short windows of 3 rows are cut at rows 4 and 8, long
    # groups of 2 rows at stride 6 span both hemispheres
    for attn_type, window in (("short", 3), ("long", 2)):
        args = ("credit.models.wxformer.wxformer_next", attn_type, window, torch.float64)
        _assert_exact(run_on_ranks(_credit_layer_on_ranks, 3, *args), ["DomainRowGroupAttention"])


@pytest.mark.parametrize(
    "module_name", ["credit.models.camulator", "credit.models.wxformer.crossformer_downscaling"]
)
def test_credit_float32_bias_attention_classes_exact_at_float32_tolerance_domain3(module_name):
    """These Attention classes compute their position bias in float32 whatever the input dtype:
    checked at the float32 tolerances (outputs / input gradients 1e-5, parameters 1e-4, relative
    to the largest reference value)."""
    for attn_type, window in (("short", 3), ("long", 2)):
        args = (module_name, attn_type, window, torch.float32)
        for e in run_on_ranks(_credit_layer_on_ranks, 3, *args):
            assert e["keys_equal"] and "DomainRowGroupAttention" in e["forms"]
            assert e["out"] <= 1e-5 * e["out_ref"], e
            assert e["input_grad"] <= 1e-5 * e["input_grad_ref"], e
            assert e["param_grad"] <= 1e-4 * e["param_grad_ref"], e
