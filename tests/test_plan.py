"""The layout planner (``credit_parallel.planner``): rows and halos per domain rank against what the
model and the layers really do, the rank layout, memory and collective estimates, collected
violations, and the report text.  Pure except for one multi-rank run that checks the halo-byte and
P2P predictions against the exchange counters of a real forward + backward."""

import math

import pytest
import torch
from torch import nn

from credit_parallel.domain.layers.conv_geometry import (
    ConvGeometry,
    conv_transpose_windows,
    conv_windows,
)
from credit_parallel.domain.rows import plan_exchange, shard_range, shard_sizes
from credit_parallel.models import PeriodicConv2d, UNet
from credit_parallel.planner import (
    format_plan,
    make_plan,
    predicted_collectives,
    predicted_halo_bytes,
)
from credit_parallel.testing import run_on_ranks
from helpers import exchange_stats_worker
from sample_conf import tiny_unet

_UNET = tiny_unet(33, 16, 4, channel_mults=[1, 2, 2], mlp_ratio=2)


def _conf(data="none", tensor=1, domain=1, model=None, **trainer):
    conf = {"trainer": {"parallelism": {"data": data, "tensor": tensor, "domain": domain}}}
    conf["trainer"].update(trainer)
    if model is not None:
        conf["model"] = dict(model)
    return conf


def _real_heights(model: nn.Module, x: torch.Tensor, paths) -> dict:
    """(input height, output height) of each module call, from a real CPU forward."""
    seen = {}
    handles = []
    for path in paths:
        module = model.get_submodule(path)

        def hook(mod, args, out, path=path):
            seen.setdefault(path, []).append((args[0].shape[-2], out.shape[-2]))

        handles.append(module.register_forward_hook(hook))
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return seen


# --------------------------------------------------------------------------- rows per level
@pytest.mark.parametrize("domain", [2, 3])
def test_unet_33x16_rows_per_domain_rank_at_every_level_match_a_real_forward(domain):
    plan = make_plan(_conf("fsdp2", 1, domain, _UNET), 2 * domain)
    assert plan.violations == []
    torch.manual_seed(0)
    model = UNet(**{k: v for k, v in _UNET.items() if k != "type"})
    paths = sorted({layer.path for layer in plan.layers})
    real = _real_heights(model, torch.randn(1, 4, 33, 16), paths)
    assert sum(len(v) for v in real.values()) == len(plan.layers)
    calls = {path: iter(v) for path, v in real.items()}
    for layer in plan.layers:
        in_h, out_h = next(calls[layer.path])
        assert (layer.in_height, layer.out_height) == (in_h, out_h), layer.path
        assert layer.out_rows == shard_sizes(out_h, domain), layer.path
    # the levels are exactly the heights the model produces: 33 -> 17 -> 9
    assert [h for h, _ in plan.levels] == [33, 17, 9]
    assert [sizes for _, sizes in plan.levels] == [shard_sizes(h, domain) for h in (33, 17, 9)]
    kinds = {layer.kind for layer in plan.layers}
    assert {"periodic_conv", "conv", "group_norm", "interpolate"} <= kinds


def test_conv_k3s1p1_halo_is_one_row_per_interior_side_and_zero_at_the_poles():
    model = nn.Sequential(nn.Conv2d(2, 3, 3, stride=1, padding=1))
    for n in (2, 3, 4):
        plan = make_plan(_conf(domain=n), n, model=model, input_shapes=[(2, 33, 8)])
        (layer,) = plan.layers
        assert layer.halo_before == (0,) + (1,) * (n - 1)
        assert layer.halo_after == (1,) * (n - 1) + (0,)
        assert layer.rows_received == tuple(
            b + a for b, a in zip(layer.halo_before, layer.halo_after)
        )
        assert layer.out_rows == shard_sizes(33, n)


@pytest.mark.parametrize("n", [2, 3])
def test_conv_k3s2p1_rows_equal_conv_windows_and_plan_exchange(n):
    conv = nn.Conv2d(2, 3, 3, stride=2, padding=1)
    plan = make_plan(_conf(domain=n), n, model=nn.Sequential(conv), input_shapes=[(2, 33, 8)])
    (layer,) = plan.layers
    windows, out_len = conv_windows(ConvGeometry.of(conv), 0, 33, n)
    expected = plan_exchange(33, n, windows)
    assert (layer.in_height, layer.out_height) == (33, out_len) == (33, 17)
    assert layer.out_rows == shard_sizes(17, n)
    assert layer.rows_received == tuple(p.rows_received for p in expected)
    assert layer.rows_sent == tuple(p.rows_sent for p in expected)
    for r, window in enumerate(windows):
        start, stop = shard_range(33, n, r)
        north = {g for g in window if 0 <= g < start}
        south = {g for g in window if g >= stop}
        assert (layer.halo_before[r], layer.halo_after[r]) == (len(north), len(south))


def test_transposed_conv_and_pixel_shuffle_windows_come_from_the_layers():
    model = nn.Sequential(
        nn.ConvTranspose2d(8, 8, 4, stride=2, padding=1),
        nn.PixelShuffle(2),
        nn.ZeroPad2d((0, 0, 1, 2)),
    )
    plan = make_plan(_conf(domain=3), 3, model=model, input_shapes=[(8, 10, 4)])
    assert [layer.kind for layer in plan.layers] == ["conv_transpose", "pixel_shuffle", "pad"]
    assert [(layer.in_height, layer.out_height) for layer in plan.layers] == [
        (10, 20),
        (20, 40),
        (40, 43),
    ]
    windows, _ = conv_transpose_windows(ConvGeometry.of(model[0]), 0, 10, 3)
    assert plan.layers[0].rows_received == tuple(
        p.rows_received for p in plan_exchange(10, 3, windows)
    )
    assert plan.violations == []


# --------------------------------------------------------------------------- violations
def test_world_size_not_divisible_by_tensor_times_domain_is_a_violation_not_an_error():
    plan = make_plan(_conf("fsdp2", 2, 3, _UNET), 8)
    assert any("not divisible by trainer.parallelism.tensor*domain" in v for v in plan.violations)
    assert plan.dims is None and plan.ranks == []
    assert "no rank layout" in format_plan(plan)


def test_domain_8_on_33_rows_with_3_stride2_levels_notes_the_empty_ranks_of_the_5_row_level():
    model = nn.Sequential(
        *(nn.Conv2d(2, 2, 3, stride=2, padding=1) for _ in range(3))
    )  # 33 -> 17 -> 9 -> 5
    plan = make_plan(_conf(domain=8), 8, model=model, input_shapes=[(2, 33, 8)])
    assert [h for h, _ in plan.levels] == [33, 17, 9, 5]
    # empty shards are exact (SPEC §3): a note, not a violation
    assert plan.violations == []
    noted = [v for v in plan.notes if "fewer than domain ranks" in v]
    assert len(noted) == 1 and noted[0].startswith("level 3 has 5 rows")
    assert "domain ranks 5..7 hold no rows" in noted[0]
    assert plan.levels[3][1] == (1, 1, 1, 1, 1, 0, 0, 0)
    assert plan.layers[2].out_rows == (1, 1, 1, 1, 1, 0, 0, 0)
    assert "(3 empty ranks)" in format_plan(plan)


def test_real_unet_with_four_levels_over_domain_8_notes_the_coarse_level():
    model = dict(_UNET, channel_mults=[1, 1, 1, 1])
    plan = make_plan(_conf("none", 1, 8, model), 8)
    assert any(v.startswith("level 3 has 5 rows, fewer than domain ranks (8)") for v in plan.notes)
    assert not any("fewer than domain ranks" in v for v in plan.violations)


def test_tensor_parallel_divisibility_names_the_layer_and_all_problems_are_collected():
    # tp=3: mid_mlp hidden width 16 and its input 8 are not divisible; world 5 not divisible
    plan = make_plan(_conf("fsdp2", 3, 1, _UNET), 5)
    text = "\n".join(plan.violations)
    assert "mid_mlp.ff.net.0" in text and "mid_mlp.ff.net.2" in text
    assert "not divisible by trainer.parallelism.tensor*domain" in text
    assert len(plan.violations) == 3


def test_window_constraints_of_crossformer_are_notes_per_local_height_as_attention_is_exact():
    model = {
        "type": "crossformer",
        "in_channels": 2,
        "out_channels": 2,
        "image_height": 32,
        "image_width": 16,
        "dims": [8, 16],
        "depths": [1, 1],
        "dim_head": 4,
        "window_sizes": [4, 2],
    }
    plan2 = make_plan(_conf("none", 1, 2, model), 2)
    assert plan2.violations == []
    assert not any("validate_sharding_constraints" in n for n in plan2.notes)
    plan = make_plan(_conf("none", 1, 3, model), 3)  # shards of 11, 11, 10 rows
    assert plan.violations == []  # exact (verified at domain 3 in test_verify_models)
    found = [n for n in plan.notes if "validate_sharding_constraints" in n]
    assert found and all("local_h=1" in n and "exact anyway" in n for n in found)
    assert {"local_h=11", "local_h=10"} <= {n.split("(")[1].split(",")[0] for n in found}


def test_window_constraints_without_exact_attention_stay_violations():
    class Windowed(nn.Module):  # declares windows but has no attention the converter knows
        window_sizes = [4]

        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 3, padding=1)

        def forward(self, x):
            return self.conv(x)

    plan = make_plan(_conf(domain=3), 3, model=Windowed(), input_shapes=[(2, 32, 8)])
    found = [v for v in plan.violations if "validate_sharding_constraints" in v]
    assert found and all("window size" in v for v in found)


def test_unsafe_module_under_domain_parallelism_is_a_violation():
    model = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.BatchNorm2d(2))
    plan = make_plan(_conf(domain=2), 2, model=model, input_shapes=[(2, 8, 8)])
    assert any(v.startswith("1: BatchNorm2d") for v in plan.violations)
    assert make_plan(_conf(), 1, model=model, input_shapes=[(2, 8, 8)]).violations == []


_CROSSFORMER = {
    "type": "crossformer",
    "in_channels": 2,
    "out_channels": 2,
    "image_height": 32,
    "image_width": 16,
    "dims": [8, 16],
    "depths": [2, 2],
    "dim_head": 4,
    "window_sizes": [4, 2],
}
_SWIN = {
    "type": "swin",
    "in_channels": 2,
    "out_channels": 2,
    "image_height": 32,
    "image_width": 16,
    "dim": 16,
    "depth": 2,
    "dim_head": 8,
    "window_size": 4,
    "patch": 2,
}


def _attention_layers(plan):
    return {layer.path: layer for layer in plan.layers if layer.form in ("relayout", "regroup")}


@pytest.mark.parametrize("domain", [2, 3])
def test_crossformer_plan_lists_its_attention_as_relayout_and_regroup(domain):
    plan = make_plan(_conf("none", 1, domain, _CROSSFORMER), domain)
    attn = _attention_layers(plan)
    # depths [2, 2]: block 0 of each level short-distance windows, block 1 long-distance groups
    assert {p: a.form for p, a in attn.items()} == {
        "levels.0.0.attn": "relayout",
        "levels.0.1.attn": "regroup",
        "levels.1.0.attn": "relayout",
        "levels.1.1.attn": "regroup",
    }
    assert not any("Attention" in v and "refuses" in v for v in plan.violations)
    # the long-distance groups reach from pole to pole: rows always move
    assert attn["levels.0.1.attn"].communication_bytes > 0
    assert attn["levels.1.1.attn"].communication_bytes > 0
    # level 0 is 16 rows in C=8 x W=8 (batch 1, fp32) in 4 strided groups of 4 rows: a rank
    # holds whole groups, the busiest ceil(4/d) of them
    layer = attn["levels.0.1.attn"]
    row_bytes = 8 * 8 * 4
    assert layer.activation_bytes == 4 * math.ceil(4 / domain) * row_bytes
    text = format_plan(plan)
    assert "levels.0.1.attn" in text and "regroup" in text and "comm/call" in text


def test_crossformer_windows_that_cut_shards_cost_a_relayout_at_domain_3():
    plan = make_plan(_conf("none", 1, 3, _CROSSFORMER), 3)
    # 16 rows over 3 ranks (6, 5, 5) with windows of 4: boundaries at 6 and 11 cut windows
    assert _attention_layers(plan)["levels.0.0.attn"].communication_bytes > 0
    plan2 = make_plan(_conf("none", 1, 2, _CROSSFORMER), 2)
    # 8 | 8 rows: every window on one rank, nothing moves
    assert _attention_layers(plan2)["levels.0.0.attn"].communication_bytes == 0


@pytest.mark.parametrize("domain", [2, 3])
def test_swin_plan_lists_its_window_attention_with_communication(domain):
    plan = make_plan(_conf("none", 1, domain, _SWIN), domain)
    attn = _attention_layers(plan)
    assert set(attn) == {"blocks.0.attn", "blocks.1.attn"}
    assert all(a.form == "relayout" for a in attn.values())
    # the shifted block moves rows across the seam on any layout
    assert attn["blocks.1.attn"].communication_bytes > 0
    assert not any("Attention" in v for v in plan.violations)


def test_batchnorm_under_gather_policy_is_planned_as_gather_with_its_all_gather_bytes():
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3))
    conf = _conf(domain=2, domain_nonlocal_policy="gather")
    plan = make_plan(conf, 2, model=model, input_shapes=[(2, 8, 4)])
    assert plan.violations == []
    (bn,) = [layer for layer in plan.layers if layer.path == "1"]
    assert bn.form == "gather"
    # all-gather of the (1, 3, 8, 4) fp32 input: every rank receives the other rank's half
    assert bn.communication_bytes == 3 * 8 * 4 * 4 * (2 - 1)
    assert bn.activation_bytes == 3 * 8 * 4 * 4  # the whole globe on every rank
    assert bn.rows_received == (0, 0)  # a collective, not a halo exchange
    assert plan.collectives["domain_all_gather"] == 1
    assert any(n.startswith("trainer.domain_nonlocal_policy: gather: 1: ") for n in plan.notes)
    assert "gather" in format_plan(plan)
    # the default policy refuses it
    default = make_plan(_conf(domain=2), 2, model=model, input_shapes=[(2, 8, 4)])
    assert any(v.startswith("1: BatchNorm2d") for v in default.violations)
    assert not any(layer.form == "gather" for layer in default.layers)


def test_a_bad_nonlocal_policy_is_a_violation_naming_the_key():
    model = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1))
    plan = make_plan(
        _conf(domain=2, domain_nonlocal_policy="ring"), 2, model=model, input_shapes=[(2, 8, 4)]
    )
    assert any("domain_nonlocal_policy" in v for v in plan.violations)


def test_a_module_the_converter_cannot_replace_is_a_violation_naming_its_path():
    model = nn.Sequential(
        nn.Conv2d(2, 2, 3, padding=1), nn.Upsample(scale_factor=2, mode="bicubic")
    )
    plan = make_plan(_conf(domain=2), 2, model=model, input_shapes=[(2, 8, 8)])
    assert len(plan.violations) == 1
    assert plan.violations[0].startswith("1: convert_to_domain_parallel cannot convert it")
    assert "bicubic" in plan.violations[0]


def test_thin_shards_are_a_note_not_a_violation():
    # kernel 7 over 8 rows on 4 ranks: 2-row shards serve a 3-row halo (multi-hop)
    model = nn.Sequential(nn.Conv2d(1, 1, 7, padding=3))
    plan = make_plan(_conf(domain=4), 4, model=model, input_shapes=[(1, 8, 4)])
    assert plan.violations == []
    assert any("beyond its neighbours" in note for note in plan.notes)


def test_unusable_configs_raise_value_error():
    with pytest.raises(ValueError, match="trainer.parallelism.data"):
        make_plan(_conf("zero", 1, 1, _UNET), 1)
    with pytest.raises(ValueError, match="model.type"):
        make_plan(_conf(model={"type": "resnet"}), 1)
    with pytest.raises(ValueError, match="world-size"):
        make_plan(_conf(model=_UNET), 0)


# --------------------------------------------------------------------------- layout and memory
def test_format_plan_lists_every_rank_of_world_8_with_its_groups():
    plan = make_plan(_conf("fsdp2", 2, 2, _UNET, batch_size=2), 8)
    text = format_plan(plan)
    lines = text.splitlines()
    for g in range(8):
        dom, tp, dp = g % 2, (g // 2) % 2, g // 4
        dom_group = [g - dom, g - dom + 1]
        tp_group = [g - 2 * tp, g - 2 * tp + 2]
        dp_group = [g - 4 * dp, g - 4 * dp + 4]
        row = [str(g), str(dp), str(tp), str(dom), str(dp_group), str(tp_group), str(dom_group)]
        assert any(
            line.split("  ")[0] == str(g) and all(c in line for c in row) for line in lines
        ), g
    for section in (
        "== Layout ==",
        "== Rows per domain rank",
        "== Memory per rank",
        "== Constraints",
    ):
        assert section in text
    assert "mesh axes kept (build_device_mesh): dp=2, tp=2, domain=2" in text
    assert plan.collectives["tp_all_reduce"] == 2  # one row layer (fwd) + one col layer (bwd)


def test_large_world_lists_a_sample_of_ranks_with_a_note():
    plan = make_plan(_conf("fsdp2", 1, 2, _UNET), 128)
    assert len(plan.ranks) < 128 and plan.ranks_omitted == 128 - len(plan.ranks)
    assert plan.ranks[-1].rank == 127 and plan.ranks[-1].dp_group[0] == 1
    assert "ranks not listed" in format_plan(plan)


def test_fsdp2_over_dp4_holds_a_quarter_of_the_replicated_parameter_bytes():
    replicated = make_plan(_conf("ddp", 1, 1, _UNET), 4).memory
    sharded = make_plan(_conf("fsdp2", 1, 1, _UNET), 4).memory
    torch.manual_seed(0)
    model = UNet(**{k: v for k, v in _UNET.items() if k != "type"})
    full = sum(p.numel() for p in model.parameters()) * 4
    padding = sum(4 * 3 * math.prod(p.shape[1:]) for p in model.parameters())
    assert replicated.param_bytes == replicated.param_bytes_unsharded == full
    assert full / 4 <= sharded.param_bytes <= full / 4 + padding / 4
    assert sharded.grad_bytes == sharded.param_bytes
    assert sharded.optimizer_bytes == 2 * sharded.param_bytes


def test_fsdp2_with_domain_shards_parameters_over_dp_times_domain():
    """FSDP2 shards over the flattened dp x domain axis: {fsdp2, 1, 2} on 4 ranks holds the
    same parameter bytes per rank as {fsdp2, 1, 1} on 4 ranks (dp 4), a quarter of the model."""
    over_dp = make_plan(_conf("fsdp2", 1, 1, _UNET), 4).memory
    over_dp_domain = make_plan(_conf("fsdp2", 1, 2, _UNET), 4).memory
    over_domain = make_plan(_conf("fsdp2", 1, 4, _UNET), 4).memory
    assert over_dp_domain.param_bytes == over_dp.param_bytes == over_domain.param_bytes
    assert over_dp.param_bytes < over_dp.param_bytes_unsharded / 3
    assert "dp x domain = 2 x 2" in format_plan(make_plan(_conf("fsdp2", 1, 2, _UNET), 4))


def test_tensor_parallel_splits_only_the_declared_layers():
    base = make_plan(_conf("none", 1, 1, _UNET), 1).memory.param_bytes
    tp2 = make_plan(_conf("none", 2, 1, _UNET), 2).memory.param_bytes
    torch.manual_seed(0)
    model = UNet(**{k: v for k, v in _UNET.items() if k != "type"})
    ff = model.mid_mlp.ff.net
    split = ff[0].weight.numel() + ff[0].bias.numel() + ff[2].weight.numel()
    assert base - tp2 == split * 4 // 2


def test_activation_estimate_shrinks_with_domain_and_pangu_two_inputs_trace():
    one = make_plan(_conf("none", 1, 1, _UNET), 1).memory.activation_bytes
    two = make_plan(_conf("none", 1, 2, _UNET), 2).memory.activation_bytes
    assert 0.5 * one <= two <= 0.56 * one
    pangu = {
        "type": "pangu",
        "upper_channels": 2,
        "surface_channels": 3,
        "levels": 4,
        "image_height": 16,
        "image_width": 8,
        "dim": 8,
    }
    plan = make_plan(_conf("fsdp2", 1, 2, pangu), 4)
    assert plan.input_shapes == ((2, 4, 16, 8), (3, 16, 8))
    assert [h for h, _ in plan.levels] == [16, 8, 4]
    assert plan.violations == []


def test_predicted_collectives_counts_by_kind():
    plan = make_plan(_conf("fsdp2", 2, 2, _UNET), 8)
    c = plan.collectives
    exchanging = sum(1 for layer in plan.layers if layer.exchanges)
    norms = sum(1 for layer in plan.layers if layer.kind == "group_norm")
    linked = sum(1 for layer in plan.layers if layer.stats_with_exchange)
    # forward and backward per exchanging call, less the backward of the first conv's: the
    # model input needs no gradient (issue 39)
    from_input = [lay.path for lay in plan.layers if lay.exchanges and not lay.input_grad]
    assert from_input == ["stem"]
    assert c["domain_p2p"] == 2 * exchanging - 1
    # the residual blocks' 12 norms and the head norm (declared by UNet) send their
    # statistics with their conv's exchange; the bottleneck MLP's norm (a 1x1 conv after it) not
    assert norms == 14 and linked == 13
    assert c["domain_all_gather"] == c["domain_all_reduce_norm"] == norms - linked == 1
    units = len(plan.fsdp_units)
    assert c["fsdp_all_gather"] == 2 * units - 1 and c["fsdp_reduce_scatter"] == units
    assert c["ddp_all_reduce"] == 0
    none = predicted_collectives(plan.layers, data="none", dp=1, tp=1, domain=1)
    assert set(none.values()) == {0}
    ddp = predicted_collectives(
        [], data="ddp", dp=2, tp=1, domain=1, grad_sizes_bytes=[2**20, 30 * 2**20, 10]
    )
    assert ddp["ddp_all_reduce"] == 3


# --------------------------------------------------------------------------- against a real run
def _halo_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.Conv2d(3, 3, 3, stride=2, padding=1),  # 19 -> 10
        PeriodicConv2d(3, 4, 3, padding=1),
        nn.Upsample(size=(19, 6), mode="bilinear"),
        nn.ConvTranspose2d(4, 2, 3, stride=1, padding=1),
        nn.GroupNorm(1, 2),
    ).double()


@pytest.mark.parametrize("world", [2, 3])
def test_predicted_halo_bytes_and_p2p_calls_equal_the_exchange_counters_of_a_real_step(world):
    plan = make_plan(_conf(domain=world), world, model=_halo_model(), input_shapes=[(2, 19, 6)])
    assert plan.violations == []
    measured = run_on_ranks(exchange_stats_worker, world, _halo_model, (2, 2, 19, 6), "plan-test")
    for r, (bytes_sent, p2p_calls) in enumerate(measured):
        predicted = predicted_halo_bytes(plan.layers, batch_size=2, dtype_bytes=8, domain_rank=r)
        assert predicted == bytes_sent > 0
        counts = predicted_collectives(
            plan.layers, data="none", dp=1, tp=1, domain=world, domain_rank=r
        )
        assert counts["domain_p2p"] == p2p_calls
    total = predicted_halo_bytes(plan.layers, batch_size=2, dtype_bytes=8)
    assert total == sum(b for b, _ in measured)


# --------------------------------------------------------------------------- FSDP2 unit merging
class _Opted(nn.Module):
    _fsdp2_shard = True

    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)

    def forward(self, x):
        return self.conv(x)


class _TwoSmallBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = _Opted(2, 4)  # 76 parameters
        self.b = _Opted(4, 2)  # 74 parameters
        self.head = nn.Conv2d(2, 2, 1)  # 6 parameters, the root's own

    def forward(self, x):
        return self.head(self.b(self.a(x)))


def test_plan_says_what_merging_small_fsdp2_units_saves_and_costs():
    model = _TwoSmallBlocks()
    plan = make_plan(_conf("fsdp2"), 2, model=model, input_shapes=[(2, 8, 8)])
    # SPEC §4: both opted-in blocks are units of their own by default
    assert plan.fsdp_units == ["a", "b", "<root>"]
    assert plan.collectives["fsdp_all_gather"] == 5 and plan.collectives["fsdp_reduce_scatter"] == 3
    (note,) = [n for n in plan.notes if n.startswith("FSDP2:")]
    # merged: one unit (the root), 1 all-gather and 1 reduce-scatter: 4 and 2 fewer; the
    # gathered parameters grow from root + largest block (6 + 76) to everything (156), fp32
    assert note.startswith(
        "FSDP2: 2 opted-in blocks under 1,000,000 parameters are units of their own (a, b)"
    )
    assert "trainer.fsdp2_min_unit_params: 1000000 would merge them" in note
    assert "saving 4 all-gathers and 2 reduce-scatters per step" in note
    assert f"costing {(156 - 82) * 4} B more peak" in note and "328 B -> 624 B" in note
    assert note in format_plan(plan)
    merged = make_plan(
        _conf("fsdp2", fsdp2_min_unit_params=1_000_000), 2, model=model, input_shapes=[(2, 8, 8)]
    )
    assert merged.fsdp_units == ["<root>"]
    assert merged.collectives["fsdp_all_gather"] == 1
    assert not [n for n in merged.notes if n.startswith("FSDP2:")]
    ddp = make_plan(_conf("ddp"), 2, model=model, input_shapes=[(2, 8, 8)])
    assert not [n for n in ddp.notes if n.startswith("FSDP2:")]
